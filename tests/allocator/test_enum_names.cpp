// The names of torpor's enums as users write them (options, C API strings, JSON, messages): every
// value prints as its name and parses back from it, and an unknown name is refused with a message
// that lists the accepted names. The expected texts are written out here, not taken from the
// library's tables.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "pool/host_store.hpp"
#include "torpor/backend.hpp"
#include "torpor/error.hpp"
#include "torpor/pool.hpp"

namespace torpor {
namespace {

template <class Parse>
std::string refusal(Parse parse, const std::string& name) {
  try {
    parse(name);
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(EnumNames, MemoryClassNamesRoundTrip) {
  const std::vector<std::pair<MemoryClass, std::string>> names = {{MemoryClass::parameter, "parameter"},
                                                                  {MemoryClass::state, "state"},
                                                                  {MemoryClass::cache, "cache"}};
  for (const auto& [c, name] : names) {
    EXPECT_EQ(to_string(c), name);
    EXPECT_EQ(parse_memory_class(name), c);
  }
  EXPECT_EQ(to_string(static_cast<MemoryClass>(9)), "?");
  EXPECT_EQ(refusal(parse_memory_class, "weights"),
            "unknown memory class 'weights' (expected parameter, state or cache)");
  EXPECT_EQ(refusal(parse_memory_class, "Parameter"),
            "unknown memory class 'Parameter' (expected parameter, state or cache)");
}

TEST(EnumNames, FillOnWakeNamesRoundTrip) {
  const std::vector<std::pair<FillOnWake, std::string>> names = {{FillOnWake::none, "none"},
                                                                 {FillOnWake::zero, "zero"},
                                                                 {FillOnWake::poison, "poison"}};
  for (const auto& [f, name] : names) {
    EXPECT_EQ(to_string(f), name);
    EXPECT_EQ(parse_fill_on_wake(name), f);
  }
  EXPECT_EQ(refusal(parse_fill_on_wake, "nan"), "unknown fill_on_wake 'nan' (expected none, zero or poison)");
}

TEST(EnumNames, SleepLevelRefusalListsNamesAndNumbers) {
  EXPECT_EQ(refusal(parse_sleep_level, "3"),
            "unknown sleep level '3' (expected none, offload or discard_parameters, or 0, 1 or 2)");
  EXPECT_EQ(refusal(parse_sleep_level, ""),
            "unknown sleep level '' (expected none, offload or discard_parameters, or 0, 1 or 2)");
}

TEST(EnumNames, BackendNamesRoundTripAndEmptyMeansAuto) {
  const std::vector<std::pair<Backend, std::string>> names = {{Backend::automatic, "auto"},
                                                              {Backend::host, "host"},
                                                              {Backend::cuda, "cuda"}};
  for (const auto& [b, name] : names) {
    EXPECT_EQ(to_string(b), name);
    EXPECT_EQ(parse_backend(name), b);
  }
  EXPECT_EQ(parse_backend(""), Backend::automatic);
  EXPECT_EQ(refusal(parse_backend, "tpu"), "unknown backend 'tpu' (expected auto, host or cuda)");
}

TEST(EnumNames, HostTierNames) {
  EXPECT_EQ(to_string(HostTier::pinned), "pinned");
  EXPECT_EQ(to_string(HostTier::pageable), "pageable");
  EXPECT_EQ(to_string(HostTier::disk), "disk");
  EXPECT_EQ(to_string(static_cast<HostTier>(7)), "?");
}

}  // namespace
}  // namespace torpor
