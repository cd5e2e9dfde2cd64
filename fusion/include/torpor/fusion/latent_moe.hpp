// LatentMoERunner: one MoE layer of a latent-MoE model on one tensor-parallel rank.
//
//   x_norm [T][hidden]
//     router:   logits = x_norm · Wrᵀ (fp32), softmax, top-k (renormalised)         replicated
//     down:     x_lat  = x_norm · Wdownᵀ                 [T][latent]                  replicated
//     experts:  for each (t, k), expert e = idx[t][k], in the latent dimension, with the
//               intermediate dimension sharded over the ranks (rank r holds rows
//               [r * I / R, (r + 1) * I / R) of every expert's gate and up, and those columns
//               of its down projection):
//                 y_lat[t][k] = (silu(x_lat[t] · Wgᵀ) * (x_lat[t] · Wuᵀ)) · Wdᵀ    this rank's part
//     shared:   the same for one shared expert (optional), for every token
//     up:       expert_out[t][k] = y_lat[t][k] · Wupᵀ    [T][k][hidden]  (and shared_out)
//     tail:     sum_k w[t][k] * expert_out[t][k] + shared_out[t], summed over the ranks,
//               + residual, RMSNorm with the next norm's gamma              (make_tail)
//
// Since up is linear, summing the ranks' up-projected parts equals up-projecting their sum; so
// every rank finishes with the same residual and normed activations.
//
// The tail is the tail op's (fusion/tail.hpp): fused (Lamport one-shot over symmetric memory)
// when every rank can build it, otherwise the default path; both give the same tokens, the
// choice is collective, and construction never fails because multicast is missing. path() says
// which this runner took; the tail op logs the one fallback warning on rank 0.
//
// Memory: the weights are the caller's (class parameter, tag "weights"). The runner allocates
// from the heap's pool: its expert tables (one device pointer per expert to its gate/up and down
// slices, computed at construction: class state, tag "weights", so they survive level-2 sleep
// without a reload) and its scratch (class cache in `scratch_tag`, default "kv_cache": nothing
// is copied on sleep). The tail's slots, control blocks and peer tables are the tail op's own
// state. GPU GEMMs: cuBLAS, the routed experts as one batched GEMM over device pointer arrays
// (no routing information ever travels to the host, so a step is capturable in a CUDA graph).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "torpor/fusion/compute.hpp"
#include "torpor/fusion/tail.hpp"
#include "torpor/fusion/tail_state.hpp"
#include "torpor/kernels/bf16.hpp"
#include "torpor/pool.hpp"
#include "torpor/symmetric.hpp"

namespace torpor::fusion {

struct LatentMoEConfig {
  int hidden = 128;  // a multiple of 64 (the tail's requirement)
  int latent = 64;
  int experts = 8;
  int top_k = 2;
  int inter = 128;         // per expert, whole (sharded: inter / ranks per rank)
  int shared_inter = 128;  // the shared expert's, whole; 0 = no shared expert
  int max_tokens = 16;     // per run()
  float eps = 1e-6f;
};

// This rank's weights (device pointers). Shapes use I_r = inter / ranks, S_r = shared_inter / ranks.
struct LatentMoEWeights {
  const bf16* router = nullptr;           // [experts][hidden]
  const bf16* down = nullptr;             // [latent][hidden]
  const bf16* experts_gate_up = nullptr;  // [experts][2 * I_r][latent]: gate rows, then up rows
  const bf16* experts_down = nullptr;     // [experts][latent][I_r]
  const bf16* shared_gate_up = nullptr;   // [2 * S_r][latent], or nullptr
  const bf16* shared_down = nullptr;      // [latent][S_r], or nullptr
  const bf16* up = nullptr;               // [hidden][latent]
};

struct LatentMoEOptions {
  std::string name = "moe";  // allocation names start with it ("layers.0.moe")
  std::string scratch_tag = tags::kv_cache;
  TailOptions tail;
};

class LatentMoERunner {
 public:
  // Collective over the heap's group (make_tail): every rank, same config and options.
  // Throws invalid_argument naming the field for a config the kernels cannot run.
  LatentMoERunner(SymmetricHeap& heap, Compute& compute, const LatentMoEConfig& config, const LatentMoEWeights& weights,
                  const LatentMoEOptions& options = {});
  ~LatentMoERunner();
  LatentMoERunner(const LatentMoERunner&) = delete;
  LatentMoERunner& operator=(const LatentMoERunner&) = delete;

  // Enqueues the layer on compute.stream(). x_norm: this layer's normed input; residual_in: the
  // residual stream; gamma: the next norm's weights; outputs are fully written. Collective
  // (the tail): every rank calls run() in the same order with the same token count.
  void run(int tokens, const bf16* x_norm, const bf16* residual_in, const bf16* gamma, bf16* residual_out,
           bf16* norm_out);
  // Enqueues everything before the tail (router .. up projection): what the tail then reads.
  void partials(int tokens, const bf16* x_norm);
  // The tail's check(): throws timeout_error naming rank, slot and op when a bounded wait ran
  // out in an earlier run(). Call after a synchronize or a graph replay.
  void check();

  TailPath path() const noexcept;
  const std::string& reason() const noexcept;
  const LatentMoEConfig& config() const noexcept { return config_; }
  int rank() const noexcept { return rank_; }
  int ranks() const noexcept { return ranks_; }
  // Where the tail keeps its state (control block, slots); nothing on the unfused path. For the
  // stress tool's negative control.
  std::optional<TailState> tail_state() const;

  // Scratch holding partials()'s results, for tests: [tokens][top_k] routing, this rank's
  // [tokens][top_k][hidden] expert parts and [tokens][hidden] shared part (or nullptr).
  const std::int32_t* topk_idx() const noexcept { return topk_idx_; }
  const float* topk_weights() const noexcept { return topk_w_; }
  const bf16* expert_out() const noexcept { return expert_out_; }
  const bf16* shared_out() const noexcept { return shared_out_; }

 private:
  template <typename T>
  T* scratch(std::size_t count, const char* what);
  void release() noexcept;

  Pool& pool_;
  Compute& compute_;
  LatentMoEConfig config_;
  LatentMoEWeights weights_;
  LatentMoEOptions options_;
  int rank_ = 0, ranks_ = 1;
  int inter_r_ = 0, shared_r_ = 0;
  std::vector<void*> allocations_;
  // State (tag "weights"): per-expert pointers into experts_gate_up and experts_down.
  const bf16** gate_up_table_ = nullptr;
  const bf16** down_table_ = nullptr;
  // Scratch.
  bf16* x_lat_ = nullptr;
  float* router_logits_ = nullptr;
  std::int32_t* topk_idx_ = nullptr;
  float* topk_w_ = nullptr;
  bf16* gate_up_ = nullptr;
  bf16* act_ = nullptr;
  bf16* y_lat_ = nullptr;
  bf16* expert_out_ = nullptr;
  kernels::ExpertPointers pointers_{};
  bf16* shared_gate_up_ = nullptr;
  bf16* shared_act_ = nullptr;
  bf16* shared_lat_ = nullptr;
  bf16* shared_out_ = nullptr;
  std::unique_ptr<Tail> tail_;
};

}  // namespace torpor::fusion
