// Configure-time probe (cmake/TorporFmt.cmake): links with allocator/src/common/fmt_once.cpp and
// no fmt library, so every fmt symbol the kinds of formatting torpor does need must come from
// that file. It only has to link. This file formats with <fmt/format.h>, fmt_probe_core.cpp with
// <fmt/core.h> alone, as torpor's sources do.
#include <fmt/format.h>

#include <string>

std::string probe_core(int n);

int main(int argc, char**) {
  std::string s = fmt::format("{} {} {:.3f} {:#x} {:>8} {:L} {}", argc, 1.5F, 2.25, 255U, "x", 1234567,
                              static_cast<const void*>(&s));
  fmt::memory_buffer b;
  fmt::format_to(std::back_inserter(b), "{}", s);
  fmt::print(stderr, "{} {}\n", fmt::to_string(b).size(), probe_core(argc));
  return 0;
}
