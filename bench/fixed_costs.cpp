// torpor_bench_fixed: the costs of a sleep and a wake that do not depend on bytes (issue 30).
//
// For each chunk count N of a sweep (default 100 to 10,000), one pool holds N dedicated chunks of
// one granule each, every one holding a small parameter allocation, so that the bytes moved are
// negligible and what is left is per chunk and per call. Per N, after one level-1 sleep and wake
// that fill the host store: `reps` times an unchanged level-1 sleep (hash, nothing copied, unmap,
// release) and its wake (create, map, set access, copy back), then a level-2 sleep (the parameters
// discarded: unmap, release) and its wake; the median of each phase, and of each of its report's
// sub-phases. A least-squares line through (N, seconds) gives each phase's cost per chunk (slope)
// and per call (intercept), so the scaling is visible.
//
// The floor, in the same run, on the same device: each driver call a chunk needs (create, map,
// set access, unmap, release) timed on its own over M granules, one call at a time, as the
// per-chunk figure torpor's sleep and wake cannot go below without batching them.
// Beside it, handles of --large-handle-bytes (the size of the scenario's chunks, whose release
// grows with the bytes): each call per handle and per GiB, and the release of all of them from 1,
// 2 and 4 threads at once, which says whether more release workers (PoolOptions::release_threads)
// would shorten a sleep of large chunks. And the driver calls each phase made, per chunk and per
// call, counted in one extra untimed cycle per N through the counting decorator, so the record
// shows which calls the time is spent in.
// Everything goes through the driver seam: the same program runs on the host backend (a smoke
// test with a small sweep) and on a GPU. --json writes every number.
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "timing.hpp"
#include "torpor/backend.hpp"
#include "torpor/error.hpp"
#include "torpor/pool.hpp"
#include "torpor/testing/fault_injecting_driver.hpp"

namespace {

using namespace torpor;
using bench::clock_type;
using bench::median;
using bench::seconds_since;

struct Fit {
  double per_chunk = 0;  // slope, seconds per chunk
  double per_call = 0;   // intercept, seconds
};

Fit least_squares(const std::vector<double>& x, const std::vector<double>& y) {
  const double n = static_cast<double>(x.size());
  if (x.size() < 2) return {x.empty() ? 0 : y[0] / std::max(x[0], 1.0), 0};
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    sx += x[i];
    sy += y[i];
    sxx += x[i] * x[i];
    sxy += x[i] * y[i];
  }
  const double den = n * sxx - sx * sx;
  if (den == 0) return {};
  Fit f;
  f.per_chunk = (n * sxy - sx * sy) / den;
  f.per_call = (sy - f.per_chunk * sx) / n;
  return f;
}

struct Options {
  std::string backend = "auto";
  std::vector<std::size_t> chunks = {100, 316, 1000, 3162, 10000};
  std::size_t alloc_bytes = std::size_t{64} << 10;
  int reps = 5;
  std::size_t floor_handles = 1000;
  std::size_t large_handle_bytes = std::size_t{512} << 20;
  std::size_t large_handles = 16;
  std::string json;
};

const char* const phase_names[] = {"l1_sleep_unchanged", "l1_wake", "l2_sleep", "l2_wake"};

using CallCounts = std::array<std::size_t, static_cast<std::size_t>(DriverCall::count_)>;

CallCounts snapshot(const FaultInjectingDriver* counting) {
  CallCounts c{};
  if (counting != nullptr)
    for (std::size_t k = 0; k < c.size(); ++k) c[k] = counting->calls(static_cast<DriverCall>(k));
  return c;
}

struct Sample {
  std::map<std::string, std::vector<double>> seconds;                             // phase -> reps
  std::map<std::string, std::map<std::string, std::vector<double>>> sub_seconds;  // phase -> sub-phase -> reps
  std::map<std::string, std::map<std::string, std::size_t>> calls;                // phase -> call -> count (last rep)
  const FaultInjectingDriver* counting = nullptr;
  CallCounts before{};
  void start() { before = snapshot(counting); }
  void add(const std::string& phase, const TransitionReport& r, double wall) {
    seconds[phase].push_back(wall);
    for (const auto& p : r.phases) sub_seconds[phase][p.name].push_back(p.seconds);
    if (counting == nullptr) return;
    CallCounts now = snapshot(counting);
    calls[phase].clear();
    for (std::size_t k = 0; k < now.size(); ++k)
      if (now[k] != before[k]) calls[phase][std::string(to_string(static_cast<DriverCall>(k)))] = now[k] - before[k];
  }
};

// `counting`: d itself when the calls are to be counted (then one untimed rep is what counts).
Sample measure(Driver& d, std::size_t n, const Options& o, int reps, const FaultInjectingDriver* counting) {
  const std::size_t gran = d.device_properties(0).granularity;
  PoolOptions po;
  po.device = 0;
  po.va_bytes = (n + 64) * gran * 2;
  Pool pool(d, po);
  std::vector<void*> ptrs;
  ptrs.reserve(n);
  std::vector<std::uint8_t> bytes(o.alloc_bytes, 0x5a);
  for (std::size_t i = 0; i < n; ++i) {
    AllocationOptions ao{"weights", MemoryClass::parameter, fmt::format("p{}", i), true};
    ptrs.push_back(pool.allocate(o.alloc_bytes, ao));
    pool.copy(ptrs.back(), bytes.data(), bytes.size());
  }
  // Fill the host store and the retained copies: the first sleep is not what this measures.
  pool.sleep(1);
  pool.wake_up();
  Sample s;
  s.counting = counting;
  for (int rep = 0; rep < reps; ++rep) {
    s.start();
    auto t = clock_type::now();
    TransitionReport r = pool.sleep(1);
    s.add("l1_sleep_unchanged", r, seconds_since(t));
    if (r.bytes_offloaded != 0)
      throw error(fmt::format("internal: the unchanged level-1 sleep copied {} bytes", r.bytes_offloaded));
    s.start();
    t = clock_type::now();
    r = pool.wake_up();
    s.add("l1_wake", r, seconds_since(t));
    s.start();
    t = clock_type::now();
    r = pool.sleep(2);
    s.add("l2_sleep", r, seconds_since(t));
    s.start();
    t = clock_type::now();
    r = pool.wake_up();
    s.add("l2_wake", r, seconds_since(t));
    // Level 2 discarded the parameters: reload them, so the next level-1 sleep is unchanged
    // against the retained copies again (its first rep after this copies; not measured).
    for (void* p : ptrs) pool.copy(p, bytes.data(), bytes.size());
    pool.sleep(1);
    pool.wake_up();
  }
  for (void* p : ptrs) pool.deallocate(p);
  return s;
}

// The floor: each call a chunk's sleep or wake makes, alone, over m granules.
nlohmann::json driver_floor(Driver& d, std::size_t m) {
  const std::size_t gran = d.device_properties(0).granularity;
  const std::size_t total = m * gran;
  device_ptr base = d.reserve(total, gran);
  std::vector<PhysicalHandle> handles(m);
  const int devices[] = {0};
  auto each = [&](auto&& call) {
    auto t = clock_type::now();
    for (std::size_t i = 0; i < m; ++i) call(i);
    return seconds_since(t) / static_cast<double>(m);
  };
  nlohmann::json j;
  j["handles"] = m;
  j["granularity"] = gran;
  j["create_s"] = each([&](std::size_t i) { handles[i] = d.create(0, gran, false); });
  j["map_s"] = each([&](std::size_t i) { d.map(base + i * gran, gran, handles[i], 0); });
  j["set_access_s"] = each([&](std::size_t i) { d.set_access(base + i * gran, gran, devices); });
  j["unmap_s"] = each([&](std::size_t i) { d.unmap(base + i * gran, gran); });
  j["release_s"] = each([&](std::size_t i) { d.release(handles[i]); });
  // One set-access over a contiguous range of every granule: what batching could reach.
  for (std::size_t i = 0; i < m; ++i) {
    handles[i] = d.create(0, gran, false);
    d.map(base + i * gran, gran, handles[i], 0);
  }
  auto t = clock_type::now();
  d.set_access(base, total, devices);
  j["set_access_one_range_per_granule_s"] = seconds_since(t) / static_cast<double>(m);
  for (std::size_t i = 0; i < m; ++i) {
    d.unmap(base + i * gran, gran);
    d.release(handles[i]);
  }
  d.free_reservation(base, total);
  return j;
}

// Handles of `bytes` (rounded to the granularity), m of them: each call per handle and per GiB,
// and the release of all m from 1, 2 and 4 threads at once (seconds per handle, wall).
nlohmann::json large_handle_floor(Driver& d, std::size_t bytes, std::size_t m) {
  const std::size_t gran = d.device_properties(0).granularity;
  bytes = (bytes + gran - 1) / gran * gran;
  const std::size_t total = m * bytes;
  const double gib = static_cast<double>(bytes) / static_cast<double>(std::size_t{1} << 30);
  device_ptr base = d.reserve(total, gran);
  std::vector<PhysicalHandle> handles(m);
  const int devices[] = {0};
  auto each = [&](auto&& call) {
    auto t = clock_type::now();
    for (std::size_t i = 0; i < m; ++i) call(i);
    return seconds_since(t) / static_cast<double>(m);
  };
  nlohmann::json j;
  j["handles"] = m;
  j["handle_bytes"] = bytes;
  j["create_s"] = each([&](std::size_t i) { handles[i] = d.create(0, bytes, false); });
  j["map_s"] = each([&](std::size_t i) { d.map(base + i * bytes, bytes, handles[i], 0); });
  j["set_access_s"] = each([&](std::size_t i) { d.set_access(base + i * bytes, bytes, devices); });
  j["unmap_s"] = each([&](std::size_t i) { d.unmap(base + i * bytes, bytes); });
  j["release_s"] = each([&](std::size_t i) { d.release(handles[i]); });
  for (const char* k : {"create_s", "map_s", "set_access_s", "unmap_s", "release_s"})
    j["per_gib"][k] = j[k].get<double>() / gib;
  for (std::size_t threads : {std::size_t{1}, std::size_t{2}, std::size_t{4}}) {
    if (threads > m) break;
    for (std::size_t i = 0; i < m; ++i) handles[i] = d.create(0, bytes, false);
    auto t = clock_type::now();
    std::vector<std::thread> workers;
    for (std::size_t w = 0; w < threads; ++w)
      workers.emplace_back([&, w] {
        for (std::size_t i = w; i < m; i += threads) d.release(handles[i]);
      });
    for (auto& w : workers) w.join();
    j["release_parallel_s"][std::to_string(threads)] = seconds_since(t) / static_cast<double>(m);
  }
  d.free_reservation(base, total);
  return j;
}

int run(const Options& o) {
  DriverSelection sel = open_driver(parse_backend(o.backend));
  Driver& d = *sel.driver;
  DeviceProperties props = d.device_properties(0);
  fmt::print("torpor_bench_fixed: backend {} ({}), device {}\n", to_string(sel.backend), sel.reason, props.name);
  nlohmann::json j;
  j["backend"] = std::string(to_string(sel.backend));
  j["device"] = props.name;
  if (const char* c = std::getenv("TORPOR_COMMIT")) j["commit"] = c;
  j["alloc_bytes"] = o.alloc_bytes;
  j["reps"] = o.reps;

  nlohmann::json floor = driver_floor(d, o.floor_handles);
  j["driver_floor"] = floor;
  fmt::print("driver floor per call over {} granules of {} bytes:\n", o.floor_handles, props.granularity);
  for (const char* k :
       {"create_s", "map_s", "set_access_s", "unmap_s", "release_s", "set_access_one_range_per_granule_s"})
    fmt::print("  {:<36} {:9.2f} us\n", k, floor[k].get<double>() * 1e6);
  if (o.large_handles > 0) {
    nlohmann::json large = large_handle_floor(d, o.large_handle_bytes, o.large_handles);
    j["large_handle_floor"] = large;
    fmt::print("driver floor per call over {} handles of {} bytes (per handle, per GiB):\n", o.large_handles,
               large["handle_bytes"].get<std::size_t>());
    for (const char* k : {"create_s", "map_s", "set_access_s", "unmap_s", "release_s"})
      fmt::print("  {:<36} {:9.2f} us {:9.2f} us/GiB\n", k, large[k].get<double>() * 1e6,
                 large["per_gib"][k].get<double>() * 1e6);
    for (auto& [t, v] : large["release_parallel_s"].items())
      fmt::print("  release from {} thread(s) at once      {:9.2f} us per handle (wall)\n", t, v.get<double>() * 1e6);
  }
  const double sleep_floor = floor["unmap_s"].get<double>() + floor["release_s"].get<double>();
  const double wake_floor =
      floor["create_s"].get<double>() + floor["map_s"].get<double>() + floor["set_access_s"].get<double>();
  j["floor_per_chunk"] = {{"sleep_s", sleep_floor}, {"wake_s", wake_floor}};

  std::map<std::string, std::vector<double>> xs, ys;
  nlohmann::json rows = nlohmann::json::array();
  fmt::print("\n{:>7} {:>12} {:>12} {:>12} {:>12}   (median seconds of {} reps)\n", "chunks", phase_names[0],
             phase_names[1], phase_names[2], phase_names[3], o.reps);
  for (std::size_t n : o.chunks) {
    Sample s = measure(d, n, o, o.reps, nullptr);
    FaultInjectingDriver counting(d);  // no fault rules: it only counts
    Sample c = measure(counting, n, o, 1, &counting);
    nlohmann::json row;
    row["chunks"] = n;
    std::string line = fmt::format("{:>7}", n);
    for (const char* ph : phase_names) {
      const double m = median(s.seconds[ph]);
      row[ph] = {{"seconds", m}, {"per_chunk_s", m / static_cast<double>(n)}, {"reps", s.seconds[ph]}};
      for (auto& [sub, v] : s.sub_seconds[ph]) row[ph]["phases"][sub] = median(v);
      row[ph]["calls"] = c.calls[ph];
      xs[ph].push_back(static_cast<double>(n));
      ys[ph].push_back(m);
      line += fmt::format(" {:12.6f}", m);
    }
    fmt::print("{}\n", line);
    for (const char* ph : phase_names) {
      std::string calls;
      for (auto& [call, count] : c.calls[ph]) calls += fmt::format("{}{} {}", calls.empty() ? "" : ", ", call, count);
      fmt::print("        calls of {}: {}\n", ph, calls);
    }
    rows.push_back(row);
  }
  j["sweep"] = rows;
  fmt::print("\n{:<20} {:>14} {:>14} {:>16}\n", "phase", "per chunk (us)", "per call (ms)", "floor/chunk (us)");
  for (const char* ph : phase_names) {
    Fit f = least_squares(xs[ph], ys[ph]);
    const bool wake = std::string(ph).find("wake") != std::string::npos;
    const double fl = wake ? wake_floor : sleep_floor;
    j["fit"][ph] = {{"per_chunk_s", f.per_chunk}, {"per_call_s", f.per_call}, {"floor_per_chunk_s", fl}};
    fmt::print("{:<20} {:14.2f} {:14.3f} {:16.2f}\n", ph, f.per_chunk * 1e6, f.per_call * 1e3, fl * 1e6);
  }
  if (!o.json.empty()) std::ofstream(o.json) << j.dump(2) << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"torpor_bench_fixed: per-chunk and per-call costs of sleep and wake, beside the driver's floor"};
  Options o;
  app.add_option("--backend", o.backend, std::string(torpor::backends_in_words.view()))
      ->check(CLI::IsMember(torpor::backend_name_strings()));
  app.add_option("--chunks", o.chunks, "chunk counts to sweep (default 100 316 1000 3162 10000)")
      ->check(CLI::Range(std::size_t{1}, std::size_t{100000}));
  app.add_option_function<std::string>(
      "--alloc-bytes", [&](const std::string& s) { o.alloc_bytes = parse_size(s); },
      "bytes of the parameter allocation in each chunk (default 64K)");
  app.add_option("--reps", o.reps, "repetitions per chunk count (default 5)")->check(CLI::Range(1, 100));
  app.add_option("--floor-handles", o.floor_handles, "granules the driver floor is timed over (default 1000)")
      ->check(CLI::Range(std::size_t{1}, std::size_t{100000}));
  app.add_option_function<std::string>(
      "--large-handle-bytes", [&](const std::string& s) { o.large_handle_bytes = parse_size(s); },
      "bytes of each handle of the large-handle floor (default 512M, the scenario's chunk size)");
  app.add_option("--large-handles", o.large_handles,
                 "handles the large-handle floor is timed over (default 16; 0: skip)")
      ->check(CLI::Range(std::size_t{0}, std::size_t{4096}));
  app.add_option("--json", o.json, "write every number to this JSON file");
  CLI11_PARSE(app, argc, argv);
  if (o.large_handles > 0 && (o.large_handle_bytes == 0 || o.large_handle_bytes > (std::size_t{64} << 30))) {
    fmt::print(stderr,
               "torpor_bench_fixed: --large-handle-bytes must be 1 byte..64G (it is rounded up to the granularity)\n");
    return 2;
  }
  if (o.alloc_bytes == 0) {
    fmt::print(stderr, "torpor_bench_fixed: --alloc-bytes must be > 0\n");
    return 2;
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    fmt::print(stderr, "torpor_bench_fixed: {}\n", e.what());
    return 1;
  }
}
