// The processes launcher (launchers.hpp): spawn the workers (spawn.cpp), read their stdout until
// every one has exited, and turn each one's last JSON line, exit status and fate into its
// outcome.
//
// SIGINT, SIGTERM and SIGHUP to the launcher are forwarded to every rank still running (a rank
// left orphaned would keep its device memory); the launcher waits for them (a rank still running
// `signal_grace` after the last forwarded signal is killed), removes the rendezvous directory, and
// then dies of the same signal. The rendezvous is removed on every path out of launch_processes
// (ranks reaped first, so that none recreates it).
#include <fcntl.h>
#include <fmt/core.h>
#include <signal.h>  // NOLINT(modernize-deprecated-headers): kill() and sigaction are POSIX, not in <csignal>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <csignal>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "launch/launchers.hpp"
#include "launch/spawn.hpp"

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

LaunchResult collect_processes(const LaunchOptions& o, int& received);

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

}  // namespace torpor::cli
