// Seeded dummy weights: element-wise reproducible, shard-independent, versioned by updates.
#include <gtest/gtest.h>

#include <set>

#include "torpor/fusion/weights.hpp"

namespace torpor::fusion {
namespace {

TEST(Weights, SameVersionSameValueDifferentVersionOrNameDiffers) {
  WeightVersion v;
  auto h = weight_name_hash("layers.0.moe.up");
  EXPECT_EQ(weight_value(v, h, 17), weight_value(v, h, 17));
  EXPECT_NE(weight_value(v, h, 17), weight_value(v, h, 18));
  EXPECT_NE(weight_value(v, h, 17), weight_value(v, weight_name_hash("layers.1.moe.up"), 17));
  WeightVersion other = v;
  other.seed = v.seed + 1;
  EXPECT_NE(weight_value(v, h, 17), weight_value(other, h, 17));
}

TEST(Weights, UpdatesPerturbByASmallSeededStep) {
  WeightVersion v0, v1, v2;
  v1.update_seed = v2.update_seed = 9;
  v1.updates = 1;
  v2.updates = 2;
  auto h = weight_name_hash("lm_head");
  int changed = 0;
  for (int i = 0; i < 1000; ++i) {
    float a = weight_value(v0, h, i), b = weight_value(v1, h, i), c = weight_value(v2, h, i);
    EXPECT_LE(std::abs(b - a), v1.update_scale + 1e-6f);
    EXPECT_LE(std::abs(c - a), v2.update_scale + 1e-6f) << "a version perturbs the base, not the last version";
    EXPECT_LE(std::abs(c - b), 2 * v2.update_scale + 1e-6f);
    changed += (a != b) + (b != c);
  }
  EXPECT_GT(changed, 1900);
}

TEST(Weights, UniformCoversMinusOneToOne) {
  float lo = 1, hi = -1;
  double sum = 0;
  for (int i = 0; i < 100000; ++i) {
    float u = weight_uniform(1, 2, static_cast<std::uint64_t>(i));
    ASSERT_GE(u, -1.f);
    ASSERT_LT(u, 1.f);
    lo = std::min(lo, u);
    hi = std::max(hi, u);
    sum += u;
  }
  EXPECT_LT(lo, -0.999f);
  EXPECT_GT(hi, 0.999f);
  EXPECT_NEAR(sum / 100000, 0.0, 0.01);
}

TEST(Weights, PromptsAreDeterministicInRangeAndVaried) {
  auto a = make_prompts(5, 16, 8, 512), b = make_prompts(5, 16, 8, 512), c = make_prompts(6, 16, 8, 512);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  std::set<std::int32_t> distinct(a.begin(), a.end());
  EXPECT_GT(distinct.size(), 64u);
  for (auto t : a) {
    EXPECT_GE(t, 0);
    EXPECT_LT(t, 512);
  }
}

}  // namespace
}  // namespace torpor::fusion
