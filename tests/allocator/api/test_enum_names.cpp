// The names of torpor's enums as users write them (options, C API strings, JSON, messages): every
// value prints as its name and parses back from it, and an unknown name is refused with a message
// that lists the accepted names. The expected texts are written out here, not taken from the
// library's tables.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "pool/store/host_store.hpp"
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

// Every value prints as its name and parses back from it.
template <class E, class Parse>
void expect_round_trip(const std::vector<std::pair<E, std::string>>& names, Parse parse) {
  for (const auto& [value, name] : names) {
    EXPECT_EQ(to_string(value), name);
    EXPECT_EQ(parse(name), value) << name;
  }
}

TEST(EnumNames, MemoryClassNamesRoundTrip) {
  expect_round_trip<MemoryClass>({{MemoryClass::parameter, "parameter"},
                                  {MemoryClass::state, "state"},
                                  {MemoryClass::cache, "cache"}},
                                 parse_memory_class);
  EXPECT_EQ(to_string(static_cast<MemoryClass>(9)), "?");
  EXPECT_EQ(refusal(parse_memory_class, "weights"),
            "unknown memory class 'weights' (expected parameter, state or cache)");
  EXPECT_EQ(refusal(parse_memory_class, "Parameter"),
            "unknown memory class 'Parameter' (expected parameter, state or cache)");
}

TEST(EnumNames, FillOnWakeNamesRoundTrip) {
  expect_round_trip<FillOnWake>({{FillOnWake::none, "none"},
                                 {FillOnWake::zero, "zero"},
                                 {FillOnWake::poison, "poison"}},
                                parse_fill_on_wake);
  EXPECT_EQ(refusal(parse_fill_on_wake, "nan"), "unknown fill_on_wake 'nan' (expected none, zero or poison)");
}

TEST(EnumNames, SleepLevelRefusalListsNamesAndNumbers) {
  EXPECT_EQ(refusal(parse_sleep_level, "3"),
            "unknown sleep level '3' (expected none, offload or discard_parameters, or 0, 1 or 2)");
  EXPECT_EQ(refusal(parse_sleep_level, ""),
            "unknown sleep level '' (expected none, offload or discard_parameters, or 0, 1 or 2)");
}

TEST(EnumNames, BackendNamesRoundTripAndEmptyMeansAuto) {
  expect_round_trip<Backend>({{Backend::automatic, "auto"}, {Backend::host, "host"}, {Backend::cuda, "cuda"}},
                             parse_backend);
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
