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
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "support/processes.hpp"
#include "torpor/backend.hpp"
#include "torpor/consensus.hpp"
#include "torpor/fusion/tail.hpp"
#include "torpor/fusion/tail_state.hpp"
#include "torpor/group.hpp"
#include "torpor/kernels/native_stream.hpp"
#include "torpor/kernels/tail_kernels.hpp"
#include "torpor/kernels/tail_protocol.hpp"
#include "torpor/nccl_comm.hpp"
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

// The bench's driver: the cuda backend (it times device kernels), or nothing and a SKIP line.
std::shared_ptr<Driver> open_bench_driver(int r) {
  std::shared_ptr<Driver> driver;
  try {
    driver = open_driver(Backend::cuda).driver;
  } catch (const std::exception& e) {
    if (r == 0) fmt::print("SKIP: tail bench: no usable GPU: {}\n", e.what());
    return nullptr;
  }
  if (driver->device_count() < 2 || !driver->can_access_peer(0, 1)) {
    if (r == 0) fmt::print("SKIP: tail bench: needs two GPUs with peer access ({} found)\n", driver->device_count());
    return nullptr;
  }
  return driver;
}

// The link and the launch floor, measured in this run.
struct LinkFigures {
  double one_way = 0;
  std::vector<double> both;
  double latency_us = 0;
  double sys_local_ns = 0, gpu_local_ns = 0, sys_peer_ns = 0, timer_step_ns = 0, timer_read_ns = 0;
  int empty_blocks = 0;
  double empty_so_us = 0, empty_pdl_us = 0;
};

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

// The tails the bench times.
struct Tails {
  std::unique_ptr<fusion::Tail> fused, fused_so, traced, unfused;
  std::vector<std::unique_ptr<fusion::Tail>> by_blocks;
  kernels::TailTrace* trace = nullptr;
};

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

// The tails' tensors, filled with reproducible values.
struct Tensors {
  bf16 *expert, *shared, *residual, *gamma, *res_out, *norm_out, *scratch;
  std::uint32_t* floor_calls;
  float* weights;
  std::vector<void*> all() const {
    return {expert, shared, residual, gamma, res_out, norm_out, scratch, weights, floor_calls};
  }
};

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

void print_header(const Options& o, const fusion::Tail& fused, const LinkFigures& f) {
  fmt::print(
      "tail fusion bench: 2 GPUs, hidden {}, top_k {} + shared expert, bf16, CUDA graphs of {} calls x {} replays\n",
      o.hidden, o.top_k, o.calls_per_graph, o.replays);
  fmt::print("path: {}\n", fused.reason());
  if (auto st = fusion::tail_state(fused))
    fmt::print("fused grid: {} blocks per row up to {} rows, else {} ({} blocks resident at most)\n",
               st->blocks_per_row_few_rows, kernels::tail_cluster_max_rows, st->blocks_per_row_many_rows,
               st->capacity_blocks);
  fmt::print(
      "link (SM stores to the peer's memory): {:.1f} GB/s one way alone, {:.1f} + {:.1f} GB/s both ways at once\n",
      f.one_way, f.both[0], f.both[1]);
  fmt::print("store seen by the peer (ping-pong): {:.2f} us one way\n", f.latency_us);
  fmt::print("one thread's dependent loads: local {:.0f} ns (.sys), {:.0f} ns (.gpu); the peer's {:.0f} ns (.sys); "
             "globaltimer step {:.0f} ns, "
             "one read {:.0f} ns\n",
             f.sys_local_ns, f.gpu_local_ns, f.sys_peer_ns, f.timer_step_ns, f.timer_read_ns);
  fmt::print("empty kernel ({} blocks) per call in a graph: {:.2f} us in stream order, {:.2f} us as a programmatic "
             "dependent\n",
             f.empty_blocks, f.empty_so_us, f.empty_pdl_us);
  fmt::print("{:>6} {:>10} {:>12} {:>11} {:>10} {:>8} {:>11} {:>10} {:>7}\n", "tokens", "fused us", "fused-so us",
             "unfused us", "nccl us", "speedup", "bytes/rank", "fused GB/s", "% link");
}

// What one row of the bench shares: the group, the stream, the link buffer, the tensors.
struct RowContext {
  Group& group;
  cudaStream_t s;
  SymmetricBuffer& link;
  const Tensors& x;
  const Options& o;
  int r;
  int max_tokens;
  double time(const std::function<void()>& fn) const {
    return slowest(group, time_graph(group, s, o.calls_per_graph, o.replays, fn));
  }
};

// The Lamport exchange alone (bench::launch_lamport_floor) for this row count: the floor under
// the fused kernel's send + receive, then with the fused kernel's other work added.
json time_floors(const RowContext& c, int t) {
  const int floor_n = t * (c.o.hidden / 8);
  json floors = json::object();
  std::string floor_line;
  for (int features : c.o.floor_features) {
    // (the loads read 9 vectors per thread from expert_out, which holds top_k * max_tokens rows)
    if ((features & 1) && 9 * t > c.o.top_k * c.max_tokens) continue;
    cuda(cudaMemset(c.link.local(), 0, static_cast<std::size_t>(floor_n) * 16 * 4), "zero the floor buffer");
    cuda(cudaMemset(c.x.floor_calls, 0, static_cast<std::size_t>(floor_n) * 4), "zero the floor counters");
    cuda(cudaDeviceSynchronize(), "zero the floor buffers");
    c.group.barrier();
    const double us = c.time([&] {
      bench::launch_lamport_floor(c.link.local(), c.link.peer(1 - c.r), c.x.floor_calls, c.x.expert, floor_n, features,
                                  c.s);
    });
    floors[std::to_string(features)] = us;
    floor_line += fmt::format("{}{}: {:.2f}", floor_line.empty() ? "" : ", ", features, us);
  }
  if (c.r == 0)
    fmt::print("  {} tokens, Lamport exchange alone (features 1 loads, 2 self copy, 4 clear stores, 8 transposed poll, "
               "16 1024 straight-line FMAs, 64 straight-line code run before the wait too, "
               "128 12 branches over 4 KB of code each, 256 the same over a few bytes): "
               "{} us\n",
               t, floor_line);
  return floors;
}

const char* const trace_phase_names[kernels::tail_trace_phases] = {"waited",     "control read", "partial",
                                                                   "set up",     "sent",         "cleared",
                                                                   "vectors in", "residual",     "row barrier",
                                                                   "block's in", "epilogue",     "end"};

// Per block: the spread of its mean times over the grid (min / median / max, and the slowest
// block), from its own wait's return.
json per_block_spread(const kernels::TailTrace& tr, double n) {
  static const char* bnames[kernels::tail_block_stamps + 1] =
      {"waited after block 0", "partial", "sent", "cleared", "row in", "all sent", "all in", "poll rounds", "end"};
  json per_block = json::object();
  for (int k = -1; k < kernels::tail_block_stamps; ++k) {
    std::vector<std::pair<double, int>> v;
    for (int b = 0; b < kernels::tail_trace_blocks; ++b) {
      if (tr.block_ns[b][kernels::tail_block_stamps - 1] == 0) continue;  // not in the grid
      const double x = k < 0 ? static_cast<double>(tr.block_waited_ns[b]) : static_cast<double>(tr.block_ns[b][k]);
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
  return per_block;
}

// The traced tail's run for this row: this rank's stamps as a JSON row.
json trace_row_of(const RowContext& c, fusion::Tail& traced, kernels::TailTrace* trace, const fusion::TailArgs& a,
                  const Stream& ts) {
  cuda(cudaMemset(trace, 0, sizeof(kernels::TailTrace)), "zero the trace");
  cuda(cudaDeviceSynchronize(), "zero the trace");
  const double t_us = c.time([&] { traced.run(a, ts); });
  traced.check();
  kernels::TailTrace tr{};
  cuda(cudaMemcpy(&tr, trace, sizeof tr, cudaMemcpyDeviceToHost), "read the trace");
  const double n = static_cast<double>(tr.calls);
  std::vector<double> phases;
  for (auto v : tr.phase_ns) phases.push_back(static_cast<double>(v) / n / 1000.0);
  const double gap = tr.gaps ? static_cast<double>(tr.gap_ns) / static_cast<double>(tr.gaps) / 1000.0 : 0.0;
  const double upd = static_cast<double>(tr.updater_ns) / n / 1000.0;
  json named = json::object();
  for (int k = 0; k < kernels::tail_trace_phases; ++k)
    named[trace_phase_names[k]] = phases[static_cast<std::size_t>(k)];
  return {{"rank", c.r},
          {"traced_us", t_us},
          {"calls", tr.calls},
          {"block0_us_from_entry", named},
          {"entry_minus_previous_end_us", gap},
          {"updater_done_us", upd},
          {"sm_ghz", static_cast<double>(tr.cycles) / (phases.back() * 1000.0 * n)},
          {"per_block_us_from_own_wait", per_block_spread(tr, n)}};
}

// Rank 0 prints every rank's trace row.
void print_traces(Group& group, const json& trace_row, int r) {
  const std::string mine = trace_row.dump();
  const auto all = consensus::gather_text(group, mine);
  if (r != 0) return;
  for (const auto& text : all) {
    const json tj = json::parse(text);
    std::string line;
    for (int k = 0; k < kernels::tail_trace_phases; ++k)
      line += fmt::format("{}{} {:.2f}", k ? ", " : "", trace_phase_names[k],
                          tj["block0_us_from_entry"][trace_phase_names[k]].get<double>());
    fmt::print("  trace rank {} ({:.2f} us/call traced), block 0 from entry: {}; entry - previous end {:.2f}; updater "
               "done {:.2f}; SM clock {:.2f} GHz\n",
               tj["rank"].get<int>(), tj["traced_us"].get<double>(), line,
               tj["entry_minus_previous_end_us"].get<double>(), tj["updater_done_us"].get<double>(),
               tj["sm_ghz"].get<double>());
    std::string blocks;
    for (const auto& [name, d] : tj["per_block_us_from_own_wait"].items())
      blocks += fmt::format("{}{} {:.2f}/{:.2f}/{:.2f} (#{})", blocks.empty() ? "" : "; ", name, d["min"].get<double>(),
                            d["median"].get<double>(), d["max"].get<double>(), d["slowest_block"].get<int>());
    fmt::print("    per block (min/median/max over {} blocks, slowest block): {}\n",
               tj["per_block_us_from_own_wait"].contains("end")
                   ? tj["per_block_us_from_own_wait"]["end"]["blocks"].get<int>()
                   : 0,
               blocks);
  }
}

// One row of the table: every tail at `t` tokens.
json measure_row(const RowContext& c, Tails& tails, NcclComm& nccl, const Stream& ts, int t, double one_way) {
  fusion::TailArgs a;
  a.tokens = t;
  a.expert_out = c.x.expert;
  a.topk_weights = c.x.weights;
  a.shared_out = c.x.shared;
  a.residual_in = c.x.residual;
  a.gamma = c.x.gamma;
  a.residual_out = c.x.res_out;
  a.norm_out = c.x.norm_out;
  const double f_us = c.time([&] { tails.fused->run(a, ts); });
  tails.fused->check();
  const double so_us = c.time([&] { tails.fused_so->run(a, ts); });
  tails.fused_so->check();
  const double u_us = c.time([&] { tails.unfused->run(a, ts); });
  tails.unfused->check();
  json floors = time_floors(c, t);
  json by_blocks_row = json::object();
  for (std::size_t i = 0; i < tails.by_blocks.size(); ++i) {
    const double b_us = c.time([&] { tails.by_blocks[i]->run(a, ts); });
    tails.by_blocks[i]->check();
    by_blocks_row[std::to_string(c.o.blocks_per_row[i])] = b_us;
    if (c.r == 0)
      fmt::print("  {} tokens, fused with {} blocks per row: {:.2f} us ({:.2f}x unfused)\n", t, c.o.blocks_per_row[i],
                 b_us, u_us / b_us);
  }
  const double n_us =
      c.time([&] { nccl.all_reduce_sum_bf16(c.x.scratch, static_cast<std::size_t>(t) * c.o.hidden, c.s); });
  json trace_row;
  if (tails.traced) {
    trace_row = trace_row_of(c, *tails.traced, tails.trace, a, ts);
    print_traces(c.group, trace_row, c.r);
  }
  const double bytes = static_cast<double>(t) * c.o.hidden * sizeof(bf16) * (ranks - 1);
  const double gbps = bytes / (f_us * 1e-6) / 1e9;
  if (c.r == 0)
    fmt::print("{:>6} {:>10.2f} {:>12.2f} {:>11.2f} {:>10.2f} {:>7.2f}x {:>11.0f} {:>10.1f} {:>6.1f}%\n", t, f_us,
               so_us, u_us, n_us, u_us / f_us, bytes, gbps, 100.0 * gbps / one_way);
  json row = {{"tokens", t},
              {"fused_us", f_us},
              {"fused_stream_order_us", so_us},
              {"unfused_us", u_us},
              {"nccl_allreduce_us", n_us},
              {"lamport_exchange_us_by_features", floors},
              {"speedup", u_us / f_us},
              {"bytes_per_rank", bytes},
              {"fused_gbps", gbps},
              {"link_fraction", gbps / one_way}};
  if (tails.traced) row["trace_rank0"] = trace_row;
  if (!tails.by_blocks.empty())
    row["fused_us_by_blocks_per_row"] = by_blocks_row;  // (rank 0's own; the table printed both)
  return row;
}

// Rank 0: the targets (met or missed) and --json.
void report(const Options& o, const fusion::Tail& fused, const LinkFigures& f, const json& rows) {
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
  if (o.json_path.empty()) return;
  cudaDeviceProp prop{};
  cuda(cudaGetDeviceProperties(&prop, 0), "properties");
  json j = {{"device", prop.name},
            {"ranks", ranks},
            {"hidden", o.hidden},
            {"top_k", o.top_k},
            {"shared_expert", true},
            {"calls_per_graph", o.calls_per_graph},
            {"replays", o.replays},
            {"path", fused.reason()},
            {"link_gbps_one_way", f.one_way},
            {"link_gbps_both_ways", f.both},
            {"peer_store_latency_us", f.latency_us},
            {"load_latency_ns",
             {{"local_sys", f.sys_local_ns}, {"local_gpu", f.gpu_local_ns}, {"peer_sys", f.sys_peer_ns}}},
            {"globaltimer_step_ns", f.timer_step_ns},
            {"globaltimer_read_ns", f.timer_read_ns},
            {"empty_kernel_blocks", f.empty_blocks},
            {"empty_kernel_us", {{"stream_order", f.empty_so_us}, {"programmatic", f.empty_pdl_us}}},
            {"rows", rows},
            {"target_speedup_met", speed_ok},
            {"target_8_tokens_met", latency_ok}};
  std::ofstream(o.json_path) << j.dump(2) << "\n";
  fmt::print("wrote {}\n", o.json_path);
}

void rank_main(int r, const Rendezvous& rv, const Options& o) {
  std::shared_ptr<Driver> driver = open_bench_driver(r);
  if (!driver) return;
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
  const LinkFigures f = measure_link(group, s, link, src, link_bytes, r, o);

  // The tails and their tensors.
  fusion::TailShape shape;
  shape.hidden = o.hidden;
  shape.max_tokens = max_tokens;
  shape.top_k = o.top_k;
  shape.shared_expert = true;
  Tails tails = make_tails(heap, pool, shape, o);
  NcclComm nccl(group, r);
  const Tensors x = make_tensors(pool, o, r, max_tokens);

  json rows = json::array();
  const Stream ts = kernels::from_native(s, r);
  if (r == 0) print_header(o, *tails.fused, f);
  const RowContext c{group, s, link, x, o, r, max_tokens};
  for (int t : o.tokens) rows.push_back(measure_row(c, tails, nccl, ts, t, f.one_way));
  if (r == 0) report(o, *tails.fused, f, rows);
  std::fflush(stdout);
  group.barrier();
  for (void* p : x.all()) pool.deallocate(p);
  pool.deallocate(src);
  tails.traced.reset();
  tails.by_blocks.clear();
  if (tails.trace != nullptr) pool.deallocate(tails.trace);
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
