// TinyMoeLM: a tiny MoE language model on LatentMoERunner, one instance per tensor-parallel rank.
//
//   embedding (+ a sinusoidal position table computed at load)
//   L x [ RMSNorm -> single-head causal attention (KV cache) -> + residual -> RMSNorm
//         -> latent MoE (router, latent down, sharded experts, up) -> tail ]
//   final RMSNorm (the last tail's norm) -> LM head -> greedy argmax
//
// Attention, embedding and LM head are replicated; only the experts' intermediate dimension is
// sharded, and the tail sums the ranks' parts, so every rank decodes the same tokens.
//
// Memory, all from the heap's pool:
//   tag "weights", class parameter  every weight, named ("tok_emb", "layers.0.attn.wqkv",
//                                   "layers.0.moe.experts.gate_up", "lm_head", ...) so preserve
//                                   globs match them
//   tag "weights", class state      what is computed at load: the position table and the
//                                   runners' expert tables (the tail op's own state too)
//   tag "kv_cache", class cache     KV caches, activations, the decode sequence and position,
//                                   the GEMM library's workspace
// So sleep(2) + wake_up({"weights"}) + load_weights() + wake_up({"kv_cache"}) restores a
// working model with no other re-initialisation, and every address is the one it had.
//
// Decoding: one decode step (every layer, LM head, argmax, position advance) reads the position
// from device memory; the prompt is fed through the same step. On a Compute with graphs the
// step is captured once per batch size (the first step of the first generate() runs eagerly as
// the warm-up) and replayed for every later step, before and after every sleep.
//
// One model per Compute (the model owns the compute's GEMM workspace). Collective: construction,
// generate() (the tails), destruction order is local.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "torpor/fusion/compute.hpp"
#include "torpor/fusion/latent_moe.hpp"
#include "torpor/fusion/weights.hpp"
#include "torpor/symmetric.hpp"

namespace torpor::fusion {

struct TinyMoeConfig {
  int vocab = 512;
  int hidden = 128;  // a multiple of 64
  int layers = 2;
  int head_dim = 64;
  int experts = 8;
  int top_k = 2;
  int latent = 64;
  int inter = 128;         // per expert, sharded over the ranks
  int shared_inter = 128;  // 0 = no shared expert
  int max_batch = 16;
  int max_seq = 64;  // prompt + generated tokens
  float eps = 1e-6f;
};

struct TinyMoeOptions {
  TailOptions tail;
  bool use_graphs = true;  // capture decode steps when the compute has graphs
};

struct ParameterInfo {
  std::string name;
  void* ptr = nullptr;
  std::size_t bytes = 0;
};

struct LoadReport {
  std::size_t tensors_loaded = 0;
  std::size_t tensors_skipped = 0;  // matched a skip glob
  std::size_t bytes_loaded = 0;
  std::size_t bytes_skipped = 0;
  double seconds = 0;
};

struct DecodeStats {
  std::size_t graphs_captured = 0;
  std::size_t graph_replays = 0;
  std::size_t eager_steps = 0;
};

class TinyMoeLM {
 public:
  // Collective. Allocates everything and loads `version`.
  TinyMoeLM(SymmetricHeap& heap, Compute& compute, const TinyMoeConfig& config, const WeightVersion& version,
            const TinyMoeOptions& options = {});
  ~TinyMoeLM();
  TinyMoeLM(const TinyMoeLM&) = delete;
  TinyMoeLM& operator=(const TinyMoeLM&) = delete;

  // Writes every parameter of `version` except those whose name matches one of `skip` (fnmatch
  // globs): what a reload after a level-2 sleep does, skipping what the pool preserved.
  LoadReport load_weights(const WeightVersion& version, const std::vector<std::string>& skip = {});

  // Greedy decoding of `batch` prompts of `prompt_len` tokens each (row-major), `new_tokens`
  // each. Returns [batch][new_tokens]. Collective. Throws timeout_error naming the rank, step and
  // the tail's op when a tail's bounded wait ran out.
  std::vector<std::int32_t> generate(const std::vector<std::int32_t>& prompts, int batch, int prompt_len,
                                     int new_tokens);

  const TinyMoeConfig& config() const noexcept { return config_; }
  int rank() const noexcept { return rank_; }
  std::vector<ParameterInfo> parameters() const;
  std::size_t parameter_bytes() const noexcept;
  // Per layer: the tail path its runner took, and why.
  std::vector<TailPath> tail_paths() const;
  std::vector<std::string> tail_reasons() const;
  // Every fused runner's tail state (the negative control zeroes it); empty on the unfused path.
  std::vector<TailState> tail_states() const;
  const DecodeStats& decode_stats() const noexcept { return stats_; }

 private:
  struct Layer;
  struct Param;
  template <typename T>
  T* alloc(std::size_t count, const std::string& tag, MemoryClass cls, const std::string& name);
  bf16* param(std::size_t count, const std::string& name, std::function<void(const WeightVersion&, bf16*)> fill);
  void build_params();
  void enqueue_step(int batch);
  void run_step(int batch);
  void release() noexcept;

  Pool& pool_;
  Compute& compute_;
  TinyMoeConfig config_;
  TinyMoeOptions options_;
  int rank_ = 0, ranks_ = 1;
  std::vector<void*> allocations_;
  std::vector<Param> params_;
  std::vector<Layer> layers_;
  bf16* tok_emb_ = nullptr;
  bf16* pos_table_ = nullptr;
  bf16* final_norm_ = nullptr;
  bf16* lm_head_ = nullptr;
  // Decode state and activations (cache).
  std::int32_t* seq_ = nullptr;      // [max_batch][max_seq]
  std::int32_t* control_ = nullptr;  // [0] position, [1] prompt length
  bf16 *x_ = nullptr, *xn_ = nullptr, *h_ = nullptr, *hn_ = nullptr, *qkv_ = nullptr, *att_ = nullptr, *o_ = nullptr;
  float* logits_ = nullptr;
  std::map<int, std::unique_ptr<Graph>> graphs_;  // by batch size
  DecodeStats stats_;
};

}  // namespace torpor::fusion
