// Text checks; see text.hpp.
#include "common/text.hpp"

#include <fmt/core.h>

#include "torpor/error.hpp"

namespace torpor {

bool valid_utf8(std::string_view s) noexcept {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t n = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      n = 1;
    } else if (c == 0xE0) {
      n = 2, lo = 0xA0;  // no overlong three-byte forms
    } else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) {
      n = 2;
    } else if (c == 0xED) {
      n = 2, hi = 0x9F;  // no surrogates
    } else if (c == 0xF0) {
      n = 3, lo = 0x90;  // no overlong four-byte forms
    } else if (c >= 0xF1 && c <= 0xF3) {
      n = 3;
    } else if (c == 0xF4) {
      n = 3, hi = 0x8F;  // nothing above U+10FFFF
    } else {
      return false;
    }
    if (s.size() - i - 1 < n) return false;
    for (std::size_t k = 1; k <= n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) return false;
    }
    i += n + 1;
  }
  return true;
}

void check_no_nul(std::string_view text, std::string_view what, std::string_view where) {
  if (text.find('\0') != std::string_view::npos)
    throw invalid_argument(fmt::format("{}: {} holds a NUL byte (at offset {})", where, what, text.find('\0')));
}

void check_tag(std::string_view tag, std::string_view where) {
  if (tag.empty()) throw invalid_argument(fmt::format("{}: empty tag (use \"default\" or a name)", where));
  if (tag.size() > max_tag_bytes)
    throw invalid_argument(
        fmt::format("{}: a tag of {} bytes; tags are 1 to {} bytes long", where, tag.size(), max_tag_bytes));
  check_no_nul(tag, "the tag", where);
  if (!valid_utf8(tag))
    throw invalid_argument(
        fmt::format("{}: the tag is not valid UTF-8 (tags appear in stats and JSON reports)", where));
}

}  // namespace torpor
