// The MoE tail: what the fused latent-MoE runner does at the end of every layer.
//
//   partial[t]  = sum_k topk_weights[t][k] * expert_out[t][k] (+ shared_out[t])   this rank's part
//   sum[t]      = sum over ranks r = 0 .. R-1 of partial_r[t]   (fixed order: deterministic)
//   residual_out[t] = residual_in[t] + sum[t]
//   norm_out[t]     = residual_out[t] * rsqrt(mean(residual_out[t]^2) + eps) * gamma
//
// bf16 activations, fp32 accumulation, row-major [tokens][...]. Two implementations behind one
// interface (this header is the contract between the tail-fusion op and the runner):
//   - fused: one kernel per call, Lamport one-shot all-reduce over symmetric slot buffers
//     (unicast over the peer table, or one multimem store to the multicast address), bounded
//     waits (the protocol: torpor/kernels/tail_protocol.hpp); its state (slots, control blocks,
//     peer table) is torpor memory of class state in the "weights" tag and survives level-2 sleep
//     without re-initialisation;
//   - unfused (the default path): finalize kernel, an all-reduce through the group (NCCL on GPUs,
//     the Group's all-gather on the host backend), then residual + RMSNorm.
// Both produce the same tokens. make_tail() is collective: every rank probes, the ranks agree on
// fused or unfused (a collective AND), and when falling back rank 0 logs one warning naming the
// cause. It never fails because multicast is missing.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "torpor/driver.hpp"
#include "torpor/kernels/bf16.hpp"

namespace torpor {
class SymmetricHeap;
}

namespace torpor::fusion {

// all_reduce: every rank produces every token. reduce_scatter: rank r of R produces only its
// share, rows token_share(tokens, r, R) (outputs are still indexed [tokens][hidden]; the other
// rows are neither read from residual_in nor written).
enum class TailMode { all_reduce, reduce_scatter };
const char* to_string(TailMode m) noexcept;

struct TailShape {
  int hidden = 0;        // a multiple of 64, at most 8192
  int max_tokens = 128;  // per call; at least 128 supported
  int top_k = 1;
  bool shared_expert = false;
  float eps = 1e-6f;
  TailMode mode = TailMode::all_reduce;
};

// Rows [begin, end) of `tokens` that rank `rank` of `ranks` produces in reduce_scatter mode:
// [floor(tokens * rank / ranks), floor(tokens * (rank + 1) / ranks)); empty when tokens < ranks
// leaves it none.
struct TokenRange {
  int begin = 0;
  int end = 0;
  int count() const noexcept { return end - begin; }
};
TokenRange token_share(int tokens, int rank, int ranks) noexcept;

// One call's tensors: device pointers on this rank's device (CPU addresses on the host
// backend). Inputs are only read; outputs are fully written (the output rows; see TailMode).
// residual_out may be residual_in (in place). Every rank passes the same `tokens`.
struct TailArgs {
  int tokens = 0;                       // 1 .. max_tokens
  const bf16* expert_out = nullptr;     // [tokens][top_k][hidden] this rank's partial expert outputs
  const float* topk_weights = nullptr;  // [tokens][top_k]
  const bf16* shared_out = nullptr;     // [tokens][hidden], or nullptr without a shared expert
  const bf16* residual_in = nullptr;    // [tokens][hidden]
  const bf16* gamma = nullptr;          // [hidden]
  bf16* residual_out = nullptr;         // [tokens][hidden]
  bf16* norm_out = nullptr;             // [tokens][hidden]
};

enum class TailPath { fused_multicast, fused_unicast, unfused };
const char* to_string(TailPath p) noexcept;

struct TailOptions {
  bool allow_fused = true;                       // false: always the unfused path
  std::chrono::milliseconds wait_timeout{5000};  // bound on every device-side spin
  // Fused path on compute capability 9.0+: launch each call as a programmatic dependent of the
  // kernel before it on the stream (CUDA programmatic dependent launch), so its blocks are
  // already resident when that kernel completes. The call still waits for that completion before
  // it reads or writes anything; false: plain stream order.
  bool programmatic_launch = true;
  // Diagnostics (fused path on a GPU): a device buffer holding a zeroed kernels::TailTrace,
  // into which every call adds where its time went (torpor_bench_tail --trace). nullptr: off.
  void* trace = nullptr;
  // Fused path on a GPU: how many blocks (a thread-block cluster, compute capability 9.0+) share
  // one row's receive and RMSNorm, each taking tail_row_lanes / blocks_per_row of its lanes:
  // 1, 4 or 8; 0: chosen per call (kernels::tail_cluster_blocks for calls of at most
  // kernels::tail_cluster_max_rows rows where clusters exist, else 1). The results are the same
  // bits for every value.
  int blocks_per_row = 0;
};

// One rank's tail. run() enqueues on `stream` (GPU; capturable in a CUDA graph) or computes
// before returning (host backend). check() throws timeout_error naming the rank, slot and op
// when a bounded wait ran out in an earlier run() (call it after a sync or a graph replay).
// On the host backend run() calls check() itself before returning. A failure is sticky: later
// calls do nothing and check() keeps throwing until reset() on every rank.
// Calls of one Tail must be ordered (one stream, or a graph), every rank making the same calls.
// Destroy CUDA graphs that captured run() before the Tail (and before NCCL communicators).
class Tail {
 public:
  virtual ~Tail() = default;
  virtual void run(const TailArgs& args, Stream stream) = 0;
  virtual void check() = 0;
  // Collective: re-initialises slots and control blocks with nothing in flight.
  virtual void reset() = 0;
  virtual TailPath path() const noexcept = 0;
  // Why this path: "fused unicast: multicast disabled by TORPOR_DISABLE_MULTICAST=1 (rank 0)", ...
  virtual const std::string& reason() const noexcept = 0;
  virtual const TailShape& shape() const noexcept = 0;
};

// Collective over the heap's group (every rank, same shape and options).
std::unique_ptr<Tail> make_tail(SymmetricHeap& heap, const TailShape& shape, const TailOptions& options = {});

}  // namespace torpor::fusion
