// The field list of torpor_pool_options. See c_pool_options.hpp.
#include "api/c_pool_options.hpp"

#include <fmt/core.h>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "api/c_enums.hpp"
#include "torpor/error.hpp"

namespace torpor::detail {

namespace {

// --- the checks: C value -> C++ value (refusing what does not convert), and back -------------

// Taken as it is.
struct AsIs {
  template <class T>
  static T to_cpp(T value, std::string_view /*name*/) {
    return value;
  }
  template <class T>
  static T to_c(T value) {
    return value;
  }
};

// Any value but 0 is true.
struct Flag {
  static bool to_cpp(int value, std::string_view /*name*/) { return value != 0; }
  static int to_c(bool value) { return value ? 1 : 0; }
};

// 0 or 1, nothing else.
struct StrictFlag {
  static bool to_cpp(int value, std::string_view name) {
    if (value != 0 && value != 1) throw invalid_argument(fmt::format("{} {} is not 0 or 1", name, value));
    return value != 0;
  }
  static int to_c(bool value) { return value ? 1 : 0; }
};

// A torpor_backend (api/c_enums.hpp reads it).
struct BackendValue {
  static Backend to_cpp(int value, std::string_view name) {
    const std::optional<Backend> b = backend_of(value);
    if (!b) throw invalid_argument(fmt::format("unknown {} {} (0 auto, 1 host, 2 cuda)", name, value));
    return *b;
  }
  static int to_c(Backend value) {
    // The C values run from 0 without gaps, as every C enumeration of torpor.h.
    for (int c = 0; const std::optional<Backend> b = backend_of(c); ++c)
      if (*b == value) return c;
    return TORPOR_BACKEND_AUTO;
  }
};

// A torpor_fill (the C values are FillOnWake's: c_enums.cpp asserts it).
struct FillValue {
  static FillOnWake to_cpp(int value, std::string_view name) {
    if (value < TORPOR_FILL_NONE || value > TORPOR_FILL_POISON)
      throw invalid_argument(fmt::format("unknown {} {} (0 none, 1 zero, 2 poison)", name, value));
    return static_cast<FillOnWake>(value);
  }
  static int to_c(FillOnWake value) { return static_cast<int>(value); }
};

// A C string, NULL for none (empty): copied on the way in; on the way out it points into the
// C++ value, so it lives as long as that.
struct Text {
  static std::string to_cpp(const char* value, std::string_view /*name*/) { return value != nullptr ? value : ""; }
  static const char* to_c(const std::string& value) { return value.empty() ? nullptr : value.c_str(); }
};

// --- a field: its name, its C member, its C++ member (of PoolSpec or of its PoolOptions), its check

template <auto member, class Spec>
auto& cpp_side(Spec& spec) {
  if constexpr (requires { spec.*member; })
    return spec.*member;
  else
    return spec.pool.*member;
}

template <auto c_member, auto cpp_member, class Check>
struct Field {
  std::string_view name;

  void to_cpp(const torpor_pool_options& c, PoolSpec& spec) const {
    cpp_side<cpp_member>(spec) = Check::to_cpp(c.*c_member, name);
  }
  void to_c(const PoolSpec& spec, torpor_pool_options& c) const {
    c.*c_member = Check::to_c(cpp_side<cpp_member>(spec));
  }
  bool same(const PoolSpec& a, const PoolSpec& b) const { return cpp_side<cpp_member>(a) == cpp_side<cpp_member>(b); }
};

using C = torpor_pool_options;

// Every member of torpor_pool_options, in its order (which is the order of the checks).
constexpr std::tuple fields{
    Field<&C::device, &PoolOptions::device, AsIs>{"device"},
    Field<&C::backend, &PoolSpec::backend, BackendValue>{"backend"},
    Field<&C::va_bytes, &PoolOptions::va_bytes, AsIs>{"va_bytes"},
    Field<&C::fill_on_wake, &PoolOptions::fill_on_wake, FillValue>{"fill_on_wake"},
    Field<&C::exportable, &PoolOptions::exportable, Flag>{"exportable"},
    Field<&C::skip_unchanged, &PoolOptions::skip_unchanged, StrictFlag>{"skip_unchanged"},
    Field<&C::host_store_limit, &PoolOptions::host_store_limit, AsIs>{"host_store_limit"},
    Field<&C::host_store_prepare, &PoolOptions::host_store_prepare, AsIs>{"host_store_prepare"},
    Field<&C::spill_dir, &PoolOptions::spill_dir, Text>{"spill_dir"},
    Field<&C::spill_limit, &PoolOptions::spill_limit, AsIs>{"spill_limit"},
    Field<&C::spill_file_per_allocation, &PoolOptions::spill_file_per_allocation, Flag>{"spill_file_per_allocation"},
};

// The number of members of an aggregate of scalars: the most initializers it takes.
struct AnyValue {
  template <class T>
  operator T() const;  // NOLINT(google-explicit-constructor): only ever named in a requires-expression
};
template <class T, class... Values>
constexpr std::size_t member_count() {
  if constexpr (requires { T{Values{}..., AnyValue{}}; })
    return member_count<T, Values..., AnyValue>();
  else
    return sizeof...(Values);
}
static_assert(member_count<torpor_pool_options>() == std::tuple_size_v<decltype(fields)>,
              "every member of torpor_pool_options has its row in `fields`");

template <class F>
void for_each_field(F&& f) {
  std::apply([&](const auto&... field) { (f(field), ...); }, fields);
}

}  // namespace

void init_c_pool_options(torpor_pool_options& o) noexcept {
  const PoolSpec defaults;  // its spill_dir is empty: NULL, so nothing points into it
  o = torpor_pool_options{};
  for_each_field([&](const auto& field) { field.to_c(defaults, o); });
}

PoolSpec pool_spec_of(const torpor_pool_options& o) {
  PoolSpec spec;
  for_each_field([&](const auto& field) { field.to_cpp(o, spec); });
  return spec;
}

bool same_pool_spec(const PoolSpec& a, const PoolSpec& b) {
  bool same = true;
  for_each_field([&](const auto& field) { same = same && field.same(a, b); });
  return same;
}

}  // namespace torpor::detail
