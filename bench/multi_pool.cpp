// torpor_bench_multi: N pools sleeping and waking at once, against the host's own memory
// bandwidth measured in the same run (issue 30: eight GPUs sleeping together share the host's
// memory).
//
// One thread per pool; pool k on device k % device_count (one pool per device where there are
// enough; on one GPU, N pools on the same device). Each pool holds `bytes` of state in
// allocations of `alloc` bytes, its host store prepared (pinned) before the run, so that what is
// timed is the copies, not the pinning; skip_unchanged is off, so every sleep copies every byte.
// Per cycle the threads start together (a barrier), each sleeps at level 1, then together each
// wakes; the aggregate rate is all pools' bytes over the slowest pool's time. For N = 1 and the
// largest N of the sweep, the same process then measures the host's memory bandwidth: N threads
// each memcpy between two touched buffers of `memcpy_bytes` (what the copies into the host store
// contend for), the aggregate and the one-thread figure. Every wake is checked (the first and last
// byte of each allocation, written with a per-pool pattern). --json writes every number.
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "timing.hpp"
#include "torpor/backend.hpp"
#include "torpor/error.hpp"
#include "torpor/pool.hpp"

namespace {

using namespace torpor;
using bench::clock_type;
using bench::median;
using bench::seconds_since;

struct Options {
  std::string backend = "auto";
  std::vector<int> pools = {1, 2, 4, 8};
  std::size_t bytes = std::size_t{4} << 30;
  std::size_t alloc = std::size_t{256} << 20;
  int cycles = 3;
  std::size_t memcpy_bytes = std::size_t{1} << 30;
  std::string json;
};

// The host's copy bandwidth with `threads` threads, each copying its own touched buffers.
double memcpy_rate(int threads, std::size_t bytes, int reps) {
  std::vector<std::unique_ptr<std::byte[]>> src(threads), dst(threads);
  for (int t = 0; t < threads; ++t) {
    src[t].reset(new std::byte[bytes]);
    dst[t].reset(new std::byte[bytes]);
    std::memset(src[t].get(), t + 1, bytes);
    std::memset(dst[t].get(), 0, bytes);
  }
  std::vector<double> rates;
  for (int rep = 0; rep < reps; ++rep) {
    std::barrier start(threads + 1);
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        start.arrive_and_wait();
        std::memcpy(dst[t].get(), src[t].get(), bytes);
      });
    auto t0 = clock_type::now();
    start.arrive_and_wait();
    for (auto& th : ts) th.join();
    rates.push_back(static_cast<double>(bytes) * threads / seconds_since(t0));
  }
  return median(rates);
}

struct PoolRun {
  std::unique_ptr<Pool> pool;
  std::vector<void*> ptrs;
  std::uint8_t pattern = 0;
};

nlohmann::json run_sweep_point(Driver& d, int n, const Options& o) {
  const int devices = d.device_count();
  std::vector<PoolRun> runs(n);
  const std::size_t count = std::max<std::size_t>(1, o.bytes / o.alloc);
  for (int k = 0; k < n; ++k) {
    PoolOptions po;
    po.device = k % devices;
    po.va_bytes = count * o.alloc * 2 + (std::size_t{1} << 30);
    po.skip_unchanged = false;
    // Several pools on one device: the device's own pool options are per pool, so the pools
    // share its memory; their VA reservations are apart.
    runs[k].pool = std::make_unique<Pool>(d, po);
    runs[k].pattern = static_cast<std::uint8_t>(0x11 * (k + 1));
    std::vector<std::uint8_t> fill(o.alloc, runs[k].pattern);
    for (std::size_t i = 0; i < count; ++i) {
      void* p = runs[k].pool->allocate(o.alloc, {"weights", MemoryClass::state, fmt::format("s{}", i)});
      runs[k].pool->copy(p, fill.data(), fill.size());
      runs[k].ptrs.push_back(p);
    }
    runs[k].pool->prepare_host_store();
  }
  for (auto& r : runs) r.pool->wait_host_store();
  std::vector<double> sleep_s, wake_s;
  for (int c = 0; c < o.cycles; ++c) {
    for (bool sleeping : {true, false}) {
      std::barrier start(n + 1);
      std::vector<double> each(n);
      std::vector<std::exception_ptr> errors(n);
      std::vector<std::thread> ts;
      for (int k = 0; k < n; ++k)
        ts.emplace_back([&, k] {
          start.arrive_and_wait();
          auto t = clock_type::now();
          try {
            if (sleeping)
              runs[k].pool->sleep(1);
            else
              runs[k].pool->wake_up();
          } catch (...) {
            errors[k] = std::current_exception();
          }
          each[k] = seconds_since(t);
        });
      start.arrive_and_wait();
      for (auto& th : ts) th.join();
      for (auto& e : errors)
        if (e) std::rethrow_exception(e);
      (sleeping ? sleep_s : wake_s).push_back(*std::max_element(each.begin(), each.end()));
    }
    for (auto& r : runs)
      for (void* p : r.ptrs) {
        std::uint8_t first = 0, last = 0;
        r.pool->copy(&first, p, 1);
        r.pool->copy(&last, static_cast<std::uint8_t*>(p) + o.alloc - 1, 1);
        if (first != r.pattern || last != r.pattern)
          throw error(fmt::format("wake restored the wrong bytes ({:#x}, {:#x}; want {:#x})", first, last, r.pattern));
      }
  }
  const double total = static_cast<double>(count * o.alloc) * n;
  nlohmann::json j;
  j["pools"] = n;
  j["devices_used"] = std::min(n, devices);
  j["bytes_per_pool"] = count * o.alloc;
  j["sleep_s"] = sleep_s;
  j["wake_s"] = wake_s;
  j["sleep_rate_Bps"] = total / median(sleep_s);
  j["wake_rate_Bps"] = total / median(wake_s);
  return j;
}

int run(const Options& o) {
  DriverSelection sel = open_driver(parse_backend(o.backend));
  Driver& d = *sel.driver;
  fmt::print("torpor_bench_multi: backend {} ({}), {} device(s), {}\n", to_string(sel.backend), sel.reason,
             d.device_count(), d.device_properties(0).name);
  nlohmann::json j;
  j["backend"] = std::string(to_string(sel.backend));
  j["device"] = d.device_properties(0).name;
  j["device_count"] = d.device_count();
  if (const char* c = std::getenv("TORPOR_COMMIT")) j["commit"] = c;
  nlohmann::json points = nlohmann::json::array();
  fmt::print("{:>6} {:>8} {:>14} {:>14}\n", "pools", "devices", "sleep GB/s", "wake GB/s");
  int most = 1;
  for (int n : o.pools) {
    nlohmann::json p = run_sweep_point(d, n, o);
    fmt::print("{:>6} {:>8} {:14.2f} {:14.2f}\n", n, p["devices_used"].get<int>(),
               p["sleep_rate_Bps"].get<double>() / 1e9, p["wake_rate_Bps"].get<double>() / 1e9);
    points.push_back(p);
    most = std::max(most, n);
  }
  j["sweep"] = points;
  const double one = memcpy_rate(1, o.memcpy_bytes, 3);
  const double many = memcpy_rate(most, o.memcpy_bytes, 3);
  j["host_memcpy"] = {{"bytes", o.memcpy_bytes}, {"one_thread_Bps", one}, {"threads", most}, {"threads_Bps", many}};
  fmt::print("host memcpy: 1 thread {:.2f} GB/s, {} threads {:.2f} GB/s (bytes copied per second)\n", one / 1e9, most,
             many / 1e9);
  for (auto& p : points)
    fmt::print("  {} pools: sleep at {:.0f}% and wake at {:.0f}% of the host's {}-thread memcpy\n",
               p["pools"].get<int>(), 100 * p["sleep_rate_Bps"].get<double>() / many,
               100 * p["wake_rate_Bps"].get<double>() / many, most);
  if (!o.json.empty()) std::ofstream(o.json) << j.dump(2) << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"torpor_bench_multi: N pools sleeping at once against the host's memory bandwidth"};
  Options o;
  app.add_option("--backend", o.backend, std::string(torpor::backends_in_words.view()))
      ->check(CLI::IsMember(torpor::backend_name_strings()));
  app.add_option("--pools", o.pools, "pool counts to sweep (default 1 2 4 8)")->check(CLI::Range(1, 64));
  app.add_option_function<std::string>(
      "--bytes", [&](const std::string& s) { o.bytes = parse_size(s); }, "state bytes per pool (default 4G)");
  app.add_option_function<std::string>(
      "--alloc", [&](const std::string& s) { o.alloc = parse_size(s); }, "bytes per allocation (default 256M)");
  app.add_option("--cycles", o.cycles, "sleep + wake cycles per pool count (default 3)")->check(CLI::Range(1, 100));
  app.add_option_function<std::string>(
      "--memcpy-bytes", [&](const std::string& s) { o.memcpy_bytes = parse_size(s); },
      "buffer per thread for the host memcpy bandwidth (default 1G)");
  app.add_option("--json", o.json, "write every number to this JSON file");
  CLI11_PARSE(app, argc, argv);
  if (o.alloc == 0 || o.bytes == 0 || o.memcpy_bytes == 0) {
    fmt::print(stderr, "torpor_bench_multi: --bytes, --alloc and --memcpy-bytes must be > 0\n");
    return 2;
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    fmt::print(stderr, "torpor_bench_multi: {}\n", e.what());
    return 1;
  }
}
