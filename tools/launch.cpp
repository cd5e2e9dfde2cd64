// Rank launching for the CLI (launch.hpp). Threads share one driver (the host backend's
// multicast emulation and the cuda backend's peer access both want that); processes each open
// their own. The launcher's only job after starting the ranks is to collect outcomes and to make
// sure a failed run ends: it never decides success itself.
//
// Processes: SIGINT, SIGTERM and SIGHUP to the launcher are forwarded to every rank still
// running (a rank left orphaned would keep its device memory); the launcher waits for them (a
// rank still running `signal_grace` after the last forwarded signal is killed), removes the
// rendezvous directory, and then dies of the same signal. The rendezvous is removed on every
// path out of launch_processes (ranks reaped first, so that none recreates it).
#include "launch.hpp"

#include <fcntl.h>
#include <fmt/core.h>
#include <netinet/in.h>
#include <signal.h>  // NOLINT(modernize-deprecated-headers): kill() and sigaction are POSIX, not in <csignal>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

#include "common/options.hpp"
#include "torpor/error.hpp"
#include "torpor/tcp_group.hpp"

namespace torpor::cli {

namespace {

using clock_type = std::chrono::steady_clock;

// After a forwarded signal, ranks get this long to exit before they are killed.
constexpr auto signal_grace = std::chrono::seconds(5);

volatile std::sig_atomic_t pending_signal = 0;

extern "C" void note_signal(int sig) { pending_signal = sig; }

// Catches the forwarded signals for its life (the previous dispositions come back after).
class SignalForwarding {
 public:
  static constexpr std::array<int, 3> signals = {SIGINT, SIGTERM, SIGHUP};

  SignalForwarding() {
    pending_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = note_signal;
    sigemptyset(&sa.sa_mask);
    for (std::size_t i = 0; i < signals.size(); ++i) ::sigaction(signals[i], &sa, &previous_[i]);
  }
  ~SignalForwarding() {
    for (std::size_t i = 0; i < signals.size(); ++i) ::sigaction(signals[i], &previous_[i], nullptr);
  }
  SignalForwarding(const SignalForwarding&) = delete;
  SignalForwarding& operator=(const SignalForwarding&) = delete;

  // The signal caught since the last call, or 0.
  static int take() {
    const int sig = pending_signal;
    pending_signal = 0;
    return sig;
  }

  // After the handlers are restored: dies of `sig` as the launcher would have without them
  // (its caller's shell sees 128 + sig), unless the previous disposition ignores it.
  static void reraise(int sig) {
    struct sigaction now {};
    ::sigaction(sig, nullptr, &now);
    if (now.sa_handler == SIG_IGN) return;
    ::raise(sig);
  }

 private:
  std::array<struct sigaction, 3> previous_{};
};

RankOutcome outcome_of(int rank, const std::function<nlohmann::json()>& fn) {
  RankOutcome o;
  o.rank = rank;
  try {
    o.result = fn();
    o.ok = true;
  } catch (const rank_failure& e) {
    o.error = e.what();
    o.result = e.partial();
  } catch (const std::exception& e) {
    o.error = e.what();
  } catch (...) {
    o.error = "an exception that is not a std::exception";
  }
  return o;
}

LaunchResult launch_threads(const LaunchOptions& o, const RankBody& body) {
  DriverSelection sel = open_rank_driver(o.backend, o.ranks);
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    int done = 0;
    std::optional<clock_type::time_point> first_failure;
    std::vector<RankOutcome> out;
    std::vector<bool> finished;
    std::shared_ptr<Driver> driver;
    std::vector<std::unique_ptr<Group>> groups;
    RankBody body;
  };
  // Shared with the threads, so that abandoning a thread that never returns stays safe.
  auto sh = std::make_shared<Shared>();
  sh->driver = sel.driver;
  sh->groups = make_thread_group(o.ranks, o.group);
  sh->body = body;
  sh->out.resize(static_cast<std::size_t>(o.ranks));
  sh->finished.assign(static_cast<std::size_t>(o.ranks), false);
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(o.ranks));
  for (int r = 0; r < o.ranks; ++r)
    threads.emplace_back([sh, r] {
      RankOutcome out =
          outcome_of(r, [&] { return sh->body(*sh->driver, *sh->groups[static_cast<std::size_t>(r)], r); });
      std::lock_guard lock(sh->mu);
      if (!out.ok && !sh->first_failure) sh->first_failure = clock_type::now();
      sh->out[static_cast<std::size_t>(r)] = std::move(out);
      sh->finished[static_cast<std::size_t>(r)] = true;
      ++sh->done;
      sh->cv.notify_all();
    });

  LaunchResult result;
  result.backend = std::string(sel.driver->backend_name());
  result.device_kernels = sel.driver->capabilities().compute == DriverCapabilities::Compute::device_kernels;
  result.host_memory = sel.driver->capabilities().host_memory;
  std::unique_lock lock(sh->mu);
  for (;;) {
    if (sh->done == o.ranks) break;
    if (sh->first_failure && clock_type::now() >= *sh->first_failure + o.failure_grace) break;
    sh->cv.wait_for(lock, std::chrono::milliseconds(100));
  }
  if (sh->done == o.ranks) {
    lock.unlock();
    for (auto& t : threads) t.join();
    result.ranks = sh->out;
    return result;
  }
  for (int r = 0; r < o.ranks; ++r)
    if (!sh->finished[static_cast<std::size_t>(r)]) {
      auto& out = sh->out[static_cast<std::size_t>(r)];
      out.rank = r;
      out.ok = false;
      out.error = fmt::format("still running {:.0f} s after the first failure (abandoned)",
                              std::chrono::duration<double>(o.failure_grace).count());
    }
  result.ranks = sh->out;
  result.abandoned = true;
  lock.unlock();
  for (auto& t : threads) t.detach();
  return result;
}

LaunchResult collect_processes(const LaunchOptions& o, int& received);

LaunchResult launch_processes(const LaunchOptions& o) {
  int received = 0;  // the last signal forwarded to the ranks
  LaunchResult result;
  {
    SignalForwarding forwarding;
    result = collect_processes(o, received);
  }
  if (received != 0) SignalForwarding::reraise(received);
  return result;
}

// The ranks' processes and the read ends of their stdout pipes.
struct Spawned {
  std::vector<pid_t> pids;
  std::vector<int> outs;
};

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

// Starts one process per rank with its stdout on a pipe. On a failure the ranks already started
// are killed and reaped, the pipes closed, the rendezvous removed, and error names the rank.
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

// What the ranks left behind: their stdout, exit codes, which were killed, and when.
struct Reaped {
  std::vector<std::string> text;
  std::vector<int> codes;
  std::vector<bool> killed;
  std::optional<clock_type::time_point> first_failure, signalled;
};

void drain(int fd, std::string& text) {
  char buf[4096];
  ssize_t k;
  while ((k = ::read(fd, buf, sizeof buf)) > 0) text.append(buf, static_cast<std::size_t>(k));
}

// Reads every rank's output until every rank has exited, forwarding signals and killing the ranks
// still running past the deadline, the failure grace or the signal grace.
Reaped reap_ranks(const LaunchOptions& o, const Spawned& sp, clock_type::time_point deadline, int& received) {
  const std::size_t n = sp.pids.size();
  Reaped rp{std::vector<std::string>(n), std::vector<int>(n, -1), std::vector<bool>(n, false), {}, {}};
  for (int fd : sp.outs) ::fcntl(fd, F_SETFL, O_NONBLOCK);
  std::size_t left = n;
  while (left > 0) {
    for (std::size_t r = 0; r < n; ++r) {
      drain(sp.outs[r], rp.text[r]);
      if (rp.codes[r] >= 0) continue;
      int status = 0;
      if (::waitpid(sp.pids[r], &status, WNOHANG) == sp.pids[r]) {
        rp.codes[r] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (rp.codes[r] != 0 && !rp.first_failure) rp.first_failure = clock_type::now();
        --left;
      }
    }
    const auto now = clock_type::now();
    if (int sig = SignalForwarding::take(); sig != 0) {
      received = sig;
      rp.signalled = now;
      for (std::size_t r = 0; r < n; ++r)
        if (rp.codes[r] < 0) ::kill(sp.pids[r], sig);
    }
    if (left > 0 && (now > deadline || (rp.first_failure && now > *rp.first_failure + o.failure_grace) ||
                     (rp.signalled && now > *rp.signalled + signal_grace)))
      for (std::size_t r = 0; r < n; ++r)
        if (rp.codes[r] < 0 && !rp.killed[r]) {
          ::kill(sp.pids[r], SIGKILL);
          rp.killed[r] = true;
        }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (std::size_t r = 0; r < n; ++r) drain(sp.outs[r], rp.text[r]);
  return rp;
}

// The last line of a rank's output that parses as JSON: the worker's report.
std::optional<nlohmann::json> last_report(const std::string& text) {
  std::optional<nlohmann::json> report;
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t nl = text.find('\n', start);
    std::string line = text.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
    start = nl == std::string::npos ? text.size() : nl + 1;
    if (line.empty() || line[0] != '{') continue;
    try {
      report = nlohmann::json::parse(line);
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): a line that is not the report is output
    }
  }
  return report;
}

// Why rank r failed when its report does not say (killed, no report, an exit status), or its
// report's error.
std::string rank_error(const LaunchOptions& o, const Reaped& rp, std::size_t r, bool has_report,
                       const std::string& reported, int received, clock_type::time_point deadline) {
  const int code = rp.codes[r];
  if (rp.killed[r] && rp.signalled)
    return fmt::format("killed: still running {:.0f} s after the launcher forwarded signal {}",
                       std::chrono::duration<double>(signal_grace).count(), received);
  if (rp.killed[r])
    return rp.first_failure && clock_type::now() < deadline
               ? fmt::format("killed: still running {:.0f} s after the first failure",
                             std::chrono::duration<double>(o.failure_grace).count())
               : "killed at the deadline";
  if (!has_report) return fmt::format("exited with status {} without a report", code);
  if (rp.signalled && code != 0 && reported.empty())
    return fmt::format("exited with status {} after the launcher forwarded signal {}", code, received);
  if (code != 0 && reported.empty()) return fmt::format("exited with status {}", code);
  return reported;
}

LaunchResult results_of(const LaunchOptions& o, const Reaped& rp, int received, clock_type::time_point deadline) {
  LaunchResult result;
  for (std::size_t r = 0; r < rp.text.size(); ++r) {
    RankOutcome out;
    out.rank = static_cast<int>(r);
    std::optional<nlohmann::json> report = last_report(rp.text[r]);
    if (report) {
      out.ok = report->value("ok", false) && rp.codes[r] == 0;
      if (report->contains("result")) out.result = (*report)["result"];
      out.error = report->value("error", std::string());
      if (report->contains("backend")) result.backend = (*report)["backend"].get<std::string>();
      result.device_kernels = report->value("device_kernels", false);
      result.host_memory = report->value("host_memory", false);
    }
    out.error = rank_error(o, rp, r, report.has_value(), out.error, received, deadline);
    result.ranks.push_back(std::move(out));
  }
  return result;
}

LaunchResult collect_processes(const LaunchOptions& o, int& received) {
  Rendezvous rv = Rendezvous::create();
  Spawned sp = spawn_ranks(o, rv);
  const auto deadline = clock_type::now() + o.deadline;
  Reaped rp = reap_ranks(o, sp, deadline, received);
  for (int fd : sp.outs) ::close(fd);
  rv.remove();
  return results_of(o, rp, received, deadline);
}

}  // namespace

int default_ranks(Backend backend) {
  DriverSelection sel = open_driver(backend);
  // An emulated machine has as many devices as asked for: two ranks show every collective.
  return sel.driver->capabilities().host_memory ? 2 : sel.driver->device_count();
}

void GroupTimeout::resolve() {
  // Read (and so validated) even when a flag overrides it.
  const std::optional<std::string> env = options::raw(options::id::group_timeout_ms);
  const std::chrono::milliseconds from_env = env ? options::group_timeout() : std::chrono::milliseconds{0};
  const bool worker_ms_given = worker_ms > 0;
  flag_given = worker_ms_given || seconds_given;
  if (worker_ms_given)
    value = std::chrono::milliseconds(worker_ms);
  else if (env && !seconds_given)
    value = from_env;
  else  // --timeout, or the command's default
    value = std::chrono::seconds(seconds);
}

std::vector<std::string> GroupTimeout::worker_args() const { return {"--timeout-ms", std::to_string(value.count())}; }

LaunchOptions model_launch(Backend backend, int ranks, bool processes, std::chrono::milliseconds group_timeout,
                           int tail_wait_timeout_ms) {
  LaunchOptions lo;
  lo.ranks = ranks;
  lo.processes = processes;
  lo.backend = backend;
  lo.group.timeout = group_timeout;
  lo.failure_grace = std::chrono::milliseconds(tail_wait_timeout_ms) + lo.group.timeout + std::chrono::seconds(5);
  return lo;
}

DriverSelection open_rank_driver(Backend backend, int ranks) {
  HostDriverOptions host = host_driver_options_from_env();
  host.devices = std::max(host.devices, ranks);
  DriverSelection sel = open_driver(backend, host);
  if (int count = sel.driver->device_count(); count < ranks)
    throw invalid_argument(
        fmt::format("{} ranks need {} devices (one per rank); the {} backend has {}{}", ranks, ranks,
                    sel.driver->backend_name(), count,
                    sel.driver->capabilities().host_memory ? "" : " GPUs: pass --ranks N with N <= the GPU count"));
  return sel;
}

LaunchResult launch(const LaunchOptions& o, const RankBody& body) {
  if (o.ranks < 1) throw invalid_argument(fmt::format("--ranks {}: at least one rank is needed", o.ranks));
  if (o.nodes < 1 || o.ranks % o.nodes != 0)
    throw invalid_argument(fmt::format("--nodes {}: use a number of nodes that divides --ranks {}", o.nodes, o.ranks));
  if (o.nodes > 1 && !o.processes)
    throw invalid_argument(fmt::format("--nodes {}: ranks of several nodes are processes (add --processes)", o.nodes));
  return o.processes ? launch_processes(o) : launch_threads(o, body);
}

// A rank ends with its launcher, however the launcher ends (issue 33 N17: a SIGKILLed launcher
// left its ranks running until their group timed out): SIGTERM when the parent goes, and an exit
// now if it is already gone (reparented before the request took effect).
void end_with_the_launcher() {
  const pid_t parent = ::getppid();
  if (::prctl(PR_SET_PDEATHSIG, SIGTERM) != 0)
    fmt::print(stderr,
               "torpor: rank: cannot ask to end with the launcher (prctl: {}); a killed launcher leaves this rank "
               "until its group times out\n",
               std::strerror(errno));
  if (parent == 1 || ::getppid() != parent) {
    fmt::print(stderr, "torpor: rank: the launcher is gone; exiting\n");
    std::_Exit(1);
  }
}

int run_worker(Backend backend, const GroupOptions& group_options, const RankBody& body) {
  end_with_the_launcher();
  std::unique_ptr<Group> group;
  std::unique_ptr<LauncherLayout> layout;  // set for a TCP group: the device is the rank within its node
  nlohmann::json line;
  try {
    if (options::master_addr() && options::launcher_rank()) layout = launcher_layout_from_env();
    if (layout)
      group = tcp_group_from_env(group_options);
    else
      group = unix_group_from_env(group_options);
  } catch (const std::exception& e) {
    line = {{"ok", false}, {"error", fmt::format("joining the group: {}", e.what())}};
    fmt::print("{}\n", line.dump());
    std::fflush(stdout);
    return 1;
  }
  const int rank = group->rank();
  std::string backend_name;
  bool device_kernels = false, host_memory = false;
  RankOutcome out = outcome_of(rank, [&] {
    DriverSelection sel = open_rank_driver(backend, layout ? layout->local_world_size : group->size());
    backend_name = std::string(sel.driver->backend_name());
    device_kernels = sel.driver->capabilities().compute == DriverCapabilities::Compute::device_kernels;
    host_memory = sel.driver->capabilities().host_memory;
    return body(*sel.driver, *group, layout ? layout->local_rank : rank);
  });
  line = {{"rank", rank},
          {"ok", out.ok},
          {"result", out.result},
          {"backend", backend_name},
          {"device_kernels", device_kernels},
          {"host_memory", host_memory}};
  if (!out.ok) line["error"] = out.error;
  fmt::print("{}\n", line.dump());
  std::fflush(stdout);
  if (out.ok) {
    // Rank 0 hosts the rendezvous: everyone leaves together (a failure here changes nothing).
    try {
      group->barrier();
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): see above: nothing changes
    }
  }
  return out.ok ? 0 : 1;
}

bool write_json_file(const std::string& path, const nlohmann::json& j, std::string_view command) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    fmt::print(stderr, "torpor {}: could not write {}: {}\n", command, path, std::strerror(errno));
    return false;
  }
  const std::string text = j.dump(2) + "\n";
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0;
  const int write_errno = errno;
  const bool closed = std::fclose(f) == 0;
  if (!written || !closed) {
    fmt::print(stderr, "torpor {}: could not write {}: {}\n", command, path,
               std::strerror(!written ? write_errno : errno));
    return false;
  }
  return true;
}

Progress::Progress(bool enabled) : enabled_(enabled && ::isatty(STDERR_FILENO) == 1) {}
Progress::~Progress() { done(); }

void Progress::update(const std::string& text) {
  if (!enabled_) return;
  std::fprintf(stderr, "\r\033[K%s", text.c_str());
  std::fflush(stderr);
  dirty_ = true;
}

void Progress::done() {
  if (!enabled_ || !dirty_) return;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
  dirty_ = false;
}

}  // namespace torpor::cli
