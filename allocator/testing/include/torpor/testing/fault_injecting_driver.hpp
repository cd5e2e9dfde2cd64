// FaultInjectingDriver: a decorator over any Driver that makes chosen calls fail, so tests can
// prove that every failure inside sleep, wake or allocate leaves the pool consistent.
//
//   FaultInjectingDriver faulty(host);
//   faulty.fail_nth(DriverCall::map, 3);      // the 3rd map from now fails, once
//   faulty.fail_from(DriverCall::create, 1);  // every create fails until clear()
//
// A failing call throws driver_error with the requested code and does not reach the inner
// driver, so the inner driver's state is exactly what it would be after a real failure that
// changed nothing. calls(kind) counts calls made (failed ones included).
//
// A test double: its header lives in allocator/testing/include (torpor::internal), never
// installed; the implementation is in the library so that every test links the same one.
//
// It reports its inner driver's capabilities and forwards the optional calls (make_current,
// native_stream, multicast_store, live_physical_bytes), so code above the seam works the same through it.
// report_capabilities() makes it stand in for a driver that lacks one: it then reports the given
// capabilities, and a call that a withheld capability names fails as on such a driver.
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <mutex>
#include <optional>

#include "torpor/driver.hpp"
#include "torpor/error.hpp"

namespace torpor {

class FaultInjectingDriver final : public Driver {
 public:
  explicit FaultInjectingDriver(Driver& inner) : inner_(inner) {}

  void fail_nth(DriverCall kind, std::size_t n, driver_status code = driver_status::out_of_memory);
  void fail_from(DriverCall kind, std::size_t n, driver_status code = driver_status::out_of_memory);
  void clear();
  std::size_t calls(DriverCall kind) const;
  std::size_t failures() const { return failures_.load(); }
  Driver& inner() noexcept { return inner_; }
  // From now on report `c` instead of the inner driver's capabilities (nullopt: forward them
  // again). Independent of the fault rules (clear() keeps it).
  void report_capabilities(std::optional<DriverCapabilities> c);
  // Called with finished = false before a call of `kind` is counted, and with finished = true once
  // it returned or threw (an injected failure included), on the calling thread. It must not throw
  // and must be set before the driver is used from more than one thread (it is read unlocked).
  using Observer = std::function<void(DriverCall kind, bool finished)>;
  void observe(Observer observer) { observer_ = std::move(observer); }

  std::string_view backend_name() const noexcept override { return inner_.backend_name(); }
  DriverCapabilities capabilities() const noexcept override;
  int device_count() override { return inner_.device_count(); }
  DeviceProperties device_properties(int d) override { return inner_.device_properties(d); }
  bool can_access_peer(int d, int p) override { return inner_.can_access_peer(d, p); }
  MemoryInfo memory_info(int d) override { return inner_.memory_info(d); }
  bool multicast_entry_points() override { return inner_.multicast_entry_points(); }

  device_ptr reserve(std::size_t b, std::size_t a) override;
  void free_reservation(device_ptr va, std::size_t b) override;
  PhysicalHandle create(int d, std::size_t b, bool e) override;
  void release(PhysicalHandle h) override;
  void map(device_ptr va, std::size_t b, PhysicalHandle h, std::size_t o) override;
  void unmap(device_ptr va, std::size_t b) override;
  void set_access(device_ptr va, std::size_t b, std::span<const int> d) override;
  int export_fd(PhysicalHandle h) override;
  PhysicalHandle import_fd(int fd) override;
  PhysicalHandle import_fd_of_size(int fd, std::size_t bytes) override;
  // Fabric export/import count as export_handle / import_handle; the probe and the node name are
  // forwarded (a withheld fabric_handles capability answers as a backend without them).
  FabricHandle export_fabric(PhysicalHandle h) override;
  PhysicalHandle import_fabric(const FabricHandle& h, std::size_t bytes) override;
  FabricProbe probe_fabric(int device) override;
  std::string node_name() override { return inner_.node_name(); }
  std::size_t multicast_granularity(std::span<const int> d, std::size_t b) override;
  MulticastHandle multicast_create(std::span<const int> d, std::size_t b) override;
  void multicast_add_device(MulticastHandle mc, int d) override;
  void multicast_bind(MulticastHandle mc, std::size_t mo, PhysicalHandle h, std::size_t o, std::size_t b) override;
  void multicast_unbind(MulticastHandle mc, int d, std::size_t mo, std::size_t b) override;
  void multicast_release(MulticastHandle mc) override;
  PhysicalHandle as_physical(MulticastHandle mc) override { return inner_.as_physical(mc); }
  int multicast_export_fd(MulticastHandle mc) override;
  MulticastHandle multicast_import_fd(int fd) override;
  FabricHandle multicast_export_fabric(MulticastHandle mc) override;
  MulticastHandle multicast_import_fabric(const FabricHandle& h) override;
  bool multicast_shares_across_processes() override { return inner_.multicast_shares_across_processes(); }
  void multicast_store(device_ptr mc_va, const void* src, std::size_t b) override;
  void make_current(int d) override;
  void* native_stream(Stream s) override;
  std::size_t live_physical_bytes(int d) const override;
  std::size_t graph_memory_nodes(std::uintptr_t graph) override { return inner_.graph_memory_nodes(graph); }
  GraphMemory graph_memory(int d) override { return inner_.graph_memory(d); }
  void* host_alloc(std::size_t b) override;
  void host_free(void* p) override;
  void host_register(void* p, std::size_t b, int d) override;
  void host_unregister(void* p, int d) override;
  Stream stream_create(int d) override;
  void stream_destroy(Stream s) override;
  void copy_async(void* dst, const void* src, std::size_t b, Stream s) override;
  void fill_async(device_ptr dst, std::uint8_t v, std::size_t b, Stream s) override;
  void stream_synchronize(Stream s) override;
  void device_synchronize(int d) override;
  Event event_create(int d) override;
  void event_destroy(Event e) override;
  void event_record(Event e, Stream s) override;
  void stream_wait_event(Stream s, Event e) override;
  void event_synchronize(Event e) override;
  void hash(std::span<const HashRange> r, Hash128* out, Stream s) override;

 private:
  struct Rule {
    std::size_t first = 0;  // 0 = no rule; else the call number (1-based, since the rule was set) that fails
    bool repeat = false;
    driver_status code = driver_status::out_of_memory;
    std::size_t seen = 0;  // calls since the rule was set
  };
  void before(DriverCall kind);
  // Tells the observer, if any, that a call began, and that it ended when this goes out of scope.
  class Observed {
   public:
    Observed(const Observer& o, DriverCall kind) : o_(o), kind_(kind) {
      if (o_) o_(kind_, false);
    }
    ~Observed() {
      try {
        if (o_) o_(kind_, true);
      } catch (...) {  // NOLINT(bugprone-empty-catch): see below
        // An observer that breaks its contract must not end the process here.
      }
    }
    Observed(const Observed&) = delete;
    Observed& operator=(const Observed&) = delete;

   private:
    const Observer& o_;
    DriverCall kind_;
  };

  Driver& inner_;
  mutable std::mutex mu_;
  std::array<Rule, static_cast<std::size_t>(DriverCall::count_)> rules_{};
  std::array<std::size_t, static_cast<std::size_t>(DriverCall::count_)> calls_{};
  std::atomic<std::size_t> failures_{0};
  std::optional<DriverCapabilities> reported_;  // guarded by mu_
  Observer observer_;
};

}  // namespace torpor
