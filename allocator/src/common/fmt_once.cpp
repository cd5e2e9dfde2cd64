// fmt's compiled part, compiled once into libtorpor.
//
// Why: linking the system's libfmt.so ties libtorpor (and the Python wheel) to that machine's
// shared library, and fmt's header-only mode compiles fmt's whole implementation into every
// translation unit that includes it, at every optimisation level: a large share of the build.
// Here, once, the library gets what fmt's own format.cc would hold: the non-template functions of
// <fmt/format-inl.h> and the explicit instantiations that <fmt/format.h> declares `extern`.
// Every other file includes fmt without FMT_HEADER_ONLY and links against these definitions
// (exported from libtorpor like the rest of its symbols). They include <fmt/core.h>, which
// declares what formatting calls (defined here), and <fmt/format.h> only for what only it has
// (fmt::join, through <fmt/ranges.h>): format.h is about as much again to parse as core.h, in
// every file, for the compilers and for clang-tidy. In header-only mode core.h includes format.h.
//
// Which instantiations <fmt/format.h> declares extern depends on fmt's version: this file knows
// fmt 9.x (Debian 12, Ubuntu 24.04). cmake/TorporFmt.cmake compiles and links this file with a
// probe at configure time and falls back to fmt's header-only mode when it does not build, and
// libtorpor is linked with --no-undefined, so a version this file does not fit fails the build,
// never a load.
#include <fmt/format.h>

#if FMT_VERSION < 90000 || FMT_VERSION >= 100000
#error "fmt_once.cpp knows fmt 9.x only: configure with this fmt falls back to header-only (cmake/TorporFmt.cmake)"
#endif

#ifdef FMT_HEADER_ONLY
#error "fmt_once.cpp is for builds without FMT_HEADER_ONLY"
#endif

#include <fmt/format-inl.h>

FMT_BEGIN_NAMESPACE
namespace detail {

template auto dragonbox::to_decimal(float x) noexcept -> dragonbox::decimal_fp<float>;
template auto dragonbox::to_decimal(double x) noexcept -> dragonbox::decimal_fp<double>;

#ifndef FMT_STATIC_THOUSANDS_SEPARATOR
template locale_ref::locale_ref(const std::locale& loc);
template auto locale_ref::get<std::locale>() const -> std::locale;
#endif

template auto thousands_sep_impl(locale_ref) -> thousands_sep_result<char>;
template auto decimal_point_impl(locale_ref) -> char;
template void buffer<char>::append(const char*, const char*);
template void vformat_to(buffer<char>&, string_view, basic_format_args<FMT_BUFFER_CONTEXT(char)>, locale_ref);

template auto thousands_sep_impl(locale_ref) -> thousands_sep_result<wchar_t>;
template auto decimal_point_impl(locale_ref) -> wchar_t;
template void buffer<wchar_t>::append(const wchar_t*, const wchar_t*);

}  // namespace detail
FMT_END_NAMESPACE
