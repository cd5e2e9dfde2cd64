// A gtest program for ctest.suites_self_test (tests/tools/check_gtest_suites.py), which turns it
// into ctest entries by suite (tests/support/gtest_suites.cmake) and checks how ctest reports
// them. Not discovered as tests itself: Mixed.FailsWhenProbed fails when TORPOR_SUITES_PROBE=1.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string_view>

namespace {

bool probed() {
  const char* v = std::getenv("TORPOR_SUITES_PROBE");
  return v != nullptr && std::string_view(v) == "1";
}

// One test skips, one fails: the entry must fail, not be reported skipped.
TEST(Mixed, Skips) { GTEST_SKIP() << "skipped on purpose"; }
TEST(Mixed, FailsWhenProbed) { EXPECT_FALSE(probed()) << "failing on purpose (TORPOR_SUITES_PROBE=1)"; }

// Every test skips: the entry is reported skipped.
TEST(AllSkip, One) { GTEST_SKIP() << "skipped on purpose"; }
TEST(AllSkip, Two) { GTEST_SKIP() << "skipped on purpose"; }

// Seven tests: split into two entries at six a piece, each test in exactly one.
TEST(Many, T1) { SUCCEED(); }
TEST(Many, T2) { SUCCEED(); }
TEST(Many, T3) { SUCCEED(); }
TEST(Many, T4) { SUCCEED(); }
TEST(Many, T5) { SUCCEED(); }
TEST(Many, T6) { SUCCEED(); }
TEST(Many, T7) { SUCCEED(); }

}  // namespace
