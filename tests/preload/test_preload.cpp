// libtorpor_preload.so on the host backend: this program calls cudaMalloc / cudaFree as an
// application linked against the CUDA runtime does (here the fake of fake_cudart.h), runs with
// the preload library on LD_PRELOAD (tests/CMakeLists.txt), and reaches torch_memory_saver's
// entry points by name with dlsym, as TMS's Python layer does with ctypes. The oracles: the bytes
// written before a pause (kept, or discarded to torpor's 0xFF poison), the fake runtime's count of
// its own blocks, torpor's pool (torpor_find: who holds an address), the spill file's size.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "fake_cudart.h"
#include "torpor/torch_allocator.h"
#include "torpor/torpor.h"

namespace {

template <class Fn>
Fn entry(const char* name) {
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, name));
  if (fn == nullptr) ADD_FAILURE() << name << " is not exported (is libtorpor_preload.so on LD_PRELOAD?)";
  return fn;
}

struct Tms {
  void (*set_interesting_region)(bool) = entry<void (*)(bool)>("tms_set_interesting_region");
  bool (*get_interesting_region)() = entry<bool (*)()>("tms_get_interesting_region");
  void (*set_current_tag)(const char*) = entry<void (*)(const char*)>("tms_set_current_tag");
  const char* (*get_current_tag)() = entry<const char* (*)()>("tms_get_current_tag");
  void (*set_enable_cpu_backup)(bool) = entry<void (*)(bool)>("tms_set_enable_cpu_backup");
  bool (*get_enable_cpu_backup)() = entry<bool (*)()>("tms_get_enable_cpu_backup");
  void (*set_cpu_backup_backend)(const char*) = entry<void (*)(const char*)>("tms_set_cpu_backup_backend");
  const char* (*get_cpu_backup_backend)() = entry<const char* (*)()>("tms_get_cpu_backup_backend");
  void (*set_enable_disk_backup)(bool) = entry<void (*)(bool)>("tms_set_enable_disk_backup");
  bool (*get_enable_disk_backup)() = entry<bool (*)()>("tms_get_enable_disk_backup");
  void (*set_disk_backup_dir)(const char*) = entry<void (*)(const char*)>("tms_set_disk_backup_dir");
  void (*set_memory_margin_bytes)(std::uint64_t) = entry<void (*)(std::uint64_t)>("set_memory_margin_bytes");
  void (*set_retain_cpu_backup)(bool) = entry<void (*)(bool)>("tms_set_retain_cpu_backup");
  bool (*get_retain_cpu_backup)() = entry<bool (*)()>("tms_get_retain_cpu_backup");
  int (*pause)(const char*) = entry<int (*)(const char*)>("tms_pause");
  int (*resume)(const char*) = entry<int (*)(const char*)>("tms_resume");
  std::uint8_t* (*get_cpu_backup_pointer)(const std::uint8_t*, std::uint64_t) =
      entry<std::uint8_t* (*)(const std::uint8_t*, std::uint64_t)>("tms_get_cpu_backup_pointer");
};

const Tms& tms() {
  static const Tms t;
  return t;
}

// The torch pools' options, before the first allocation: discarded bytes come back as 0xFF.
void configure_poison() {
  static bool done = [] {
    torpor_pool_options o;
    torpor_pool_options_init(&o);
    o.backend = TORPOR_BACKEND_HOST;
    o.fill_on_wake = TORPOR_FILL_POISON;
    o.va_bytes = size_t{1} << 30;
    EXPECT_EQ(torpor_torch_configure(&o), TORPOR_OK) << torpor_last_error();
    return true;
  }();
  (void)done;
}

std::vector<std::uint8_t> pattern(size_t n, unsigned seed) {
  std::vector<std::uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint8_t>((i * 131 + seed * 7 + i / 4096) % 251);  // never 0xFF
  return v;
}

bool in_torpor(const void* p) {
  torpor_pool_t pool = nullptr;
  if (torpor_torch_pool(0, &pool) != TORPOR_OK) return false;
  void* base = nullptr;
  size_t bytes = 0;
  return torpor_find(pool, p, &base, &bytes) == TORPOR_OK;
}

// A region as torch_memory_saver's Python layer opens one (entrypoint.py _with_region_config).
struct Region {
  Region(const char* tag, bool cpu_backup, const char* backend = nullptr, bool disk = false)
      : backend_before(tms().get_cpu_backup_backend()) {
    tms().set_current_tag(tag);
    tms().set_interesting_region(true);
    tms().set_enable_cpu_backup(cpu_backup);
    if (backend != nullptr) tms().set_cpu_backup_backend(backend);
    tms().set_enable_disk_backup(disk);
  }
  ~Region() {
    tms().set_interesting_region(false);
    tms().set_enable_cpu_backup(false);
    tms().set_enable_disk_backup(false);
    tms().set_current_tag("default");
    tms().set_cpu_backup_backend(backend_before.c_str());
  }
  std::string backend_before;
};

void* device_alloc(size_t n) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n), 0);
  return p;
}

constexpr size_t N = size_t{4} << 20;

TEST(Preload, OutsideARegionEveryCallGoesToTheRealRuntime) {
  configure_poison();
  ASSERT_FALSE(tms().get_interesting_region()) << "TMS_INIT_ENABLE is unset: no region at start";
  size_t before = fake_cudart_live_device_blocks();
  void* p = device_alloc(N);
  EXPECT_EQ(fake_cudart_live_device_blocks(), before + 1);
  EXPECT_FALSE(in_torpor(p));
  EXPECT_EQ(cudaFree(p), 0);
  EXPECT_EQ(fake_cudart_live_device_blocks(), before);
  EXPECT_EQ(cudaFree(nullptr), 0) << "cudaFree(NULL) is the runtime's no-op";
}

TEST(Preload, APauseDiscardsARegionWithoutBackupAndKeepsOneWithABackup) {
  configure_poison();
  size_t before = fake_cudart_live_device_blocks();
  void* cache = nullptr;
  void* kept = nullptr;
  {
    Region r("kv_cache", false);
    cache = device_alloc(N);
  }
  {
    Region r("weights", true);
    kept = device_alloc(N);
  }
  EXPECT_EQ(fake_cudart_live_device_blocks(), before) << "the region's memory is torpor's, not the runtime's";
  ASSERT_TRUE(in_torpor(cache) && in_torpor(kept));
  auto c = pattern(N, 1), k = pattern(N, 2);
  std::memcpy(cache, c.data(), N);
  std::memcpy(kept, k.data(), N);
  EXPECT_EQ(tms().pause(nullptr), 0);
  EXPECT_EQ(tms().pause(nullptr), 0) << "a second pause is a no-op (torch_memory_saver exits)";
  EXPECT_EQ(tms().resume(nullptr), 0);
  EXPECT_EQ(tms().resume(nullptr), 0) << "resuming awake memory is a no-op";
  EXPECT_EQ(std::memcmp(kept, k.data(), N), 0) << "a backed-up region comes back bit-exact";
  std::vector<std::uint8_t> poison(N, 0xFF);
  EXPECT_EQ(std::memcmp(cache, poison.data(), N), 0) << "a region without backup was discarded";
  EXPECT_EQ(cudaFree(cache), 0);
  EXPECT_EQ(cudaFree(kept), 0);
  EXPECT_FALSE(in_torpor(cache));
}

TEST(Preload, APauseOfOneTagLeavesTheOthersAwakeAndItsResumeRestoresIt) {
  configure_poison();
  void* a = nullptr;
  void* b = nullptr;
  {
    Region r("tag_a", true);
    a = device_alloc(N);
  }
  {
    Region r("tag_b", true);
    b = device_alloc(N);
  }
  auto pa = pattern(N, 3), pb = pattern(N, 4);
  std::memcpy(a, pa.data(), N);
  std::memcpy(b, pb.data(), N);
  EXPECT_EQ(tms().pause("tag_a"), 0);
  EXPECT_EQ(std::memcmp(b, pb.data(), N), 0) << "tag_b stays mapped and readable";
  auto pb2 = pattern(N, 5);
  std::memcpy(b, pb2.data(), N);
  EXPECT_EQ(tms().resume("tag_a"), 0);
  EXPECT_EQ(std::memcmp(a, pa.data(), N), 0);
  EXPECT_EQ(std::memcmp(b, pb2.data(), N), 0);
  EXPECT_EQ(tms().pause("no_such_tag"), 0) << "a tag no region used: nothing to do";
  EXPECT_EQ(cudaFree(a), 0);
  EXPECT_EQ(cudaFree(b), 0);
}

TEST(Preload, TheBackupPointerKeepsItsAddressAcrossARetainedResumeAndGoesWithout) {
  configure_poison();
  void* x = nullptr;
  void* lost = nullptr;
  {
    Region r("retained", true, "pinned");
    x = device_alloc(N);
  }
  {
    Region r("retained", false);
    lost = device_alloc(N);
  }
  auto first = pattern(N, 6);
  std::memcpy(x, first.data(), N);
  auto* gx = static_cast<const std::uint8_t*>(x);
  EXPECT_EQ(tms().get_cpu_backup_pointer(gx, N), nullptr) << "awake and never paused: no backup";
  size_t host_before = fake_cudart_live_host_blocks();
  ASSERT_EQ(tms().pause("retained"), 0);
  std::uint8_t* p1 = tms().get_cpu_backup_pointer(gx, N);
  ASSERT_NE(p1, nullptr);
  EXPECT_TRUE(fake_cudart_is_host_block(p1)) << "backend pinned: page-locked through cudaMallocHost";
  EXPECT_EQ(std::memcmp(p1, first.data(), N), 0);
  EXPECT_EQ(tms().get_cpu_backup_pointer(gx + 4096, 16), p1 + 4096) << "an inner range: the slot plus its offset";
  EXPECT_EQ(tms().get_cpu_backup_pointer(static_cast<const std::uint8_t*>(lost), N), nullptr)
      << "a region without backup has none";
  tms().set_retain_cpu_backup(true);
  ASSERT_TRUE(tms().get_retain_cpu_backup());
  ASSERT_EQ(tms().resume("retained"), 0);
  EXPECT_EQ(tms().get_cpu_backup_pointer(gx, N), p1) << "retained: same host address after resume";
  auto second = pattern(N, 7);
  std::memcpy(x, second.data(), N);
  ASSERT_EQ(tms().pause("retained"), 0);
  EXPECT_EQ(std::memcmp(p1, second.data(), N), 0) << "the pause renewed the slot in place";
  tms().set_retain_cpu_backup(false);
  ASSERT_EQ(tms().resume("retained"), 0);
  EXPECT_EQ(std::memcmp(x, second.data(), N), 0);
  EXPECT_EQ(tms().get_cpu_backup_pointer(gx, N), nullptr) << "a resume without retain frees the slot";
  EXPECT_EQ(fake_cudart_live_host_blocks(), host_before) << "its page-locked memory went back";
  EXPECT_EQ(cudaFree(x), 0);
  EXPECT_EQ(cudaFree(lost), 0);
}

// torch_memory_saver's library links the runtime, and its example reaches cudaHostGetFlags and
// cudaGetLastError through it (test/examples/cpu_backup.py _cuda_host_pointer_is_allocated at
// 4a43c97): the preload library's exports forward to the runtime (here the fake), and the
// page-locked backup goes with its allocation, whether that is freed awake or paused.
struct RuntimeEntries {
  int (*host_get_flags)(unsigned int*, void*) = entry<int (*)(unsigned int*, void*)>("cudaHostGetFlags");
  int (*get_last_error)() = entry<int (*)()>("cudaGetLastError");
};

bool exported_by_the_preload_library(const void* fn) {
  Dl_info info{};
  return dladdr(fn, &info) != 0 && std::string(info.dli_fname).find("libtorpor_preload") != std::string::npos;
}

bool host_allocated(const RuntimeEntries& rt, void* p) {
  unsigned int flags = 0;
  int status = rt.host_get_flags(&flags, p);
  if (status != 0) {
    EXPECT_EQ(rt.get_last_error(), status) << "the failure is the runtime's last error, once";
  }
  return status == 0;
}

TEST(Preload, ThePinnedBackupGoesWithItsAllocationAsCudaHostGetFlagsThroughTheLibrarySees) {
  configure_poison();
  RuntimeEntries rt;
  ASSERT_TRUE(exported_by_the_preload_library(reinterpret_cast<const void*>(rt.host_get_flags)));
  ASSERT_TRUE(exported_by_the_preload_library(reinterpret_cast<const void*>(rt.get_last_error)));
  EXPECT_EQ(rt.get_last_error(), 0);
  for (bool paused : {false, true}) {
    SCOPED_TRACE(paused ? "freed while paused" : "freed awake");
    std::string tag = paused ? "free_paused" : "free_awake";
    void* x = nullptr;
    {
      Region r(tag.c_str(), true);  // the default backend: pinned
      x = device_alloc(N);
    }
    auto bytes = pattern(N, paused ? 11 : 12);
    std::memcpy(x, bytes.data(), N);
    auto* gx = static_cast<const std::uint8_t*>(x);
    tms().set_retain_cpu_backup(true);
    ASSERT_EQ(tms().pause(tag.c_str()), 0);
    std::uint8_t* backup = tms().get_cpu_backup_pointer(gx + 4096, 4096);
    ASSERT_NE(backup, nullptr);
    EXPECT_EQ(std::memcmp(backup, bytes.data() + 4096, 4096), 0);
    EXPECT_TRUE(host_allocated(rt, backup)) << "page-locked while its allocation lives";
    if (!paused) {
      ASSERT_EQ(tms().resume(tag.c_str()), 0);
      EXPECT_EQ(tms().get_cpu_backup_pointer(gx + 4096, 4096), backup) << "retained: the same address";
      EXPECT_TRUE(host_allocated(rt, backup));
    }
    EXPECT_EQ(cudaFree(x), 0);
    EXPECT_FALSE(host_allocated(rt, backup)) << "freeing the allocation gives its page-locked backup back";
    EXPECT_EQ(rt.get_last_error(), 0) << "cleared by the read above";
    tms().set_retain_cpu_backup(false);
  }
}

TEST(Preload, FreeingPausedMemoryGivesItBack) {
  configure_poison();
  void* p = nullptr;
  {
    Region r("freed_paused", true, "mmap");
    p = device_alloc(N);
  }
  ASSERT_EQ(tms().pause("freed_paused"), 0);
  ASSERT_NE(tms().get_cpu_backup_pointer(static_cast<const std::uint8_t*>(p), N), nullptr);
  EXPECT_EQ(cudaFree(p), 0);
  EXPECT_FALSE(in_torpor(p));
  EXPECT_EQ(tms().get_cpu_backup_pointer(static_cast<const std::uint8_t*>(p), N), nullptr);
  EXPECT_EQ(tms().resume("freed_paused"), 0) << "nothing left under the tag";
}

TEST(Preload, SettingsReadBackAsTorchMemorySaversDo) {
  EXPECT_STREQ(tms().get_current_tag(), "default");
  tms().set_current_tag("x");
  EXPECT_STREQ(tms().get_current_tag(), "x");
  tms().set_current_tag(nullptr);
  EXPECT_STREQ(tms().get_current_tag(), "x") << "a null tag is refused, the current one kept";
  tms().set_current_tag("default");
  EXPECT_STREQ(tms().get_cpu_backup_backend(), "pinned");
  tms().set_cpu_backup_backend("mmap");
  EXPECT_STREQ(tms().get_cpu_backup_backend(), "mmap");
  tms().set_cpu_backup_backend("disk");
  EXPECT_STREQ(tms().get_cpu_backup_backend(), "mmap") << "an unknown backend is refused";
  tms().set_cpu_backup_backend("pinned");
  EXPECT_FALSE(tms().get_enable_cpu_backup());
  EXPECT_FALSE(tms().get_enable_disk_backup());
  {
    Region r("both", true, nullptr, true);
    void* p = reinterpret_cast<void*>(1);
    EXPECT_EQ(cudaMalloc(&p, N), 1) << "CPU and disk backup together: cudaErrorInvalidValue";
  }
  tms().set_memory_margin_bytes(std::uint64_t{1} << 62);  // more than TORPOR_TORCH_MEMORY_MARGIN_MAX: refused
  EXPECT_EQ(torpor_torch_memory_margin(), 0u);
}

TEST(InitEnable, EveryAllocationIsInARegionFromTheStart) {
  const char* v = std::getenv("TMS_INIT_ENABLE");
  ASSERT_TRUE(v != nullptr && std::string(v) == "1") << "run with TMS_INIT_ENABLE=1 (tests/CMakeLists.txt)";
  configure_poison();
  ASSERT_TRUE(tms().get_interesting_region());
  size_t before = fake_cudart_live_device_blocks();
  void* p = device_alloc(N);
  EXPECT_TRUE(in_torpor(p));
  EXPECT_EQ(fake_cudart_live_device_blocks(), before);
  tms().set_interesting_region(false);
  void* q = device_alloc(N);
  EXPECT_FALSE(in_torpor(q)) << "a region turned off: the runtime's again";
  EXPECT_EQ(cudaFree(p), 0);
  EXPECT_EQ(cudaFree(q), 0);
}

TEST(Disk, ADiskRegionBacksUpIntoTorporsDiskTierInTheDirectory) {
  std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("torpor_preload_disk_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  tms().set_disk_backup_dir(dir.c_str());  // before the first allocation, as torch_memory_saver's example
  void* p = nullptr;
  void* p2 = nullptr;
  void* q = nullptr;
  {
    Region r("disk", false, nullptr, true);
    p = device_alloc(N);
    p2 = device_alloc(N / 4 + 12345);  // as torch_memory_saver's example: sizes off the granularity
  }
  {
    Region r("disk_cache", false);
    q = device_alloc(N);
  }
  auto data = pattern(N, 9);
  auto data2 = pattern(N / 4 + 12345, 10);
  std::memcpy(p, data.data(), N);
  std::memcpy(p2, data2.data(), data2.size());
  std::memcpy(q, data.data(), N);
  ASSERT_EQ(tms().pause(nullptr), 0);
  std::uintmax_t on_disk = 0;
  size_t files = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    on_disk += std::filesystem::file_size(f.path());
    ++files;
  }
  EXPECT_EQ(files, 2u) << "as torch_memory_saver: a backup file per disk-backed allocation";
  EXPECT_GE(on_disk, N + data2.size());
  torpor_pool_t pool = nullptr;
  ASSERT_EQ(torpor_torch_pool(0, &pool), TORPOR_OK);
  std::string stats(1 << 16, '\0');
  size_t needed = 0;
  ASSERT_EQ(torpor_stats_json(pool, stats.data(), stats.size(), &needed), TORPOR_OK);
  EXPECT_GE(on_disk, N) << "the disk region's bytes are in a file of the directory: " << stats.c_str();
  EXPECT_EQ(tms().get_cpu_backup_pointer(static_cast<const std::uint8_t*>(p), N), nullptr)
      << "as torch_memory_saver: a disk backup has no CPU pointer";
  ASSERT_EQ(tms().resume(nullptr), 0);
  EXPECT_EQ(std::memcmp(p, data.data(), N), 0);
  EXPECT_EQ(std::memcmp(p2, data2.data(), data2.size()), 0);
  EXPECT_NE(std::memcmp(q, data.data(), N), 0) << "the region without backup was discarded";
  EXPECT_EQ(cudaFree(p2), 0);
  EXPECT_EQ(cudaFree(p), 0);
  EXPECT_EQ(cudaFree(q), 0);
  std::filesystem::remove_all(dir);
}

// PyTorch's caching allocator, on an out-of-memory cudaMalloc, frees its cached blocks with
// cudaFree (checking each) and retries: memory freed through the interposer must be the
// driver's again, and those cudaFree calls must not report the earlier cudaMalloc's failure
// (test/examples/training_engine.py's cache-eviction step at 4a43c97). Run with a small emulated
// device (TORPOR_HOST_DEVICE_MEMORY, tests/CMakeLists.txt).
TEST(Oom, AnAllocationThatDidNotFitFitsAfterTheFreesThroughTheInterposer) {
  const char* v = std::getenv("TORPOR_HOST_DEVICE_MEMORY");
  ASSERT_TRUE(v != nullptr && std::string(v) == "64M") << "run with TORPOR_HOST_DEVICE_MEMORY=64M";
  configure_poison();
  constexpr size_t mib = size_t{1} << 20;
  void* a = nullptr;
  void* b = nullptr;
  void* c = nullptr;
  Region r("default", true);
  ASSERT_EQ(cudaMalloc(&a, 24 * mib), 0);
  ASSERT_EQ(cudaMalloc(&b, 24 * mib), 0);
  EXPECT_EQ(cudaMalloc(&c, 40 * mib), 2) << "48 of 64 MiB held: cudaErrorMemoryAllocation";
  EXPECT_EQ(cudaFree(a), 0) << "a free after a failed cudaMalloc succeeds";
  EXPECT_EQ(cudaFree(b), 0);
  ASSERT_EQ(cudaMalloc(&c, 40 * mib), 0) << "the freed memory went back to the device";
  EXPECT_TRUE(in_torpor(c));
  EXPECT_EQ(cudaFree(c), 0);
}

}  // namespace
