// HostDriver's asynchronous mode: device work completes later, in stream order, on a worker per
// stream; events and synchronisation really wait; memory a queued operation touches cannot be
// unmapped or freed (refused and counted, never a random fault). The oracle is the bytes in
// memory observed before and after each wait.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <vector>

#include "torpor/content_hash.hpp"
#include "torpor/error.hpp"
#include "torpor/host_driver.hpp"

namespace torpor {
namespace {

using namespace std::chrono_literals;

constexpr std::size_t G = std::size_t{64} << 10;

HostDriverOptions async_opts(std::chrono::microseconds max_delay = 50us) {
  HostDriverOptions o;
  o.devices = 2;
  o.device_bytes = 16 * G;
  o.granularity = G;
  o.async = true;
  o.async_seed = 3;
  o.async_max_delay = max_delay;
  return o;
}

// One granule of device memory on device 0 with access set, given back at the end.
struct DeviceBuffer {
  HostDriver& d;
  device_ptr va;
  PhysicalHandle h;
  explicit DeviceBuffer(HostDriver& drv) : d(drv), va(drv.reserve(G, G)), h(drv.create(0, G, false)) {
    d.map(va, G, h, 0);
    int dev = 0;
    d.set_access(va, G, std::span<const int>(&dev, 1));
  }
  ~DeviceBuffer() {
    d.device_synchronize(0);
    d.unmap(va, G);
    d.release(h);
    d.free_reservation(va, G);
  }
  unsigned char* bytes() const { return reinterpret_cast<unsigned char*>(va); }
  void* ptr() const { return reinterpret_cast<void*>(va); }
};

TEST(HostDriverAsync, CopiesCompleteLaterInStreamOrderAndSynchronizeWaits) {
  HostDriver d(async_opts());
  ASSERT_TRUE(d.asynchronous());
  Stream s = d.stream_create(0);
  {
    DeviceBuffer dev(d);
    auto* pinned = static_cast<unsigned char*>(d.host_alloc(256));
    std::memset(pinned, 0x11, 256);
    std::memset(dev.bytes(), 0, 256);
    d.delay_stream(s, 30ms);
    d.copy_async(dev.ptr(), pinned, 256, s);
    std::memset(pinned, 0x22, 128);  // pinned memory is read when the copy runs, as by a DMA engine
    d.copy_async(dev.ptr(), pinned, 64, s);
    EXPECT_EQ(dev.bytes()[0], 0) << "the copy has not run yet";
    EXPECT_GE(d.counters().async_pending, 2u);
    d.stream_synchronize(s);
    EXPECT_EQ(d.counters().async_pending, 0u);
    EXPECT_EQ(dev.bytes()[0], 0x22) << "stream order: the second copy ran after the first";
    EXPECT_EQ(dev.bytes()[127], 0x22);
    EXPECT_EQ(dev.bytes()[128], 0x11);
    d.host_free(pinned);
  }
  d.stream_destroy(s);
  EXPECT_EQ(d.counters().async_conflicts, 0u);
}

TEST(HostDriverAsync, PageableSourcesAreTakenWhenQueuedAndPageableDestinationsOnReturn) {
  HostDriver d(async_opts());
  Stream s = d.stream_create(0);
  {
    DeviceBuffer dev(d);
    std::vector<unsigned char> src(256, 0x33);
    d.delay_stream(s, 20ms);
    d.copy_async(dev.ptr(), src.data(), src.size(), s);
    std::fill(src.begin(), src.end(), 0x44);  // as cuMemcpyAsync from pageable memory: already taken
    std::vector<unsigned char> back(256, 0);
    d.copy_async(back.data(), dev.ptr(), back.size(), s);  // returns with the bytes
    EXPECT_EQ(back, std::vector<unsigned char>(256, 0x33));
  }
  d.stream_destroy(s);
}

TEST(HostDriverAsync, EventsOrderWorkAcrossStreams) {
  HostDriver d(async_opts());
  Stream a = d.stream_create(0), b = d.stream_create(0);
  Event e = d.event_create(0);
  {
    DeviceBuffer dev(d);
    auto* pinned = static_cast<unsigned char*>(d.host_alloc(G));
    std::memset(pinned, 0, G);
    std::memset(dev.bytes(), 0, G);
    d.delay_stream(a, 30ms);
    d.fill_async(dev.va, 0x5A, G, a);
    d.event_record(e, a);
    d.stream_wait_event(b, e);
    d.copy_async(pinned, dev.ptr(), G, b);  // must see the fill: b waits for the event
    d.stream_synchronize(b);
    EXPECT_EQ(pinned[0], 0x5A);
    EXPECT_EQ(pinned[G - 1], 0x5A);
    // event_synchronize waits for the work recorded before the event, not for later work.
    d.delay_stream(a, 30ms);
    d.fill_async(dev.va, 0x6B, 16, a);
    d.event_record(e, a);
    d.delay_stream(a, 200ms);
    d.fill_async(dev.va + 16, 0x7C, 16, a);
    d.event_synchronize(e);
    EXPECT_EQ(dev.bytes()[0], 0x6B);
    EXPECT_EQ(dev.bytes()[16], 0x5A) << "work queued after the record is not waited for";
    d.device_synchronize(0);
    EXPECT_EQ(dev.bytes()[16], 0x7C) << "device_synchronize waits for every stream of the device";
    d.host_free(pinned);
  }
  d.event_destroy(e);
  d.stream_destroy(a);
  d.stream_destroy(b);
}

TEST(HostDriverAsync, HashIsOrderedAfterEarlierWorkOnItsStream) {
  HostDriver d(async_opts());
  Stream s = d.stream_create(0);
  {
    DeviceBuffer dev(d);
    std::memset(dev.bytes(), 0, G);
    d.delay_stream(s, 20ms);
    d.fill_async(dev.va, 0x9C, G, s);
    HashRange r{dev.ptr(), G};
    Hash128 h;
    d.hash(std::span<const HashRange>(&r, 1), &h, s);
    std::vector<unsigned char> expected(G, 0x9C);
    EXPECT_EQ(h, content_hash::compute(expected.data(), G));
  }
  d.stream_destroy(s);
}

TEST(HostDriverAsync, HostKernelsRunOnTheStreamInOrder) {
  HostDriver d(async_opts());
  Stream s = d.stream_create(0);
  std::vector<int> order;
  std::atomic<int> ran{0};
  d.delay_stream(s, 20ms);
  d.launch(s, [&] {
    order.push_back(1);
    ++ran;
  });
  d.launch(s, [&] {
    order.push_back(2);
    ++ran;
  });
  EXPECT_EQ(ran.load(), 0) << "queued, not run by the caller";
  d.stream_synchronize(s);
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  d.stream_destroy(s);
}

TEST(HostDriverAsync, UnmappingOrFreeingMemoryAQueuedOperationTouchesIsRefusedAndCounted) {
  HostDriver d(async_opts());
  Stream s = d.stream_create(0);
  device_ptr va = d.reserve(G, G);
  PhysicalHandle h = d.create(0, G, false);
  d.map(va, G, h, 0);
  int dev = 0;
  d.set_access(va, G, std::span<const int>(&dev, 1));
  std::memset(reinterpret_cast<void*>(va), 0x42, G);
  auto* pinned = static_cast<unsigned char*>(d.host_alloc(G));
  d.delay_stream(s, 50ms);
  d.copy_async(pinned, reinterpret_cast<void*>(va), G, s);  // the sleep engine's offload copy
  try {
    d.unmap(va, G);  // the sleep engine's bug: unmapping before the copy completed
    FAIL() << "unmap of memory a queued copy reads was accepted";
  } catch (const driver_error& e) {
    EXPECT_NE(std::string(e.what()).find("still touched by a queued cuMemcpyAsync"), std::string::npos) << e.what();
  }
  EXPECT_THROW(d.host_free(pinned), driver_error) << "the copy also writes the pinned block";
  EXPECT_EQ(d.counters().async_conflicts, 2u);
  EXPECT_EQ(d.counters().mappings, 1u) << "a refused unmap changes nothing";
  d.stream_synchronize(s);
  EXPECT_EQ(pinned[G - 1], 0x42) << "the copy read mapped memory";
  d.unmap(va, G);
  d.host_free(pinned);
  d.release(h);
  d.free_reservation(va, G);
  d.stream_destroy(s);
  EXPECT_EQ(d.counters().async_conflicts, 2u);
}

// A host span reused (a new copy into it queued on another stream) while a queued copy still
// targets it is a race on a GPU: counted and logged. The same reuse ordered by an event recorded
// after the first copy is not.
TEST(HostDriverAsync, AHostSpanReusedWhileAQueuedCopyTargetsItIsFlagged) {
  HostDriver d(async_opts());
  Stream first = d.stream_create(0), second = d.stream_create(0);
  {
    DeviceBuffer a(d), b(d);
    std::memset(a.bytes(), 0x0a, G);
    std::memset(b.bytes(), 0x0b, G);
    auto* span = static_cast<unsigned char*>(d.host_alloc(G));
    // Unordered: the second stream's copy into the span runs while the first's is still queued.
    d.delay_stream(first, 50ms);
    d.copy_async(span, a.ptr(), G, first);
    d.copy_async(span + 100, b.ptr(), 200, second);
    d.stream_synchronize(second);
    d.stream_synchronize(first);
    EXPECT_EQ(d.counters().async_races, 1u) << "the reuse raced the queued copy";
    // Ordered: the second stream waits for an event recorded after the first copy.
    Event done = d.event_create(0);
    d.delay_stream(first, 50ms);
    d.copy_async(span, a.ptr(), G, first);
    d.event_record(done, first);
    d.stream_wait_event(second, done);
    d.copy_async(span + 100, b.ptr(), 200, second);
    d.stream_synchronize(second);
    EXPECT_EQ(d.counters().async_races, 1u) << "an event orders the two: no race";
    EXPECT_EQ(span[99], 0x0a);
    EXPECT_EQ(span[100], 0x0b) << "the ordered copy ran last";
    // Two reads of the span on two streams do not race.
    d.delay_stream(first, 20ms);
    d.copy_async(a.ptr(), span, G, first);
    d.copy_async(b.ptr(), span, G, second);
    d.device_synchronize(0);
    EXPECT_EQ(d.counters().async_races, 1u) << "reads only";
    d.event_destroy(done);
    d.host_free(span);
  }
  d.stream_destroy(first);
  d.stream_destroy(second);
  EXPECT_EQ(d.counters().async_conflicts, 0u);
}

// The host writing a page-locked span while a queued copy still targets it (a staging slot or
// a host-store span reused before the copy out of it, or into it, ran) is a race on a GPU:
// counted and logged when the copy runs. Deliberately broken orderings, each on a delayed stream
// so the copy is surely still queued: the host refills a copy's source, and writes into a copy's
// destination. Correct orderings are not flagged: writing after the stream is synchronized, and
// a span written by an earlier copy on the same stream before a later copy reads it.
TEST(HostDriverAsync, TheHostWritingASpanAQueuedCopyTargetsIsFlagged) {
  HostDriver d(async_opts());
  Stream s = d.stream_create(0);
  {
    DeviceBuffer dev(d), other(d);
    std::memset(dev.bytes(), 0x11, G);
    auto* span = static_cast<unsigned char*>(d.host_alloc(G));
    std::memset(span, 0x22, G);
    // Broken: the source refilled while the copy out of it is queued.
    d.delay_stream(s, 50ms);
    d.copy_async(dev.ptr(), span, G, s);
    std::memset(span, 0x33, 4096);
    d.stream_synchronize(s);
    EXPECT_EQ(d.counters().async_host_writes, 1u) << "the source was refilled under a queued copy";
    // Broken: the destination written while the copy into it is queued.
    d.delay_stream(s, 50ms);
    d.copy_async(span, dev.ptr(), G, s);
    span[G - 1] = 0x44;
    d.stream_synchronize(s);
    EXPECT_EQ(d.counters().async_host_writes, 2u) << "the destination was written under a queued copy";
    // Correct: the stream is synchronized before the host reuses the span.
    d.delay_stream(s, 20ms);
    d.copy_async(dev.ptr(), span, G, s);
    d.stream_synchronize(s);
    std::memset(span, 0x55, G);
    // Correct: one stream writes the span, then reads it (staging through the span); the host
    // does not touch it meanwhile.
    d.delay_stream(s, 20ms);
    d.copy_async(span, dev.ptr(), G, s);
    d.copy_async(other.ptr(), span, G, s);
    d.stream_synchronize(s);
    EXPECT_EQ(d.counters().async_host_writes, 2u) << "nothing changed the spans under a queued copy";
    EXPECT_EQ(std::memcmp(other.bytes(), dev.bytes(), G), 0) << "the staged copy went through in order";
    d.host_free(span);
  }
  d.stream_destroy(s);
  EXPECT_EQ(d.counters().async_conflicts, 0u);
  EXPECT_EQ(d.counters().async_races, 0u);
}

TEST(HostDriverAsync, DestroyingAStreamOrTheDriverFinishesItsWork) {
  std::atomic<int> ran{0};
  {
    HostDriver d(async_opts());
    Stream s = d.stream_create(0);
    d.delay_stream(s, 20ms);
    d.launch(s, [&] { ++ran; });
    d.stream_destroy(s);
    EXPECT_EQ(ran.load(), 1) << "cuStreamDestroy lets queued work complete";
    Stream t = d.stream_create(1);
    d.delay_stream(t, 20ms);
    d.launch(t, [&] { ++ran; });
    (void)t;  // left to the driver's destructor
  }
  EXPECT_EQ(ran.load(), 2) << "the driver's destructor drains every stream";
}

TEST(HostDriverAsync, DelayBoundIsRangeChecked) {
  HostDriverOptions o = async_opts(std::chrono::microseconds{2'000'000});
  try {
    HostDriver d(o);
    FAIL() << "a two-second delay bound was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("outside [0, 1000000] us"), std::string::npos) << e.what();
  }
}

TEST(HostDriverAsync, SynchronousModeIgnoresDelaysAndRunsKernelsAtOnce) {
  HostDriverOptions o = async_opts();
  o.async = false;
  HostDriver d(o);
  EXPECT_FALSE(d.asynchronous());
  Stream s = d.stream_create(0);
  int ran = 0;
  d.delay_stream(s, 1s);
  d.launch(s, [&] { ++ran; });
  EXPECT_EQ(ran, 1);
  d.stream_destroy(s);
}

}  // namespace
}  // namespace torpor
