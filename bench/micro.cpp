// Google Benchmark micro benches: the allocation fast path (no driver call) and the CPU
// content hash (what the host backend runs; the GPU one is timed inside sleep reports).
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "torpor/backend.hpp"
#include "torpor/content_hash.hpp"
#include "torpor/pool.hpp"

namespace {

void BM_SmallAllocateFree(benchmark::State& state) {
  // The host backend: the fast path is the pool's own bookkeeping, the same on every backend.
  torpor::DriverSelection driver = torpor::open_driver(torpor::Backend::host, torpor::HostDriverOptions{});
  torpor::Pool pool(*driver.driver);
  void* keep = pool.allocate(4096, {torpor::tags::weights, torpor::MemoryClass::state, ""});  // slab stays mapped
  auto n = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = pool.allocate(n, {torpor::tags::weights, torpor::MemoryClass::state, ""});
    benchmark::DoNotOptimize(p);
    pool.deallocate(p);
  }
  pool.deallocate(keep);
}
BENCHMARK(BM_SmallAllocateFree)->Arg(256)->Arg(64 << 10);

void BM_ContentHashCpu(benchmark::State& state) {
  std::vector<std::uint64_t> data(static_cast<std::size_t>(state.range(0)) / 8);
  std::mt19937_64 rng(1);
  for (auto& w : data) w = rng();
  for (auto _ : state) benchmark::DoNotOptimize(torpor::content_hash::compute(data.data(), data.size() * 8));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(BM_ContentHashCpu)->Arg(1 << 20);

}  // namespace

BENCHMARK_MAIN();
