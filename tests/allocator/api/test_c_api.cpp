// The C API over the host backend: status codes, messages, JSON documents, byte survival.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "torpor/torpor.h"

namespace {

struct CPoolFixture : ::testing::Test {
  void SetUp() override {
    torpor_pool_options o;
    torpor_pool_options_init(&o);
    o.backend = TORPOR_BACKEND_HOST;
    o.fill_on_wake = TORPOR_FILL_POISON;
    o.va_bytes = std::size_t{1} << 30;
    ASSERT_EQ(torpor_pool_create(&o, &pool), TORPOR_OK) << torpor_last_error();
  }
  void TearDown() override {
    if (pool) EXPECT_EQ(torpor_pool_destroy(pool), TORPOR_OK);
  }
  std::string stats() {
    size_t needed = 0;
    EXPECT_EQ(torpor_stats_json(pool, nullptr, 0, &needed), TORPOR_OK);
    std::string s(needed, '\0');
    EXPECT_EQ(torpor_stats_json(pool, s.data(), s.size(), &needed), TORPOR_OK);
    s.resize(needed - 1);
    return s;
  }
  torpor_pool_t pool = nullptr;
};

TEST_F(CPoolFixture, TagsJsonListsEveryTagSortedAndSaysTheSizeItNeeds) {
  auto tags_json = [&] {
    size_t needed = 0;
    EXPECT_EQ(torpor_tags_json(pool, nullptr, 0, &needed), TORPOR_OK);
    std::string s(needed, '\0');
    EXPECT_EQ(torpor_tags_json(pool, s.data(), s.size(), &needed), TORPOR_OK);
    EXPECT_EQ(needed, s.size());
    s.resize(needed - 1);
    return s;
  };
  EXPECT_EQ(tags_json(), "[]");
  void *a = nullptr, *b = nullptr, *c = nullptr;
  ASSERT_EQ(torpor_alloc(pool, 4096, "zeta", TORPOR_CLASS_STATE, nullptr, &a), TORPOR_OK);
  ASSERT_EQ(torpor_alloc(pool, 4096, "alpha \"quoted\"", TORPOR_CLASS_CACHE, nullptr, &b), TORPOR_OK);
  ASSERT_EQ(torpor_alloc(pool, 4096, "zeta", TORPOR_CLASS_PARAMETER, nullptr, &c), TORPOR_OK);
  EXPECT_EQ(tags_json(), R"(["alpha \"quoted\"","zeta"])");
  char small[4] = {'x', 'x', 'x', 'x'};
  size_t needed = 0;
  EXPECT_EQ(torpor_tags_json(pool, small, sizeof small, &needed), TORPOR_OK);
  EXPECT_EQ(needed, std::string(R"(["alpha \"quoted\"","zeta"])").size() + 1) << "the size a full copy needs";
  EXPECT_EQ(torpor_tags_json(nullptr, nullptr, 0, &needed), TORPOR_ERROR_INVALID_HANDLE);
  for (void* p : {a, b, c}) EXPECT_EQ(torpor_free(pool, p), TORPOR_OK);
}

TEST_F(CPoolFixture, SleepWakeKeepsStateAndReportsJson) {
  EXPECT_STREQ(torpor_pool_backend(pool), "host");
  void *w = nullptr, *s = nullptr;
  ASSERT_EQ(torpor_alloc(pool, 4096, "weights", TORPOR_CLASS_PARAMETER, "w0", &w), TORPOR_OK);
  ASSERT_EQ(torpor_alloc(pool, 4096, "weights", TORPOR_CLASS_STATE, "flags", &s), TORPOR_OK);
  std::vector<unsigned char> src(4096);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 7 + 1);
  ASSERT_EQ(torpor_copy(pool, w, src.data(), 4096), TORPOR_OK);
  ASSERT_EQ(torpor_copy(pool, s, src.data(), 4096), TORPOR_OK);
  ASSERT_EQ(torpor_sleep(pool, 2, nullptr, 0), TORPOR_OK) << torpor_last_error();
  size_t needed = 0;
  char buf[4096];
  ASSERT_EQ(torpor_last_report_json(pool, buf, sizeof buf, &needed), TORPOR_OK);
  EXPECT_NE(std::string(buf).find("\"bytes_offloaded\":4096"), std::string::npos) << buf;
  EXPECT_NE(stats().find("\"asleep\":true"), std::string::npos);
  const char* tags[] = {"weights"};
  ASSERT_EQ(torpor_wake_up(pool, tags, 1), TORPOR_OK) << torpor_last_error();
  std::vector<unsigned char> back(4096);
  ASSERT_EQ(torpor_copy(pool, back.data(), s, 4096), TORPOR_OK);
  EXPECT_EQ(back, src);
  ASSERT_EQ(torpor_copy(pool, back.data(), w, 4096), TORPOR_OK);
  EXPECT_EQ(back, std::vector<unsigned char>(4096, 0xFF)) << "level 2 discards parameters; poison fill";
  void* base = nullptr;
  size_t bytes = 0;
  ASSERT_EQ(torpor_find(pool, static_cast<char*>(s) + 100, &base, &bytes), TORPOR_OK);
  EXPECT_EQ(base, s);
  EXPECT_EQ(bytes, 4096u);
  EXPECT_EQ(torpor_free(pool, w), TORPOR_OK);
  EXPECT_EQ(torpor_free(pool, s), TORPOR_OK);
}

TEST_F(CPoolFixture, ErrorsAreStatusCodesWithMessages) {
  void* p = nullptr;
  EXPECT_EQ(torpor_alloc(pool, 0, "t", TORPOR_CLASS_STATE, nullptr, &p), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("torpor_alloc: allocate: size 0"), std::string::npos)
      << torpor_last_error();
  EXPECT_EQ(torpor_alloc(pool, 10, "t", 9, nullptr, &p), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("unknown memory class 9"), std::string::npos);
  EXPECT_EQ(torpor_sleep(pool, 5, nullptr, 0), TORPOR_ERROR_INVALID_ARGUMENT);
  const char* bad[] = {"nope"};
  EXPECT_EQ(torpor_wake_up(pool, bad, 1), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(torpor_sleep(pool, 1, nullptr, 1), TORPOR_ERROR_INVALID_ARGUMENT) << "NULL tags with a count";
  ASSERT_EQ(torpor_alloc(pool, 10, "kv", TORPOR_CLASS_CACHE, nullptr, &p), TORPOR_OK);
  ASSERT_EQ(torpor_sleep(pool, 1, nullptr, 0), TORPOR_OK);
  void* q = nullptr;
  EXPECT_EQ(torpor_alloc(pool, 10, "kv", TORPOR_CLASS_CACHE, nullptr, &q), TORPOR_ERROR_INVALID_STATE);
  EXPECT_EQ(q, nullptr);
  EXPECT_STREQ(torpor_status_name(TORPOR_ERROR_INVALID_STATE), "TORPOR_ERROR_INVALID_STATE");
  ASSERT_EQ(torpor_wake_up(pool, nullptr, 0), TORPOR_OK);
  EXPECT_EQ(torpor_free(pool, p), TORPOR_OK);
  EXPECT_EQ(torpor_free(pool, p), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("double free"), std::string::npos);
}

// What a binding builds its tables from: every enumerator of torpor.h by name and value, and
// nothing past the ends (the Python suite checks the same against the header's text).
TEST(CApiEnums, NamesAndValuesMatchTheHeader) {
  EXPECT_EQ(torpor_status_value("TORPOR_OK"), TORPOR_OK);
  EXPECT_EQ(torpor_status_value("TORPOR_ERROR_TIMEOUT"), TORPOR_ERROR_TIMEOUT);
  EXPECT_EQ(torpor_status_value("TORPOR_ERROR_UNAVAILABLE"), TORPOR_ERROR_UNAVAILABLE);
  EXPECT_EQ(torpor_status_value("TORPOR_ERROR_UNKNOWN"), -1);
  EXPECT_EQ(torpor_status_value("timeout"), -1);
  EXPECT_EQ(torpor_status_value(nullptr), -1);

  const std::vector<std::pair<int, const char*>> classes = {{TORPOR_CLASS_PARAMETER, "parameter"},
                                                            {TORPOR_CLASS_STATE, "state"},
                                                            {TORPOR_CLASS_CACHE, "cache"}};
  for (const auto& [value, name] : classes) EXPECT_STREQ(torpor_class_name(value), name);
  EXPECT_EQ(torpor_class_name(-1), nullptr);
  EXPECT_EQ(torpor_class_name(TORPOR_CLASS_CACHE + 1), nullptr);

  EXPECT_STREQ(torpor_backend_name(TORPOR_BACKEND_AUTO), "auto");
  EXPECT_STREQ(torpor_backend_name(TORPOR_BACKEND_HOST), "host");
  EXPECT_STREQ(torpor_backend_name(TORPOR_BACKEND_CUDA), "cuda");
  EXPECT_EQ(torpor_backend_name(-1), nullptr);
  EXPECT_EQ(torpor_backend_name(TORPOR_BACKEND_CUDA + 1), nullptr);

  EXPECT_STREQ(torpor_fill_name(TORPOR_FILL_NONE), "none");
  EXPECT_STREQ(torpor_fill_name(TORPOR_FILL_ZERO), "zero");
  EXPECT_STREQ(torpor_fill_name(TORPOR_FILL_POISON), "poison");
  EXPECT_EQ(torpor_fill_name(-1), nullptr);
  EXPECT_EQ(torpor_fill_name(TORPOR_FILL_POISON + 1), nullptr);

  EXPECT_STREQ(torpor_sleep_level_name(TORPOR_SLEEP_NONE), "none");
  EXPECT_STREQ(torpor_sleep_level_name(TORPOR_SLEEP_OFFLOAD), "offload");
  EXPECT_STREQ(torpor_sleep_level_name(TORPOR_SLEEP_DISCARD_PARAMETERS), "discard_parameters");
  EXPECT_EQ(torpor_sleep_level_name(-1), nullptr);
  EXPECT_EQ(torpor_sleep_level_name(TORPOR_SLEEP_DISCARD_PARAMETERS + 1), nullptr);
}

// The graph-memory entries check their arguments before asking a driver, and without a usable GPU
// say so (UNAVAILABLE, naming the cuda backend), never crash or report 0. The GPU side (a graph
// with memory nodes counted) is tests/python/test_graphs_gpu.py's and the fusion runner's.
TEST(CApi, GraphMemoryEntriesCheckArgumentsAndNameAMissingGpu) {
  std::size_t count = 7;
  EXPECT_EQ(torpor_graph_memory_nodes(0x1000, nullptr), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(torpor_graph_memory_nodes(0, &count), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("graph is 0"), std::string::npos) << torpor_last_error();
  EXPECT_EQ(count, 7u);
  unsigned long long used = 0;
  unsigned long long reserved = 0;
  EXPECT_EQ(torpor_graph_memory(0, nullptr, &reserved), TORPOR_ERROR_INVALID_ARGUMENT);
  // Whether a usable GPU is here, asked of the pool API rather than of the entries under test.
  torpor_pool_options o;
  torpor_pool_options_init(&o);
  o.backend = TORPOR_BACKEND_CUDA;
  torpor_pool_t gpu_pool = nullptr;
  const bool gpu = torpor_pool_create(&o, &gpu_pool) == TORPOR_OK;
  if (gpu) ASSERT_EQ(torpor_pool_destroy(gpu_pool), TORPOR_OK);
  const torpor_status s = torpor_graph_memory(0, &used, &reserved);
  if (gpu) {
    EXPECT_EQ(s, TORPOR_OK) << torpor_last_error();
    return;
  }
  EXPECT_EQ(s, TORPOR_ERROR_UNAVAILABLE) << torpor_last_error();
  EXPECT_NE(std::string(torpor_last_error()).find("cuda backend"), std::string::npos) << torpor_last_error();
  EXPECT_EQ(torpor_graph_memory_nodes(0x1000, &count), TORPOR_ERROR_UNAVAILABLE) << torpor_last_error();
}

TEST_F(CPoolFixture, MarkAndPreserveThroughTheCApi) {
  void* seg = nullptr;
  ASSERT_EQ(torpor_alloc(pool, 8192, "weights", TORPOR_CLASS_STATE, nullptr, &seg), TORPOR_OK);
  ASSERT_EQ(torpor_mark(pool, seg, 4096, TORPOR_CLASS_PARAMETER, "embed.weight"), TORPOR_OK);
  ASSERT_EQ(torpor_mark(pool, static_cast<char*>(seg) + 4096, 4096, TORPOR_CLASS_PARAMETER, "lm_head.weight"),
            TORPOR_OK);
  const char* globs[] = {"embed.*"};
  ASSERT_EQ(torpor_set_preserve(pool, globs, 1), TORPOR_OK);
  std::vector<unsigned char> src(8192, 0x3C);
  ASSERT_EQ(torpor_copy(pool, seg, src.data(), src.size()), TORPOR_OK);
  ASSERT_EQ(torpor_sleep(pool, 2, nullptr, 0), TORPOR_OK);
  ASSERT_EQ(torpor_wake_up(pool, nullptr, 0), TORPOR_OK);
  std::vector<unsigned char> back(8192);
  ASSERT_EQ(torpor_copy(pool, back.data(), seg, back.size()), TORPOR_OK);
  EXPECT_EQ(back[0], 0x3C) << "preserved parameter kept";
  EXPECT_EQ(back[4096], 0xFF) << "other parameter discarded";
  EXPECT_EQ(torpor_free(pool, seg), TORPOR_OK);
}

// Sleep hooks (torpor_add_sleep_hook): what the PyTorch layer's re-mark relies on. The oracle is
// the bytes a wake restores, written by the test itself, and the calls the hooks recorded.
struct HookLog {
  std::vector<std::string> calls;  // "sleep 2 weights", "wake weights ok"
  void* remark = nullptr;          // marked state by before_sleep when set
  torpor_status refuse = TORPOR_OK;
};

std::string joined(const char* const* tags, size_t count) {
  std::string out;
  for (size_t i = 0; i < count; ++i) out += std::string(i ? "," : "") + tags[i];
  return out;
}

torpor_status record_sleep(void* user, torpor_pool_t pool, int level, const char* const* tags, size_t count,
                           char* message, size_t capacity) {
  auto* log = static_cast<HookLog*>(user);
  log->calls.push_back("sleep " + std::to_string(level) + " " + joined(tags, count));
  if (log->refuse != TORPOR_OK) {
    std::snprintf(message, capacity, "%s", "host store full (the test's hook)");
    return log->refuse;
  }
  if (log->remark != nullptr) return torpor_mark(pool, log->remark, 4096, TORPOR_CLASS_STATE, "kept");
  return TORPOR_OK;
}

void record_wake(void* user, torpor_pool_t /*pool*/, const char* const* tags, size_t count, int ok) {
  static_cast<HookLog*>(user)->calls.push_back("wake " + joined(tags, count) + (ok ? " ok" : " failed"));
}

TEST_F(CPoolFixture, ASleepHookMarksInsideTheSleepItRunsBefore) {
  void* w = nullptr;
  ASSERT_EQ(torpor_alloc(pool, 4096, "weights", TORPOR_CLASS_PARAMETER, "w", &w), TORPOR_OK);
  std::vector<unsigned char> src(4096, 0x5A);
  ASSERT_EQ(torpor_copy(pool, w, src.data(), src.size()), TORPOR_OK);
  HookLog log;
  log.remark = w;  // level 2 would discard the parameter; the hook makes it state first
  unsigned long long id = 0;
  ASSERT_EQ(torpor_add_sleep_hook(pool, record_sleep, record_wake, &log, &id), TORPOR_OK) << torpor_last_error();
  EXPECT_NE(id, 0u);
  ASSERT_EQ(torpor_sleep(pool, 0, nullptr, 0), TORPOR_OK);
  EXPECT_TRUE(log.calls.empty()) << "level 0 moves nothing and calls no hook";
  ASSERT_EQ(torpor_sleep(pool, 2, nullptr, 0), TORPOR_OK) << torpor_last_error();
  ASSERT_EQ(torpor_wake_up(pool, nullptr, 0), TORPOR_OK) << torpor_last_error();
  std::vector<unsigned char> back(4096);
  ASSERT_EQ(torpor_copy(pool, back.data(), w, back.size()), TORPOR_OK);
  EXPECT_EQ(back, src) << "the hook's mark applied to the sleep it ran in";
  EXPECT_EQ(log.calls, (std::vector<std::string>{"sleep 2 weights", "wake weights ok"}));
  ASSERT_EQ(torpor_remove_sleep_hook(pool, id), TORPOR_OK) << torpor_last_error();
  ASSERT_EQ(torpor_sleep(pool, 1, nullptr, 0), TORPOR_OK);
  ASSERT_EQ(torpor_wake_up(pool, nullptr, 0), TORPOR_OK);
  EXPECT_EQ(log.calls.size(), 2u) << "a removed hook is not called";
  EXPECT_EQ(torpor_remove_sleep_hook(pool, id), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("is not a sleep hook of this pool"), std::string::npos)
      << torpor_last_error();
  EXPECT_EQ(torpor_free(pool, w), TORPOR_OK);
}

TEST_F(CPoolFixture, ASleepHookThatFailsAbortsTheSleepBeforeAnythingMoved) {
  void* s = nullptr;
  ASSERT_EQ(torpor_alloc(pool, 4096, "weights", TORPOR_CLASS_STATE, "s", &s), TORPOR_OK);
  std::vector<unsigned char> src(4096, 0x7E);
  ASSERT_EQ(torpor_copy(pool, s, src.data(), src.size()), TORPOR_OK);
  HookLog first, second;
  first.refuse = TORPOR_ERROR_OUT_OF_MEMORY;
  unsigned long long a = 0, b = 0;
  ASSERT_EQ(torpor_add_sleep_hook(pool, record_sleep, nullptr, &first, &a), TORPOR_OK);
  ASSERT_EQ(torpor_add_sleep_hook(pool, record_sleep, nullptr, &second, &b), TORPOR_OK);
  EXPECT_NE(a, b);
  const std::string before = stats();
  EXPECT_EQ(torpor_sleep(pool, 1, nullptr, 0), TORPOR_ERROR_OUT_OF_MEMORY);
  const std::string message = torpor_last_error();
  EXPECT_NE(message.find("torpor_sleep: sleep hook"), std::string::npos) << message;
  EXPECT_NE(message.find("host store full (the test's hook)"), std::string::npos) << message;
  EXPECT_EQ(stats(), before) << "nothing moved";
  EXPECT_TRUE(second.calls.empty()) << "a later hook does not run once one refused";
  std::vector<unsigned char> back(4096);
  ASSERT_EQ(torpor_copy(pool, back.data(), s, back.size()), TORPOR_OK);
  EXPECT_EQ(back, src);
  first.refuse = TORPOR_ERROR_DRIVER;
  EXPECT_EQ(torpor_sleep(pool, 1, nullptr, 0), TORPOR_ERROR_INTERNAL) << "other statuses come back as internal";
  EXPECT_NE(std::string(torpor_last_error()).find("TORPOR_ERROR_DRIVER"), std::string::npos) << torpor_last_error();
  first.refuse = TORPOR_OK;
  ASSERT_EQ(torpor_sleep(pool, 1, nullptr, 0), TORPOR_OK) << "the same call succeeds once the cause is gone";
  EXPECT_EQ(second.calls, (std::vector<std::string>{"sleep 1 weights"}));
  ASSERT_EQ(torpor_wake_up(pool, nullptr, 0), TORPOR_OK);
  EXPECT_EQ(torpor_remove_sleep_hook(pool, a), TORPOR_OK);
  EXPECT_EQ(torpor_remove_sleep_hook(pool, b), TORPOR_OK);
  EXPECT_EQ(torpor_free(pool, s), TORPOR_OK);
}

TEST_F(CPoolFixture, SleepHookArgumentsAreChecked) {
  unsigned long long id = 7;
  EXPECT_EQ(torpor_add_sleep_hook(pool, nullptr, nullptr, nullptr, &id), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(id, 0u);
  EXPECT_NE(std::string(torpor_last_error()).find("both NULL"), std::string::npos) << torpor_last_error();
  EXPECT_EQ(torpor_add_sleep_hook(pool, record_sleep, nullptr, nullptr, nullptr), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(torpor_add_sleep_hook(nullptr, record_sleep, nullptr, nullptr, &id), TORPOR_ERROR_INVALID_HANDLE);
  EXPECT_EQ(torpor_remove_sleep_hook(pool, 12345), TORPOR_ERROR_INVALID_ARGUMENT);
}

}  // namespace
