// The NVLS policy (ranks/multicast.hpp: pure, on the host, no NCCL needed).
// Oracle for the policy: the rules as the issue states them, written out case by case.
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "ranks/multicast.hpp"
#include "support/processes.hpp"

namespace torpor {
namespace {

using opt = std::optional<std::string>;

struct PolicyCase {
  opt torpor, torch, nvshmem, nccl;
  bool sets;
  std::vector<std::string> named;  // what the log line must name
};

TEST(NcclNvlsPolicy, TorporSwitchOverridesForeignSwitchesDeferToTheUser) {
  const opt none;
  const PolicyCase cases[] = {
      {none, none, none, none, false, {}},
      // torpor's own switch: NCCL_NVLS_ENABLE=0, whatever the user said.
      {"1", none, none, none, true, {"TORPOR_DISABLE_MULTICAST=1"}},
      {"1", none, none, "1", true, {"TORPOR_DISABLE_MULTICAST=1", "NCCL_NVLS_ENABLE=1"}},
      {"yes", none, none, "2", true, {"TORPOR_DISABLE_MULTICAST=yes", "NCCL_NVLS_ENABLE=2"}},
      {"1", "1", none, "1", true, {"TORPOR_DISABLE_MULTICAST=1", "NCCL_NVLS_ENABLE=1"}},
      {"1", none, none, "0", false, {}},  // already off
      // Values that leave torpor's switch unset.
      {"0", none, none, none, false, {}},
      {"off", none, none, none, false, {}},
      {"", none, none, none, false, {}},
      // Foreign switches: NCCL_NVLS_ENABLE=0 only where the user did not set it.
      {none, "1", none, none, true, {"TORCH_SYMM_MEM_DISABLE_MULTICAST=1"}},
      {"false", "1", none, none, true, {"TORCH_SYMM_MEM_DISABLE_MULTICAST=1"}},
      {none, "1", none, "1", false, {}},
      {none, "1", none, "0", false, {}},
      {none, none, "1", none, true, {"NVSHMEM_DISABLE_NVLS=1"}},
      {none, none, "1", "", true, {"NVSHMEM_DISABLE_NVLS=1"}},  // empty counts as unset
      {none, none, "1", "1", false, {}},
      {none, none, "false", none, false, {}},
      // The user's own switch alone: nothing to change.
      {none, none, none, "0", false, {}},
      {none, none, none, "1", false, {}},
  };
  for (const PolicyCase& c : cases) {
    const NvlsAction a = nccl_nvls_policy({c.torpor, c.torch, c.nvshmem, c.nccl});
    SCOPED_TRACE(testing::Message() << "TORPOR_DISABLE_MULTICAST=" << c.torpor.value_or("(unset)")
                                    << " TORCH_SYMM_MEM_DISABLE_MULTICAST=" << c.torch.value_or("(unset)")
                                    << " NVSHMEM_DISABLE_NVLS=" << c.nvshmem.value_or("(unset)")
                                    << " NCCL_NVLS_ENABLE=" << c.nccl.value_or("(unset)"));
    EXPECT_EQ(a.set_nvls_off, c.sets);
    if (!c.sets) {
      EXPECT_EQ(a.why, "");
    }
    for (const std::string& n : c.named) EXPECT_NE(a.why.find(n), std::string::npos) << a.why;
  }
}

// In a child process: the decision is taken once, at the first call, and sets the variable.
TEST(NcclNvlsPolicy, AppliedOnceBeforeTheFirstCommunicator) {
  auto outcomes = test::run_ranks(1, [](int) {
    for (const char* v : {"TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"}) ::unsetenv(v);
    ::setenv("TORPOR_DISABLE_MULTICAST", "1", 1);
    ::setenv("NCCL_NVLS_ENABLE", "1", 1);
    apply_nccl_nvls_policy();
    const char* v = std::getenv("NCCL_NVLS_ENABLE");
    test::check(v != nullptr && std::string(v) == "0", "NCCL_NVLS_ENABLE=0 after the first call");
    ::setenv("NCCL_NVLS_ENABLE", "1", 1);
    apply_nccl_nvls_policy();
    v = std::getenv("NCCL_NVLS_ENABLE");
    test::check(v != nullptr && std::string(v) == "1", "a second call changes nothing");
  });
  EXPECT_EQ(test::failures(outcomes), "");
}

}  // namespace
}  // namespace torpor
