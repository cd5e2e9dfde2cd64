// The CPU reference kernels against hand-computed values: these define the math the GPU kernels
// are checked against (test_moe_ops_gpu.cpp), so they are tested on cases whose answer is known
// without running any of them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "torpor/kernels/moe_ops.hpp"

namespace torpor::kernels {
namespace {

std::vector<bf16> B(std::initializer_list<float> v) {
  std::vector<bf16> out;
  for (float x : v) out.push_back(bf16::from_float(x));
  return out;
}
std::vector<float> F(const std::vector<bf16>& v) {
  std::vector<float> out;
  for (bf16 x : v) out.push_back(x.to_float());
  return out;
}

TEST(RefKernels, LinearIsXTimesWTransposed) {
  auto x = B({1, 2, 3, 4, 5, 6});                    // [2][3]
  auto w = B({1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1});  // [4][3]
  std::vector<bf16> y(8);
  ref::linear(x.data(), w.data(), y.data(), 2, 4, 3);
  EXPECT_EQ(F(y), (std::vector<float>{1, 2, 3, 6, 4, 5, 6, 15}));
  std::vector<float> yf(8);
  ref::linear(x.data(), w.data(), yf.data(), 2, 4, 3);
  EXPECT_EQ(yf, (std::vector<float>{1, 2, 3, 6, 4, 5, 6, 15}));
}

// The definition on random values, bitwise: each output is its fp32 sum in index order, rounded
// once. Column counts around the kernel's blocking (below, at and past a multiple of four) and a
// long row, whose rounding differs when the terms are summed in any other order.
TEST(RefKernels, LinearIsTheFp32SumInIndexOrderForEveryColumnCount) {
  std::uint32_t state = 12345;
  const auto next = [&state] {
    state = state * 1664525u + 1013904223u;
    return bf16::from_float(static_cast<float>(static_cast<int>(state >> 8) % 2001 - 1000) / 37.f);
  };
  const int m = 3, k = 301;
  for (int n : {1, 3, 4, 5, 8, 11}) {
    std::vector<bf16> x(static_cast<std::size_t>(m) * k), w(static_cast<std::size_t>(n) * k);
    for (auto& v : x) v = next();
    for (auto& v : w) v = next();
    std::vector<bf16> y(static_cast<std::size_t>(m) * n);
    std::vector<float> yf(y.size());
    ref::linear(x.data(), w.data(), y.data(), m, n, k);
    ref::linear(x.data(), w.data(), yf.data(), m, n, k);
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        float sum = 0.f;
        for (int c = 0; c < k; ++c)
          sum += x[static_cast<std::size_t>(i) * k + c].to_float() * w[static_cast<std::size_t>(j) * k + c].to_float();
        const std::size_t o = static_cast<std::size_t>(i) * n + j;
        ASSERT_EQ(yf[o], sum) << "n " << n << ", output [" << i << "][" << j << "]";
        ASSERT_EQ(y[o].bits, bf16::from_float(sum).bits) << "n " << n << ", output [" << i << "][" << j << "]";
      }
  }
}

TEST(RefKernels, LinearBatchedUsesEachEntrysPointers) {
  auto x0 = B({1, 2}), x1 = B({3, 4});
  auto wa = B({1, 0, 0, 1}), wb = B({0, 1, 1, 0});  // identity, swap
  std::vector<bf16> y0(2), y1(2);
  const bf16* xs[] = {x0.data(), x1.data()};
  const bf16* ws[] = {wb.data(), wa.data()};
  bf16* ys[] = {y0.data(), y1.data()};
  ref::linear_batched(xs, ws, ys, 2, 2, 2);
  EXPECT_EQ(F(y0), (std::vector<float>{2, 1}));
  EXPECT_EQ(F(y1), (std::vector<float>{3, 4}));
}

TEST(RefKernels, RmsnormOfAConstantRowIsGamma) {
  auto x = B({3, 3, 3, 3, -2, 2, -2, 2});
  auto g = B({1, 2, 0.5f, 1});
  std::vector<bf16> y(8);
  ref::rmsnorm(x.data(), g.data(), y.data(), 2, 4, 0.f);
  EXPECT_EQ(F(y), (std::vector<float>{1, 2, 0.5f, 1, -1, 2, -0.5f, 1}));
}

TEST(RefKernels, AddRmsnormWritesTheRoundedSumAndItsNorm) {
  auto a = B({1, 1, 1, 1}), b = B({1, 1, 1, 1});
  auto g = B({1, 1, 1, 1});
  std::vector<bf16> s(4), n(4);
  ref::add_rmsnorm(a.data(), b.data(), g.data(), s.data(), n.data(), 1, 4, 0.f);
  EXPECT_EQ(F(s), (std::vector<float>{2, 2, 2, 2}));
  EXPECT_EQ(F(n), (std::vector<float>{1, 1, 1, 1}));
}

TEST(RefKernels, EmbedAddsThePositionRowAndClampsBadTokens) {
  auto emb = B({1, 2, 10, 20, 100, 20});          // vocab 3, hidden 2 (sums exact in bf16)
  auto pos_table = B({0, 0, 0.5f, 0.25f});        // 2 positions
  std::vector<std::int32_t> seq = {9, 2, 7, 77};  // [2][2]: rows read position 1 -> tokens 2 and 77 (bad)
  std::int32_t pos = 1;
  std::vector<bf16> out(4);
  ref::embed(seq.data(), 2, &pos, emb.data(), 3, pos_table.data(), out.data(), 2, 2);
  EXPECT_EQ(F(out), (std::vector<float>{100.5f, 20.25f, 1.5f, 2.25f}));
}

TEST(RefKernels, AttentionAtPositionZeroReturnsV) {
  const int D = 2, S = 4;
  auto qkv = B({1, 1, 0.5f, -1, 3, 7});  // q, k, v
  std::vector<bf16> kc(S * D), vc(S * D), out(D);
  std::int32_t pos = 0;
  ref::attention_decode(qkv.data(), kc.data(), vc.data(), &pos, out.data(), 1, D, S);
  EXPECT_EQ(F(out), (std::vector<float>{3, 7}));
  EXPECT_EQ(kc[0].to_float(), 0.5f);
  EXPECT_EQ(vc[1].to_float(), 7.f);
}

TEST(RefKernels, AttentionAveragesEqualScoresAndIsCausal) {
  const int D = 2, S = 4;
  std::vector<bf16> kc(S * D, bf16::from_float(0)), vc(S * D, bf16::from_float(0));
  // Position 0 holds k = 0, v = (2, 4); position 2 (the future) holds a huge v that must not count.
  vc[0] = bf16::from_float(2);
  vc[1] = bf16::from_float(4);
  vc[4] = bf16::from_float(1000);
  auto qkv = B({1, 1, 0, 0, 4, 8});  // at position 1: k = 0 (same score as position 0), v = (4, 8)
  std::int32_t pos = 1;
  std::vector<bf16> out(D);
  ref::attention_decode(qkv.data(), kc.data(), vc.data(), &pos, out.data(), 1, D, S);
  EXPECT_EQ(F(out), (std::vector<float>{3, 6}));
}

TEST(RefKernels, RouterPicksTopKRenormalisedTiesToLowerIndex) {
  std::vector<float> logits = {0.f, 2.f,  1.f,  2.f,  // tie between 1 and 3
                               5.f, -1.f, -1.f, -1.f};
  std::vector<std::int32_t> idx(4);
  std::vector<float> w(4);
  ref::router_topk(logits.data(), 2, 4, 2, idx.data(), w.data());
  EXPECT_EQ(idx, (std::vector<std::int32_t>{1, 3, 0, 1}));
  EXPECT_FLOAT_EQ(w[0], 0.5f);
  EXPECT_FLOAT_EQ(w[1], 0.5f);
  EXPECT_FLOAT_EQ(w[2] + w[3], 1.f);
  EXPECT_NEAR(w[2], std::exp(5.f) / (std::exp(5.f) + std::exp(-1.f)), 1e-6);
}

TEST(RefKernels, RouterNeverPicksNaNFirst) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> logits = {nan, 1.f, nan, 0.f};
  std::vector<std::int32_t> idx(2);
  std::vector<float> w(2);
  ref::router_topk(logits.data(), 1, 4, 2, idx.data(), w.data());
  EXPECT_EQ(idx, (std::vector<std::int32_t>{1, 3}));
}

TEST(RefKernels, SiluMul) {
  auto in = B({0, 1, 2, 3});  // gate (0, 1), up (2, 3)
  std::vector<bf16> out(2);
  ref::silu_mul(in.data(), out.data(), 1, 2);
  EXPECT_EQ(out[0].to_float(), 0.f);
  EXPECT_EQ(out[1].bits, bf16::from_float(1.f / (1.f + std::exp(-1.f)) * 3.f).bits);
}

TEST(RefKernels, ExpertPointersFollowTheRouting) {
  const int top_k = 2, count = 4, latent = 3, inter = 5, experts = 3;
  std::vector<std::int32_t> idx = {2, 0, 1, 9};  // 9 is out of range: expert 0
  std::vector<bf16> w(100), x(2 * latent), gu(count * 2 * inter), act(count * inter), y(count * latent);
  const bf16* gut[] = {w.data() + 0, w.data() + 10, w.data() + 20};
  const bf16* dnt[] = {w.data() + 30, w.data() + 40, w.data() + 50};
  std::vector<const bf16*> a(count), b(count), d(count), e(count);
  std::vector<bf16*> c(count), f(count);
  ExpertPointers p{a.data(), b.data(), c.data(), d.data(), e.data(), f.data()};
  ref::expert_pointers(idx.data(), count, top_k, gut, dnt, experts, x.data(), latent, gu.data(), inter, act.data(),
                       y.data(), p);
  EXPECT_EQ(a[3], x.data() + latent);  // entry 3 is token 1
  EXPECT_EQ(b[0], gut[2]);
  EXPECT_EQ(b[3], gut[0]);
  EXPECT_EQ(e[2], dnt[1]);
  EXPECT_EQ(c[1], gu.data() + 2 * inter);
  EXPECT_EQ(d[2], act.data() + 2 * inter);
  EXPECT_EQ(f[3], y.data() + 3 * latent);
}

TEST(RefKernels, ArgmaxNextWritesAfterThePromptOnly) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> logits = {1,   5,   5,   0,     // tie: first maximum (1)
                               nan, nan, nan, nan};  // all NaN: 0
  std::vector<std::int32_t> seq(2 * 4, -1);
  std::int32_t pos = 0, prompt_len = 2;
  ref::argmax_next(logits.data(), 2, 4, seq.data(), 4, &pos, &prompt_len);
  EXPECT_EQ(seq, std::vector<std::int32_t>(8, -1)) << "inside the prompt nothing is written";
  pos = 1;
  ref::argmax_next(logits.data(), 2, 4, seq.data(), 4, &pos, &prompt_len);
  EXPECT_EQ(seq[2], 1);
  EXPECT_EQ(seq[6], 0);
  pos = 3;  // next position 4 is past the sequence: nothing written
  ref::argmax_next(logits.data(), 2, 4, seq.data(), 4, &pos, &prompt_len);
  ref::advance(&pos);
  EXPECT_EQ(pos, 4);
}

TEST(RefKernels, TouchWritesEveryWordAndSumsThem) {
  std::vector<std::uint64_t> a(1000, 0), b(1000, 0);
  auto s1 = ref::touch(a.data(), a.size() * 8, 7);
  auto s2 = ref::touch(b.data(), b.size() * 8, 7);
  EXPECT_EQ(s1, s2);
  EXPECT_EQ(a, b);
  std::uint64_t sum = 0;
  for (auto v : a) sum += v;
  EXPECT_EQ(sum, s1);
  EXPECT_NE(ref::touch(b.data(), b.size() * 8, 8), s1);
}

}  // namespace
}  // namespace torpor::kernels
