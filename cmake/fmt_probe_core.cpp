// Configure-time probe, with cmake/fmt_probe.cpp: torpor's sources include <fmt/core.h> (format.h
// only where they need what only it has), whose calls format through functions it declares and
// fmt_once.cpp defines. This file formats what they format, with core.h alone.
#include <fmt/core.h>

#include <cstdio>
#include <iterator>
#include <string>

std::string probe_core(int n) {
  std::string s = fmt::format("{} {:.2f} {:#x} {:<6} {:L} {}", n, 0.5, 17U, "y", 1234567, static_cast<const void*>(&n));
  fmt::format_to(std::back_inserter(s), "{}", n);
  fmt::print(stderr, "{}\n", s);
  return s;
}
