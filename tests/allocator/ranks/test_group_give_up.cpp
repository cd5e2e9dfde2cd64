// A rank's side of a collective when the hub stays silent: the rank gives up once at its
// deadline, tells the hub, waits the grace for the hub's answer, and only then reports the hub
// itself as unreachable. The transport here is a stand-in hub that records what reached it and
// answers a give-up only when told to.
#include <gtest/gtest.h>

#include <chrono>
#include <deque>
#include <string>
#include <utility>

#include "ranks/groups/hub/group_client.hpp"

namespace torpor::detail {
namespace {

struct SilentHub {
  int contributions = 0;
  int give_ups = 0;
  int recoveries = 0;
  int recovery_give_ups = 0;
  bool answer_give_up = false;  // answer a give-up with "rank 1 did not arrive"
  std::deque<Received> replies;
};

class StandInGroup final : public HubClientGroup {
 public:
  explicit StandInGroup(SilentHub& hub) : HubClientGroup(0, 2, GroupOptions{std::chrono::milliseconds(1)}), hub_(hub) {}
  std::string_view kind() const noexcept override { return "stand-in"; }

 protected:
  void post_contribution(std::uint64_t, std::uint64_t, CollectiveKind, Part) override { ++hub_.contributions; }
  void post_give_up(std::uint64_t generation, std::uint64_t sequence, double) override {
    ++hub_.give_ups;
    if (!hub_.answer_give_up) return;
    Received r;
    r.type = ReplyType::failed;
    r.reason = FailReason::timeout;
    r.generation = generation;
    r.sequence = sequence;
    r.missing = {1};
    r.message = "rank 1 did not arrive";
    hub_.replies.push_back(std::move(r));
  }
  void post_recover(std::uint64_t) override { ++hub_.recoveries; }
  void post_give_up_recovery(std::uint64_t) override { ++hub_.recovery_give_ups; }
  std::optional<Received> next_reply(clock::time_point) override {  // the deadline has passed
    if (hub_.replies.empty()) return std::nullopt;
    Received r = std::move(hub_.replies.front());
    hub_.replies.pop_front();
    return r;
  }
  std::chrono::milliseconds give_up_grace() const override { return std::chrono::milliseconds(1); }

 private:
  SilentHub& hub_;
};

// `f` throws group_timeout naming the ranks `missing` and saying `text`.
template <class F>
void expect_timeout(F f, const std::vector<int>& missing, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << "expected group_timeout";
  } catch (const group_timeout& e) {
    EXPECT_EQ(e.missing(), missing) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(GroupGiveUp, ASilentHubIsReportedAfterOneGiveUp) {
  SilentHub hub;
  StandInGroup g(hub);
  // The missing rank is 0: the hub's host, which did not answer.
  expect_timeout([&] { g.barrier(); }, {0}, "the rendezvous (hosted by rank 0) did not answer");
  EXPECT_EQ(hub.contributions, 1);
  EXPECT_EQ(hub.give_ups, 1) << "the rank tells the hub once that it stops waiting";
  EXPECT_THROW(g.barrier(), invalid_state) << "the group is unusable until recover()";
}

TEST(GroupGiveUp, TheHubsAnswerToAGiveUpNamesTheMissingRank) {
  SilentHub hub;
  hub.answer_give_up = true;
  StandInGroup g(hub);
  expect_timeout([&] { g.barrier(); }, {1}, "rank 1 did not arrive");
  EXPECT_EQ(hub.give_ups, 1);
}

TEST(GroupGiveUp, RecoveryFromASilentHubTimesOutAfterOneGiveUp) {
  SilentHub hub;
  StandInGroup g(hub);
  expect_timeout([&] { g.recover(); }, {0}, "recover() got no answer from the rendezvous");
  EXPECT_EQ(hub.recoveries, 1);
  EXPECT_EQ(hub.recovery_give_ups, 1);
}

}  // namespace
}  // namespace torpor::detail
