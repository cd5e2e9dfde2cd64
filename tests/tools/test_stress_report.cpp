// `torpor stress`'s verdict from rank rows: every way a run can be wrong must make it fail, and a
// clean run must pass. Rows are written by hand here; the CLI tests run the real plan.
#include <gtest/gtest.h>

#include "stress/stress_report.hpp"

namespace torpor::cli {
namespace {

nlohmann::json row(const std::string& step, int level, int matching, std::size_t live = 100, std::size_t store = 10,
                   const std::string& kind = "plan", int cycle = 0) {
  nlohmann::json r = {{"step", step},
                      {"kind", kind},
                      {"level", level},
                      {"offloaded", 5},
                      {"skipped", 1},
                      {"discarded", 7},
                      {"released", 8},
                      {"returned", 8},
                      {"sleep_s", 0.5},
                      {"wake_s", 0.25},
                      {"matching", matching},
                      {"prompts", 16},
                      {"mismatched_tokens", matching == 16 ? 0 : 3},
                      {"live_physical", live},
                      {"host_store", store},
                      {"mapped", 100}};
  if (cycle) r["cycle"] = cycle;
  return r;
}

RankOutcome rank(int r, std::vector<nlohmann::json> steps, const std::string& digest = "abc") {
  RankOutcome o;
  o.rank = r;
  o.ok = true;
  o.result = {{"rank", r},
              {"steps", steps},
              {"reference_digest", digest},
              {"tail_paths", {"fused_unicast", "fused_unicast"}},
              {"tail_reasons", {"fused unicast: multicast disabled", "fused unicast: multicast disabled"}},
              {"fused_runners", 2},
              {"runners", 2},
              {"backend", "host"}};
  return o;
}

std::vector<nlohmann::json> plan_rows() {
  return {row("generate", 0, 16), row("generate again", 0, 16), row("sleep 1", 1, 16), row("sleep 2 #1", 2, 16),
          row("sleep 2 #2", 2, 16)};
}

StressExpectations expect(int ranks, int cycles = 0) {
  StressExpectations e;
  e.ranks = ranks;
  e.cycles = cycles;
  e.soak_patterns = 2;
  return e;
}

TEST(StressReport, CleanRunPassesAndSumsBytesOverRanks) {
  LaunchResult l;
  l.backend = "host";
  l.ranks = {rank(0, plan_rows()), rank(1, plan_rows())};
  auto s = summarize(l, expect(2));
  EXPECT_TRUE(s.pass) << ::testing::PrintToString(s.problems);
  EXPECT_EQ(s.json["steps"][3]["offloaded"], 10);
  EXPECT_EQ(s.json["steps"][3]["released"], 16);
  EXPECT_EQ(s.json["steps"][3]["matching"], 16);
  std::string text = render(s);
  EXPECT_NE(text.find("PASS"), std::string::npos);
  EXPECT_NE(text.find("2/2 runners fused"), std::string::npos);
  EXPECT_NE(text.find("16/16"), std::string::npos);
}

TEST(StressReport, OneMismatchedPromptOnOneRankFails) {
  LaunchResult l;
  auto bad = plan_rows();
  bad[4] = row("sleep 2 #2", 2, 15);
  l.ranks = {rank(0, plan_rows()), rank(1, bad)};
  auto s = summarize(l, expect(2));
  EXPECT_FALSE(s.pass);
  ASSERT_EQ(s.problems.size(), 1u);
  EXPECT_NE(s.problems[0].find("rank 1: 15/16 prompts"), std::string::npos) << s.problems[0];
  EXPECT_EQ(s.json["steps"][4]["matching"], 15);
  EXPECT_NE(render(s).find("FAIL"), std::string::npos);
}

TEST(StressReport, RanksDecodingDifferentTokensFail) {
  LaunchResult l;
  l.ranks = {rank(0, plan_rows(), "aaa"), rank(1, plan_rows(), "bbb")};
  auto s = summarize(l, expect(2));
  EXPECT_FALSE(s.pass);
  EXPECT_NE(s.problems.at(0).find("different tokens"), std::string::npos);
}

TEST(StressReport, AFailedRankFailsAndTheSameErrorIsSaidOnce) {
  LaunchResult l;
  l.ranks = {rank(0, plan_rows()), rank(1, plan_rows())};
  for (auto& r : l.ranks) {
    r.ok = false;
    r.error = "step 'x': rank 1: tail timed out";
  }
  auto s = summarize(l, expect(2));
  EXPECT_FALSE(s.pass);
  ASSERT_EQ(s.problems.size(), 1u);
  EXPECT_EQ(s.problems[0], "ranks 0,1: step 'x': rank 1: tail timed out");
}

TEST(StressReport, MissingRanksFail) {
  LaunchResult l;
  l.ranks = {rank(0, plan_rows())};
  EXPECT_FALSE(summarize(l, expect(2)).pass);
}

TEST(StressReport, SoakGrowthAfterWarmupFailsButWarmupGrowthDoesNot) {
  auto rows = plan_rows();
  // Warm-up (2 patterns): the host store grows from 10 to 20 on the second pattern: allowed.
  rows.push_back(row("soak 1", 1, 16, 100, 10, "soak", 1));
  rows.push_back(row("soak 2", 2, 16, 100, 20, "soak", 2));
  for (int c = 3; c <= 6; ++c) rows.push_back(row("soak", 1, 16, 100, 20, "soak", c));
  LaunchResult ok;
  ok.ranks = {rank(0, rows)};
  auto s = summarize(ok, expect(1, 6));
  EXPECT_TRUE(s.pass) << ::testing::PrintToString(s.problems);
  EXPECT_EQ(s.json["per_rank"][0]["soak_growth"]["host_store"]["max"], 20);

  auto grown = rows;
  grown[8] = row("soak", 1, 16, 164, 20, "soak", 4);  // live physical bytes grow at cycle 4
  LaunchResult bad;
  bad.ranks = {rank(0, grown)};
  auto b = summarize(bad, expect(1, 6));
  EXPECT_FALSE(b.pass);
  ASSERT_EQ(b.problems.size(), 1u);
  EXPECT_NE(b.problems[0].find("live physical bytes grew from 100"), std::string::npos) << b.problems[0];
  EXPECT_NE(b.problems[0].find("cycle 4"), std::string::npos) << b.problems[0];
}

// A rank that failed in the middle of a soak step (a tail that timed out) returns its rows so far;
// the failed row lacks what the step would have measured after the failure. The verdict names the
// failure and the table renders: nothing reads a row past the keys it has (a const operator[] on
// a missing key is undefined behaviour; in a 1000-cycle soak under load it surfaced as "type must
// be number, but is number" instead of the rank's error).
TEST(StressReport, ARankThatFailedMidSoakIsReportedFromItsPartialRows) {
  auto rows = plan_rows();
  for (int c = 1; c <= 4; ++c) rows.push_back(row("soak", 1, 16, 100, 10, "soak", c));
  nlohmann::json failed = {{"step", "soak 5: L1 all"},
                           {"kind", "soak"},
                           {"level", 1},
                           {"cycle", 5},
                           {"pattern", "L1 all"},
                           {"sleep_s", 0.5},
                           {"error", "rank 1: tail timed out"}};
  rows.push_back(failed);
  LaunchResult l;
  l.ranks = {rank(0, rows), rank(1, rows)};
  for (auto& r : l.ranks) {
    r.ok = false;
    r.error = "step 'soak 5: L1 all': rank 1: tail timed out";
  }
  StressSummary s;
  ASSERT_NO_THROW(s = summarize(l, expect(2, 5)));
  EXPECT_FALSE(s.pass);
  ASSERT_FALSE(s.problems.empty());
  EXPECT_EQ(s.problems[0], "ranks 0,1: step 'soak 5: L1 all': rank 1: tail timed out");
  EXPECT_EQ(s.json["per_rank"][0]["soak_growth"]["host_store"]["max"], 10) << "the cycles before the failure";
  std::string table;
  ASSERT_NO_THROW(table = render(s));
  EXPECT_NE(table.find("ERROR"), std::string::npos) << table;
}

TEST(StressReport, OnCudaExactlyOneGraphPerRank) {
  LaunchResult l;
  l.ranks = {rank(0, plan_rows()), rank(1, plan_rows())};
  l.ranks[0].result["graphs"] = {{"captured", 1}, {"replays", 300}, {"eager_steps", 1}};
  l.ranks[1].result["graphs"] = {{"captured", 2}, {"replays", 300}, {"eager_steps", 2}};
  auto e = expect(2);
  e.graphs = true;
  auto s = summarize(l, e);
  EXPECT_FALSE(s.pass);
  ASSERT_EQ(s.problems.size(), 1u);
  EXPECT_NE(s.problems[0].find("rank 1: 2 CUDA graphs captured"), std::string::npos) << s.problems[0];
  e.graphs = false;  // the host backend has no graphs to count
  EXPECT_TRUE(summarize(l, e).pass);
}

// A transition row as stress_plan writes it on a GPU: the device memory split awake, asleep and
// after wake, what stayed outside the pool while asleep, CUDA's graph allocator bytes.
nlohmann::json with_memory(nlohmann::json r, long long outside, std::size_t graph_allocator = 0) {
  auto split = [&](std::size_t used, std::size_t mapped) {
    return nlohmann::json{{"used", used},
                          {"torpor_mapped", mapped},
                          {"graph_allocator", graph_allocator},
                          {"other", static_cast<long long>(used - mapped - graph_allocator)}};
  };
  r["outside_torpor"] = outside;
  r["graph_allocator_asleep"] = graph_allocator;
  r["memory"] = {{"awake", split(1000, 700)}, {"asleep", split(300 + outside, 0)}, {"woken", split(1000, 700)}};
  return r;
}

TEST(StressReport, MemoryOutsideThePoolWhileAsleepIsReportedPerRankAndSummedPerStep) {
  LaunchResult l;
  l.backend = "cuda";
  auto rows = plan_rows();
  rows[2] = with_memory(rows[2], 0);
  rows[3] = with_memory(rows[3], 64);
  rows[4] = with_memory(rows[4], 32);
  auto leaky = rows;
  leaky[3] = with_memory(leaky[3], 4096);
  l.ranks = {rank(0, rows), rank(1, leaky)};
  l.ranks[0].result["context_bytes"] = 300;
  l.ranks[1].result["context_bytes"] = 300;
  auto s = summarize(l, expect(2));
  EXPECT_TRUE(s.pass) << ::testing::PrintToString(s.problems);  // reported, not judged
  EXPECT_EQ(s.json["steps"][3]["outside_torpor"], 64 + 4096);
  const auto& m1 = s.json["per_rank"][1]["memory"];
  EXPECT_EQ(m1["context_bytes"], 300);
  EXPECT_EQ(m1["outside_torpor_asleep"]["min"], 0);
  EXPECT_EQ(m1["outside_torpor_asleep"]["max"], 4096);
  ASSERT_EQ(m1["transitions"].size(), 2u) << "the first transition of each level";
  EXPECT_EQ(m1["transitions"][1]["level"], 2);
  EXPECT_EQ(m1["transitions"][1]["asleep"]["used"], 300 + 4096);
  const std::string text = render(s);
  EXPECT_NE(text.find("rank 1: device memory in use = torpor mapped + CUDA graph allocator + other"), std::string::npos)
      << text;
  EXPECT_NE(text.find("outside torpor while asleep, every transition: 0 B..4.00 KiB"), std::string::npos) << text;
}

TEST(StressReport, GraphAllocatorBytesWhileAsleepFail) {
  LaunchResult l;
  l.backend = "cuda";
  auto rows = plan_rows();
  rows[2] = with_memory(rows[2], 0);
  auto bad = plan_rows();
  bad[2] = with_memory(bad[2], 2 << 20, 2 << 20);
  l.ranks = {rank(0, rows), rank(1, bad)};
  auto s = summarize(l, expect(2));
  EXPECT_FALSE(s.pass);
  EXPECT_NE(render(s).find("rank 1: CUDA's graph allocator held 2.00 MiB while asleep"), std::string::npos)
      << render(s);
}

TEST(StressReport, NegativeControlNeverPasses) {
  LaunchResult l;
  l.ranks = {rank(0, plan_rows()), rank(1, plan_rows())};
  auto e = expect(2);
  e.negative_control = true;
  auto s = summarize(l, e);
  EXPECT_FALSE(s.pass);
  EXPECT_NE(s.problems.at(0).find("negative control"), std::string::npos);

  for (auto& r : l.ranks) {
    r.ok = false;
    r.error = "step 'sleep 2 #1': rank 1: timeout in the tail";
    r.result["negative_control"] = {{"rank", 1}, {"seconds_to_failure", 2.5}, {"wait_timeout_ms", 2000}};
  }
  auto f = summarize(l, e);
  EXPECT_FALSE(f.pass);
  EXPECT_NE(render(f).find("the tail state of rank 1 was zeroed"), std::string::npos) << render(f);
}

}  // namespace
}  // namespace torpor::cli
