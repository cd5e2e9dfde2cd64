// The names of the pool's enums (MemoryClass, FillOnWake, SleepLevel), both ways: the one table
// each for to_string and parse_*, so the C API, the PyTorch entry points, the JSON and the log
// spell them alike (common/enum_names.hpp holds the lookup).
#include <array>
#include <string_view>

#include "common/enum_names.hpp"
#include "torpor/error.hpp"
#include "torpor/pool.hpp"

namespace torpor {

namespace {

constexpr auto memory_class_names = std::to_array<EnumName<MemoryClass>>(
    {{MemoryClass::parameter, "parameter"}, {MemoryClass::state, "state"}, {MemoryClass::cache, "cache"}});
static_assert(memory_class_names.size() == memory_class_count);

constexpr auto fill_on_wake_names = std::to_array<EnumName<FillOnWake>>(
    {{FillOnWake::none, "none"}, {FillOnWake::zero, "zero"}, {FillOnWake::poison, "poison"}});

constexpr auto sleep_level_names =
    std::to_array<EnumName<SleepLevel>>({{SleepLevel::none, "none"},
                                         {SleepLevel::offload, "offload"},
                                         {SleepLevel::discard_parameters, "discard_parameters"}});
// The levels' numbers, as vLLM's sleep(level=...) and the C API write them.
constexpr auto sleep_level_numbers = std::to_array<EnumName<SleepLevel>>(
    {{SleepLevel::none, "0"}, {SleepLevel::offload, "1"}, {SleepLevel::discard_parameters, "2"}});

}  // namespace

std::string_view to_string(MemoryClass c) noexcept { return name_of(memory_class_names, c); }

MemoryClass parse_memory_class(std::string_view name) { return parse_named(memory_class_names, name, "memory class"); }

std::string_view to_string(FillOnWake f) noexcept { return name_of(fill_on_wake_names, f); }

FillOnWake parse_fill_on_wake(std::string_view name) { return parse_named(fill_on_wake_names, name, "fill_on_wake"); }

std::string_view to_string(SleepLevel l) noexcept { return name_of(sleep_level_names, l); }

SleepLevel parse_sleep_level(std::string_view name) {
  if (std::optional<SleepLevel> l = value_named(sleep_level_names, name)) return *l;
  if (std::optional<SleepLevel> l = value_named(sleep_level_numbers, name)) return *l;
  throw invalid_argument(fmt::format("unknown sleep level '{}' (expected {}, or {})", name,
                                     spoken_list(sleep_level_names), spoken_list(sleep_level_numbers)));
}

}  // namespace torpor
