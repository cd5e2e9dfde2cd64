// CPU reference implementations of the MoE runner's small ops (moe_ops.hpp). They are the
// host backend's kernels and the GPU kernels' oracle, so they favour the plainest loop that
// states the math: fp32 accumulation in index order, one rounding to bf16 per output.
#include "torpor/kernels/moe_ops.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace torpor::kernels::ref {

namespace {

inline float f(bf16 v) { return v.to_float(); }
inline bf16 b(float v) { return bf16::from_float(v); }

std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <typename Out>
void store(Out* y, float acc) {
  if constexpr (std::is_same_v<Out, float>)
    *y = acc;
  else
    *y = b(acc);
}

// Output columns in fours: each column keeps its own sum, in index order as the definition says,
// so every output is bitwise what one column at a time gives; four independent sums keep the
// floating-point unit busy where one sum waits on the previous addition.
template <typename Out>
void linear_impl(const bf16* x, const bf16* w, Out* y, int m, int n, int k) {
  std::vector<float> row(static_cast<std::size_t>(k));
  const float* r = row.data();
  for (int i = 0; i < m; ++i) {
    for (int c = 0; c < k; ++c) row[static_cast<std::size_t>(c)] = f(x[static_cast<std::size_t>(i) * k + c]);
    Out* yr = y + static_cast<std::size_t>(i) * n;
    int j = 0;
    for (; j + 4 <= n; j += 4) {
      const bf16* w0 = w + static_cast<std::size_t>(j) * k;
      const bf16* w1 = w0 + k;
      const bf16* w2 = w1 + k;
      const bf16* w3 = w2 + k;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
      for (int c = 0; c < k; ++c) {
        a0 += r[c] * f(w0[c]);
        a1 += r[c] * f(w1[c]);
        a2 += r[c] * f(w2[c]);
        a3 += r[c] * f(w3[c]);
      }
      store(yr + j, a0);
      store(yr + j + 1, a1);
      store(yr + j + 2, a2);
      store(yr + j + 3, a3);
    }
    for (; j < n; ++j) {
      const bf16* wr = w + static_cast<std::size_t>(j) * k;
      float acc = 0.f;
      for (int c = 0; c < k; ++c) acc += r[c] * f(wr[c]);
      store(yr + j, acc);
    }
  }
}

float rms_scale(const float* v, int n, float eps) {
  float ss = 0.f;
  for (int i = 0; i < n; ++i) ss += v[i] * v[i];
  return 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
}

}  // namespace

void linear(const bf16* x, const bf16* w, bf16* y, int m, int n, int k) { linear_impl(x, w, y, m, n, k); }
void linear(const bf16* x, const bf16* w, float* y, int m, int n, int k) { linear_impl(x, w, y, m, n, k); }

void linear_batched(const bf16* const* x, const bf16* const* w, bf16* const* y, int count, int n, int k) {
  for (int i = 0; i < count; ++i) linear_impl(x[i], w[i], y[i], 1, n, k);
}

void embed(const std::int32_t* seq, int seq_stride, const std::int32_t* pos, const bf16* tok_emb, int vocab,
           const bf16* pos_table, bf16* out, int batch, int hidden) {
  const int p = *pos;
  for (int r = 0; r < batch; ++r) {
    std::int32_t t = seq[static_cast<std::size_t>(r) * seq_stride + p];
    if (t < 0 || t >= vocab) t = 0;
    const bf16* e = tok_emb + static_cast<std::size_t>(t) * hidden;
    const bf16* pe = pos_table + static_cast<std::size_t>(p) * hidden;
    for (int h = 0; h < hidden; ++h) out[static_cast<std::size_t>(r) * hidden + h] = b(f(e[h]) + f(pe[h]));
  }
}

void rmsnorm(const bf16* x, const bf16* gamma, bf16* out, int rows, int hidden, float eps) {
  std::vector<float> v(static_cast<std::size_t>(hidden));
  for (int r = 0; r < rows; ++r) {
    for (int h = 0; h < hidden; ++h) v[static_cast<std::size_t>(h)] = f(x[static_cast<std::size_t>(r) * hidden + h]);
    float s = rms_scale(v.data(), hidden, eps);
    for (int h = 0; h < hidden; ++h)
      out[static_cast<std::size_t>(r) * hidden + h] = b(v[static_cast<std::size_t>(h)] * s * f(gamma[h]));
  }
}

void add_rmsnorm(const bf16* a, const bf16* bb, const bf16* gamma, bf16* sum_out, bf16* norm_out, int rows, int hidden,
                 float eps) {
  std::vector<float> v(static_cast<std::size_t>(hidden));
  for (int r = 0; r < rows; ++r) {
    for (int h = 0; h < hidden; ++h) {
      std::size_t i = static_cast<std::size_t>(r) * hidden + h;
      bf16 s = b(f(a[i]) + f(bb[i]));
      sum_out[i] = s;
      v[static_cast<std::size_t>(h)] = f(s);
    }
    float s = rms_scale(v.data(), hidden, eps);
    for (int h = 0; h < hidden; ++h)
      norm_out[static_cast<std::size_t>(r) * hidden + h] = b(v[static_cast<std::size_t>(h)] * s * f(gamma[h]));
  }
}

void attention_decode(const bf16* qkv, bf16* k_cache, bf16* v_cache, const std::int32_t* pos, bf16* out, int batch,
                      int head_dim, int max_seq) {
  const int p = *pos;
  if (p < 0 || p >= max_seq) return;  // the runner never asks; never write out of bounds
  const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
  std::vector<float> score(static_cast<std::size_t>(p) + 1);
  for (int r = 0; r < batch; ++r) {
    const bf16* q = qkv + static_cast<std::size_t>(r) * 3 * head_dim;
    bf16* kc = k_cache + static_cast<std::size_t>(r) * max_seq * head_dim;
    bf16* vc = v_cache + static_cast<std::size_t>(r) * max_seq * head_dim;
    for (int d = 0; d < head_dim; ++d) {
      kc[static_cast<std::size_t>(p) * head_dim + d] = q[head_dim + d];
      vc[static_cast<std::size_t>(p) * head_dim + d] = q[2 * head_dim + d];
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (int j = 0; j <= p; ++j) {
      float acc = 0.f;
      for (int d = 0; d < head_dim; ++d) acc += f(q[d]) * f(kc[static_cast<std::size_t>(j) * head_dim + d]);
      score[static_cast<std::size_t>(j)] = acc * scale;
      mx = std::max(mx, score[static_cast<std::size_t>(j)]);
    }
    float sum = 0.f;
    for (int j = 0; j <= p; ++j) {
      score[static_cast<std::size_t>(j)] = std::exp(score[static_cast<std::size_t>(j)] - mx);
      sum += score[static_cast<std::size_t>(j)];
    }
    for (int d = 0; d < head_dim; ++d) {
      float acc = 0.f;
      for (int j = 0; j <= p; ++j)
        acc += score[static_cast<std::size_t>(j)] * f(vc[static_cast<std::size_t>(j) * head_dim + d]);
      out[static_cast<std::size_t>(r) * head_dim + d] = b(acc / sum);
    }
  }
}

void router_topk(const float* logits, int rows, int experts, int top_k, std::int32_t* idx, float* weights) {
  std::vector<float> p(static_cast<std::size_t>(experts));
  std::vector<char> taken(static_cast<std::size_t>(experts));
  for (int r = 0; r < rows; ++r) {
    const float* l = logits + static_cast<std::size_t>(r) * experts;
    float mx = -std::numeric_limits<float>::infinity();
    for (int e = 0; e < experts; ++e)
      if (l[e] > mx) mx = l[e];
    float sum = 0.f;
    for (int e = 0; e < experts; ++e) {
      p[static_cast<std::size_t>(e)] = std::isnan(l[e]) ? 0.f : std::exp(l[e] - mx);
      sum += p[static_cast<std::size_t>(e)];
    }
    std::fill(taken.begin(), taken.end(), 0);
    float chosen = 0.f;
    for (int k = 0; k < top_k; ++k) {
      int best = -1;
      for (int e = 0; e < experts; ++e)
        if (!taken[static_cast<std::size_t>(e)] &&
            (best < 0 || p[static_cast<std::size_t>(e)] > p[static_cast<std::size_t>(best)]))
          best = e;
      taken[static_cast<std::size_t>(best)] = 1;
      idx[static_cast<std::size_t>(r) * top_k + k] = best;
      float w = sum > 0.f ? p[static_cast<std::size_t>(best)] / sum : 0.f;
      weights[static_cast<std::size_t>(r) * top_k + k] = w;
      chosen += w;
    }
    for (int k = 0; k < top_k; ++k) {
      float& w = weights[static_cast<std::size_t>(r) * top_k + k];
      w = chosen > 0.f ? w / chosen : 1.f / static_cast<float>(top_k);
    }
  }
}

void silu_mul(const bf16* in, bf16* out, int rows, int inter) {
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < inter; ++i) {
      float g = f(in[static_cast<std::size_t>(r) * 2 * inter + i]);
      float u = f(in[static_cast<std::size_t>(r) * 2 * inter + inter + i]);
      out[static_cast<std::size_t>(r) * inter + i] = b(g / (1.f + std::exp(-g)) * u);
    }
}

void expert_pointers(const std::int32_t* idx, int count, int top_k, const bf16* const* gate_up_table,
                     const bf16* const* down_table, int experts, const bf16* x_lat, int latent, bf16* gate_up_out,
                     int inter, bf16* act, bf16* y_lat, ExpertPointers out) {
  for (int i = 0; i < count; ++i) {
    int e = idx[i];
    if (e < 0 || e >= experts) e = 0;
    out.gate_up_x[i] = x_lat + static_cast<std::size_t>(i / top_k) * latent;
    out.gate_up_w[i] = gate_up_table[e];
    out.gate_up_y[i] = gate_up_out + static_cast<std::size_t>(i) * 2 * inter;
    out.down_x[i] = act + static_cast<std::size_t>(i) * inter;
    out.down_w[i] = down_table[e];
    out.down_y[i] = y_lat + static_cast<std::size_t>(i) * latent;
  }
}

void argmax_next(const float* logits, int batch, int vocab, std::int32_t* seq, int seq_stride, const std::int32_t* pos,
                 const std::int32_t* prompt_len) {
  const int next_pos = *pos + 1;
  if (next_pos < *prompt_len || next_pos >= seq_stride) return;
  for (int r = 0; r < batch; ++r) {
    const float* l = logits + static_cast<std::size_t>(r) * vocab;
    int best = 0;
    float bv = -std::numeric_limits<float>::infinity();
    bool any = false;
    for (int v = 0; v < vocab; ++v) {
      if (std::isnan(l[v])) continue;
      if (!any || l[v] > bv) {
        bv = l[v];
        best = v;
        any = true;
      }
    }
    seq[static_cast<std::size_t>(r) * seq_stride + next_pos] = best;
  }
}

void advance(std::int32_t* pos) { ++*pos; }

unsigned long long touch(void* p, std::size_t bytes, std::uint64_t seed) {
  auto* w = static_cast<std::uint64_t*>(p);
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < bytes / 8; ++i) {
    w[i] = mix64(seed ^ i);
    sum += w[i];
  }
  return sum;
}

}  // namespace torpor::kernels::ref
