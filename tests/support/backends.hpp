// Backends for typed test suites: every pool/sleep test runs once per backend. The host
// backend always runs; host_async is the same emulation with device work done later on worker
// threads, in stream order, after random delays (HostDriverOptions::async), so that a missing
// wait (for copies before unmapping, for a stream before reading) fails on a CPU machine; the
// cuda backend skips, saying why, when no usable GPU is present.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "torpor/driver.hpp"
#include "torpor/host_driver.hpp"
#include "torpor/pool.hpp"
#ifdef TORPOR_HAVE_CUDA
#include "driver/cuda_driver.hpp"
#endif

namespace torpor::test {

struct HostBackend {
  static constexpr const char* name = "host";
  // Small emulated devices and a small granularity keep the suite fast; semantics are the same.
  static HostDriverOptions options() {
    HostDriverOptions o;
    o.devices = 2;
    o.device_bytes = std::size_t{512} << 20;
    o.granularity = std::size_t{64} << 10;
    return o;
  }
  static std::shared_ptr<Driver> open(std::string& skip) {
    (void)skip;
    return std::make_shared<HostDriver>(options());
  }
};

struct HostAsyncBackend {
  static constexpr const char* name = "host_async";
  static HostDriverOptions options() {
    HostDriverOptions o = HostBackend::options();
    o.async = true;
    o.async_seed = 17;
    o.async_max_delay = std::chrono::microseconds{100};
    return o;
  }
  static std::shared_ptr<Driver> open(std::string& skip) {
    (void)skip;
    return std::make_shared<HostDriver>(options());
  }
};

struct CudaBackend {
  static constexpr const char* name = "cuda";
  static std::shared_ptr<Driver> open(std::string& skip) {
#ifdef TORPOR_HAVE_CUDA
    std::string why;
    auto d = CudaDriver::open(&why);
    if (!d) {
      skip = "no usable GPU: " + why;
      return nullptr;
    }
    if (!d->device_properties(0).vmm_supported) {
      skip = "device 0 lacks VMM support";
      return nullptr;
    }
    return std::shared_ptr<Driver>(std::move(d));
#else
    skip = "built without the CUDA backend (TORPOR_CUDA=OFF)";
    return nullptr;
#endif
  }
};

using Backends = ::testing::Types<HostBackend, HostAsyncBackend, CudaBackend>;

struct BackendNames {
  template <typename T>
  static std::string GetName(int) {
    return T::name;
  }
};

// Fixture base: opens the backend's driver or skips with the reason.
template <typename B>
class BackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string skip;
    driver_ = B::open(skip);
    if (!driver_) GTEST_SKIP() << skip;
  }
  // The asynchronous emulation refuses (and counts) an unmap or a host_free of memory that a
  // queued operation still touches; code that swallows the refusal (a rollback that logs) must
  // not hide it.
  void TearDown() override {
    if (HostDriver* h = host()) {
      HostDriverCounters c = h->counters();
      EXPECT_EQ(c.async_conflicts, 0u) << "memory was unmapped or freed while queued device work still touched it";
      EXPECT_EQ(c.async_races, 0u) << "queued work on two streams touched the same bytes with nothing ordering them";
      EXPECT_EQ(c.async_host_writes, 0u) << "the host changed a page-locked span while a queued copy still targeted it";
    }
  }
  Driver& driver() { return *driver_; }
  HostDriver* host() { return dynamic_cast<HostDriver*>(driver_.get()); }
  std::size_t granularity() { return driver_->device_properties(0).granularity; }
  // Small slabs and dedicated chunks only: the chunk layout a test asserts stays obvious.
  PoolOptions small_pool(FillOnWake fill = FillOnWake::none) {
    PoolOptions o;
    o.va_bytes = std::size_t{256} << 20;
    o.fill_on_wake = fill;
    o.medium_limit = 0;
    return o;
  }
  // All three size classes, medium slabs scaled to the granularity.
  PoolOptions tiered_pool(FillOnWake fill = FillOnWake::none) {
    PoolOptions o = small_pool(fill);
    std::size_t g = granularity();
    // Sizes here scale with the granularity (2 MiB on a GPU, 64 KiB on the host backend): so
    // does the address space, or a random sequence fragments it before it fills the device.
    o.va_bytes = std::max(o.va_bytes, 2048 * g);
    o.medium_limit = 8 * g;
    o.medium_slab_min = 4 * g;
    o.medium_slab_max = 16 * g;
    return o;
  }
  std::shared_ptr<Driver> driver_;
};

inline std::vector<std::uint8_t> random_bytes(std::mt19937_64& rng, std::size_t n) {
  std::vector<std::uint8_t> v(n);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t x = rng();
    std::memcpy(v.data() + i, &x, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<std::uint8_t>(rng());
  return v;
}

inline void write(Pool& pool, void* p, const std::vector<std::uint8_t>& bytes) {
  pool.copy(p, bytes.data(), bytes.size());
}

inline std::vector<std::uint8_t> read(Pool& pool, const void* p, std::size_t n) {
  std::vector<std::uint8_t> v(n);
  pool.copy(v.data(), p, n);
  return v;
}

inline void* at(void* p, std::size_t off) { return static_cast<std::byte*>(p) + off; }

}  // namespace torpor::test
