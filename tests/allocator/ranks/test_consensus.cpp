// The consensus helper (consensus.hpp) over the in-process thread Group: one thread per rank.
// The oracles are the inputs each test gives its ranks (which rank asks for what, which rank
// fails with which type), never the helper's own output. Suites whose name contains "Threads"
// run under TSan.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "torpor/consensus.hpp"
#include "torpor/error.hpp"
#include "torpor/group.hpp"

namespace torpor::test {
namespace {

using namespace std::chrono_literals;
namespace cs = torpor::consensus;

// Runs fn(rank, group) on one thread per rank over one thread group; each rank's exception as
// "<kind>|<what>" ("" when none), kind naming the most derived of the types we throw.
std::vector<std::string> on_ranks(int n, const std::function<void(int, Group&)>& fn) {
  GroupOptions o;
  o.timeout = 20s;
  auto groups = make_thread_group(n, o);
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      auto& e = errors[static_cast<std::size_t>(r)];
      try {
        fn(r, *groups[static_cast<std::size_t>(r)]);
      } catch (const invalid_argument& x) {
        e = std::string("invalid_argument|") + x.what();
      } catch (const invalid_state& x) {
        e = std::string("invalid_state|") + x.what();
      } catch (const out_of_memory& x) {
        e = std::string("out_of_memory|") + x.what();
      } catch (const timeout_error& x) {
        e = std::string("timeout|") + x.what();
      } catch (const error& x) {
        e = std::string("error|") + x.what();
      } catch (const std::exception& x) {
        e = std::string("std|") + x.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(ConsensusThreads, AgreeingRanksGetEveryRanksExtraIndexedByRank) {
  const int n = 4;
  std::vector<std::vector<std::string>> seen(n);
  auto errors = on_ranks(n, [&](int r, Group& g) {
    seen[static_cast<std::size_t>(r)] = cs::agree(g, "op", "sleep level 1", "extra of " + std::to_string(r));
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
    ASSERT_EQ(seen[static_cast<std::size_t>(r)].size(), static_cast<std::size_t>(n));
    for (int q = 0; q < n; ++q)
      EXPECT_EQ(seen[static_cast<std::size_t>(r)][static_cast<std::size_t>(q)], "extra of " + std::to_string(q));
  }
}

TEST(ConsensusThreads, MismatchThrowsInvalidArgumentOnEveryRankNamingTheRanksThatDiffer) {
  const int n = 4;
  std::atomic<int> acted{0};
  auto errors = on_ranks(n, [&](int r, Group& g) {
    // Ranks 1 and 3 ask for another request; rank 2 agrees with rank 0 though its extra differs.
    const std::string request = (r == 1 || r == 3) ? "sleep level 2" : "sleep level 1";
    cs::agree(g, "collective_op", request, std::to_string(r));
    ++acted;
  });
  EXPECT_EQ(acted.load(), 0);
  for (int r = 0; r < n; ++r) {
    const std::string& e = errors[static_cast<std::size_t>(r)];
    EXPECT_TRUE(e.starts_with("invalid_argument|")) << e;
    EXPECT_TRUE(contains(e, "rank(s) [1, 3] asked for another operation than rank 0")) << e;
    EXPECT_TRUE(contains(e, "rank 0: sleep level 1; rank 1: sleep level 2; rank 3: sleep level 2")) << e;
    EXPECT_TRUE(contains(e, "collective_op on group rank " + std::to_string(r) + " of 4")) << e;
  }
}

TEST(ConsensusThreads, CompareRequestsTellsSeparatorsInsideFieldsApart) {
  // ("a", "b:c") and ("a:b", "c") must not look alike on the wire.
  const int n = 2;
  std::vector<cs::Agreement> seen(n);
  auto errors = on_ranks(n, [&](int r, Group& g) {
    seen[static_cast<std::size_t>(r)] =
        r == 0 ? cs::compare_requests(g, "1:a", "b") : cs::compare_requests(g, "1:", "ab");
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(errors[static_cast<std::size_t>(r)], "");
    EXPECT_EQ(seen[static_cast<std::size_t>(r)].differing, std::vector<int>{1});
    EXPECT_EQ(seen[static_cast<std::size_t>(r)].requests, (std::vector<std::string>{"1:a", "1:"}));
    EXPECT_EQ(seen[static_cast<std::size_t>(r)].extras, (std::vector<std::string>{"b", "ab"}));
  }
}

TEST(ConsensusThreads, FailedRanksAreNamedFirstFirstAndTheirTypeTravels) {
  const int n = 4;
  std::vector<cs::Outcomes> seen(n);
  std::vector<std::string> raised(n);
  auto errors = on_ranks(n, [&](int r, Group& g) {
    seen[static_cast<std::size_t>(r)] = cs::run_all_or_none(g, [r] {
      if (r == 1) throw out_of_memory("rank one ran out");
      if (r == 3) throw invalid_state("rank three is confused");
    });
    seen[static_cast<std::size_t>(r)].raise("everyone says so");
  });
  for (int r = 0; r < n; ++r) {
    const cs::Outcomes& o = seen[static_cast<std::size_t>(r)];
    EXPECT_FALSE(o.ok());
    EXPECT_EQ(o.failed_ranks(), (std::vector<int>{1, 3}));
    EXPECT_EQ(o.first_failed(), 1);
    EXPECT_EQ(o.first().failure, cs::Failure::out_of_memory);
    EXPECT_EQ(o.first().message, "rank one ran out");
    EXPECT_EQ(o.by_rank[3].failure, cs::Failure::invalid_state);
    EXPECT_EQ(o.details(), "; rank 1: rank one ran out; rank 3: rank three is confused");
    EXPECT_EQ(static_cast<bool>(o.local), r == 1 || r == 3) << "rank " << r;
    // Every rank raises the first failed rank's type, the ranks that did fine too.
    EXPECT_EQ(errors[static_cast<std::size_t>(r)], "out_of_memory|everyone says so");
  }
  // A rank's own exception keeps its own type.
  EXPECT_THROW(std::rethrow_exception(seen[3].local), invalid_state);
}

TEST(ConsensusThreads, RollbackRunsOnEveryRankOnlyWhenSomeRankFailed) {
  const int n = 3;
  for (int failing : {-1, 2}) {
    std::atomic<int> rolled{0};
    std::vector<cs::Outcomes> seen(n);
    auto errors = on_ranks(n, [&](int r, Group& g) {
      seen[static_cast<std::size_t>(r)] = cs::run_all_or_none(
          g,
          [&] {
            if (r == failing) throw error("no");
          },
          [&] { ++rolled; });
    });
    EXPECT_EQ(rolled.load(), failing < 0 ? 0 : n) << "failing rank " << failing;
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(errors[static_cast<std::size_t>(r)], "");
      EXPECT_EQ(seen[static_cast<std::size_t>(r)].ok(), failing < 0);
      EXPECT_EQ(seen[static_cast<std::size_t>(r)].first_failed(), failing);
    }
  }
}

TEST(ConsensusThreads, ARollbackThatThrowsIsKeptNotThrown) {
  const int n = 2;
  std::vector<cs::Outcomes> seen(n);
  auto errors = on_ranks(n, [&](int r, Group& g) {
    seen[static_cast<std::size_t>(r)] = cs::run_all_or_none(
        g, [] { throw timeout_error("slow"); },
        [r] {
          if (r == 0) throw error("could not undo");
        });
  });
  EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
  EXPECT_EQ(seen[0].rollback_failure, "could not undo");
  EXPECT_EQ(seen[1].rollback_failure, "");
  EXPECT_EQ(seen[1].first().failure, cs::Failure::timeout);
}

TEST(ConsensusThreads, GatherTextReturnsEveryRanksBytesIndexedByRank) {
  const int n = 3;
  std::vector<std::vector<std::string>> seen(n);
  auto errors = on_ranks(n, [&](int r, Group& g) {
    seen[static_cast<std::size_t>(r)] = cs::gather_text(g, std::string(static_cast<std::size_t>(r), '\0') + "x");
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(errors[static_cast<std::size_t>(r)], "");
    EXPECT_EQ(seen[static_cast<std::size_t>(r)],
              (std::vector<std::string>{"x", std::string(1, '\0') + "x", std::string(2, '\0') + "x"}));
  }
}

TEST(Consensus, FieldsRoundTripAndMalformedTextIsRefused) {
  const std::vector<std::string> fields{"", "a:b", std::string("\0\n7:", 4), "last"};
  EXPECT_EQ(cs::decode_fields(cs::encode_fields(fields), 4, "t"), fields);
  EXPECT_EQ(cs::encode_fields({"ab", ""}), "2:ab0:");
  EXPECT_THROW(cs::decode_fields("3:ab", 1, "t"), error);
  EXPECT_THROW(cs::decode_fields("x:ab", 1, "t"), error);
  EXPECT_THROW(cs::decode_fields("2:ab", 2, "t"), error);
  EXPECT_THROW(cs::decode_fields("2", 1, "t"), error);
}

TEST(Consensus, ClassifyAndRaiseKeepTheErrorType) {
  EXPECT_EQ(cs::classify(invalid_argument("x")), cs::Failure::invalid_argument);
  EXPECT_EQ(cs::classify(std::bad_alloc()), cs::Failure::out_of_memory);
  EXPECT_EQ(cs::classify(std::runtime_error("x")), cs::Failure::error);
  EXPECT_THROW(cs::raise(cs::Failure::unavailable, "x"), unavailable);
  EXPECT_THROW(cs::raise(cs::Failure::invalid_state, "x"), invalid_state);
}

}  // namespace
}  // namespace torpor::test
