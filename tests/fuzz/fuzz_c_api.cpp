// Fuzz target: the C API on the host backend, driven by a byte string read as a list of calls
// (alloc, free, mark, set_preserve, sleep, wake_up, copy, find, stats). Arguments come from the
// input unchecked: sizes up to 2^64 - 1, any int as class or level, tags and globs of arbitrary
// bytes. Pointers are an allocation's base plus an offset from the input, or a place in a host
// buffer of this harness (a C caller passing a wild host pointer is beyond any API's reach).
//
// Oracle: no crash or sanitizer report, never TORPOR_ERROR_INTERNAL (an internal error after a
// call that was accepted is issue 19's item 4), the stats document always available, a copy of a
// size that wraps the address space always refused, and bytes written through torpor_copy read
// back the same while the allocation is awake.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "torpor/torpor.h"

namespace {

// Reads the input front to back; past its end every read is zero.
class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) : p_(data), end_(data + size) {}
  bool done() const { return p_ >= end_; }
  std::uint8_t byte() { return p_ < end_ ? *p_++ : 0; }
  std::uint64_t u64(int bytes) {
    std::uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v = v << 8 | byte();
    return v;
  }
  std::string text() {
    std::string s;
    for (std::size_t n = byte() % 12; n > 0 && !done(); --n) s.push_back(static_cast<char>(byte()));
    return s;
  }

 private:
  const std::uint8_t* p_;
  const std::uint8_t* end_;
};

[[noreturn]] void fail(const char* what, torpor_status s) {
  std::fprintf(stderr, "fuzz_c_api: %s: %s: %s\n", what, torpor_status_name(s), torpor_last_error());
  std::abort();
}

void check(torpor_status s, const char* what) {
  if (s == TORPOR_ERROR_INTERNAL) fail(what, s);
}

// A size: mostly small, sometimes near the top of size_t.
std::size_t size_from(Input& in) {
  switch (in.byte() % 4) {
    case 0: return in.u64(1);
    case 1: return in.u64(3) % (std::size_t{4} << 20);
    case 2: return ~std::size_t{0} - in.u64(2);
    default: return in.u64(8);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const char* const tags_known[] = {"default", "weights", "kv_cache", "w\xc3\xa9"};
  torpor_pool_options o;
  torpor_pool_options_init(&o);
  o.backend = TORPOR_BACKEND_HOST;
  o.va_bytes = std::size_t{64} << 20;
  o.fill_on_wake = TORPOR_FILL_ZERO;
  torpor_pool_t pool = nullptr;
  if (torpor_pool_create(&o, &pool) != TORPOR_OK) fail("pool_create", TORPOR_ERROR_INTERNAL);
  std::vector<void*> live;
  std::vector<unsigned char> host(1 << 16);
  Input in(data, size);
  for (int step = 0; step < 64 && !in.done(); ++step) {
    auto pick_ptr = [&]() -> void* {
      if (!live.empty() && in.byte() % 2 == 0) return static_cast<char*>(live[in.byte() % live.size()]) + in.u64(2);
      return host.data() + in.u64(2) % host.size();
    };
    auto pick_tag = [&]() -> std::string {
      return in.byte() % 2 == 0 ? std::string(tags_known[in.byte() % 4]) : in.text();
    };
    switch (in.byte() % 10) {
      case 0:
      case 1: {
        std::size_t bytes = size_from(in);
        std::string tag = pick_tag(), name = in.text();
        int cls = static_cast<int>(in.u64(1)) - 8;
        void* p = nullptr;
        torpor_status s = torpor_alloc(pool, bytes, in.byte() % 8 == 0 ? nullptr : tag.c_str(), cls, name.c_str(), &p);
        check(s, "alloc");
        if (s == TORPOR_OK) live.push_back(p);
        break;
      }
      case 2: {
        if (live.empty()) break;
        std::size_t i = in.byte() % live.size();
        check(torpor_free(pool, live[i]), "free");
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
      case 3: {
        std::string name = in.text();
        check(torpor_mark(pool, pick_ptr(), size_from(in), static_cast<int>(in.u64(1)) - 8, name.c_str()), "mark");
        break;
      }
      case 4: {
        std::vector<std::string> globs(in.byte() % 3);
        for (auto& g : globs) g = in.text();
        std::vector<const char*> ptrs;
        for (auto& g : globs) ptrs.push_back(g.c_str());
        check(torpor_set_preserve(pool, ptrs.data(), ptrs.size()), "set_preserve");
        break;
      }
      case 5:
      case 6: {
        std::vector<std::string> tags(in.byte() % 3);
        for (auto& t : tags) t = pick_tag();
        std::vector<const char*> ptrs;
        for (auto& t : tags) ptrs.push_back(t.c_str());
        const int level = static_cast<int>(in.u64(1)) % 5 - 1;
        if (in.byte() % 2 == 0)
          check(torpor_sleep(pool, level, ptrs.empty() ? nullptr : ptrs.data(), ptrs.size()), "sleep");
        else
          check(torpor_wake_up(pool, ptrs.empty() ? nullptr : ptrs.data(), ptrs.size()), "wake_up");
        break;
      }
      case 7: {
        // Pool memory and host memory, any direction; a host range stays inside the harness's
        // buffer, a pool range is the API's to check.
        const bool to_pool = in.byte() % 2 == 0;
        if (live.empty()) break;
        char* pool_ptr = static_cast<char*>(live[in.byte() % live.size()]) + in.u64(2) % 4096;
        const std::size_t bytes = in.u64(2) % host.size();
        unsigned char* h = host.data() + (host.size() - bytes) * (in.byte() % 2);
        torpor_status s = to_pool ? torpor_copy(pool, pool_ptr, h, bytes) : torpor_copy(pool, h, pool_ptr, bytes);
        check(s, "copy");
        if (s == TORPOR_OK && to_pool && bytes > 0) {
          std::vector<unsigned char> back(bytes);
          check(torpor_copy(pool, back.data(), pool_ptr, bytes), "copy back");
          if (std::memcmp(back.data(), h, bytes) != 0) fail("bytes read back differ", TORPOR_OK);
        }
        break;
      }
      case 8: {
        // A size that wraps: always refused, whatever the pointers.
        const std::size_t bytes = ~std::size_t{0} - in.u64(2);
        torpor_status s = torpor_copy(pool, pick_ptr(), pick_ptr(), bytes);
        if (s != TORPOR_ERROR_INVALID_ARGUMENT) fail("a wrapping copy was not refused", s);
        break;
      }
      default: {
        void* base = nullptr;
        std::size_t bytes = 0;
        check(torpor_find(pool, pick_ptr(), &base, &bytes), "find");
        break;
      }
    }
    std::size_t needed = 0;
    torpor_status s = torpor_stats_json(pool, nullptr, 0, &needed);
    if (s != TORPOR_OK) fail("stats after a call", s);
  }
  for (void* p : live) check(torpor_free(pool, p), "free at the end");
  if (torpor_pool_destroy(pool) != TORPOR_OK) fail("pool_destroy", TORPOR_ERROR_INTERNAL);
  return 0;
}
