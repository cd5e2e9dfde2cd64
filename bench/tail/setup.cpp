// torpor_bench_tail's setup (tail_bench.hpp): the link and launch floors measured in the run,
// the tails it times, and their tensors filled with reproducible values.
#include <cuda_runtime.h>
#include <fmt/core.h>

#include <algorithm>
#include <cstring>
#include <span>

#include "tail/tail_bench.hpp"

namespace torpor::bench::tail {

using namespace torpor;
using json = nlohmann::json;

namespace {

// GB/s of peer stores of `bytes`; `active`: whether this rank stores (else it idles).
double link_gbps(Group& g, cudaStream_t s, void* dst, const void* src, std::size_t bytes, bool active) {
  int sms = 0, dev = 0;
  cuda(cudaGetDevice(&dev), "device");
  cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "attribute");
  if (active) bench::launch_peer_store(dst, src, bytes, sms * 4, s);  // warm-up
  cuda(cudaStreamSynchronize(s), "sync");
  constexpr int reps = 10;
  g.barrier();
  const float ms = elapsed_ms(s, [&] {
    if (active)
      for (int i = 0; i < reps; ++i) bench::launch_peer_store(dst, src, bytes, sms * 4, s);
  });
  return active ? static_cast<double>(bytes) * reps / (static_cast<double>(ms) * 1e-3) / 1e9 : 0.0;
}

// One-way latency in microseconds of a store seen by the peer: `rounds` round trips of one thread
// per GPU through the words at own / peer (zeroed here first). Both ranks return it.
double one_way_latency_us(Group& g, cudaStream_t s, void* own, void* peer, int rank) {
  constexpr int rounds = 20000;
  cuda(cudaMemsetAsync(own, 0, sizeof(std::uint32_t), s), "memset");
  cuda(cudaStreamSynchronize(s), "sync");
  g.barrier();  // both words zero before either kernel starts
  const float ms = elapsed_ms(s, [&] { bench::launch_ping_pong(own, peer, rounds, rank == 0, s); });
  g.barrier();
  return static_cast<double>(ms) * 1000.0 / (2.0 * rounds);
}

}  // namespace

std::vector<double> gather(Group& g, double v) {
  auto all = g.all_gather(std::as_bytes(std::span<const double>(&v, 1)));
  std::vector<double> out;
  for (auto& b : all) {
    double x;
    std::memcpy(&x, b.data(), sizeof x);
    out.push_back(x);
  }
  return out;
}

double slowest(Group& g, double v) {
  auto all = gather(g, v);
  return *std::max_element(all.begin(), all.end());
}

namespace {

void fill_random(void* dst, std::size_t elements, std::uint64_t seed, float lo, float hi) {
  std::vector<bf16> h(elements);
  std::uint64_t z = seed;
  for (auto& x : h) {
    z = z * 6364136223846793005ull + 1442695040888963407ull;
    const float u = static_cast<float>(z >> 40) * 0x1.0p-24f;
    x = bf16::from_float(lo + (hi - lo) * u);
    if ((x.bits & 0x7FFF) == 0) x = bf16::from_float(lo + (hi - lo) * 0.5f + 0.01f);
  }
  cuda(cudaMemcpy(dst, h.data(), elements * sizeof(bf16), cudaMemcpyHostToDevice), "upload");
}

}  // namespace

LinkFigures measure_link(Group& group, cudaStream_t s, SymmetricBuffer& link, void* src, std::size_t link_bytes, int r,
                         const Options& o) {
  LinkFigures f;
  f.one_way = gather(group, link_gbps(group, s, link.peer(1 - r), src, link_bytes, r == 0))[0];
  f.both = gather(group, link_gbps(group, s, link.peer(1 - r), src, link_bytes, true));
  // Rank 0's view of the round trip (rank 1's kernel starts a little later and waits less).
  f.latency_us = gather(group, one_way_latency_us(group, s, link.local(), link.peer(1 - r), r))[0];
  // One thread's dependent loads: local at system and GPU scope, the peer's at system scope.
  bench::load_latency(link.local(), 0, &f.sys_local_ns, &f.timer_step_ns, &f.timer_read_ns);
  bench::load_latency(link.local(), 1, &f.gpu_local_ns, &f.timer_step_ns, &f.timer_read_ns);
  bench::load_latency(link.peer(1 - r), 0, &f.sys_peer_ns, &f.timer_step_ns, &f.timer_read_ns);
  // An empty kernel of the fused kernel's grid at 8 tokens.
  f.empty_blocks = (8 * o.hidden / 8 + kernels::tail_row_lanes - 1) / kernels::tail_row_lanes;
  f.empty_so_us = slowest(group, time_graph(group, s, o.calls_per_graph, o.replays, [&] {
                            bench::launch_empty(f.empty_blocks, kernels::tail_row_lanes, false, s);
                          }));
  f.empty_pdl_us = slowest(group, time_graph(group, s, o.calls_per_graph, o.replays, [&] {
                             bench::launch_empty(f.empty_blocks, kernels::tail_row_lanes, true, s);
                           }));
  return f;
}

Tails make_tails(SymmetricHeap& heap, Pool& pool, const fusion::TailShape& shape, const Options& o) {
  Tails t;
  t.fused = fusion::make_tail(heap, shape);
  fusion::TailOptions so;
  so.programmatic_launch = false;
  t.fused_so = fusion::make_tail(heap, shape, so);
  // --trace: a third fused tail that stamps its phases (kernels::TailTrace), timed apart so the
  // stamps cannot slow the headline numbers.
  if (o.trace) {
    t.trace = static_cast<kernels::TailTrace*>(
        pool.allocate(sizeof(kernels::TailTrace), {"bench", MemoryClass::state, "bench.trace"}));
    fusion::TailOptions to;
    to.trace = t.trace;
    t.traced = fusion::make_tail(heap, shape, to);
  }
  // --blocks-per-row: the fused tail again with each of these row decompositions.
  for (int b : o.blocks_per_row) {
    fusion::TailOptions bo;
    bo.blocks_per_row = b;
    t.by_blocks.push_back(fusion::make_tail(heap, shape, bo));
  }
  fusion::TailOptions uo;
  uo.allow_fused = false;
  t.unfused = fusion::make_tail(heap, shape, uo);
  return t;
}

Tensors make_tensors(Pool& pool, const Options& o, int r, int max_tokens) {
  const std::size_t th = static_cast<std::size_t>(max_tokens) * o.hidden;
  auto alloc = [&](std::size_t bytes, const char* name) {
    return pool.allocate(bytes, {"activations", MemoryClass::state, name});
  };
  Tensors x{};
  x.expert = static_cast<bf16*>(alloc(th * o.top_k * sizeof(bf16), "expert_out"));
  x.shared = static_cast<bf16*>(alloc(th * sizeof(bf16), "shared_out"));
  x.residual = static_cast<bf16*>(alloc(th * sizeof(bf16), "residual"));
  x.gamma = static_cast<bf16*>(alloc(static_cast<std::size_t>(o.hidden) * sizeof(bf16), "gamma"));
  x.res_out = static_cast<bf16*>(alloc(th * sizeof(bf16), "residual_out"));
  x.norm_out = static_cast<bf16*>(alloc(th * sizeof(bf16), "norm_out"));
  x.scratch = static_cast<bf16*>(alloc(th * sizeof(bf16), "nccl_scratch"));
  x.floor_calls = static_cast<std::uint32_t*>(alloc(th / 8 * sizeof(std::uint32_t), "floor_calls"));
  x.weights = static_cast<float*>(alloc(static_cast<std::size_t>(max_tokens) * o.top_k * sizeof(float), "weights"));
  fill_random(x.expert, th * o.top_k, 11 + r, -1, 1);
  fill_random(x.shared, th, 12 + r, -0.5f, 0.5f);
  fill_random(x.residual, th, 13, -2, 2);
  fill_random(x.gamma, static_cast<std::size_t>(o.hidden), 14, 0.5f, 1.5f);
  fill_random(x.scratch, th, 15, -1, 1);
  std::vector<float> w(static_cast<std::size_t>(max_tokens) * o.top_k, 1.0f / static_cast<float>(o.top_k));
  cuda(cudaMemcpy(x.weights, w.data(), w.size() * sizeof(float), cudaMemcpyHostToDevice), "upload");
  cuda(cudaDeviceSynchronize(), "uploads");  // pageable uploads may still be in flight
  return x;
}

}  // namespace torpor::bench::tail
