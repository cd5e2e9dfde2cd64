// torpor_bench_sleep: sleep and wake at the PCIe ceiling, measured against the ceiling and
// against the per-allocation policy engines use today (issue 3).
//
// One run, one device:
//   1. the ceiling: plain copies between device memory and a pinned host buffer, both ways;
//   2. torpor, cycles 1..N: L1 sleep + wake with changed bytes, L1 sleep + wake with nothing
//      changed, L2 sleep, wake "weights", reload, wake "kv_cache"; cycle 1 (which grows the
//      host store) reported apart from the steady state (cycles 2..N, median);
//   3. the per-allocation baseline, as vLLM's CuMemAllocator does it: per allocation a fresh
//      pinned buffer, a synchronous copy, unmap and release; the reverse on wake;
//   4. device memory returned after each sleep, by cuMemGetInfo.
// The first L1 sleep pins the host store it copies into (all of it, then the copies;
// --overlap-pinning copies into each block once it is page-locked while the next is pinned, the
// other arrangement, for a record of both); with --prepare the store is pinned in the background while the scenario
// loads (Pool::prepare_host_store), as an engine would during model load. Cycle 1's L1 sleep is checked against its own
// target, with or without preparation. Every wake is checked: hashes of the bytes that must survive equal those before
// the sleep. Everything goes through the driver seam, so the same program runs on the host backend (CI's smoke test,
// with a small scenario) and on a GPU.
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "common/range_allocator.hpp"
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
  std::size_t param_count = 2048;
  std::size_t param_bytes = std::size_t{16} << 20;
  std::size_t state_bytes = std::size_t{256} << 20;
  std::size_t state_min = std::size_t{64} << 10;
  std::size_t state_max = std::size_t{4} << 20;
  std::size_t shared = 64;  // parameter tensors whose segment also holds a state range
  std::size_t cache_bytes = std::size_t{16} << 30;
  std::size_t cache_alloc = std::size_t{1} << 30;
  int cycles = 5;
  bool baseline = true;
  int baseline_cycles = 2;
  std::size_t ceiling_buffer = std::size_t{2} << 30;
  int release_threads = 2;
  double settle = 0;                 // seconds of pause before each timed step of a cycle
  bool prepare = false;              // prepare_host_store() while the scenario loads
  bool overlap_pinning = false;      // PoolOptions::host_pin_overlap
  std::size_t host_store_limit = 0;  // PoolOptions::host_store_limit
  std::string spill_dir;             // PoolOptions::spill_dir
  std::string json;
};

struct Range {
  void* p;
  std::size_t bytes;
};

// The scenario's allocations, by what they hold.
struct Scenario {
  std::vector<Range> params;  // parameter bytes (16 MiB tensors)
  std::vector<Range> state;   // state bytes (standalone and inside parameter segments)
  std::vector<void*> allocations;
  std::size_t param_bytes = 0, state_bytes = 0, cache_bytes = 0;
};

Scenario build(Pool& pool, const Options& o) {
  Scenario s;
  std::mt19937_64 rng(42);
  std::size_t shared_tail =
      std::max<std::size_t>(o.state_min,
                            std::min<std::size_t>(o.state_bytes / 8 / std::max<std::size_t>(o.shared, 1), o.state_max));
  for (std::size_t i = 0; i < o.param_count; ++i) {
    std::string name = fmt::format("layers.{}.w{}", i / 8, i % 8);
    if (i < o.shared) {
      // A PyTorch-style segment: the tensor and, behind it, a buffer the module computed.
      void* seg = pool.allocate(o.param_bytes + shared_tail, {tags::weights, MemoryClass::state, name + ".segment"});
      pool.mark(seg, o.param_bytes, MemoryClass::parameter, name);
      s.allocations.push_back(seg);
      s.params.push_back({seg, o.param_bytes});
      s.state.push_back({static_cast<std::byte*>(seg) + o.param_bytes, shared_tail});
      s.state_bytes += shared_tail;
    } else {
      void* p = pool.allocate(o.param_bytes, {tags::weights, MemoryClass::parameter, name});
      s.allocations.push_back(p);
      s.params.push_back({p, o.param_bytes});
    }
    s.param_bytes += o.param_bytes;
  }
  while (s.state_bytes < o.state_bytes) {
    std::size_t n = o.state_min + rng() % (o.state_max - o.state_min + 1);
    n = std::min(n, o.state_bytes - s.state_bytes);
    n = std::max<std::size_t>(n, 256);
    void* p = pool.allocate(n, {tags::weights, MemoryClass::state, "buffers"});
    s.allocations.push_back(p);
    s.state.push_back({p, n});
    s.state_bytes += n;
  }
  for (std::size_t done = 0; done < o.cache_bytes; done += o.cache_alloc) {
    std::size_t n = std::min(o.cache_alloc, o.cache_bytes - done);
    s.allocations.push_back(pool.allocate(n, {tags::kv_cache, MemoryClass::cache, "kv"}));
    s.cache_bytes += n;
  }
  return s;
}

// Random bytes everywhere that matters (never time on zeros), through a pinned pattern.
void fill_random(Driver& d, Stream st, const std::vector<Range>& ranges, std::uint64_t seed) {
  std::size_t pattern_bytes = std::size_t{64} << 20;
  auto* pattern = static_cast<std::uint64_t*>(d.host_alloc(pattern_bytes));
  std::mt19937_64 rng(seed);
  for (std::size_t i = 0; i < pattern_bytes / 8; ++i) pattern[i] = rng();
  std::size_t k = 0;
  for (const Range& r : ranges) {
    for (std::size_t off = 0; off < r.bytes; off += pattern_bytes) {
      std::size_t n = std::min(pattern_bytes, r.bytes - off);
      std::size_t shift = (k++ * 4096) % (pattern_bytes - n + 1);
      d.copy_async(static_cast<std::byte*>(r.p) + off, reinterpret_cast<std::byte*>(pattern) + shift / 8 * 8, n, st);
    }
  }
  d.stream_synchronize(st);
  d.host_free(pattern);
}

// Changes every byte of the ranges on the device (cycle-dependent, never zero).
void mutate(Driver& d, Stream st, const std::vector<Range>& ranges, int cycle) {
  for (std::size_t i = 0; i < ranges.size(); ++i)
    d.fill_async(reinterpret_cast<device_ptr>(ranges[i].p), static_cast<std::uint8_t>((cycle * 37 + i * 11) | 1),
                 ranges[i].bytes, st);
  d.stream_synchronize(st);
}

std::vector<Hash128> hashes(Driver& d, Stream st, const std::vector<Range>& ranges) {
  std::vector<HashRange> hr;
  for (const Range& r : ranges) hr.push_back({r.p, r.bytes});
  std::vector<Hash128> out(hr.size());
  d.hash(hr, out.data(), st);
  return out;
}

void expect_same(const std::vector<Hash128>& before, const std::vector<Hash128>& after, const char* what) {
  for (std::size_t i = 0; i < before.size(); ++i)
    if (before[i] != after[i])
      throw error(fmt::format("{}: range {} of {} changed across sleep/wake (hash mismatch)", what, i, before.size()));
}

struct Ceiling {
  double d2h_seconds = 0, h2d_seconds = 0;
  std::size_t bytes = 0;
};

// Plain pinned copies of the same byte count, through one reusable pinned buffer.
Ceiling measure_ceiling(Driver& d, Stream st, const std::vector<Range>& ranges, std::size_t buffer_bytes) {
  Ceiling c;
  for (const Range& r : ranges) c.bytes += r.bytes;
  buffer_bytes = std::min(buffer_bytes, c.bytes);
  auto* buf = static_cast<std::byte*>(d.host_alloc(buffer_bytes));
  auto run = [&](bool to_host) {
    std::size_t used = 0;
    auto t = clock_type::now();
    for (const Range& r : ranges) {
      for (std::size_t off = 0; off < r.bytes;) {
        std::size_t n = std::min(r.bytes - off, buffer_bytes - used);
        auto* dev = static_cast<std::byte*>(r.p) + off;
        if (to_host)
          d.copy_async(buf + used, dev, n, st);
        else
          d.copy_async(dev, buf + used, n, st);
        used = (used + n) % buffer_bytes;
        off += n;
      }
    }
    d.stream_synchronize(st);
    return seconds_since(t);
  };
  run(true);  // warm-up
  c.d2h_seconds = run(true);
  c.h2d_seconds = run(false);
  d.host_free(buf);
  return c;
}

double returned_fraction(std::size_t free_before, std::size_t free_after, std::size_t mapped) {
  return mapped == 0
             ? 1.0
             : (static_cast<double>(free_after) - static_cast<double>(free_before)) / static_cast<double>(mapped);
}

nlohmann::json report_json(const TransitionReport& r) { return nlohmann::json::parse(to_json(r)); }

struct Baseline {
  std::vector<double> sleep_seconds, wake_seconds;
};

// vLLM's CuMemAllocator policy through the same seam: one handle per allocation; sleep =
// per allocation a fresh pinned buffer, a synchronous copy, unmap, release; wake = create,
// map, set access, copy back, free the buffer.
Baseline run_baseline(Driver& d, int device, const Options& o, int cycles) {
  struct Alloc {
    device_ptr va;
    std::size_t bytes;
    bool offload;
    PhysicalHandle h;
    void* backup = nullptr;
  };
  std::size_t g = d.device_properties(device).granularity;
  std::vector<Alloc> allocs;
  std::size_t total = 0;
  auto add = [&](std::size_t n, bool offload) {
    n = align_up(n, g);
    allocs.push_back({0, n, offload, {}});
    total += n;
  };
  for (std::size_t i = 0; i < o.param_count; ++i) add(o.param_bytes, true);
  std::mt19937_64 rng(42);
  for (std::size_t s = 0; s < o.state_bytes;) {
    std::size_t n = std::min(o.state_min + rng() % (o.state_max - o.state_min + 1), o.state_bytes - s);
    add(std::max<std::size_t>(n, 256), true);
    s += n;
  }
  for (std::size_t done = 0; done < o.cache_bytes; done += o.cache_alloc)
    add(std::min(o.cache_alloc, o.cache_bytes - done), false);
  device_ptr base = d.reserve(total, g);
  int dev = device;
  std::span<const int> access(&dev, 1);
  std::size_t at = 0;
  for (auto& a : allocs) {
    a.va = base + at;
    at += a.bytes;
    a.h = d.create(device, a.bytes, false);
    d.map(a.va, a.bytes, a.h, 0);
    d.set_access(a.va, a.bytes, access);
  }
  Stream st = d.stream_create(device);
  for (auto& a : allocs) d.fill_async(a.va, 0x5A, a.bytes, st);
  d.stream_synchronize(st);
  Baseline b;
  for (int c = 0; c < cycles; ++c) {
    auto t = clock_type::now();
    for (auto& a : allocs) {
      if (a.offload) {
        a.backup = d.host_alloc(a.bytes);
        d.copy_async(a.backup, reinterpret_cast<void*>(a.va), a.bytes, st);
        d.stream_synchronize(st);
      }
      d.unmap(a.va, a.bytes);
      d.release(a.h);
    }
    b.sleep_seconds.push_back(seconds_since(t));
    t = clock_type::now();
    for (auto& a : allocs) {
      a.h = d.create(device, a.bytes, false);
      d.map(a.va, a.bytes, a.h, 0);
      d.set_access(a.va, a.bytes, access);
      if (a.offload) {
        d.copy_async(reinterpret_cast<void*>(a.va), a.backup, a.bytes, st);
        d.stream_synchronize(st);
        d.host_free(a.backup);
        a.backup = nullptr;
      }
    }
    b.wake_seconds.push_back(seconds_since(t));
    fmt::print("  baseline cycle {}: sleep {:.3f} s, wake {:.3f} s\n", c + 1, b.sleep_seconds.back(),
               b.wake_seconds.back());
  }
  for (auto& a : allocs) {
    d.unmap(a.va, a.bytes);
    d.release(a.h);
  }
  d.free_reservation(base, total);
  d.stream_destroy(st);
  return b;
}

int run(const Options& o) {
  DriverSelection sel = open_driver(parse_backend(o.backend));
  Driver& d = *sel.driver;
  const int device = 0;
  DeviceProperties props = d.device_properties(device);
  fmt::print("torpor_bench_sleep: backend {} ({}), device {}\n", to_string(sel.backend), sel.reason, props.name);
  nlohmann::json j;
  j["backend"] = std::string(to_string(sel.backend));
  j["device"] = props.name;
  if (const char* c = std::getenv("TORPOR_COMMIT")) j["commit"] = c;
  j["scenario"] = {{"param_count", o.param_count},
                   {"param_bytes", o.param_bytes},
                   {"state_bytes", o.state_bytes},
                   {"state_min", o.state_min},
                   {"state_max", o.state_max},
                   {"shared", o.shared},
                   {"cache_bytes", o.cache_bytes},
                   {"cache_alloc", o.cache_alloc},
                   {"cycles", o.cycles},
                   {"release_threads", o.release_threads},
                   {"settle_seconds", o.settle},
                   {"prepare", o.prepare},
                   {"host_store_limit", o.host_store_limit},
                   {"spill_dir", o.spill_dir},
                   {"overlap_pinning", o.overlap_pinning}};

  Ceiling ceiling;
  std::vector<nlohmann::json> cycles;
  std::size_t moved = 0;
  {
    PoolOptions po;
    po.device = device;
    po.release_threads = o.release_threads;
    po.host_store_limit = o.host_store_limit;
    po.spill_dir = o.spill_dir;
    po.host_pin_overlap = o.overlap_pinning;
    Pool pool(d, po);
    auto t = clock_type::now();
    Scenario s = build(pool, o);
    if (o.prepare) {
      std::size_t added = pool.prepare_host_store();  // pins while the bytes load and the ceiling runs
      j["prepare_added_bytes"] = added;
      fmt::print("prepare_host_store: pinning {} in the background\n", format_bytes(added));
    }
    Stream st = d.stream_create(device);
    fill_random(d, st, s.params, 1);
    fill_random(d, st, s.state, 2);
    moved = s.param_bytes + s.state_bytes;
    fmt::print("scenario: {} parameter, {} state ({} ranges), {} cache; {} chunks, built in {:.2f} s\n",
               format_bytes(s.param_bytes), format_bytes(s.state_bytes), s.state.size(), format_bytes(s.cache_bytes),
               pool.stats().chunks, seconds_since(t));
    std::vector<Range> all = s.params;
    all.insert(all.end(), s.state.begin(), s.state.end());
    ceiling = measure_ceiling(d, st, all, o.ceiling_buffer);
    fmt::print("ceiling: D2H {:.3f} s ({:.1f} GB/s), H2D {:.3f} s ({:.1f} GB/s) for {}\n", ceiling.d2h_seconds,
               ceiling.bytes / ceiling.d2h_seconds / 1e9, ceiling.h2d_seconds,
               ceiling.bytes / ceiling.h2d_seconds / 1e9, format_bytes(ceiling.bytes));

    for (int c = 1; c <= o.cycles; ++c) {
      nlohmann::json cj;
      cj["cycle"] = c;
      if (c == 1) {
        PoolStats hs = pool.stats();
        j["host_before_first_sleep"] = {{"pinned_bytes", hs.host_store_pinned_bytes},
                                        {"pinning_bytes", hs.host_store_pinning_bytes}};
        fmt::print("host store before the first sleep: {} pinned, {} being pinned\n",
                   format_bytes(hs.host_store_pinned_bytes), format_bytes(hs.host_store_pinning_bytes));
      }
      mutate(d, st, s.params, c);
      mutate(d, st, s.state, c + 100);
      auto hp = hashes(d, st, s.params);
      auto hs = hashes(d, st, s.state);
      auto step = [&](const char* name, auto&& fn) {
        if (o.settle > 0) std::this_thread::sleep_for(std::chrono::duration<double>(o.settle));
        std::size_t mapped = pool.stats().mapped_bytes;
        std::size_t free_before = d.memory_info(device).free_bytes;
        auto t0 = clock_type::now();
        TransitionReport r = fn();
        double secs = seconds_since(t0);
        nlohmann::json x = report_json(r);
        x["wall_seconds"] = secs;
        if (r.operation == "sleep")
          x["returned"] = returned_fraction(free_before, d.memory_info(device).free_bytes, mapped);
        cj[name] = x;
        return secs;
      };
      step("l1_sleep", [&] { return pool.sleep(1); });
      step("l1_wake", [&] { return pool.wake_up(); });
      expect_same(hp, hashes(d, st, s.params), "parameters after level 1");
      expect_same(hs, hashes(d, st, s.state), "state after level 1");
      step("l1_sleep_unchanged", [&] { return pool.sleep(1); });
      step("l1_wake_unchanged", [&] { return pool.wake_up(); });
      expect_same(hs, hashes(d, st, s.state), "state after an unchanged level 1");
      step("l2_sleep", [&] { return pool.sleep(2); });
      step("l2_wake_weights", [&] { return pool.wake_up({tags::weights}); });
      mutate(d, st, s.params, c + 200);  // the weight update an RL loop would load here
      step("l2_wake_kv", [&] { return pool.wake_up({tags::kv_cache}); });
      expect_same(hs, hashes(d, st, s.state), "state after level 2");
      auto g = [&](const char* k) { return cj[k]["wall_seconds"].get<double>(); };
      fmt::print("cycle {}: L1 sleep {:.3f} s wake {:.3f} s | unchanged sleep {:.3f} s | L2 sleep {:.3f} s wake "
                 "{:.3f}+{:.3f} s"
                 " | returned L1 {:.4f} L2 {:.4f}\n",
                 c, g("l1_sleep"), g("l1_wake"), g("l1_sleep_unchanged"), g("l2_sleep"), g("l2_wake_weights"),
                 g("l2_wake_kv"), cj["l1_sleep"]["returned"].get<double>(), cj["l2_sleep"]["returned"].get<double>());
      // Where each step's time goes. With the pinning overlapped, host_pinning_wait is the time
      // the copies waited for their blocks, inside offload_and_release; the hash runs group by
      // group inside offload_and_release too, so the phases of a sleep overlap.
      for (const char* k : {"l1_sleep", "l1_sleep_unchanged", "l2_sleep", "l2_wake_weights", "l2_wake_kv"}) {
        std::string phases;
        for (auto& [name, sec] : cj[k]["phases"].items())
          phases += fmt::format("{}{} {:.4f} s", phases.empty() ? "" : ", ", name, sec.get<double>());
        fmt::print("  cycle {} {} phases: {}\n", c, k, phases);
      }
      cycles.push_back(cj);
    }
    PoolStats hs = pool.stats();
    j["host_store"] = {{"bytes", hs.host_store_bytes},
                       {"pinned_bytes", hs.host_store_pinned_bytes},
                       {"pageable_bytes", hs.host_store_pageable_bytes},
                       {"registration_refused", hs.host_registration_refused},
                       {"spill_bytes", hs.spill_bytes},
                       {"spill_direct_io", hs.spill_direct_io}};
    fmt::print("host store: {} held ({} pinned, {} pageable){}; spill {}{}\n", format_bytes(hs.host_store_bytes),
               format_bytes(hs.host_store_pinned_bytes), format_bytes(hs.host_store_pageable_bytes),
               hs.host_registration_refused ? ", registration refused (host_alloc used)" : "",
               format_bytes(hs.spill_bytes),
               hs.spill_path.empty() ? "" : (hs.spill_direct_io ? " (O_DIRECT)" : " (buffered I/O)"));
    d.stream_destroy(st);
  }
  j["ceiling"] = {{"bytes", ceiling.bytes}, {"d2h_seconds", ceiling.d2h_seconds}, {"h2d_seconds", ceiling.h2d_seconds}};
  j["cycles"] = cycles;

  // Steady state: cycles 2..N (cycle 1 when only one ran).
  auto steady = [&](const char* key) {
    std::vector<double> v;
    for (std::size_t i = cycles.size() > 1 ? 1 : 0; i < cycles.size(); ++i) v.push_back(cycles[i][key]["wall_seconds"]);
    return median(v);
  };
  auto first = [&](const char* key) { return cycles.front()[key]["wall_seconds"].get<double>(); };
  // Memory returned, steady state (cycles 2..N) and cycle 1 apart: the first sleep creates
  // the pinned host store, and mapping that much host memory for the GPU takes device
  // memory for page tables, outside the pool (bench/results/2026-11-30-sleep-h200.md: how much).
  double min_returned = 1, first_returned = 1;
  for (std::size_t i = 0; i < cycles.size(); ++i)
    for (const char* k : {"l1_sleep", "l1_sleep_unchanged", "l2_sleep"}) {
      double v = cycles[i][k]["returned"].get<double>();
      if (i == 0) first_returned = std::min(first_returned, v);
      if (i > 0 || cycles.size() == 1) min_returned = std::min(min_returned, v);
    }

  Baseline base;
  if (o.baseline) {
    fmt::print("baseline (per-allocation policy), {} cycles:\n", o.baseline_cycles);
    base = run_baseline(d, device, o, o.baseline_cycles);
  }

  double ceil_d2h = ceiling.bytes / ceiling.d2h_seconds, ceil_h2d = ceiling.bytes / ceiling.h2d_seconds;
  double s1 = steady("l1_sleep"), w1 = steady("l1_wake");
  double unchanged = steady("l1_sleep_unchanged");
  double s2 = steady("l2_sleep"), w2 = steady("l2_wake_weights") + steady("l2_wake_kv");
  double base_round = o.baseline ? median(base.sleep_seconds) + median(base.wake_seconds) : 0;
  fmt::print("\n{:<34} {:>12} {:>12} {:>10} {:>11}\n", "phase", "first s", "steady s", "GB/s", "of ceiling");
  auto row = [&](const char* name, double f, double s, double bytes, double ceil) {
    fmt::print("{:<34} {:>12.3f} {:>12.3f} {:>10.1f} {:>10.1f}%\n", name, f, s, bytes / s / 1e9,
               100 * (bytes / s) / ceil);
  };
  row("ceiling D2H (pinned copy)", ceiling.d2h_seconds, ceiling.d2h_seconds, ceiling.bytes, ceil_d2h);
  row("ceiling H2D (pinned copy)", ceiling.h2d_seconds, ceiling.h2d_seconds, ceiling.bytes, ceil_h2d);
  row("torpor L1 sleep (changed)", first("l1_sleep"), s1, moved, ceil_d2h);
  row("torpor L1 wake", first("l1_wake"), w1, moved, ceil_h2d);
  fmt::print("{:<34} {:>12.3f} {:>12.3f}\n", "torpor L1 sleep (unchanged)", first("l1_sleep_unchanged"), unchanged);
  fmt::print("{:<34} {:>12.3f} {:>12.3f}\n", "torpor L2 sleep", first("l2_sleep"), s2);
  fmt::print("{:<34} {:>12.3f} {:>12.3f}\n", "torpor L2 wake (weights + kv)",
             first("l2_wake_weights") + first("l2_wake_kv"), w2);
  if (o.baseline) {
    fmt::print("{:<34} {:>12.3f} {:>12.3f}\n", "baseline sleep (per allocation)", base.sleep_seconds.front(),
               median(base.sleep_seconds));
    fmt::print("{:<34} {:>12.3f} {:>12.3f}\n", "baseline wake (per allocation)", base.wake_seconds.front(),
               median(base.wake_seconds));
  }
  fmt::print("minimum memory returned after a sleep: {:.5f} of mapped bytes (steady), {:.5f} in cycle 1\n",
             min_returned, first_returned);

  nlohmann::json targets =
      {{"l1_sleep_of_ceiling",
        {{"value", (moved / s1) / ceil_d2h}, {"target", ">= 0.90"}, {"met", (moved / s1) / ceil_d2h >= 0.9}}},
       {"l1_wake_of_ceiling",
        {{"value", (moved / w1) / ceil_h2d}, {"target", ">= 0.90"}, {"met", (moved / w1) / ceil_h2d >= 0.9}}},
       {"l1_unchanged_sleep_seconds", {{"value", unchanged}, {"target", "<= 0.050"}, {"met", unchanged <= 0.05}}},
       {"l2_sleep_seconds", {{"value", s2}, {"target", "<= 0.100"}, {"met", s2 <= 0.1}}},
       {"l2_wake_seconds", {{"value", w2}, {"target", "<= 0.150"}, {"met", w2 <= 0.15}}},
       {"returned_fraction", {{"value", min_returned}, {"target", ">= 0.999"}, {"met", min_returned >= 0.999}}}};
  // The first L1 sleep, which pins the host store: 1.2 s unprepared (issue 30), 0.8 s prepared.
  const double first_target = o.prepare ? 0.8 : 1.2;
  const std::string first_key = o.prepare ? "first_l1_sleep_prepared_seconds" : "first_l1_sleep_seconds";
  targets[first_key] = {{"value", first("l1_sleep")},
                        {"target", fmt::format("<= {:.3f}", first_target)},
                        {"met", first("l1_sleep") <= first_target}};
  // Fixed costs (issue 30): what a sleep or wake costs when it moves (almost) no bytes.
  targets["issue30_l1_unchanged_sleep_seconds"] = {{"value", unchanged},
                                                   {"target", "<= 0.015"},
                                                   {"met", unchanged <= 0.015}};
  targets["issue30_l2_sleep_seconds"] = {{"value", s2}, {"target", "<= 0.020"}, {"met", s2 <= 0.02}};
  targets["issue30_l2_wake_seconds"] = {{"value", w2}, {"target", "<= 0.015"}, {"met", w2 <= 0.015}};
  if (o.baseline)
    targets["l1_round_trip_speedup"] = {{"value", base_round / (s1 + w1)},
                                        {"target", ">= 10"},
                                        {"met", base_round / (s1 + w1) >= 10}};
  fmt::print("\ntargets (steady state; first_l1_sleep*: cycle 1):\n");
  for (auto& [k, v] : targets.items())
    fmt::print("  {:<30} {:>10.4f}  target {:<8} {}\n", k, v["value"].get<double>(), v["target"].get<std::string>(),
               v["met"].get<bool>() ? "met" : "MISSED");
  j["steady"] = {{"l1_sleep", s1},
                 {"l1_wake", w1},
                 {"l1_sleep_unchanged", unchanged},
                 {"l2_sleep", s2},
                 {"l2_wake", w2}};
  j["first"] = {{"l1_sleep", first("l1_sleep")}, {"l1_wake", first("l1_wake")}};
  j["baseline"] = {{"sleep_seconds", base.sleep_seconds}, {"wake_seconds", base.wake_seconds}};
  j["targets"] = targets;
  j["moved_bytes"] = moved;
  j["returned"] = {{"steady_min", min_returned}, {"first_cycle_min", first_returned}};
  if (!o.json.empty()) {
    std::ofstream(o.json) << j.dump(2) << "\n";
    fmt::print("wrote {}\n", o.json);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"torpor_bench_sleep: sleep/wake against the PCIe ceiling and the per-allocation policy"};
  Options o;
  app.add_option("--backend", o.backend, std::string(torpor::backends_in_words.view()))
      ->check(CLI::IsMember(torpor::backend_name_strings()));
  app.add_option("--params", o.param_count, "parameter tensors (default 2048)");
  app.add_option_function<std::string>(
      "--param-bytes", [&](const std::string& s) { o.param_bytes = parse_size(s); },
      "bytes per parameter tensor (default 16M)");
  app.add_option_function<std::string>(
      "--state-bytes", [&](const std::string& s) { o.state_bytes = parse_size(s); },
      "state bytes in all (default 256M)");
  app.add_option_function<std::string>(
      "--state-min", [&](const std::string& s) { o.state_min = parse_size(s); },
      "smallest state allocation (default 64K)");
  app.add_option_function<std::string>(
      "--state-max", [&](const std::string& s) { o.state_max = parse_size(s); },
      "largest state allocation (default 4M)");
  app.add_option("--shared", o.shared, "parameter segments that also hold a state range (default 64)");
  app.add_option_function<std::string>(
      "--cache-bytes", [&](const std::string& s) { o.cache_bytes = parse_size(s); }, "KV cache bytes (default 16G)");
  app.add_option_function<std::string>(
      "--cache-alloc", [&](const std::string& s) { o.cache_alloc = parse_size(s); },
      "bytes per KV cache allocation (default 1G)");
  app.add_option("--cycles", o.cycles, "torpor cycles (default 5; cycle 1 is reported apart)")
      ->check(CLI::Range(1, 100));
  app.add_flag("!--no-baseline", o.baseline, "skip the per-allocation baseline");
  app.add_option("--baseline-cycles", o.baseline_cycles, "baseline cycles (default 2)")->check(CLI::Range(1, 100));
  app.add_option_function<std::string>(
      "--ceiling-buffer", [&](const std::string& s) { o.ceiling_buffer = parse_size(s); },
      "pinned buffer for the ceiling copies (default 2G)");
  app.add_option("--release-threads", o.release_threads, "PoolOptions::release_threads (default 2)")
      ->check(CLI::Range(1, 64));
  app.add_option("--settle", o.settle,
                 "pause this many seconds before each timed step of a cycle, as an engine's rollout or a trainer's "
                 "step would between a sleep and a wake: the driver's own work on the memory just released or "
                 "created is then done (default 0)")
      ->check(CLI::Range(0.0, 60.0));
  app.add_flag("--prepare", o.prepare, "prepare_host_store() while the scenario loads (first-sleep target 0.8 s)");
  app.add_flag("--overlap-pinning", o.overlap_pinning,
               "a first sleep that grows the host store copies into each block once it is page-locked, "
               "while later blocks are pinned (PoolOptions::host_pin_overlap on; default: pin all, then copy)");
  app.add_option_function<std::string>(
      "--host-store-limit", [&](const std::string& s) { o.host_store_limit = parse_size(s); },
      "PoolOptions::host_store_limit (default 0: none)");
  app.add_option("--spill-dir", o.spill_dir, "PoolOptions::spill_dir (needs --host-store-limit)");
  app.add_option("--json", o.json, "write every number to this JSON file");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    fmt::print(stderr, "torpor_bench_sleep: {}\n", e.what());
    return 1;
  }
}
