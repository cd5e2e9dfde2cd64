// CUDA kernels of the MoE runner's small ops (moe_ops.hpp); the CPU references in
// reference/moe_ops.cpp define the math. Sizes are tiny (one decode step of a small model), so
// each kernel is the obvious mapping: one block per row, block reductions through warp shuffles,
// fp32 inside, one rounding to bf16 per output. Reductions have a fixed shape, so a kernel gives
// the same bits every run (what the stress plan's token-for-token comparison relies on).
// Nothing here allocates, synchronises or reads host state: every launcher is capturable.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "torpor/kernels/moe_ops.hpp"
#include "torpor/kernels/native_stream.hpp"

namespace torpor::kernels::gpu {

namespace {

using nvbf16 = __nv_bfloat16;
static_assert(sizeof(nvbf16) == sizeof(bf16));

__device__ __forceinline__ float ld(const bf16* p, std::size_t i) {
  return __bfloat162float(reinterpret_cast<const nvbf16*>(p)[i]);
}
__device__ __forceinline__ void st(bf16* p, std::size_t i, float v) {
  reinterpret_cast<nvbf16*>(p)[i] = __float2bfloat16_rn(v);
}

constexpr int block = 128;  // threads per block for the row kernels (4 warps)

// Sum over the block; every thread gets the result. `scratch` holds one float per warp.
__device__ float block_sum(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read by an earlier call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) total += scratch[w];
  return total;
}

__device__ float block_max(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float m = -FLT_MAX;
  for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) m = fmaxf(m, scratch[w]);
  return m;
}

__global__ void embed_kernel(const std::int32_t* seq, int seq_stride, const std::int32_t* pos, const bf16* tok_emb,
                             int vocab, const bf16* pos_table, bf16* out, int hidden) {
  const int r = blockIdx.x, p = *pos;
  std::int32_t t = seq[static_cast<std::size_t>(r) * seq_stride + p];
  if (t < 0 || t >= vocab) t = 0;
  for (int h = threadIdx.x; h < hidden; h += blockDim.x)
    st(out, static_cast<std::size_t>(r) * hidden + h,
       ld(tok_emb, static_cast<std::size_t>(t) * hidden + h) + ld(pos_table, static_cast<std::size_t>(p) * hidden + h));
}

__global__ void rmsnorm_kernel(const bf16* x, const bf16* gamma, bf16* out, int hidden, float eps) {
  __shared__ float scratch[block / 32];
  const std::size_t row = static_cast<std::size_t>(blockIdx.x) * hidden;
  float ss = 0.f;
  for (int h = threadIdx.x; h < hidden; h += blockDim.x) {
    float v = ld(x, row + h);
    ss += v * v;
  }
  const float s = rsqrtf(block_sum(ss, scratch) / static_cast<float>(hidden) + eps);
  for (int h = threadIdx.x; h < hidden; h += blockDim.x) st(out, row + h, ld(x, row + h) * s * ld(gamma, h));
}

__global__ void add_rmsnorm_kernel(const bf16* a, const bf16* b, const bf16* gamma, bf16* sum_out, bf16* norm_out,
                                   int hidden, float eps) {
  __shared__ float scratch[block / 32];
  const std::size_t row = static_cast<std::size_t>(blockIdx.x) * hidden;
  float ss = 0.f;
  for (int h = threadIdx.x; h < hidden; h += blockDim.x) {
    nvbf16 s = __float2bfloat16_rn(ld(a, row + h) + ld(b, row + h));
    reinterpret_cast<nvbf16*>(sum_out)[row + h] = s;
    float v = __bfloat162float(s);
    ss += v * v;
  }
  const float s = rsqrtf(block_sum(ss, scratch) / static_cast<float>(hidden) + eps);
  // Each thread reads back only the sums it wrote itself: no barrier needed for sum_out.
  for (int h = threadIdx.x; h < hidden; h += blockDim.x) st(norm_out, row + h, ld(sum_out, row + h) * s * ld(gamma, h));
}

// One block per sequence; dynamic shared memory: max_seq scores.
__global__ void attention_kernel(const bf16* qkv, bf16* k_cache, bf16* v_cache, const std::int32_t* pos, bf16* out,
                                 int head_dim, int max_seq) {
  extern __shared__ float score[];
  __shared__ float scratch[block / 32];
  const int r = blockIdx.x, p = *pos;
  if (p < 0 || p >= max_seq) return;
  const bf16* q = qkv + static_cast<std::size_t>(r) * 3 * head_dim;
  bf16* kc = k_cache + static_cast<std::size_t>(r) * max_seq * head_dim;
  bf16* vc = v_cache + static_cast<std::size_t>(r) * max_seq * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    kc[static_cast<std::size_t>(p) * head_dim + d] = q[head_dim + d];
    vc[static_cast<std::size_t>(p) * head_dim + d] = q[2 * head_dim + d];
  }
  __syncthreads();
  const float scale = rsqrtf(static_cast<float>(head_dim));
  float mx = -FLT_MAX;
  for (int j = threadIdx.x; j <= p; j += blockDim.x) {
    float acc = 0.f;
    for (int d = 0; d < head_dim; ++d) acc += ld(q, d) * ld(kc, static_cast<std::size_t>(j) * head_dim + d);
    score[j] = acc * scale;
    mx = fmaxf(mx, score[j]);
  }
  mx = block_max(mx, scratch);
  float sum = 0.f;
  for (int j = threadIdx.x; j <= p; j += blockDim.x) {
    score[j] = __expf(score[j] - mx);
    sum += score[j];
  }
  sum = block_sum(sum, scratch);  // its barriers also publish score[]
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j <= p; ++j) acc += score[j] * ld(vc, static_cast<std::size_t>(j) * head_dim + d);
    st(out, static_cast<std::size_t>(r) * head_dim + d, acc / sum);
  }
}

// One thread per row: experts <= max_experts, top_k <= max_top_k.
__global__ void router_kernel(const float* logits, int rows, int experts, int top_k, std::int32_t* idx,
                              float* weights) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const float* l = logits + static_cast<std::size_t>(r) * experts;
  float mx = -INFINITY;
  for (int e = 0; e < experts; ++e)
    if (l[e] > mx) mx = l[e];
  float sum = 0.f;
  for (int e = 0; e < experts; ++e) sum += isnan(l[e]) ? 0.f : expf(l[e] - mx);
  int chosen_idx[max_top_k];
  float chosen_w[max_top_k];
  float chosen = 0.f;
  for (int k = 0; k < top_k; ++k) {
    int best = -1;
    float bp = 0.f;
    for (int e = 0; e < experts; ++e) {
      bool taken = false;
      for (int j = 0; j < k; ++j) taken = taken || chosen_idx[j] == e;
      if (taken) continue;
      float pe = isnan(l[e]) ? 0.f : expf(l[e] - mx);
      if (best < 0 || pe > bp) {
        best = e;
        bp = pe;
      }
    }
    chosen_idx[k] = best;
    chosen_w[k] = sum > 0.f ? bp / sum : 0.f;
    chosen += chosen_w[k];
  }
  for (int k = 0; k < top_k; ++k) {
    idx[static_cast<std::size_t>(r) * top_k + k] = chosen_idx[k];
    weights[static_cast<std::size_t>(r) * top_k + k] =
        chosen > 0.f ? chosen_w[k] / chosen : 1.f / static_cast<float>(top_k);
  }
}

__global__ void silu_mul_kernel(const bf16* in, bf16* out, int rows, int inter) {
  const std::size_t n = static_cast<std::size_t>(rows) * inter;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t r = i / inter, c = i % inter;
    float g = ld(in, r * 2 * inter + c), u = ld(in, r * 2 * inter + inter + c);
    st(out, i, g / (1.f + expf(-g)) * u);
  }
}

__global__ void expert_pointers_kernel(const std::int32_t* idx, int count, int top_k, const bf16* const* gate_up_table,
                                       const bf16* const* down_table, int experts, const bf16* x_lat, int latent,
                                       bf16* gate_up_out, int inter, bf16* act, bf16* y_lat, ExpertPointers out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  int e = idx[i];
  if (e < 0 || e >= experts) e = 0;
  out.gate_up_x[i] = x_lat + static_cast<std::size_t>(i / top_k) * latent;
  out.gate_up_w[i] = gate_up_table[e];
  out.gate_up_y[i] = gate_up_out + static_cast<std::size_t>(i) * 2 * inter;
  out.down_x[i] = act + static_cast<std::size_t>(i) * inter;
  out.down_w[i] = down_table[e];
  out.down_y[i] = y_lat + static_cast<std::size_t>(i) * latent;
}

// One block per row: (value, index) reduction, ties to the lower index, NaN skipped.
__global__ void argmax_kernel(const float* logits, int vocab, std::int32_t* seq, int seq_stride,
                              const std::int32_t* pos, const std::int32_t* prompt_len) {
  __shared__ float sv[block];
  __shared__ int si[block];
  const int next_pos = *pos + 1;
  if (next_pos < *prompt_len || next_pos >= seq_stride) return;
  const float* l = logits + static_cast<std::size_t>(blockIdx.x) * vocab;
  float bv = 0.f;
  int bi = -1;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
    float x = l[v];
    if (isnan(x)) continue;
    if (bi < 0 || x > bv) {  // v increases within a thread: first maximum kept
      bv = x;
      bi = v;
    }
  }
  sv[threadIdx.x] = bv;
  si[threadIdx.x] = bi;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) {
      float ov = sv[threadIdx.x + s];
      int oi = si[threadIdx.x + s];
      int mi = si[threadIdx.x];
      if (oi >= 0 && (mi < 0 || ov > sv[threadIdx.x] || (ov == sv[threadIdx.x] && oi < mi))) {
        sv[threadIdx.x] = ov;
        si[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) seq[static_cast<std::size_t>(blockIdx.x) * seq_stride + next_pos] = si[0] < 0 ? 0 : si[0];
}

__global__ void advance_kernel(std::int32_t* pos) { ++*pos; }

__device__ __forceinline__ std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__global__ void touch_kernel(std::uint64_t* w, std::size_t words, std::uint64_t seed, unsigned long long* checksum) {
  unsigned long long local = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint64_t v = mix64(seed ^ i);
    w[i] = v;
    local += v;
  }
  // Addition modulo 2^64 commutes: the total is the same whatever the order.
  for (int o = 16; o > 0; o >>= 1) local += __shfl_xor_sync(0xffffffffu, local, o);
  if (threadIdx.x % 32 == 0) atomicAdd(checksum, local);
}

int launched() { return static_cast<int>(cudaGetLastError()); }
int grid_for(std::size_t n) {
  std::size_t g = (n + block - 1) / block;
  return static_cast<int>(g < 4096 ? (g == 0 ? 1 : g) : 4096);
}

}  // namespace

int embed(const std::int32_t* seq, int seq_stride, const std::int32_t* pos, const bf16* tok_emb, int vocab,
          const bf16* pos_table, bf16* out, int batch, int hidden, Stream stream) {
  embed_kernel<<<batch, block, 0, native(stream)>>>(seq, seq_stride, pos, tok_emb, vocab, pos_table, out, hidden);
  return launched();
}

int rmsnorm(const bf16* x, const bf16* gamma, bf16* out, int rows, int hidden, float eps, Stream stream) {
  rmsnorm_kernel<<<rows, block, 0, native(stream)>>>(x, gamma, out, hidden, eps);
  return launched();
}

int add_rmsnorm(const bf16* a, const bf16* b, const bf16* gamma, bf16* sum_out, bf16* norm_out, int rows, int hidden,
                float eps, Stream stream) {
  add_rmsnorm_kernel<<<rows, block, 0, native(stream)>>>(a, b, gamma, sum_out, norm_out, hidden, eps);
  return launched();
}

int attention_decode(const bf16* qkv, bf16* k_cache, bf16* v_cache, const std::int32_t* pos, bf16* out, int batch,
                     int head_dim, int max_seq, Stream stream) {
  // max_seq <= max_attention_seq (8192): at most 32 KiB, under the 48 KiB default limit.
  const std::size_t shared = static_cast<std::size_t>(max_seq) * sizeof(float);
  if (max_seq > max_attention_seq) return static_cast<int>(cudaErrorInvalidValue);
  attention_kernel<<<batch, block, shared, native(stream)>>>(qkv, k_cache, v_cache, pos, out, head_dim, max_seq);
  return launched();
}

int router_topk(const float* logits, int rows, int experts, int top_k, std::int32_t* idx, float* weights,
                Stream stream) {
  router_kernel<<<(rows + 63) / 64, 64, 0, native(stream)>>>(logits, rows, experts, top_k, idx, weights);
  return launched();
}

int silu_mul(const bf16* in, bf16* out, int rows, int inter, Stream stream) {
  silu_mul_kernel<<<grid_for(static_cast<std::size_t>(rows) * inter), block, 0, native(stream)>>>(in, out, rows, inter);
  return launched();
}

int expert_pointers(const std::int32_t* idx, int count, int top_k, const bf16* const* gate_up_table,
                    const bf16* const* down_table, int experts, const bf16* x_lat, int latent, bf16* gate_up_out,
                    int inter, bf16* act, bf16* y_lat, ExpertPointers out, Stream stream) {
  expert_pointers_kernel<<<(count + 63) / 64, 64, 0, native(stream)>>>(idx, count, top_k, gate_up_table, down_table,
                                                                       experts, x_lat, latent, gate_up_out, inter, act,
                                                                       y_lat, out);
  return launched();
}

int argmax_next(const float* logits, int batch, int vocab, std::int32_t* seq, int seq_stride, const std::int32_t* pos,
                const std::int32_t* prompt_len, Stream stream) {
  argmax_kernel<<<batch, block, 0, native(stream)>>>(logits, vocab, seq, seq_stride, pos, prompt_len);
  return launched();
}

int advance(std::int32_t* pos, Stream stream) {
  advance_kernel<<<1, 1, 0, native(stream)>>>(pos);
  return launched();
}

int touch(void* p, std::size_t bytes, std::uint64_t seed, unsigned long long* checksum, Stream stream) {
  const std::size_t words = bytes / 8;
  touch_kernel<<<grid_for(words), block, 0, native(stream)>>>(static_cast<std::uint64_t*>(p), words, seed, checksum);
  return launched();
}

const char* error_string(int code) noexcept { return cudaGetErrorName(static_cast<cudaError_t>(code)); }

}  // namespace torpor::kernels::gpu
