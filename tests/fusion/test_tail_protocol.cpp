// The pieces of the tail protocol that both the kernels and the CPU reference rely on
// (kernels/include/torpor/kernels/tail_protocol.hpp): the reduce-scatter split and its inverse,
// bf16 rounding as the IEEE definition gives it (and as the host type does), the sentinel and its
// sanitising, the slot layout, and the fixed reduction tree of the row's sum of squares.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>

#include "tail_oracle.hpp"
#include "tail_support.hpp"
#include "torpor/fusion/tail.hpp"
#include "torpor/kernels/tail_protocol.hpp"
#include "torpor/kernels/tail_reference.hpp"

namespace torpor::test {
namespace {

using namespace torpor::kernels;

TEST(TailProtocol, TokenShareCoversEveryRowOnceAndOwnerIsItsInverse) {
  for (int ranks = 1; ranks <= 16; ++ranks)
    for (int tokens = 1; tokens <= 300; ++tokens) {
      int next = 0;
      for (int r = 0; r < ranks; ++r) {
        const fusion::TokenRange share = fusion::token_share(tokens, r, ranks);
        ASSERT_EQ(share.begin, next) << tokens << " tokens, rank " << r << " of " << ranks;
        ASSERT_GE(share.count(), tokens >= ranks ? 1 : 0) << "every rank gets a row when there are enough";
        ASSERT_LE(share.count(), (tokens + ranks - 1) / ranks);
        for (int t = share.begin; t < share.end; ++t) ASSERT_EQ(tail_token_owner(t, tokens, ranks), r);
        next = share.end;
      }
      ASSERT_EQ(next, tokens);
    }
}

TEST(TailProtocol, ReceiveRowsGiveEveryRankARowFromEverySourceEachCall) {
  // Invariant I3 needs it: every rank hears from every source in every call.
  for (bool rs : {false, true})
    for (bool mc : {false, true})
      for (int ranks = 2; ranks <= 16; ++ranks)
        for (int tokens = 1; tokens <= 40; ++tokens)
          for (int r = 0; r < ranks; ++r) {
            TailParams p;
            p.tokens = tokens;
            p.ranks = ranks;
            p.rank = r;
            p.reduce_scatter = rs;
            p.multicast = mc;
            const TailRows recv = tail_receive_rows(p);
            ASSERT_GE(recv.count(), 1);
            for (int t = 0; t < tokens; ++t) ASSERT_EQ(tail_receives(p, r, t), recv.contains(t));
            const TailRows out = tail_output_rows(p);
            ASSERT_TRUE(out.count() == 0 || (recv.contains(out.begin) && recv.contains(out.end - 1)));
          }
}

// The tail's rounding (tail_float_to_bf16, which the CPU reference uses and the GPU's
// cvt.rn.bf16x2 path must equal, see GpuTail.Bf16RoundingOfEveryFloatIsTheIeeeDefinitions) and the
// host bf16 type's, against rounding from the IEEE definition (tail_oracle.hpp: the nearer of the
// two bf16 neighbours, ties to even). Every upper half of the float with the lower halves where
// rounding turns (just below, at and just above the halfway point, both parities, the extremes),
// then a million random floats, then the edge cases by name. NaN: the tail gives the canonical
// 0x7FFF; the host type keeps the sign and the top of the payload and makes it quiet.
std::uint16_t host_type_nan(std::uint32_t u) { return static_cast<std::uint16_t>((u >> 16) | 0x40); }

void expect_ieee_rounding(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  ASSERT_EQ(tail_float_to_bf16(x), ieee_bf16(u)) << std::hex << "float bits 0x" << u;
  ASSERT_EQ(bf16::from_float(x).bits, ieee_bf16(u, host_type_nan(u))) << std::hex << "float bits 0x" << u;
}

TEST(TailProtocol, Bf16RoundingIsTheIeeeDefinitions) {
  const std::uint32_t lows[] = {0x0000, 0x0001, 0x3FFF, 0x4000, 0x7FFE, 0x7FFF, 0x8000,
                                0x8001, 0x8002, 0xBFFF, 0xC000, 0xFFFE, 0xFFFF};
  for (std::uint32_t high = 0; high <= 0xFFFFu; ++high)
    for (std::uint32_t low : lows) expect_ieee_rounding((high << 16) | low);
  Rng rng{7};
  for (int i = 0; i < 1000000; ++i) expect_ieee_rounding(static_cast<std::uint32_t>(rng.next()));
  // By name: signed zeros, the smallest subnormals (and halfway below them), the largest finite
  // float (rounds up to inf), the largest bf16 and the halfway point above it (a tie towards the
  // even significand: inf), the ties either side of 1.0, infinities, NaNs.
  const std::pair<std::uint32_t, std::uint16_t> named[] = {{0x00000000u, 0x0000}, {0x80000000u, 0x8000},
                                                           {0x00010000u, 0x0001}, {0x00008000u, 0x0000},
                                                           {0x00018000u, 0x0002}, {0x80008001u, 0x8001},
                                                           {0x7F7FFFFFu, 0x7F80}, {0x7F7F0000u, 0x7F7F},
                                                           {0x7F7F8000u, 0x7F80}, {0x7F7F7FFFu, 0x7F7F},
                                                           {0x3F808000u, 0x3F80}, {0x3F818000u, 0x3F82},
                                                           {0x7F800000u, 0x7F80}, {0xFF800000u, 0xFF80},
                                                           {0x7FC00000u, 0x7FFF}, {0xFFC00001u, 0x7FFF},
                                                           {0x7F800001u, 0x7FFF}};
  for (auto [u, want] : named) {
    float x;
    std::memcpy(&x, &u, 4);
    EXPECT_EQ(tail_float_to_bf16(x), want) << std::hex << "float bits 0x" << u;
    EXPECT_EQ(ieee_bf16(u), want) << std::hex << "the oracle itself, float bits 0x" << u;
  }
  for (std::uint32_t b = 0; b <= 0xFFFFu; ++b) {  // widening is exact: the bits move up
    const float a = tail_bf16_to_float(static_cast<std::uint16_t>(b));
    const float c = bf16::from_bits(static_cast<std::uint16_t>(b)).to_float();
    const std::uint32_t want = b << 16;
    ASSERT_EQ(std::memcmp(&a, &want, 4), 0) << std::hex << b;
    ASSERT_EQ(std::memcmp(&c, &want, 4), 0) << std::hex << b;
  }
}

TEST(TailProtocol, SanitiseTurnsOnlyTheSentinelIntoPositiveZero) {
  EXPECT_EQ(tail_sentinel, bf16_negative_zero.bits);
  for (std::uint32_t b = 0; b <= 0xFFFF; ++b) {
    const auto s = tail_sanitize(static_cast<std::uint16_t>(b));
    EXPECT_EQ(s, b == 0x8000 ? 0u : b);
    EXPECT_NE(s, tail_sentinel);
  }
  EXPECT_TRUE(tail_word_has_sentinel(0x80001234u));
  EXPECT_TRUE(tail_word_has_sentinel(0x12348000u));
  EXPECT_FALSE(tail_word_has_sentinel(0x00000000u));
  EXPECT_FALSE(tail_word_has_sentinel(0x80018001u));  // the smallest negative denormals are data
  EXPECT_FALSE(tail_word_has_sentinel(0x7FC07FC0u));  // NaN is data too
}

// tail_word_has_sentinel is a borrow trick; it must agree with comparing each half, for every
// value of one half against edge values of the other (where a borrow could leak across).
TEST(TailProtocol, SentinelCheckMatchesComparingEachHalf) {
  const std::uint32_t edges[] = {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu, 0x7F80u, 0xFF80u};
  auto plain = [](std::uint32_t w) { return (w & 0xFFFFu) == tail_sentinel || (w >> 16) == tail_sentinel; };
  int with_sentinel = 0;
  for (std::uint32_t half = 0; half <= 0xFFFFu; ++half)
    for (std::uint32_t edge : edges)
      for (std::uint32_t w : {half | (edge << 16), edge | (half << 16)}) {
        ASSERT_EQ(tail_word_has_sentinel(w), plain(w)) << std::hex << w;
        with_sentinel += plain(w) ? 1 : 0;
      }
  EXPECT_GT(with_sentinel, 0);
  std::uint64_t x = 0x9E3779B97F4A7C15ull;  // and a spread of arbitrary words
  for (int i = 0; i < 1000000; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    const auto w = static_cast<std::uint32_t>(x);
    ASSERT_EQ(tail_word_has_sentinel(w), plain(w)) << std::hex << w;
  }
}

TEST(TailProtocol, SlotLayoutIsDenseAndDisjoint) {
  const int ranks = 3, max_tokens = 5, hidden = 64;
  std::set<std::size_t> seen;
  for (int slot = 0; slot < tail_slot_count; ++slot)
    for (int src = 0; src < ranks; ++src)
      for (int row = 0; row < max_tokens; ++row)
        for (int col = 0; col < hidden; ++col)
          ASSERT_TRUE(seen.insert(tail_slot_offset(slot, src, row, col, ranks, max_tokens, hidden)).second);
  EXPECT_EQ(seen.size() * sizeof(bf16), tail_slot_bytes(ranks, max_tokens, hidden));
  EXPECT_EQ(*seen.rbegin() + 1, seen.size());
}

// The tree: tail_row_lanes lanes, lane j sums vectors j, j + lanes, ...; xor butterfly per warp; warps in
// order. Checked against an independent simulation of the GPU's shuffles, and against fp64.
TEST(TailProtocol, SumOfSquaresFollowsTheGpuTree) {
  for (int hidden : {64, 512, 2048, 7168, 8192}) {
    Rng rng{static_cast<std::uint64_t>(hidden)};
    std::vector<float> x(static_cast<std::size_t>(hidden));
    for (auto& v : x) v = tail_bf16_to_float(tail_float_to_bf16(rng.uniform(-3.0f, 3.0f)));
    // Simulate the block: per-lane sums, then 5 rounds of __shfl_xor on every lane at once.
    std::vector<float> lanes(tail_row_lanes, 0.0f);
    const int vectors = hidden / 8;
    for (int j = 0; j < tail_row_lanes; ++j)
      for (int v = j; v < vectors; v += tail_row_lanes)
        for (int e = 0; e < 8; ++e) lanes[j] = lanes[j] + x[v * 8 + e] * x[v * 8 + e];
    for (int m = 16; m >= 1; m /= 2) {
      std::vector<float> next(lanes.size());
      for (std::size_t i = 0; i < lanes.size(); ++i) next[i] = lanes[i] + lanes[i ^ static_cast<std::size_t>(m)];
      lanes = next;
    }
    for (std::size_t i = 0; i < lanes.size(); ++i)
      ASSERT_EQ(lanes[i], lanes[i & ~std::size_t{31}]) << "every lane of a warp agrees";
    float total = lanes[0];
    for (int w = 1; w < tail_row_lanes / 32; ++w) total = total + lanes[static_cast<std::size_t>(w) * 32];
    EXPECT_EQ(reference_sum_squares(x.data(), hidden), total) << hidden;
    double exact = 0;
    for (float v : x) exact += static_cast<double>(v) * v;
    EXPECT_NEAR(total, exact, exact * 1e-5) << hidden;
  }
}

}  // namespace
}  // namespace torpor::test
