// The small ops of the latent-MoE runner and the tiny MoE language model, in two
// implementations with one signature each:
//   - torpor::kernels::ref  — CPU reference (the host backend runs these; GPU tests use them as
//                             the oracle);
//   - torpor::kernels::gpu  — CUDA kernels (built with TORPOR_CUDA), enqueued on `stream` (a
//                             torpor::Stream of the current device: torpor/stream.hpp says why
//                             that type, and this header needs no CUDA header).
//                             Each launcher returns the cudaError_t of the launch (0 = success);
//                             the caller checks it (fusion/cuda_check.hpp).
//
// Conventions: row-major, bf16 activations and weights, fp32 arithmetic inside every op, one
// rounding to bf16 per output. Linear layers are y = x · Wᵀ with W stored [out][in] (PyTorch's
// layout); GEMMs themselves are the Compute's (cuBLAS on GPU, ref::linear on the host).
// Scalars that change from one decode step to the next (the position) are read from memory, so
// a step captured once in a CUDA graph replays at every position.
#pragma once

#include <cstddef>
#include <cstdint>

#include "torpor/kernels/bf16.hpp"
#include "torpor/stream.hpp"

namespace torpor::kernels {

// Pointer arrays for the two batched expert GEMMs of one MoE call (count = tokens * top_k
// entries each). Filled on the device by expert_pointers from the routing; consumed by a batched
// GEMM (cublasGemmBatchedEx), so nothing about the routing ever travels to the host.
struct ExpertPointers {
  const bf16** gate_up_x;  // x_lat row of the entry's token
  const bf16** gate_up_w;  // the routed expert's [2 * inter][latent] slice
  bf16** gate_up_y;        // row i of the gate/up output [count][2 * inter]
  const bf16** down_x;     // row i of the activation [count][inter]
  const bf16** down_w;     // the routed expert's [latent][inter] slice
  bf16** down_y;           // row i of the latent output [count][latent]
};

namespace ref {

// y[m][n] = sum_k x[m][k] * w[n][k]; fp32 accumulation in index order.
void linear(const bf16* x, const bf16* w, bf16* y, int m, int n, int k);
void linear(const bf16* x, const bf16* w, float* y, int m, int n, int k);
// For i < count: y[i][0..n) = x[i][0..k) · w[i]ᵀ (w[i] is [n][k]).
void linear_batched(const bf16* const* x, const bf16* const* w, bf16* const* y, int count, int n, int k);

// out[b] = tok_emb[seq[b * seq_stride + *pos]] + pos_table[*pos]. A token outside [0, vocab)
// reads row 0 (never out of bounds).
void embed(const std::int32_t* seq, int seq_stride, const std::int32_t* pos, const bf16* tok_emb, int vocab,
           const bf16* pos_table, bf16* out, int batch, int hidden);
// out = x * rsqrt(mean(x^2) + eps) * gamma, per row.
void rmsnorm(const bf16* x, const bf16* gamma, bf16* out, int rows, int hidden, float eps);
// sum_out = bf16(a + b); norm_out = rmsnorm(sum_out) * gamma.
void add_rmsnorm(const bf16* a, const bf16* b, const bf16* gamma, bf16* sum_out, bf16* norm_out, int rows, int hidden,
                 float eps);
// Single-head causal attention for one decode step. qkv[b] = [q | k | v] (3 * head_dim);
// writes k and v at *pos into the caches ([batch][max_seq][head_dim]), then
// out[b] = softmax(q · K[0..pos]ᵀ / sqrt(head_dim)) · V[0..pos].
void attention_decode(const bf16* qkv, bf16* k_cache, bf16* v_cache, const std::int32_t* pos, bf16* out, int batch,
                      int head_dim, int max_seq);
// Softmax over each row of logits [rows][experts], the top_k largest (ties: lower index first),
// weights renormalised to sum 1. NaN logits never win a slot.
void router_topk(const float* logits, int rows, int experts, int top_k, std::int32_t* idx, float* weights);
// out[r][i] = silu(in[r][i]) * in[r][inter + i].
void silu_mul(const bf16* in, bf16* out, int rows, int inter);
// Entry i (token i / top_k, expert idx[i]) of both batched expert GEMMs. Tables hold one
// pointer per expert (the runner's state, computed at load).
void expert_pointers(const std::int32_t* idx, int count, int top_k, const bf16* const* gate_up_table,
                     const bf16* const* down_table, int experts, const bf16* x_lat, int latent, bf16* gate_up_out,
                     int inter, bf16* act, bf16* y_lat, ExpertPointers out);
// Greedy decoding: next[b] = argmax logits[b] (first maximum; NaN never wins; all NaN -> 0).
// When *pos + 1 >= *prompt_len and *pos + 1 < seq_stride, writes next into seq[b][*pos + 1]
// (inside the prompt the prompt's own token stays).
void argmax_next(const float* logits, int batch, int vocab, std::int32_t* seq, int seq_stride, const std::int32_t* pos,
                 const std::int32_t* prompt_len);
// ++*pos.
void advance(std::int32_t* pos);
// Writes `bytes` of a pattern derived from `seed` into p and returns their 64-bit sum: a
// stand-in for a training step that really touches its memory.
unsigned long long touch(void* p, std::size_t bytes, std::uint64_t seed);

}  // namespace ref

namespace gpu {

int embed(const std::int32_t* seq, int seq_stride, const std::int32_t* pos, const bf16* tok_emb, int vocab,
          const bf16* pos_table, bf16* out, int batch, int hidden, Stream stream);
int rmsnorm(const bf16* x, const bf16* gamma, bf16* out, int rows, int hidden, float eps, Stream stream);
int add_rmsnorm(const bf16* a, const bf16* b, const bf16* gamma, bf16* sum_out, bf16* norm_out, int rows, int hidden,
                float eps, Stream stream);
int attention_decode(const bf16* qkv, bf16* k_cache, bf16* v_cache, const std::int32_t* pos, bf16* out, int batch,
                     int head_dim, int max_seq, Stream stream);
int router_topk(const float* logits, int rows, int experts, int top_k, std::int32_t* idx, float* weights,
                Stream stream);
int silu_mul(const bf16* in, bf16* out, int rows, int inter, Stream stream);
int expert_pointers(const std::int32_t* idx, int count, int top_k, const bf16* const* gate_up_table,
                    const bf16* const* down_table, int experts, const bf16* x_lat, int latent, bf16* gate_up_out,
                    int inter, bf16* act, bf16* y_lat, ExpertPointers out, Stream stream);
int argmax_next(const float* logits, int batch, int vocab, std::int32_t* seq, int seq_stride, const std::int32_t* pos,
                const std::int32_t* prompt_len, Stream stream);
int advance(std::int32_t* pos, Stream stream);
// As ref::touch; adds the sum into *checksum (device memory, zero it first).
int touch(void* p, std::size_t bytes, std::uint64_t seed, unsigned long long* checksum, Stream stream);
// The name of a cudaError_t value.
const char* error_string(int code) noexcept;

}  // namespace gpu

// Limits the GPU kernels assume (checked by the runner at construction).
inline constexpr int max_top_k = 8;
inline constexpr int max_experts = 256;
inline constexpr int max_attention_seq = 8192;

}  // namespace torpor::kernels
