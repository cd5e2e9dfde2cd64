// The one ErrorKind table (common/error_kind.hpp) against the statuses of torpor/status.h (which
// torpor.h includes), parsed
// from the header: every status has its kind, and every kind round-trips: an exception of the
// type the C API documents for the status -> kind -> status -> the exception raised again, of
// the same type (or torpor::error, where the status cannot carry the type) and the same message.
// The expected types are written out here, not taken from the table. Also through the C
// boundary itself: a sleep hook's status comes back from torpor_sleep as the same status.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <new>
#include <optional>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <typeindex>
#include <typeinfo>

#include "common/error_kind.hpp"
#include "torpor/error.hpp"
#include "torpor/torpor.h"

namespace torpor {
namespace {

// status.h's `typedef enum torpor_status { NAME = value, ... }`, comments removed.
std::map<std::string, int> header_statuses() {
  std::ifstream in(TORPOR_SOURCE_DIR "/allocator/include/torpor/status.h");
  EXPECT_TRUE(in) << "cannot read status.h";
  std::stringstream text;
  text << in.rdbuf();
  std::smatch body;
  const std::string all = text.str();
  EXPECT_TRUE(std::regex_search(all, body, std::regex(R"(typedef enum torpor_status \{([^}]*)\})")));
  const std::string enumerators = std::regex_replace(body[1].str(), std::regex(R"(/\*[^*]*\*/)"), "");
  std::map<std::string, int> out;
  const std::regex one(R"((\w+)\s*=\s*(-?\d+))");
  for (auto it = std::sregex_iterator(enumerators.begin(), enumerators.end(), one); it != std::sregex_iterator(); ++it)
    out[(*it)[1].str()] = std::stoi((*it)[2].str());
  return out;
}

// What each status means as an exception, as torpor.h and error.hpp document it: how to make
// one (none for the statuses no exception stands for) and the type it comes back as.
struct Expected {
  std::function<void(const std::string&)> throw_one;  // empty: no exception is this status's
  std::type_index comes_back_as;
};

std::map<std::string, Expected> expected_by_status() {
  auto as = [](auto make) { return [make](const std::string& m) { throw make(m); }; };
  return {
      {"TORPOR_OK", {{}, typeid(error)}},
      {"TORPOR_ERROR_INVALID_ARGUMENT",
       {as([](const std::string& m) { return invalid_argument(m); }), typeid(invalid_argument)}},
      {"TORPOR_ERROR_INVALID_STATE",
       {as([](const std::string& m) { return invalid_state(m); }), typeid(invalid_state)}},
      {"TORPOR_ERROR_OUT_OF_MEMORY",
       {as([](const std::string& m) { return out_of_memory(m); }), typeid(out_of_memory)}},
      // The status carries no CUresult: a driver failure comes back as torpor::error.
      {"TORPOR_ERROR_DRIVER",
       {[](const std::string& m) { throw driver_error(static_cast<int>(driver_status::not_permitted), "cuX", m); },
        typeid(error)}},
      {"TORPOR_ERROR_TIMEOUT", {as([](const std::string& m) { return timeout_error(m); }), typeid(timeout_error)}},
      {"TORPOR_ERROR_INVALID_HANDLE", {{}, typeid(error)}},
      {"TORPOR_ERROR_INTERNAL", {as([](const std::string& m) { return std::runtime_error(m); }), typeid(error)}},
      {"TORPOR_ERROR_UNAVAILABLE", {as([](const std::string& m) { return unavailable(m); }), typeid(unavailable)}},
  };
}

TEST(ErrorKind, EveryStatusOfTheHeaderHasItsKindAndName) {
  const std::map<std::string, int> statuses = header_statuses();
  ASSERT_GE(statuses.size(), 9u) << "status.h's statuses were not found";
  const std::map<std::string, Expected> expected = expected_by_status();
  for (const auto& [name, value] : statuses) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(expected.count(name)) << "a status this test does not know: say what it means above";
    const std::optional<ErrorKind> kind = error_kind_of_status(value);
    ASSERT_TRUE(kind) << "no row for status " << value;
    EXPECT_EQ(status_of(*kind), value);
    EXPECT_STREQ(status_name(*kind), name.c_str());
    EXPECT_STREQ(torpor_status_name(static_cast<torpor_status>(value)), name.c_str());
    EXPECT_EQ(torpor_status_value(name.c_str()), value);
  }
  EXPECT_EQ(static_cast<std::size_t>(error_kind_count), statuses.size()) << "one kind per status, no more";
  EXPECT_FALSE(error_kind_of_status(-1));
  EXPECT_FALSE(error_kind_of_status(static_cast<int>(statuses.size())));
}

TEST(ErrorKind, EveryKindRoundTripsThroughItsStatus) {
  const std::map<std::string, int> statuses = header_statuses();
  ASSERT_GE(statuses.size(), 9u);
  const std::map<std::string, Expected> expected = expected_by_status();
  for (const auto& [name, value] : statuses) {
    SCOPED_TRACE(name);
    auto e = expected.find(name);
    ASSERT_NE(e, expected.end());
    const std::string message = "the message of " + name;
    std::optional<ErrorKind> kind;
    std::string what = message;
    if (e->second.throw_one) {
      try {
        e->second.throw_one(message);
      } catch (const std::exception& x) {
        kind = error_kind_of(x);
        what = x.what();
      }
      ASSERT_TRUE(kind);
      EXPECT_EQ(status_of(*kind), value) << "the exception classifies as this status";
    } else {
      kind = error_kind_of_status(value);  // no exception stands for it: start from the status
      ASSERT_TRUE(kind);
    }
    const std::optional<ErrorKind> back = error_kind_of_status(status_of(*kind));
    ASSERT_TRUE(back);
    EXPECT_EQ(*back, *kind);
    try {
      raise_error_kind(*back, what);
    } catch (const std::exception& x) {
      EXPECT_TRUE(std::type_index(typeid(x)) == e->second.comes_back_as)
          << "came back as " << typeid(x).name() << ", not as " << e->second.comes_back_as.name();
      EXPECT_EQ(std::string(x.what()), what);
      EXPECT_EQ(raises_own_type(*back), e->second.comes_back_as != std::type_index(typeid(error)));
      if (raises_own_type(*back)) EXPECT_EQ(error_kind_of(x), *back) << "raised again, the same kind";
    }
  }
}

TEST(ErrorKind, AnExceptionInFlightGivesItsKindAndText) {
  auto caught = [](const std::function<void()>& f) {
    try {
      f();
    } catch (...) {
      return caught_error();
    }
    return CaughtError{ErrorKind::none, ""};
  };
  CaughtError c = caught([] { throw std::bad_alloc(); });
  EXPECT_EQ(c.kind, ErrorKind::out_of_memory);
  EXPECT_EQ(c.message, "host out of memory");
  c = caught([] { throw 42; });
  EXPECT_EQ(c.kind, ErrorKind::internal);
  EXPECT_EQ(c.message, "unknown exception");
  c = caught([] { throw driver_error(static_cast<int>(driver_status::out_of_memory), "cuMemCreate", "2 MiB"); });
  EXPECT_EQ(c.kind, ErrorKind::out_of_memory) << "a driver's out of memory is out of memory";
  EXPECT_EQ(c.message, "cuMemCreate failed: 2 MiB");
  c = caught([] { throw timeout_error("late"); });
  EXPECT_EQ(c.kind, ErrorKind::timeout);
  EXPECT_EQ(c.message, "late");
}

// Through the C boundary: a sleep hook refuses with a status; torpor_sleep returns the same
// status where the kind travels as its own type, TORPOR_ERROR_INTERNAL naming the status where
// it does not.
torpor_status refuse_with(void* user, torpor_pool_t, int, const char* const*, size_t, char* message, size_t capacity) {
  std::snprintf(message, capacity, "%s", "refused by the test");
  return *static_cast<torpor_status*>(user);
}

TEST(ErrorKind, AHooksStatusComesBackFromTheCApi) {
  const std::map<std::string, int> statuses = header_statuses();
  ASSERT_GE(statuses.size(), 9u);
  const std::map<std::string, Expected> expected = expected_by_status();
  for (const auto& [name, value] : statuses) {
    if (value == TORPOR_OK) continue;
    SCOPED_TRACE(name);
    torpor_pool_options o;
    torpor_pool_options_init(&o);
    o.backend = TORPOR_BACKEND_HOST;
    o.va_bytes = std::size_t{1} << 30;
    torpor_pool_t pool = nullptr;
    ASSERT_EQ(torpor_pool_create(&o, &pool), TORPOR_OK) << torpor_last_error();
    auto refusal = static_cast<torpor_status>(value);
    unsigned long long id = 0;
    ASSERT_EQ(torpor_add_sleep_hook(pool, refuse_with, nullptr, &refusal, &id), TORPOR_OK);
    void* p = nullptr;
    ASSERT_EQ(torpor_alloc(pool, 4096, "weights", TORPOR_CLASS_STATE, nullptr, &p), TORPOR_OK);
    const torpor_status s = torpor_sleep(pool, 1, nullptr, 0);
    const std::string message = torpor_last_error();
    const bool typed = expected.at(name).comes_back_as != std::type_index(typeid(error));
    EXPECT_EQ(s, typed ? value : TORPOR_ERROR_INTERNAL) << message;
    EXPECT_NE(message.find("refused by the test"), std::string::npos) << message;
    if (!typed) EXPECT_NE(message.find("(status " + name + ")"), std::string::npos) << message;
    EXPECT_EQ(torpor_free(pool, p), TORPOR_OK) << torpor_last_error();
    EXPECT_EQ(torpor_pool_destroy(pool), TORPOR_OK);
  }
}

}  // namespace
}  // namespace torpor
