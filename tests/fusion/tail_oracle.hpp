// Oracles for the MoE tail written in the tests, independent of kernels/ (neither the CPU
// reference nor tail_protocol.hpp's helpers are used to compute them):
//   ieee_bf16        float -> bf16 from the IEEE 754 definition of round to nearest, ties to even:
//                    the two bf16 neighbours of x as doubles, the nearer one, the even one on a tie;
//   tail_by_definition  the tail's outputs from its definition (fusion/tail.hpp) with the
//                    arithmetic tail_protocol.hpp fixes: one FMA per expert into the shared
//                    expert's value, the partial rounded to bf16 once and sent as +0.0 when it
//                    rounds to -0.0 (I2), the ranks' partials summed in rank order in fp32 (I7),
//                    residual_out rounded to bf16, its sum of squares along the GPU block's tree
//                    (simulated lane by lane: 512 lanes, xor shuffles per warp of 32, warps in
//                    order), 1 / sqrt(mean + eps) in fp32, norm_out = (x * inv) * gamma rounded.
// Every NaN the tail writes is the canonical 0x7FFF. These are what "bit for bit" means for the
// tail; tests hold the host backend and the GPU against them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tail_support.hpp"

namespace torpor::test {

inline constexpr std::uint16_t canonical_bf16_nan = 0x7FFF;

inline double bf16_bits_as_double(std::uint32_t magnitude_bits) {
  if (magnitude_bits == 0x7F80u) return std::ldexp(1.0, 128);  // rounding treats +inf as 2^128
  const std::uint32_t u = magnitude_bits << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// The bf16 nearest to the float with bits u (ties to the even significand); NaN gives `nan`.
inline std::uint16_t ieee_bf16(std::uint32_t u, std::uint16_t nan = canonical_bf16_nan) {
  const std::uint32_t sign = u >> 31;
  const std::uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return nan;
  float fx;
  std::memcpy(&fx, &magnitude, 4);
  const double x = fx;  // |value|, exact
  // The bf16 magnitudes just below (or at) and just above |x|: the truncation and the next one.
  const std::uint32_t below = magnitude >> 16;
  const double lo = bf16_bits_as_double(below);
  std::uint32_t pick = below;
  if (lo != x) {
    const double hi = bf16_bits_as_double(below + 1);
    const double to_lo = x - lo, to_hi = hi - x;  // exact: floats of one binade, a power of two apart at most
    if (to_hi < to_lo || (to_hi == to_lo && (below & 1u) != 0)) pick = below + 1;
  }
  return static_cast<std::uint16_t>((sign << 15) | pick);
}
inline std::uint16_t ieee_bf16(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return ieee_bf16(u);
}
inline float bf16_value(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// The row's sum of squares along the GPU block's tree, lane by lane.
inline float tree_sum_of_squares(const float* x, int hidden) {
  constexpr int lanes = 512, warp = 32, vector = 8;
  std::vector<float> lane(lanes, 0.0f);
  const int vectors = hidden / vector;
  for (int j = 0; j < lanes; ++j)
    for (int v = j; v < vectors; v += lanes)
      for (int e = 0; e < vector; ++e) {
        const float sq = x[v * vector + e] * x[v * vector + e];
        lane[static_cast<std::size_t>(j)] = lane[static_cast<std::size_t>(j)] + sq;
      }
  for (int m = warp / 2; m >= 1; m /= 2) {  // every lane at once, as __shfl_xor_sync does
    std::vector<float> next(lane.size());
    for (std::size_t i = 0; i < lane.size(); ++i) next[i] = lane[i] + lane[i ^ static_cast<std::size_t>(m)];
    lane = std::move(next);
  }
  float total = lane[0];
  for (int w = 1; w < lanes / warp; ++w) total = total + lane[static_cast<std::size_t>(w) * warp];
  return total;
}

// Every row's outputs: [tokens][hidden] residual_out, then [tokens][hidden] norm_out.
inline std::vector<bf16> tail_by_definition(const TailShape& s, const CallInputs& c) {
  const std::size_t h = static_cast<std::size_t>(s.hidden);
  const std::size_t n = static_cast<std::size_t>(c.tokens) * h;
  std::vector<bf16> out(2 * n);
  std::vector<float> sum(h), x(h);
  for (int t = 0; t < c.tokens; ++t) {
    const std::size_t row = static_cast<std::size_t>(t) * h;
    for (std::size_t r = 0; r < c.ranks.size(); ++r) {
      const RankInputs& in = c.ranks[r];
      for (std::size_t col = 0; col < h; ++col) {
        float acc = in.shared.empty() ? 0.0f : bf16_value(in.shared[row + col].bits);
        for (int k = 0; k < s.top_k; ++k)
          acc = std::fma(in.weights[static_cast<std::size_t>(t) * s.top_k + k],
                         bf16_value(in.expert[(static_cast<std::size_t>(t) * s.top_k + k) * h + col].bits), acc);
        std::uint16_t partial = ieee_bf16(acc);
        if (partial == 0x8000) partial = 0;  // I2: never the sentinel
        const float p = bf16_value(partial);
        sum[col] = r == 0 ? p : sum[col] + p;
      }
    }
    for (std::size_t col = 0; col < h; ++col) {
      const std::uint16_t res = ieee_bf16(bf16_value(c.residual[row + col].bits) + sum[col]);
      out[row + col] = bf16::from_bits(res);
      x[col] = bf16_value(res);
    }
    const float ss = tree_sum_of_squares(x.data(), s.hidden);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(s.hidden) + s.eps);
    for (std::size_t col = 0; col < h; ++col)
      out[n + row + col] = bf16::from_bits(ieee_bf16((x[col] * inv) * bf16_value(c.gamma[col].bits)));
  }
  return out;
}

// Inputs whose partials include every special case of the protocol, on top of random ones
// (needs at least 4 tokens, top_k >= 1 and a shared expert; every rank's inputs are changed):
//   token 0, columns 0-63: every rank's partial exactly -0.0 (shared -0.0 + w * -0.0), and the
//     residual -0.0 in columns 0-31: the sanitised sum +0.0 makes residual_out +0.0 there
//     (-0.0 + -0.0 would keep the sign);
//   token 1: rank 0's partial NaN at column 5 (a quiet NaN expert output) and at column 9 (a
//     negative NaN with a payload), so residual_out is the canonical NaN there and the row's
//     norm_out is NaN throughout;
//   token 2, column 3: rank 0's partial +inf, the last rank's -inf: their sum is NaN;
//   token 3, columns 0-15: every rank's partial a negative fp32 subnormal (2^-135) that rounds to
//     -0.0 in bf16, so it is sent as +0.0 too.
inline CallInputs special_call(const TailShape& s, int ranks, int tokens, std::uint64_t seed) {
  CallInputs c = random_call(s, ranks, tokens, seed);
  const std::size_t h = static_cast<std::size_t>(s.hidden);
  const auto expert = [&](RankInputs& in, int t, int k, int col) -> bf16& {
    return in.expert[(static_cast<std::size_t>(t) * s.top_k + k) * h + static_cast<std::size_t>(col)];
  };
  for (RankInputs& in : c.ranks) {
    for (int col = 0; col < 64; ++col) {
      in.shared[static_cast<std::size_t>(col)] = bf16_negative_zero;
      for (int k = 0; k < s.top_k; ++k) expert(in, 0, k, col) = bf16_negative_zero;
    }
    in.weights[3 * static_cast<std::size_t>(s.top_k)] = 0.25f;
    for (int col = 0; col < 16; ++col) {
      in.shared[3 * h + static_cast<std::size_t>(col)] = bf16::from_bits(0x0000);
      expert(in, 3, 0, col) = bf16::from_bits(0x8001);  // -2^-133; times 0.25: -2^-135
      for (int k = 1; k < s.top_k; ++k) expert(in, 3, k, col) = bf16::from_bits(0x0000);
    }
  }
  for (int col = 0; col < 32; ++col) c.residual[static_cast<std::size_t>(col)] = bf16_negative_zero;
  expert(c.ranks.front(), 1, 0, 5) = bf16::from_bits(0x7FC0);
  expert(c.ranks.front(), 1, 0, 9) = bf16::from_bits(0xFFC1);
  expert(c.ranks.front(), 2, 0, 3) = bf16::from_bits(0x7F80);  // +inf
  expert(c.ranks.back(), 2, 0, 3) = bf16::from_bits(0xFF80);   // -inf
  return c;
}

// "" when got's rows [begin, end) ([tokens][hidden] residual_out, then norm_out) are want's bits.
inline std::string first_difference(const std::vector<bf16>& got, const std::vector<bf16>& want, int hidden, int begin,
                                    int end, const char* what) {
  const std::size_t n = got.size() / 2, h = static_cast<std::size_t>(hidden);
  for (std::size_t half : {std::size_t{0}, n})
    for (std::size_t i = static_cast<std::size_t>(begin) * h; i < static_cast<std::size_t>(end) * h; ++i)
      if (got[half + i].bits != want[half + i].bits) {
        char hex[64];
        std::snprintf(hex, sizeof hex, "0x%04x, %s gives 0x%04x", got[half + i].bits, what, want[half + i].bits);
        return std::string(half == 0 ? "residual_out" : "norm_out") + " of token " + std::to_string(i / h) +
               " column " + std::to_string(i % h) + " is " + hex;
      }
  return "";
}

}  // namespace torpor::test
