// Checks of the strings that cross torpor's boundaries and come back out of it (tags appear in
// stats, reports and JSON documents; names and globs are matched with C string functions).
//
// A tag is 1 to max_tag_bytes bytes of valid UTF-8 without NUL: a tag that JSON cannot carry
// would be accepted at allocation and then break every stats() and report of its pool.
#pragma once

#include <cstddef>
#include <string_view>

namespace torpor {

inline constexpr std::size_t max_tag_bytes = 1024;

// Whether `s` is well-formed UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF).
bool valid_utf8(std::string_view s) noexcept;

// Throws invalid_argument, prefixed with `where`, unless `tag` is a valid tag (see above).
void check_tag(std::string_view tag, std::string_view where);

// Throws invalid_argument, prefixed with `where`, when `text` holds a NUL byte (C strings end
// there: the rest would be silently lost).
void check_no_nul(std::string_view text, std::string_view what, std::string_view where);

}  // namespace torpor
