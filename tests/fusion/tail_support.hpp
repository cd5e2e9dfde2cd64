// Test support for the MoE tail: random inputs (never zeros), the fp64 reference of finalize +
// all-reduce + residual + RMSNorm, the error bound a bf16 result must meet against it, and thread
// ranks over one HostDriver.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "torpor/fusion/tail.hpp"
#include "torpor/host_driver.hpp"
#include "torpor/kernels/bf16.hpp"
#include "torpor/kernels/tail_protocol.hpp"
#include "torpor/pool.hpp"

namespace torpor::test {

using fusion::TailArgs;
using fusion::TailMode;
using fusion::TailShape;

// 16-byte aligned storage (the kernels move 16-byte vectors).
template <typename T>
struct Aligned {
  std::vector<T> v;
  explicit Aligned(std::size_t n = 0) : v(n) {}
  T* data() { return v.data(); }
  const T* data() const { return v.data(); }
  std::size_t size() const { return v.size(); }
  T& operator[](std::size_t i) { return v[i]; }
  const T& operator[](std::size_t i) const { return v[i]; }
};

inline float f(bf16 b) { return b.to_float(); }

// One rank's inputs of one call.
struct RankInputs {
  std::vector<bf16> expert;    // [tokens][top_k][hidden]
  std::vector<float> weights;  // [tokens][top_k]
  std::vector<bf16> shared;    // [tokens][hidden] or empty
};

// One call: every rank's partial inputs, and the residual and gamma every rank shares.
struct CallInputs {
  int tokens = 0;
  std::vector<RankInputs> ranks;
  std::vector<bf16> residual;  // [tokens][hidden]
  std::vector<bf16> gamma;     // [hidden]
};

// splitmix64: fast, and the same sequence everywhere (processes and the GPU oracle agree).
struct Rng {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform(float lo, float hi) { return lo + (hi - lo) * static_cast<float>(next() >> 40) * 0x1.0p-24f; }
};

// A non-zero bf16 uniform in [lo, hi) (resampled when it rounds to +-0).
inline bf16 nonzero(Rng& rng, float lo, float hi) {
  for (;;) {
    bf16 b = bf16::from_float(rng.uniform(lo, hi));
    if ((b.bits & 0x7FFFu) != 0) return b;
  }
}

inline CallInputs random_call(const TailShape& s, int ranks, int tokens, std::uint64_t seed) {
  Rng rng{seed * 0x2545F4914F6CDD1Dull + 1};
  CallInputs c;
  c.tokens = tokens;
  const std::size_t th = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(s.hidden);
  for (int r = 0; r < ranks; ++r) {
    RankInputs in;
    in.expert.resize(th * static_cast<std::size_t>(s.top_k));
    for (auto& e : in.expert) e = nonzero(rng, -1.0f, 1.0f);
    in.weights.resize(static_cast<std::size_t>(tokens) * static_cast<std::size_t>(s.top_k));
    for (auto& x : in.weights) x = rng.uniform(0.1f, 1.0f);
    if (s.shared_expert) {
      in.shared.resize(th);
      for (auto& e : in.shared) e = nonzero(rng, -0.5f, 0.5f);
    }
    c.ranks.push_back(std::move(in));
  }
  c.residual.resize(th);
  for (auto& e : c.residual) e = nonzero(rng, -2.0f, 2.0f);
  c.gamma.resize(static_cast<std::size_t>(s.hidden));
  for (auto& e : c.gamma) e = nonzero(rng, 0.5f, 1.5f);
  return c;
}

// The exact answer (fp64 from the bf16 inputs) and what the bound needs.
struct Expected {
  int tokens = 0;
  int hidden = 0;
  std::vector<double> residual;      // residual + sum of partials
  std::vector<double> abs_partials;  // sum over ranks of |partial|
  std::vector<double> norm;
  std::vector<double> inv;    // per token: 1 / sqrt(mean(residual^2) + eps)
  std::vector<double> gamma;  // per column
};

inline Expected fp64_reference(const TailShape& s, const CallInputs& c) {
  Expected e;
  e.tokens = c.tokens;
  e.hidden = s.hidden;
  const std::size_t n = static_cast<std::size_t>(c.tokens) * static_cast<std::size_t>(s.hidden);
  e.residual.assign(n, 0.0);
  e.abs_partials.assign(n, 0.0);
  e.norm.assign(n, 0.0);
  for (bf16 g : c.gamma) e.gamma.push_back(f(g));
  for (const RankInputs& in : c.ranks)
    for (int t = 0; t < c.tokens; ++t)
      for (int col = 0; col < s.hidden; ++col) {
        const std::size_t i = static_cast<std::size_t>(t) * s.hidden + col;
        double p = in.shared.empty() ? 0.0 : f(in.shared[i]);
        for (int k = 0; k < s.top_k; ++k)
          p += static_cast<double>(in.weights[static_cast<std::size_t>(t) * s.top_k + k]) *
               f(in.expert[(static_cast<std::size_t>(t) * s.top_k + k) * s.hidden + col]);
        e.residual[i] += p;
        e.abs_partials[i] += std::abs(p);
      }
  for (int t = 0; t < c.tokens; ++t) {
    double ss = 0;
    for (int col = 0; col < s.hidden; ++col) {
      const std::size_t i = static_cast<std::size_t>(t) * s.hidden + col;
      e.residual[i] += f(c.residual[i]);
      ss += e.residual[i] * e.residual[i];
    }
    const double inv = 1.0 / std::sqrt(ss / s.hidden + s.eps);
    e.inv.push_back(inv);
    for (int col = 0; col < s.hidden; ++col) {
      const std::size_t i = static_cast<std::size_t>(t) * s.hidden + col;
      e.norm[i] = e.residual[i] * inv * f(c.gamma[static_cast<std::size_t>(col)]);
    }
  }
  return e;
}

// "" when rows [begin, end) of the outputs are within bf16 bounds of the fp64 answer; otherwise
// the first few offending elements. The bound, per element: residual_out has the partials'
// rounding (2^-8 of each, so 2^-8 * sum |partial|) and its own (2^-8 |x|); norm_out has x's error
// times inv * gamma, inv's error from every x of the row, and its own rounding. Both get a factor
// 2 of margin (fp32 accumulation is far below it). NaN or inf never passes.
inline std::string check_outputs(const Expected& e, const bf16* residual_out, const bf16* norm_out, int begin, int end,
                                 double margin = 2.0) {
  constexpr double u = 1.0 / 256;  // bf16 unit roundoff (8 significant bits)
  std::string report;
  int bad = 0;
  const int h = e.hidden;
  for (int t = begin; t < end; ++t) {
    std::vector<double> ex(static_cast<std::size_t>(h));
    double ss = 0, dss = 0;
    for (int col = 0; col < h; ++col) {
      const std::size_t i = static_cast<std::size_t>(t) * h + col;
      ex[static_cast<std::size_t>(col)] = u * (e.abs_partials[i] + std::abs(e.residual[i]));
      ss += e.residual[i] * e.residual[i];
      dss += 2 * std::abs(e.residual[i]) * ex[static_cast<std::size_t>(col)] +
             ex[static_cast<std::size_t>(col)] * ex[static_cast<std::size_t>(col)];
    }
    const double inv = e.inv[static_cast<std::size_t>(t)];
    const double rel_inv = 0.5 * dss / ss + 1e-6;
    for (int col = 0; col < h; ++col) {
      const std::size_t i = static_cast<std::size_t>(t) * h + col;
      const double got_r = f(residual_out[i]), got_n = f(norm_out[i]);
      const double bound_r = margin * ex[static_cast<std::size_t>(col)] + 1e-7;
      const double g = std::abs(e.gamma[static_cast<std::size_t>(col)]);
      const double bound_n =
          margin * (g * (ex[static_cast<std::size_t>(col)] * inv + std::abs(e.residual[i]) * inv * rel_inv) +
                    u * std::abs(e.norm[i])) +
          1e-7;
      const double err_r = std::abs(got_r - e.residual[i]), err_n = std::abs(got_n - e.norm[i]);
      if (!(std::isfinite(got_r) && err_r <= bound_r) || !(std::isfinite(got_n) && err_n <= bound_n)) {
        if (++bad <= 5)
          report += "token " + std::to_string(t) + " col " + std::to_string(col) + ": residual " +
                    std::to_string(got_r) + " (exact " + std::to_string(e.residual[i]) + ", bound " +
                    std::to_string(bound_r) + "), norm " + std::to_string(got_n) + " (exact " +
                    std::to_string(e.norm[i]) + ", bound " + std::to_string(bound_n) + ")\n";
      }
    }
  }
  if (bad > 0) report += std::to_string(bad) + " elements out of bounds\n";
  return report;
}

// One rank's buffers of one call (host memory: device memory on the host backend).
struct RankBuffers {
  Aligned<bf16> expert, shared, residual, gamma, residual_out, norm_out;
  Aligned<float> weights;

  RankBuffers(const TailShape& s, int max_tokens)
      : expert(static_cast<std::size_t>(max_tokens) * s.top_k * s.hidden),
        shared(s.shared_expert ? static_cast<std::size_t>(max_tokens) * s.hidden : 0),
        residual(static_cast<std::size_t>(max_tokens) * s.hidden),
        gamma(static_cast<std::size_t>(s.hidden)),
        residual_out(static_cast<std::size_t>(max_tokens) * s.hidden),
        norm_out(static_cast<std::size_t>(max_tokens) * s.hidden),
        weights(static_cast<std::size_t>(max_tokens) * s.top_k) {}

  void load(const CallInputs& c, int rank) {
    const RankInputs& in = c.ranks[static_cast<std::size_t>(rank)];
    std::copy(in.expert.begin(), in.expert.end(), expert.v.begin());
    std::copy(in.weights.begin(), in.weights.end(), weights.v.begin());
    if (!in.shared.empty()) std::copy(in.shared.begin(), in.shared.end(), shared.v.begin());
    std::copy(c.residual.begin(), c.residual.end(), residual.v.begin());
    std::copy(c.gamma.begin(), c.gamma.end(), gamma.v.begin());
  }
  // Outputs preset to a NaN pattern, so an unwritten row is visible.
  void poison_outputs() {
    std::fill(residual_out.v.begin(), residual_out.v.end(), bf16::from_bits(0x7FC1));
    std::fill(norm_out.v.begin(), norm_out.v.end(), bf16::from_bits(0x7FC1));
  }
  TailArgs args(int tokens) {
    TailArgs a;
    a.tokens = tokens;
    a.expert_out = expert.data();
    a.topk_weights = weights.data();
    a.shared_out = shared.size() > 0 ? shared.data() : nullptr;
    a.residual_in = residual.data();
    a.gamma = gamma.data();
    a.residual_out = residual_out.data();
    a.norm_out = norm_out.data();
    return a;
  }
};

inline bool same_bits(const bf16* a, const bf16* b, std::size_t n) { return std::memcmp(a, b, n * sizeof(bf16)) == 0; }

// Runs body(rank) on n threads; returns "rank r: what" lines for the ranks that threw.
inline std::string on_threads(int n, const std::function<void(int)>& body) {
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  std::string s;
  for (int r = 0; r < n; ++r)
    if (!errors[static_cast<std::size_t>(r)].empty())
      s += "rank " + std::to_string(r) + ": " + errors[static_cast<std::size_t>(r)] + "\n";
  return s;
}

inline HostDriverOptions tail_host_options(bool multicast_attribute) {
  HostDriverOptions o;
  o.devices = 8;
  o.device_bytes = std::size_t{512} << 20;
  o.granularity = std::size_t{64} << 10;
  o.multicast_attribute = multicast_attribute;
  return o;
}

inline PoolOptions tail_pool_options(int device) {
  PoolOptions o;
  o.device = device;
  o.va_bytes = std::size_t{256} << 20;
  o.exportable = true;
  return o;
}

}  // namespace torpor::test
