// torpor_bench_tail: the fused MoE tail against the unfused path it replaces, on two GPUs (one
// process each, the vLLM layout), everything in CUDA graphs:
//   fused     one kernel per call (finalize + Lamport all-reduce + residual + RMSNorm), launched
//             as a programmatic dependent of the call before it (the default);
//   fused-so  the same kernel in plain stream order (TailOptions::programmatic_launch = false);
//   unfused   finalize kernel, ncclAllReduce (fp32), residual + RMSNorm kernel;
//   nccl      ncclAllReduce of the same bf16 bytes alone, for scale.
// The floors under them, in the same run: the one-way latency of a store seen by the peer (one
// thread per GPU bouncing a counter), the per-call cost of an empty kernel in a graph, in
// stream order and as a programmatic dependent, and for every token count the Lamport exchange
// alone with, optionally, parts of the fused kernel's other work (--floor-features).
// --blocks-per-row times the fused tail again with other row decompositions
// (TailOptions::blocks_per_row); --trace adds per-phase and per-block times (TailTrace).
// Each graph holds --calls-per-graph calls; a measurement replays it --replays times between two
// events, after a barrier so both ranks start together; per-call time = elapsed / calls (the
// larger of the two ranks is reported). The link is measured in the same run: SM stores into the
// peer's memory through torpor's peer mapping (the fused kernel's path), one direction alone and
// both at once. Bytes moved per call and rank: the partial sent to each peer, tokens * hidden * 2
// * (ranks - 1).
//
// Targets (issue 5): fused >= 2x faster than unfused for <= 32 tokens, <= 6 us at 8 tokens.
// Prints a table and writes --json. Needs two GPUs with peer access; prints SKIP otherwise.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "driver/cuda_driver.hpp"
#include "nccl_comm.hpp"
#include "support/processes.hpp"
#include "torpor/fusion/tail.hpp"
#include "torpor/fusion/tail_state.hpp"
#include "torpor/group.hpp"
#include "torpor/kernels/native_stream.hpp"
#include "torpor/kernels/tail_kernels.hpp"
#include "torpor/kernels/tail_protocol.hpp"
#include "torpor/pool.hpp"
#include "torpor/symmetric.hpp"

namespace torpor::bench {
void launch_peer_store(void* dst, const void* src, std::size_t bytes, int blocks, void* stream);
void launch_ping_pong(void* own, void* peer, int rounds, bool starter, void* stream);
void launch_empty(int blocks, int threads, bool programmatic, void* stream);
void launch_lamport_floor(void* own, void* peer, std::uint32_t* calls, const void* inputs, int n, int features,
                          void* stream);
void load_latency(const void* p, int scope, double* ns_per_load, double* timer_step_ns, double* timer_read_ns);
}  // namespace torpor::bench

namespace {

using namespace torpor;
using json = nlohmann::json;
constexpr int ranks = 2;

struct Options {
  int hidden = 7168;
  int top_k = 8;
  std::vector<int> tokens = {1, 8, 32, 128, 512};
  int calls_per_graph = 50;
  int replays = 20;
  std::string json_path;
  bool trace = false;
  std::vector<int> blocks_per_row;            // extra fused tails, one per value (TailOptions::blocks_per_row)
  std::vector<int> floor_features = {0, 15};  // Lamport exchange variants (bench::launch_lamport_floor)
};

void cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

// Milliseconds from an event recorded on `s` before enqueue() to one recorded after it.
template <typename F>
float elapsed_ms(cudaStream_t s, F enqueue) {
  cudaEvent_t a, b;
  cuda(cudaEventCreate(&a), "event");
  cuda(cudaEventCreate(&b), "event");
  cuda(cudaEventRecord(a, s), "record");
  enqueue();
  cuda(cudaEventRecord(b, s), "record");
  cuda(cudaEventSynchronize(b), "sync");
  float ms = 0;
  cuda(cudaEventElapsedTime(&ms, a, b), "elapsed");
  cuda(cudaEventDestroy(a), "event");
  cuda(cudaEventDestroy(b), "event");
  return ms;
}

// A graph of `calls` enqueues of fn, replayed `replays` times; returns microseconds per call.
template <typename F>
double time_graph(Group& g, cudaStream_t s, int calls, int replays, F fn) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cuda(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "begin capture");
  for (int i = 0; i < calls; ++i) fn();
  cuda(cudaStreamEndCapture(s, &graph), "end capture");
  cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (int i = 0; i < 3; ++i) cuda(cudaGraphLaunch(exec, s), "warm-up replay");
  cuda(cudaStreamSynchronize(s), "warm-up");
  g.barrier();
  const float ms = elapsed_ms(s, [&] {
    for (int i = 0; i < replays; ++i) cuda(cudaGraphLaunch(exec, s), "replay");
  });
  // Graphs go before communicators (teardown with live graphs hung on these machines).
  cuda(cudaGraphExecDestroy(exec), "graph exec destroy");
  cuda(cudaGraphDestroy(graph), "graph destroy");
  return static_cast<double>(ms) * 1000.0 / (static_cast<double>(calls) * replays);
}

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

// Every rank's value of v, by rank.
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

// The slower rank's time: a collective step is as fast as its last rank.
double slowest(Group& g, double v) {
  auto all = gather(g, v);
  return *std::max_element(all.begin(), all.end());
}

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

void rank_main(int r, const Rendezvous& rv, const Options& o) {
  std::string why;
  auto driver = CudaDriver::open(&why);
  if (!driver) {
    if (r == 0) fmt::print("SKIP: tail bench: no usable GPU: {}\n", why);
    return;
  }
  if (driver->device_count() < 2 || !driver->can_access_peer(0, 1)) {
    if (r == 0) fmt::print("SKIP: tail bench: needs two GPUs with peer access ({} found)\n", driver->device_count());
    return;
  }
  cuda(cudaSetDevice(r), "cudaSetDevice");
  cudaStream_t s = nullptr;
  cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  GroupOptions go;
  go.timeout = std::chrono::seconds(120);
  UnixSocketGroup group(rv, r, ranks, go);
  PoolOptions po;
  po.device = r;
  po.exportable = true;
  Pool pool(*driver, po);
  SymmetricHeap heap(pool, group);
  const int max_tokens = *std::max_element(o.tokens.begin(), o.tokens.end());

  // The link, in this run.
  const std::size_t link_bytes = std::size_t{256} << 20;
  SymmetricBuffer& link = heap.allocate(link_bytes, {"bench", "bench.link", false});
  void* src = pool.allocate(link_bytes, {"bench", MemoryClass::cache, "bench.link.src"});
  cuda(cudaMemset(src, 0x3C, link_bytes), "memset");
  cuda(cudaDeviceSynchronize(), "memset");  // the legacy stream is not ordered with ours
  const double one_way = gather(group, link_gbps(group, s, link.peer(1 - r), src, link_bytes, r == 0))[0];
  const auto both = gather(group, link_gbps(group, s, link.peer(1 - r), src, link_bytes, true));
  // Rank 0's view of the round trip (rank 1's kernel starts a little later and waits less).
  const double latency_us = gather(group, one_way_latency_us(group, s, link.local(), link.peer(1 - r), r))[0];
  // One thread's dependent loads: local at system and GPU scope, the peer's at system scope.
  double sys_local_ns = 0, gpu_local_ns = 0, sys_peer_ns = 0, timer_step_ns = 0, timer_read_ns = 0;
  bench::load_latency(link.local(), 0, &sys_local_ns, &timer_step_ns, &timer_read_ns);
  bench::load_latency(link.local(), 1, &gpu_local_ns, &timer_step_ns, &timer_read_ns);
  bench::load_latency(link.peer(1 - r), 0, &sys_peer_ns, &timer_step_ns, &timer_read_ns);
  // An empty kernel of the fused kernel's grid at 8 tokens.
  const int empty_blocks = (8 * o.hidden / 8 + kernels::tail_row_lanes - 1) / kernels::tail_row_lanes;
  const double empty_so_us = slowest(group, time_graph(group, s, o.calls_per_graph, o.replays, [&] {
                                       bench::launch_empty(empty_blocks, kernels::tail_row_lanes, false, s);
                                     }));
  const double empty_pdl_us = slowest(group, time_graph(group, s, o.calls_per_graph, o.replays, [&] {
                                        bench::launch_empty(empty_blocks, kernels::tail_row_lanes, true, s);
                                      }));

  // The tails and their tensors.
  fusion::TailShape shape;
  shape.hidden = o.hidden;
  shape.max_tokens = max_tokens;
  shape.top_k = o.top_k;
  shape.shared_expert = true;
  auto fused = fusion::make_tail(heap, shape);
  fusion::TailOptions so;
  so.programmatic_launch = false;
  auto fused_so = fusion::make_tail(heap, shape, so);
  // --trace: a third fused tail that stamps its phases (kernels::TailTrace), timed apart so the
  // stamps cannot slow the headline numbers.
  kernels::TailTrace* trace = nullptr;
  std::unique_ptr<fusion::Tail> traced;
  if (o.trace) {
    trace = static_cast<kernels::TailTrace*>(
        pool.allocate(sizeof(kernels::TailTrace), {"bench", MemoryClass::state, "bench.trace"}));
    fusion::TailOptions to;
    to.trace = trace;
    traced = fusion::make_tail(heap, shape, to);
  }
  // --blocks-per-row: the fused tail again with each of these row decompositions.
  std::vector<std::unique_ptr<fusion::Tail>> by_blocks;
  for (int b : o.blocks_per_row) {
    fusion::TailOptions bo;
    bo.blocks_per_row = b;
    by_blocks.push_back(fusion::make_tail(heap, shape, bo));
  }
  fusion::TailOptions uo;
  uo.allow_fused = false;
  auto unfused = fusion::make_tail(heap, shape, uo);
  fusion::detail::NcclComm nccl(group, r);
  const std::size_t th = static_cast<std::size_t>(max_tokens) * o.hidden;
  auto alloc = [&](std::size_t bytes, const char* name) {
    return pool.allocate(bytes, {"activations", MemoryClass::state, name});
  };
  auto* expert = static_cast<bf16*>(alloc(th * o.top_k * sizeof(bf16), "expert_out"));
  auto* shared = static_cast<bf16*>(alloc(th * sizeof(bf16), "shared_out"));
  auto* residual = static_cast<bf16*>(alloc(th * sizeof(bf16), "residual"));
  auto* gamma = static_cast<bf16*>(alloc(static_cast<std::size_t>(o.hidden) * sizeof(bf16), "gamma"));
  auto* res_out = static_cast<bf16*>(alloc(th * sizeof(bf16), "residual_out"));
  auto* norm_out = static_cast<bf16*>(alloc(th * sizeof(bf16), "norm_out"));
  auto* scratch = static_cast<bf16*>(alloc(th * sizeof(bf16), "nccl_scratch"));
  auto* floor_calls = static_cast<std::uint32_t*>(alloc(th / 8 * sizeof(std::uint32_t), "floor_calls"));
  auto* weights = static_cast<float*>(alloc(static_cast<std::size_t>(max_tokens) * o.top_k * sizeof(float), "weights"));
  fill_random(expert, th * o.top_k, 11 + r, -1, 1);
  fill_random(shared, th, 12 + r, -0.5f, 0.5f);
  fill_random(residual, th, 13, -2, 2);
  fill_random(gamma, static_cast<std::size_t>(o.hidden), 14, 0.5f, 1.5f);
  fill_random(scratch, th, 15, -1, 1);
  std::vector<float> w(static_cast<std::size_t>(max_tokens) * o.top_k, 1.0f / static_cast<float>(o.top_k));
  cuda(cudaMemcpy(weights, w.data(), w.size() * sizeof(float), cudaMemcpyHostToDevice), "upload");
  cuda(cudaDeviceSynchronize(), "uploads");  // pageable uploads may still be in flight

  json rows = json::array();
  const Stream ts = kernels::from_native(s, r);
  if (r == 0) {
    fmt::print(
        "tail fusion bench: 2 GPUs, hidden {}, top_k {} + shared expert, bf16, CUDA graphs of {} calls x {} replays\n",
        o.hidden, o.top_k, o.calls_per_graph, o.replays);
    fmt::print("path: {}\n", fused->reason());
    if (auto st = fusion::tail_state(*fused))
      fmt::print("fused grid: {} blocks per row up to {} rows, else {} ({} blocks resident at most)\n",
                 st->blocks_per_row_few_rows, kernels::tail_cluster_max_rows, st->blocks_per_row_many_rows,
                 st->capacity_blocks);
    fmt::print(
        "link (SM stores to the peer's memory): {:.1f} GB/s one way alone, {:.1f} + {:.1f} GB/s both ways at once\n",
        one_way, both[0], both[1]);
    fmt::print("store seen by the peer (ping-pong): {:.2f} us one way\n", latency_us);
    fmt::print("one thread's dependent loads: local {:.0f} ns (.sys), {:.0f} ns (.gpu); the peer's {:.0f} ns (.sys); "
               "globaltimer step {:.0f} ns, "
               "one read {:.0f} ns\n",
               sys_local_ns, gpu_local_ns, sys_peer_ns, timer_step_ns, timer_read_ns);
    fmt::print("empty kernel ({} blocks) per call in a graph: {:.2f} us in stream order, {:.2f} us as a programmatic "
               "dependent\n",
               empty_blocks, empty_so_us, empty_pdl_us);
    fmt::print("{:>6} {:>10} {:>12} {:>11} {:>10} {:>8} {:>11} {:>10} {:>7}\n", "tokens", "fused us", "fused-so us",
               "unfused us", "nccl us", "speedup", "bytes/rank", "fused GB/s", "% link");
  }
  for (int t : o.tokens) {
    fusion::TailArgs a;
    a.tokens = t;
    a.expert_out = expert;
    a.topk_weights = weights;
    a.shared_out = shared;
    a.residual_in = residual;
    a.gamma = gamma;
    a.residual_out = res_out;
    a.norm_out = norm_out;
    const double f_us = slowest(group, time_graph(group, s, o.calls_per_graph, o.replays, [&] { fused->run(a, ts); }));
    fused->check();
    const double so_us =
        slowest(group, time_graph(group, s, o.calls_per_graph, o.replays, [&] { fused_so->run(a, ts); }));
    fused_so->check();
    const double u_us =
        slowest(group, time_graph(group, s, o.calls_per_graph, o.replays, [&] { unfused->run(a, ts); }));
    unfused->check();
    // The Lamport exchange alone (bench::launch_lamport_floor) for this row count: the floor
    // under the fused kernel's send + receive, then with the fused kernel's other work added.
    const int floor_n = t * (o.hidden / 8);
    json floors = json::object();
    std::string floor_line;
    for (int features : o.floor_features) {
      // (the loads read 9 vectors per thread from expert_out, which holds top_k * max_tokens rows)
      if ((features & 1) && 9 * t > o.top_k * max_tokens) continue;
      cuda(cudaMemset(link.local(), 0, static_cast<std::size_t>(floor_n) * 16 * 4), "zero the floor buffer");
      cuda(cudaMemset(floor_calls, 0, static_cast<std::size_t>(floor_n) * 4), "zero the floor counters");
      cuda(cudaDeviceSynchronize(), "zero the floor buffers");
      group.barrier();
      const double us = slowest(group, time_graph(group, s, o.calls_per_graph, o.replays, [&] {
                                  bench::launch_lamport_floor(link.local(), link.peer(1 - r), floor_calls, expert,
                                                              floor_n, features, s);
                                }));
      floors[std::to_string(features)] = us;
      floor_line += fmt::format("{}{}: {:.2f}", floor_line.empty() ? "" : ", ", features, us);
    }
    if (r == 0)
      fmt::print(
          "  {} tokens, Lamport exchange alone (features 1 loads, 2 self copy, 4 clear stores, 8 transposed poll, "
          "16 1024 straight-line FMAs, 64 straight-line code run before the wait too, "
          "128 12 branches over 4 KB of code each, 256 the same over a few bytes): "
          "{} us\n",
          t, floor_line);
    json by_blocks_row = json::object();
    for (std::size_t i = 0; i < by_blocks.size(); ++i) {
      const double b_us =
          slowest(group, time_graph(group, s, o.calls_per_graph, o.replays, [&] { by_blocks[i]->run(a, ts); }));
      by_blocks[i]->check();
      by_blocks_row[std::to_string(o.blocks_per_row[i])] = b_us;
      if (r == 0)
        fmt::print("  {} tokens, fused with {} blocks per row: {:.2f} us ({:.2f}x unfused)\n", t, o.blocks_per_row[i],
                   b_us, u_us / b_us);
    }
    const double n_us = slowest(group, time_graph(group, s, o.calls_per_graph, o.replays, [&] {
                                  nccl.all_reduce_sum_bf16(scratch, static_cast<std::size_t>(t) * o.hidden, s);
                                }));
    json trace_row;
    if (traced) {
      cuda(cudaMemset(trace, 0, sizeof(kernels::TailTrace)), "zero the trace");
      cuda(cudaDeviceSynchronize(), "zero the trace");
      const double t_us =
          slowest(group, time_graph(group, s, o.calls_per_graph, o.replays, [&] { traced->run(a, ts); }));
      traced->check();
      kernels::TailTrace tr{};
      cuda(cudaMemcpy(&tr, trace, sizeof tr, cudaMemcpyDeviceToHost), "read the trace");
      const double n = static_cast<double>(tr.calls);
      std::vector<double> phases;
      for (auto v : tr.phase_ns) phases.push_back(static_cast<double>(v) / n / 1000.0);
      const double gap = tr.gaps ? static_cast<double>(tr.gap_ns) / static_cast<double>(tr.gaps) / 1000.0 : 0.0;
      const double upd = static_cast<double>(tr.updater_ns) / n / 1000.0;
      static const char* names[kernels::tail_trace_phases] = {"waited",      "control read", "partial",    "set up",
                                                              "sent",        "cleared",      "vectors in", "residual",
                                                              "row barrier", "block's in",   "epilogue",   "end"};
      // Per block: the spread of its mean times over the grid (min / median / max, and the slowest
      // block), from its own wait's return.
      json per_block = json::object();
      {
        static const char* bnames[kernels::tail_block_stamps + 1] =
            {"waited after block 0", "partial", "sent", "cleared", "row in", "all sent", "all in",
             "poll rounds",          "end"};
        for (int k = -1; k < kernels::tail_block_stamps; ++k) {
          std::vector<std::pair<double, int>> v;
          for (int b = 0; b < kernels::tail_trace_blocks; ++b) {
            if (tr.block_ns[b][kernels::tail_block_stamps - 1] == 0) continue;  // not in the grid
            const double x =
                k < 0 ? static_cast<double>(tr.block_waited_ns[b]) : static_cast<double>(tr.block_ns[b][k]);
            if (k >= 0 && x == 0) continue;  // a stamp this block does not have
            v.push_back({x / n / 1000.0, b});
          }
          if (v.empty()) continue;
          std::sort(v.begin(), v.end());
          per_block[bnames[k + 1]] = {{"blocks", v.size()},
                                      {"min", v.front().first},
                                      {"median", v[v.size() / 2].first},
                                      {"max", v.back().first},
                                      {"slowest_block", v.back().second}};
        }
      }
      json named = json::object();
      for (int k = 0; k < kernels::tail_trace_phases; ++k) named[names[k]] = phases[static_cast<std::size_t>(k)];
      trace_row = {{"rank", r},
                   {"traced_us", t_us},
                   {"calls", tr.calls},
                   {"block0_us_from_entry", named},
                   {"entry_minus_previous_end_us", gap},
                   {"updater_done_us", upd},
                   {"sm_ghz", static_cast<double>(tr.cycles) / (phases.back() * 1000.0 * n)},
                   {"per_block_us_from_own_wait", per_block}};
      const std::string mine = trace_row.dump();
      const auto all = group.all_gather(std::as_bytes(std::span<const char>(mine.data(), mine.size())));
      if (r == 0)
        for (const auto& b : all) {
          const json tj = json::parse(std::string(reinterpret_cast<const char*>(b.data()), b.size()));
          std::string line;
          for (int k = 0; k < kernels::tail_trace_phases; ++k)
            line +=
                fmt::format("{}{} {:.2f}", k ? ", " : "", names[k], tj["block0_us_from_entry"][names[k]].get<double>());
          fmt::print(
              "  trace rank {} ({:.2f} us/call traced), block 0 from entry: {}; entry - previous end {:.2f}; updater "
              "done {:.2f}; SM clock {:.2f} GHz\n",
              tj["rank"].get<int>(), tj["traced_us"].get<double>(), line,
              tj["entry_minus_previous_end_us"].get<double>(), tj["updater_done_us"].get<double>(),
              tj["sm_ghz"].get<double>());
          std::string blocks;
          for (const auto& [name, d] : tj["per_block_us_from_own_wait"].items())
            blocks +=
                fmt::format("{}{} {:.2f}/{:.2f}/{:.2f} (#{})", blocks.empty() ? "" : "; ", name, d["min"].get<double>(),
                            d["median"].get<double>(), d["max"].get<double>(), d["slowest_block"].get<int>());
          fmt::print("    per block (min/median/max over {} blocks, slowest block): {}\n",
                     tj["per_block_us_from_own_wait"].contains("end")
                         ? tj["per_block_us_from_own_wait"]["end"]["blocks"].get<int>()
                         : 0,
                     blocks);
        }
    }
    const double bytes = static_cast<double>(t) * o.hidden * sizeof(bf16) * (ranks - 1);
    const double gbps = bytes / (f_us * 1e-6) / 1e9;
    if (r == 0)
      fmt::print("{:>6} {:>10.2f} {:>12.2f} {:>11.2f} {:>10.2f} {:>7.2f}x {:>11.0f} {:>10.1f} {:>6.1f}%\n", t, f_us,
                 so_us, u_us, n_us, u_us / f_us, bytes, gbps, 100.0 * gbps / one_way);
    rows.push_back({{"tokens", t},
                    {"fused_us", f_us},
                    {"fused_stream_order_us", so_us},
                    {"unfused_us", u_us},
                    {"nccl_allreduce_us", n_us},
                    {"lamport_exchange_us_by_features", floors},
                    {"speedup", u_us / f_us},
                    {"bytes_per_rank", bytes},
                    {"fused_gbps", gbps},
                    {"link_fraction", gbps / one_way}});
    if (traced) rows.back()["trace_rank0"] = trace_row;
    if (!by_blocks.empty())
      rows.back()["fused_us_by_blocks_per_row"] = by_blocks_row;  // (rank 0's own; the table printed both)
  }
  if (r == 0) {
    std::string speedups;
    bool speed_ok = true, latency_ok = true;
    double at8 = -1;
    for (const auto& row : rows) {
      const int t = row["tokens"];
      if (t <= 32) {
        speed_ok = speed_ok && row["speedup"].get<double>() >= 2.0;
        speedups += fmt::format("{}{}: {:.2f}x", speedups.empty() ? "" : ", ", t, row["speedup"].get<double>());
      }
      if (t == 8) {
        at8 = row["fused_us"];
        latency_ok = at8 <= 6.0;
      }
    }
    fmt::print("target >= 2x faster than unfused for <= 32 tokens: {} ({})\n", speed_ok ? "MET" : "MISSED", speedups);
    if (at8 >= 0) fmt::print("target <= 6 us at 8 tokens: {} ({:.2f} us)\n", latency_ok ? "MET" : "MISSED", at8);
    if (!o.json_path.empty()) {
      cudaDeviceProp prop{};
      cuda(cudaGetDeviceProperties(&prop, 0), "properties");
      json j = {{"device", prop.name},
                {"ranks", ranks},
                {"hidden", o.hidden},
                {"top_k", o.top_k},
                {"shared_expert", true},
                {"calls_per_graph", o.calls_per_graph},
                {"replays", o.replays},
                {"path", fused->reason()},
                {"link_gbps_one_way", one_way},
                {"link_gbps_both_ways", both},
                {"peer_store_latency_us", latency_us},
                {"load_latency_ns",
                 {{"local_sys", sys_local_ns}, {"local_gpu", gpu_local_ns}, {"peer_sys", sys_peer_ns}}},
                {"globaltimer_step_ns", timer_step_ns},
                {"globaltimer_read_ns", timer_read_ns},
                {"empty_kernel_blocks", empty_blocks},
                {"empty_kernel_us", {{"stream_order", empty_so_us}, {"programmatic", empty_pdl_us}}},
                {"rows", rows},
                {"target_speedup_met", speed_ok},
                {"target_8_tokens_met", latency_ok}};
      std::ofstream(o.json_path) << j.dump(2) << "\n";
      fmt::print("wrote {}\n", o.json_path);
    }
  }
  std::fflush(stdout);
  group.barrier();
  for (void* p : {static_cast<void*>(expert), static_cast<void*>(shared), static_cast<void*>(residual),
                  static_cast<void*>(gamma), static_cast<void*>(res_out), static_cast<void*>(norm_out),
                  static_cast<void*>(scratch), static_cast<void*>(weights), static_cast<void*>(floor_calls), src})
    pool.deallocate(p);
  traced.reset();
  by_blocks.clear();
  if (trace != nullptr) pool.deallocate(trace);
  cuda(cudaStreamDestroy(s), "stream destroy");
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"torpor_bench_tail: the fused MoE tail against the unfused path on two GPUs"};
  app.add_option("--hidden", o.hidden, "hidden size");
  app.add_option("--top-k", o.top_k, "experts per token");
  app.add_option("--tokens", o.tokens, "token counts");
  app.add_option("--calls-per-graph", o.calls_per_graph, "calls captured in one graph");
  app.add_option("--replays", o.replays, "graph replays per measurement");
  app.add_option("--json", o.json_path, "write the results here");
  app.add_option("--blocks-per-row", o.blocks_per_row,
                 "also time the fused tail with each of these blocks per row (1, 4, 8; TailOptions::blocks_per_row)");
  app.add_option(
      "--floor-features", o.floor_features,
      "Lamport exchange floors to time, as feature masks: 1 the partial's input loads, 2 a copy to itself, "
      "4 the clear's stores, 8 a transposed poll, 16 1024 straight-line FMAs, 64 the "
      "straight-line code run before griddepcontrol.wait too, 128 12 branches over 4 KB of code, 256 the same "
      "over a few bytes");
  app.add_flag("--trace", o.trace, "also time a fused tail that stamps its phases (where a call's time goes)");
  CLI11_PARSE(app, argc, argv);
  // Fork before anything touches CUDA: the parent never does.
  const Rendezvous rv = Rendezvous::create();
  auto outcomes = test::run_ranks(
      ranks, [&](int r) { rank_main(r, rv, o); }, std::chrono::seconds(540));
  rv.remove();
  const std::string failed = test::failures(outcomes);
  if (!failed.empty()) {
    fmt::print(stderr, "tail bench failed:\n{}", failed);
    return 1;
  }
  return 0;
}
