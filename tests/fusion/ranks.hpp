// Tensor-parallel ranks as threads over one HostDriver, for the fusion tests: each rank gets its
// group, the shared driver and its device (= rank). Failures are collected per rank and
// reported by the caller on the test's thread.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "torpor/group.hpp"
#include "torpor/host_driver.hpp"

namespace torpor::test {

inline HostDriverOptions small_host_machine(int devices) {
  HostDriverOptions o;
  o.devices = devices;
  o.device_bytes = std::size_t{1} << 30;
  o.granularity = std::size_t{64} << 10;
  return o;
}

// Runs fn on `n` rank threads; returns one error text per rank ("" = it returned normally).
inline std::vector<std::string> on_ranks(int n,
                                         const std::function<void(int rank, Group& group, HostDriver& driver)>& fn,
                                         std::shared_ptr<HostDriver> driver = nullptr) {
  if (!driver) driver = std::make_shared<HostDriver>(small_host_machine(n));
  GroupOptions go;
  go.timeout = std::chrono::seconds(30);
  auto groups = make_thread_group(n, go);
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r, *groups[static_cast<std::size_t>(r)], *driver);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

inline std::string all_errors(const std::vector<std::string>& errors) {
  std::string s;
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) s += "rank " + std::to_string(r) + ": " + errors[r] + "\n";
  return s;
}

}  // namespace torpor::test
