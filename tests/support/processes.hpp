// Ranks as processes for tests: fork one child per rank, run a function in it, collect its exit
// status and whatever it reported. Fork happens before the test starts any thread (children of a
// multi-threaded process may only call async-signal-safe functions), so call run_ranks from the
// test's main thread with no other threads alive. A child that runs past the deadline is killed
// and reported as such.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace torpor::test {

struct RankOutcome {
  int exit_code = -1;   // 0 = the function returned normally
  bool killed = false;  // ran past the deadline
  std::string report;   // what the child wrote with report() or the exception it died of
};

// Inside a child: text that comes back in RankOutcome::report.
inline int& report_fd() {
  static int fd = -1;
  return fd;
}
inline void report(const std::string& text) {
  if (report_fd() >= 0) {
    std::string line = text + "\n";
    (void)!::write(report_fd(), line.data(), line.size());
  }
}

// Throws in a child; the message comes back in the report.
inline void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

inline std::vector<RankOutcome> run_ranks(int n, const std::function<void(int rank)>& body,
                                          std::chrono::milliseconds deadline = std::chrono::seconds(60)) {
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  std::vector<int> pipes;
  for (int r = 0; r < n; ++r) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
    pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      ::close(p[0]);
      for (int fd : pipes) ::close(fd);
      report_fd() = p[1];
      int code = 0;
      try {
        body(r);
      } catch (const std::exception& e) {
        report(std::string("rank ") + std::to_string(r) + " failed: " + e.what());
        code = 1;
      } catch (...) {
        report(std::string("rank ") + std::to_string(r) + " failed with an unknown exception");
        code = 1;
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    ::close(p[1]);
    pids.push_back(pid);
    pipes.push_back(p[0]);
  }
  std::vector<RankOutcome> out(static_cast<std::size_t>(n));
  auto until = std::chrono::steady_clock::now() + deadline;
  for (int r = 0; r < n; ++r) {
    int status = 0;
    for (;;) {
      pid_t w = ::waitpid(pids[static_cast<std::size_t>(r)], &status, WNOHANG);
      if (w == pids[static_cast<std::size_t>(r)]) break;
      if (std::chrono::steady_clock::now() > until) {
        ::kill(pids[static_cast<std::size_t>(r)], SIGKILL);
        ::waitpid(pids[static_cast<std::size_t>(r)], &status, 0);
        out[static_cast<std::size_t>(r)].killed = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    auto& o = out[static_cast<std::size_t>(r)];
    o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    char buf[4096];
    ssize_t k;
    while ((k = ::read(pipes[static_cast<std::size_t>(r)], buf, sizeof buf)) > 0)
      o.report.append(buf, static_cast<std::size_t>(k));
    ::close(pipes[static_cast<std::size_t>(r)]);
  }
  return out;
}

// "" when every rank exited 0; otherwise one line per failing rank.
inline std::string failures(const std::vector<RankOutcome>& outcomes) {
  std::string s;
  for (std::size_t r = 0; r < outcomes.size(); ++r) {
    const auto& o = outcomes[r];
    if (o.exit_code == 0 && !o.killed) continue;
    s += "rank " + std::to_string(r) + (o.killed ? " killed at the deadline" : " exit " + std::to_string(o.exit_code)) +
         ": " + o.report + "\n";
  }
  return s;
}

}  // namespace torpor::test
