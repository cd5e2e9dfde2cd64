// decide_multicast: see multicast_decision.hpp.
#include "torpor/multicast_decision.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <set>

#include "driver/multicast_policy.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

struct Verdict {
  bool usable = false;
  bool shares_across_processes = false;
  // Ranks in one process can always share a multicast object (through the process's driver).
  std::string domain;
  std::string reason;
  std::string backend;
};

std::vector<std::byte> encode(const Verdict& v) {
  std::string s =
      fmt::format("{}|{}|{}|{}|{}", v.usable ? 1 : 0, v.shares_across_processes ? 1 : 0, v.domain, v.backend, v.reason);
  auto b = std::as_bytes(std::span(s.data(), s.size()));
  return {b.begin(), b.end()};
}

Verdict decode(const std::vector<std::byte>& bytes, int rank) {
  std::string s(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  Verdict v;
  std::size_t at = 0;
  auto field = [&]() {
    auto bar = s.find('|', at);
    if (bar == std::string::npos) throw error(fmt::format("multicast decision: malformed verdict from rank {}", rank));
    std::string f = s.substr(at, bar - at);
    at = bar + 1;
    return f;
  };
  v.usable = field() == "1";
  v.shares_across_processes = field() == "1";
  v.domain = field();
  v.backend = field();
  v.reason = s.substr(at);  // the rest: a reason may contain '|'
  return v;
}

}  // namespace

MulticastDecision decide_multicast(Group& group, Driver& driver, int device) {
  // Local part: environment and attributes only; no multicast call.
  MulticastProbe probe = probe_multicast(driver, device);
  Verdict mine;
  mine.usable = probe.usable;
  mine.reason = probe.reason;
  mine.domain = std::to_string(::getpid());
  mine.backend = std::string(driver.backend_name());
  mine.shares_across_processes = probe.usable && driver.multicast_shares_across_processes();

  auto gathered = group.all_gather(encode(mine));
  std::vector<Verdict> all;
  for (std::size_t r = 0; r < gathered.size(); ++r) all.push_back(decode(gathered[r], static_cast<int>(r)));

  MulticastDecision d;
  std::vector<int> refusing;
  std::set<std::string> domains;
  for (std::size_t r = 0; r < all.size(); ++r) {
    d.rank_reasons.push_back(all[r].usable ? std::string() : all[r].reason);
    if (!all[r].usable) refusing.push_back(static_cast<int>(r));
    domains.insert(all[r].domain);
  }
  const int n = group.size();
  bool warn = true;
  if (!refusing.empty()) {
    int first = refusing.front();
    d.reason = fmt::format("rank {}: {}", first, all[static_cast<std::size_t>(first)].reason);
    if (refusing.size() > 1) {
      std::vector<int> rest(refusing.begin() + 1, refusing.end());
      d.reason += fmt::format(" (rank(s) {} cannot use it either)", format_ranks(rest));
    }
  } else if (domains.size() > 1) {
    for (std::size_t r = 0; r < all.size() && d.reason.empty(); ++r)
      if (!all[r].shares_across_processes)
        d.reason = fmt::format("rank {}: the {} backend cannot share a multicast object with a rank in another "
                               "process, and the ranks are separate processes",
                               r, all[r].backend);
  }
  if (d.reason.empty() && n == 1) {
    d.reason = "the group has a single rank; multicast needs two or more";
    warn = false;
  }
  d.use = d.reason.empty();
  if (!d.use && group.rank() == 0) {
    std::string text =
        fmt::format("multicast (NVLS) is not used by this group of {} rank(s): {}; symmetric buffers use "
                    "unicast peer mappings",
                    n, d.reason);
    if (warn) {
      d.warning = text;
      log::warn("{}", text);
    } else {
      log::info("{}", text);
    }
  }
  return d;
}

}  // namespace torpor
