// Enum <-> name tables: one constexpr array of {value, name} per enum and one lookup each way,
// so an enum's names are written once and its to_string and parse cannot disagree. A value the
// table lacks (a corrupted enum) prints as "?"; an unknown name is an invalid_argument that
// lists the accepted names in the table's order.
#pragma once

#include <fmt/core.h>

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "torpor/error.hpp"

namespace torpor {

template <class E>
struct EnumName {
  E value;
  std::string_view name;
};

template <class E, std::size_t N>
using EnumNames = std::array<EnumName<E>, N>;

template <class E, std::size_t N>
constexpr std::string_view name_of(const EnumNames<E, N>& names, E value) noexcept {
  for (const EnumName<E>& n : names)
    if (n.value == value) return n.name;
  return "?";
}

template <class E, std::size_t N>
constexpr std::optional<E> value_named(const EnumNames<E, N>& names, std::string_view name) noexcept {
  for (const EnumName<E>& n : names)
    if (n.name == name) return n.value;
  return std::nullopt;
}

// The names as an error message lists them: "a, b or c".
template <class E, std::size_t N>
std::string spoken_list(const EnumNames<E, N>& names) {
  std::string list;
  for (std::size_t i = 0; i < N; ++i) {
    if (i > 0) list += i + 1 == N ? " or " : ", ";
    list += names[i].name;
  }
  return list;
}

// The value named `name`; otherwise throws invalid_argument "unknown WHAT 'NAME' (expected a, b or c)".
template <class E, std::size_t N>
E parse_named(const EnumNames<E, N>& names, std::string_view name, std::string_view what) {
  if (std::optional<E> v = value_named(names, name)) return *v;
  throw invalid_argument(fmt::format("unknown {} '{}' (expected {})", what, name, spoken_list(names)));
}

}  // namespace torpor
