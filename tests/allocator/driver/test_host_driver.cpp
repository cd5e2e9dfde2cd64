// HostDriver: the emulation must behave like the GPU's VMM API where torpor relies on it,
// and catch misuse with driver_error instead of corrupting memory.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "torpor/error.hpp"
#include "torpor/host_driver.hpp"

namespace torpor {
namespace {

constexpr std::size_t G = std::size_t{64} << 10;

HostDriverOptions opts() {
  HostDriverOptions o;
  o.devices = 2;
  o.device_bytes = 16 * G;
  o.granularity = G;
  return o;
}

struct Mapped {
  HostDriver& d;
  device_ptr va;
  PhysicalHandle h;
};

TEST(HostDriver, MapSetAccessWriteReadUnmapRelease) {
  HostDriver d(opts());
  device_ptr va = d.reserve(4 * G, G);
  PhysicalHandle h = d.create(0, 2 * G, false);
  EXPECT_EQ(d.live_physical_bytes(0), 2 * G);
  d.map(va, 2 * G, h, 0);
  int dev = 0;
  d.set_access(va, 2 * G, std::span<const int>(&dev, 1));
  auto* p = reinterpret_cast<std::uint64_t*>(va);
  p[0] = 0x1234567890abcdefULL;
  p[2 * G / 8 - 1] = 42;
  EXPECT_EQ(p[0], 0x1234567890abcdefULL);
  d.unmap(va, 2 * G);
  d.release(h);
  EXPECT_EQ(d.live_physical_bytes(0), 0u);
  auto c = d.counters();
  EXPECT_EQ(c.live_handles, 0u);
  EXPECT_EQ(c.mappings, 0u);
  d.free_reservation(va, 4 * G);
  EXPECT_EQ(d.counters().reservations, 0u);
}

TEST(HostDriver, ReleaseWhileMappedKeepsMemoryUntilUnmap) {
  HostDriver d(opts());
  device_ptr va = d.reserve(2 * G, G);
  PhysicalHandle h = d.create(1, G, false);
  d.map(va, G, h, 0);
  int dev = 1;
  d.set_access(va, G, std::span<const int>(&dev, 1));
  *reinterpret_cast<int*>(va) = 7;
  d.release(h);  // allowed, as on the GPU
  EXPECT_EQ(d.counters().live_handles, 0u);
  EXPECT_EQ(d.live_physical_bytes(1), G) << "a mapping keeps the memory alive";
  EXPECT_EQ(*reinterpret_cast<int*>(va), 7);
  d.unmap(va, G);
  EXPECT_EQ(d.live_physical_bytes(1), 0u);
  d.free_reservation(va, 2 * G);
}

TEST(HostDriver, MisuseIsReportedNotSilentlyAccepted) {
  HostDriver d(opts());
  device_ptr va = d.reserve(4 * G, G);
  PhysicalHandle h = d.create(0, 2 * G, false);
  d.map(va, 2 * G, h, 0);
  // Unmap of a span that is not exactly one mapping.
  EXPECT_THROW(d.unmap(va, G), driver_error);
  EXPECT_THROW(d.unmap(va + G, G), driver_error);
  // Mapping over a mapping.
  PhysicalHandle h2 = d.create(0, G, false);
  EXPECT_THROW(d.map(va + G, G, h2, 0), driver_error);
  // Outside the reservation, misaligned, beyond the handle.
  EXPECT_THROW(d.map(va + 4 * G, G, h2, 0), driver_error);
  EXPECT_THROW(d.map(va + 2 * G + 1, G, h2, 0), driver_error);
  EXPECT_THROW(d.map(va + 2 * G, 2 * G, h2, 0), driver_error);
  // set_access over a hole.
  int dev = 0;
  EXPECT_THROW(d.set_access(va, 3 * G, std::span<const int>(&dev, 1)), driver_error);
  // Freeing a reservation with a live mapping.
  EXPECT_THROW(d.free_reservation(va, 4 * G), driver_error);
  // Release of an unknown handle / twice.
  d.release(h2);
  EXPECT_THROW(d.release(h2), driver_error);
  // Invalid device; size not a multiple of the granularity.
  EXPECT_THROW(d.create(5, G, false), driver_error);
  EXPECT_THROW(d.create(0, G + 1, false), driver_error);
  d.unmap(va, 2 * G);
  d.release(h);
  d.free_reservation(va, 4 * G);
  EXPECT_EQ(d.counters().live_physical_bytes, 0u);
}

TEST(HostDriver, CreateBeyondCapacityIsOutOfMemoryAndChangesNothing) {
  HostDriver d(opts());
  PhysicalHandle a = d.create(0, 12 * G, false);
  try {
    d.create(0, 8 * G, false);
    FAIL() << "expected out of memory";
  } catch (const driver_error& e) {
    EXPECT_TRUE(e.is_out_of_memory()) << e.what();
    EXPECT_NE(std::string(e.what()).find("cuMemCreate"), std::string::npos);
  }
  EXPECT_EQ(d.live_physical_bytes(0), 12 * G);
  EXPECT_EQ(d.memory_info(0).free_bytes, 4 * G);
  d.release(a);
  EXPECT_EQ(d.memory_info(0).free_bytes, 16 * G);
}

TEST(HostDriver, CopiesFromUnmappedMemoryAreErrors) {
  HostDriver d(opts());
  Stream s = d.stream_create(0);
  device_ptr va = d.reserve(2 * G, G);
  std::vector<char> buf(64);
  EXPECT_THROW(d.copy_async(buf.data(), reinterpret_cast<void*>(va), 64, s), driver_error);
  PhysicalHandle h = d.create(0, G, false);
  d.map(va, G, h, 0);
  // Mapped but no access yet: still an error, as on the GPU.
  EXPECT_THROW(d.copy_async(buf.data(), reinterpret_cast<void*>(va), 64, s), driver_error);
  int dev = 0;
  d.set_access(va, G, std::span<const int>(&dev, 1));
  std::memset(buf.data(), 0x5a, 64);
  d.copy_async(reinterpret_cast<void*>(va), buf.data(), 64, s);
  EXPECT_EQ(*reinterpret_cast<unsigned char*>(va + 63), 0x5a);
  // A copy running off the end of the mapping.
  EXPECT_THROW(d.copy_async(buf.data(), reinterpret_cast<void*>(va + G - 8), 64, s), driver_error);
  d.unmap(va, G);
  d.release(h);
  d.free_reservation(va, 2 * G);
  d.stream_destroy(s);
}

TEST(HostDriverDeathTest, TouchingAnUnmappedAddressFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  HostDriver d(opts());
  device_ptr va = d.reserve(2 * G, G);
  PhysicalHandle h = d.create(0, G, false);
  d.map(va, G, h, 0);
  int dev = 0;
  d.set_access(va, G, std::span<const int>(&dev, 1));
  *reinterpret_cast<volatile int*>(va) = 1;
  d.unmap(va, G);  // as after sleep: the address stays reserved, the memory is gone
  EXPECT_DEATH({ *reinterpret_cast<volatile int*>(va) = 2; }, "");
  d.release(h);
  d.free_reservation(va, 2 * G);
}

TEST(HostDriver, ExportImportSharesTheSameBytes) {
  HostDriver d(opts());
  PhysicalHandle h = d.create(0, G, true);
  int fd = d.export_fd(h);
  ASSERT_GE(fd, 0);
  PhysicalHandle imported = d.import_fd(fd);
  ::close(fd);
  device_ptr a = d.reserve(G, G), b = d.reserve(G, G);
  int devs[] = {0, 1};
  d.map(a, G, h, 0);
  d.map(b, G, imported, 0);
  d.set_access(a, G, devs);
  d.set_access(b, G, devs);
  *reinterpret_cast<int*>(a) = 99;
  EXPECT_EQ(*reinterpret_cast<int*>(b), 99);
  // One piece of memory, counted once, alive while either handle or mapping is.
  EXPECT_EQ(d.live_physical_bytes(0), G);
  d.release(h);
  d.unmap(a, G);
  EXPECT_EQ(d.live_physical_bytes(0), G) << "the importer's mapping keeps it alive";
  d.unmap(b, G);
  d.release(imported);
  EXPECT_EQ(d.live_physical_bytes(0), 0u);
  d.free_reservation(a, G);
  d.free_reservation(b, G);
  PhysicalHandle plain = d.create(0, G, false);
  EXPECT_THROW(d.export_fd(plain), driver_error);
  d.release(plain);
}

TEST(HostDriver, MulticastBindBeforeEveryDeviceAddedIsAnError) {
  HostDriver d(opts());
  int devs[] = {0, 1};
  MulticastHandle mc = d.multicast_create(devs, G);
  PhysicalHandle m0 = d.create(0, G, false), m1 = d.create(1, G, false);
  d.multicast_add_device(mc, 0);
  EXPECT_THROW(d.multicast_bind(mc, 0, m0, 0, G), driver_error);
  d.multicast_add_device(mc, 1);
  EXPECT_THROW(d.multicast_add_device(mc, 1), driver_error);
  d.multicast_bind(mc, 0, m0, 0, G);
  d.multicast_bind(mc, 0, m1, 0, G);
  EXPECT_THROW(d.multicast_bind(mc, 0, m1, 0, G), driver_error) << "device 1 already bound there";

  // A multicast store fans out to every bound buffer.
  device_ptr mva = d.reserve(G, G), a = d.reserve(G, G), b = d.reserve(G, G);
  d.map(mva, G, d.as_physical(mc), 0);
  d.map(a, G, m0, 0);
  d.map(b, G, m1, 0);
  d.set_access(mva, G, devs);
  d.set_access(a, G, devs);
  d.set_access(b, G, devs);
  const std::uint32_t v = 0xC0FFEE;
  d.multicast_store(mva + 128, &v, sizeof v);
  EXPECT_EQ(*reinterpret_cast<std::uint32_t*>(a + 128), v);
  EXPECT_EQ(*reinterpret_cast<std::uint32_t*>(b + 128), v);
  d.multicast_unbind(mc, 1, 0, G);
  const std::uint32_t w = 7;
  d.multicast_store(mva + 128, &w, sizeof w);
  EXPECT_EQ(*reinterpret_cast<std::uint32_t*>(a + 128), w);
  EXPECT_EQ(*reinterpret_cast<std::uint32_t*>(b + 128), v) << "unbound device no longer receives";
  EXPECT_THROW(d.multicast_unbind(mc, 1, 0, G), driver_error);
  d.unmap(mva, G);
  d.unmap(a, G);
  d.unmap(b, G);
  d.multicast_unbind(mc, 0, 0, G);
  d.multicast_release(mc);
  d.release(m0);
  d.release(m1);
  for (device_ptr r : {mva, a, b}) d.free_reservation(r, G);
  EXPECT_EQ(d.counters().multicast_objects, 0u);
  EXPECT_EQ(d.counters().live_physical_bytes, 0u);
}

TEST(HostDriver, MulticastRefusedWhenDevicesReportNoSupport) {
  HostDriverOptions o = opts();
  o.multicast_attribute = false;
  HostDriver d(o);
  int devs[] = {0, 1};
  EXPECT_FALSE(d.device_properties(0).multicast_attribute);
  EXPECT_THROW(d.multicast_create(devs, G), driver_error);
}

TEST(HostDriver, HostAllocAccounting) {
  HostDriver d(opts());
  void* p = d.host_alloc(1000);
  EXPECT_EQ(d.counters().host_bytes, 1000u);
  std::memset(p, 1, 1000);
  d.host_free(p);
  EXPECT_EQ(d.counters().host_bytes, 0u);
  EXPECT_THROW(d.host_free(p), driver_error);
}

}  // namespace
}  // namespace torpor
