// Starting the ranks of a process launch (spawn.hpp): the workers' environment (the launcher's,
// less every group variable, plus the rank's own), a loopback port for the emulated nodes' TCP
// group, and posix_spawn of this program with each rank's stdout on a pipe.
#include "launch/spawn.hpp"

#include <fcntl.h>
#include <fmt/core.h>
#include <netinet/in.h>
#include <signal.h>  // NOLINT(modernize-deprecated-headers): kill() is POSIX, not in <csignal>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <string_view>

#include "common/options.hpp"
#include "torpor/error.hpp"

namespace torpor::cli {

namespace {

// The launcher's environment without the group variables, then this rank's group variables
// (with several nodes, the launcher's variables a TcpGroup reads and the emulated node).
std::vector<std::string> rank_environment(const Rendezvous& rv, int rank, int ranks, int nodes, int master_port) {
  using options::id;
  std::vector<std::string_view> names;
  for (id k : {id::group_rendezvous, id::rank, id::world_size, id::master_addr, id::master_port, id::launcher_rank,
               id::launcher_world_size, id::local_rank, id::local_world_size, id::host_node})
    names.push_back(options::option(k).name);
  auto assigns = [](std::string_view entry, std::string_view name) {
    return entry.starts_with(name) && entry.size() > name.size() && entry[name.size()] == '=';
  };
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string_view s(*e);
    if (std::any_of(names.begin(), names.end(), [&](std::string_view n) { return assigns(s, n); })) continue;
    env.emplace_back(s);
  }
  auto set = [&](id k, const std::string& v) { env.push_back(fmt::format("{}={}", options::option(k).name, v)); };
  set(id::group_rendezvous, rv.to_string());
  set(id::rank, std::to_string(rank));
  set(id::world_size, std::to_string(ranks));
  if (nodes > 1) {
    const int local = ranks / nodes;
    set(id::master_addr, "127.0.0.1");
    set(id::master_port, std::to_string(master_port));
    set(id::launcher_rank, std::to_string(rank));
    set(id::launcher_world_size, std::to_string(ranks));
    set(id::local_rank, std::to_string(rank % local));
    set(id::local_world_size, std::to_string(local));
    set(id::host_node, std::to_string(rank / local));
  }
  return env;
}

// MASTER_PORT for a launch on loopback: one below a port the kernel just found free, since
// tcp_group_from_env listens on MASTER_PORT + 1.
int loopback_master_port() {
  UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (!s || ::bind(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0)
    throw error(fmt::format("--nodes: no free loopback port for the TCP group: {}", std::strerror(errno)));
  return ntohs(a.sin_port) - 1;
}

}  // namespace

Spawned spawn_ranks(const LaunchOptions& o, const Rendezvous& rv) {
  Spawned sp;
  const int master_port = o.nodes > 1 ? loopback_master_port() : 0;
  auto cleanup = [&] {
    for (int fd : sp.outs) ::close(fd);
    rv.remove();
  };
  for (int r = 0; r < o.ranks; ++r) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) {
      cleanup();
      throw error(fmt::format("starting rank {}: pipe2 failed: {}", r, std::strerror(errno)));
    }
    std::vector<std::string> args = {"torpor"};
    args.insert(args.end(), o.worker_args.begin(), o.worker_args.end());
    std::vector<std::string> env = rank_environment(rv, r, o.ranks, o.nodes, master_port);
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, p[1], STDOUT_FILENO);
    pid_t pid = 0;
    int rc = ::posix_spawn(&pid, "/proc/self/exe", &fa, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    ::close(p[1]);
    if (rc != 0) {
      ::close(p[0]);
      for (pid_t q : sp.pids) ::kill(q, SIGKILL);
      for (pid_t q : sp.pids) ::waitpid(q, nullptr, 0);
      cleanup();
      throw error(fmt::format("starting rank {} failed: {}", r, std::strerror(rc)));
    }
    sp.pids.push_back(pid);
    sp.outs.push_back(p[0]);
  }
  return sp;
}

}  // namespace torpor::cli
