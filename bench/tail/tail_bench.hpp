// torpor_bench_tail's pieces (tail_bench.cpp says what the bench measures): its options, the
// timing helpers, the tails and tensors it times, and one row of its table. setup.cpp makes the
// tails, tensors and link figures; rows.cpp times and prints the rows; kernels.cu holds the
// floors' kernels.
#pragma once

#include <cuda_runtime.h>
#include <fmt/core.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "torpor/fusion/tail.hpp"
#include "torpor/group.hpp"
#include "torpor/kernels/tail_protocol.hpp"
#include "torpor/nccl_comm.hpp"
#include "torpor/pool.hpp"
#include "torpor/symmetric.hpp"

// The floors' kernels (kernels.cu).
namespace torpor::bench {
void launch_peer_store(void* dst, const void* src, std::size_t bytes, int blocks, void* stream);
void launch_ping_pong(void* own, void* peer, int rounds, bool starter, void* stream);
void launch_empty(int blocks, int threads, bool programmatic, void* stream);
void launch_lamport_floor(void* own, void* peer, std::uint32_t* calls, const void* inputs, int n, int features,
                          void* stream);
void load_latency(const void* p, int scope, double* ns_per_load, double* timer_step_ns, double* timer_read_ns);
}  // namespace torpor::bench

namespace torpor::bench::tail {

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

inline void cuda(cudaError_t e, const char* what) {
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

// Every rank's value of v, by rank.
std::vector<double> gather(Group& g, double v);
// The slower rank's time: a collective step is as fast as its last rank.
double slowest(Group& g, double v);

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
                         const Options& o);

// The tails the bench times.
struct Tails {
  std::unique_ptr<fusion::Tail> fused, fused_so, traced, unfused;
  std::vector<std::unique_ptr<fusion::Tail>> by_blocks;
  kernels::TailTrace* trace = nullptr;
};

Tails make_tails(SymmetricHeap& heap, Pool& pool, const fusion::TailShape& shape, const Options& o);

// The tails' tensors, filled with reproducible values.
struct Tensors {
  bf16 *expert, *shared, *residual, *gamma, *res_out, *norm_out, *scratch;
  std::uint32_t* floor_calls;
  float* weights;
  std::vector<void*> all() const {
    return {expert, shared, residual, gamma, res_out, norm_out, scratch, weights, floor_calls};
  }
};

Tensors make_tensors(Pool& pool, const Options& o, int r, int max_tokens);

// The header lines and the table's column names (rank 0).
void print_header(const Options& o, const fusion::Tail& fused, const LinkFigures& f);

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

// One row of the table: every tail at `t` tokens.
json measure_row(const RowContext& c, Tails& tails, NcclComm& nccl, const Stream& ts, int t, double one_way);

// Rank 0: the targets (met or missed) and --json.
void report(const Options& o, const fusion::Tail& fused, const LinkFigures& f, const json& rows);

}  // namespace torpor::bench::tail
