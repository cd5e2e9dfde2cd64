// The backends, each written once: its name (TORPOR_BACKEND, the CLI's --backend,
// torpor_backend_name, torpor_pool_backend), its C++ value (Backend), its C value (torpor_backend)
// and one line that describes it for help texts. The options module (TORPOR_BACKEND's choices and
// description), the CLI (--backend's choices and help) and the C API (torpor_backend values and
// names) all read this table, so they cannot disagree.
//
// A new backend is one row here, its Backend and torpor_backend values, and how open_driver
// opens it (torpor/backend.hpp). Everything here is a constant: the options table is one.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "torpor/backend.h"

namespace torpor {

enum class Backend { automatic, host, cuda };

struct BackendEntry {
  Backend value;
  std::string_view name;  // a literal, so name.data() is NUL-terminated (the C API returns it)
  torpor_backend c_value;
  std::string_view description;  // one line, for help texts
};

inline constexpr std::array<BackendEntry, 3> backend_table = {{
    {Backend::automatic, "auto", TORPOR_BACKEND_AUTO, "cuda when a GPU with VMM support is usable, else host"},
    {Backend::host, "host", TORPOR_BACKEND_HOST, "the CUDA VMM API emulated on the CPU with real bytes"},
    {Backend::cuda, "cuda", TORPOR_BACKEND_CUDA, "a GPU through libcuda, loaded at run time"},
}};

// The names alone, in the table's order.
inline constexpr std::array<std::string_view, backend_table.size()> backend_names = [] {
  std::array<std::string_view, backend_table.size()> names{};
  for (std::size_t i = 0; i < backend_table.size(); ++i) names[i] = backend_table[i].name;
  return names;
}();

// The same as strings (a command line's choices).
inline std::vector<std::string> backend_name_strings() { return {backend_names.begin(), backend_names.end()}; }

// The entry of the backend whose C value is `c_value`; nullptr for a value out of range.
constexpr const BackendEntry* backend_entry_of_c(int c_value) noexcept {
  for (const BackendEntry& b : backend_table)
    if (static_cast<int>(b.c_value) == c_value) return &b;
  return nullptr;
}

// A text as a constant: fixed-size characters, read through view().
template <std::size_t N>
struct FixedText {
  std::array<char, N> chars{};
  constexpr std::string_view view() const noexcept { return {chars.data(), N}; }
};

namespace detail {

// The length of the table in words (spoken_backends without `before` and `after`).
constexpr std::size_t spoken_backends_length() noexcept {
  std::size_t n = 0;
  for (std::size_t i = 0; i < backend_table.size(); ++i) {
    n += backend_table[i].name.size() + 2 + backend_table[i].description.size() + 1;  // "name (description)"
    if (i + 1 < backend_table.size()) n += i + 2 == backend_table.size() ? 4 : 2;     // " or " or ", "
  }
  return n;
}

}  // namespace detail

// The table in words between `before` and `after`: "auto (DESCRIPTION), host (DESCRIPTION) or cuda
// (DESCRIPTION)", as help texts list choices.
template <std::size_t B, std::size_t A>
constexpr FixedText<B - 1 + detail::spoken_backends_length() + A - 1> spoken_backends(const char (&before)[B],
                                                                                      const char (&after)[A]) noexcept {
  FixedText<B - 1 + detail::spoken_backends_length() + A - 1> out{};
  std::size_t at = 0;
  auto put = [&](std::string_view text) {
    for (char c : text) out.chars[at++] = c;
  };
  put({before, B - 1});
  for (std::size_t i = 0; i < backend_table.size(); ++i) {
    put(backend_table[i].name);
    put(" (");
    put(backend_table[i].description);
    put(")");
    if (i + 1 < backend_table.size()) put(i + 2 == backend_table.size() ? " or " : ", ");
  }
  put({after, A - 1});
  return out;
}

// The table in words alone (a help text's list of choices).
inline constexpr auto backends_in_words = spoken_backends("", "");

}  // namespace torpor
