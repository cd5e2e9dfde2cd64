// FaultInjectingDriver; the design note is in torpor/testing/fault_injecting_driver.hpp.
#include "torpor/testing/fault_injecting_driver.hpp"

#include <fmt/core.h>

namespace torpor {

void FaultInjectingDriver::fail_nth(DriverCall kind, std::size_t n, driver_status code) {
  if (n == 0) throw invalid_argument("fail_nth: n counts from 1");
  std::lock_guard lock(mu_);
  rules_[static_cast<std::size_t>(kind)] = Rule{n, false, code, 0};
}

void FaultInjectingDriver::fail_from(DriverCall kind, std::size_t n, driver_status code) {
  if (n == 0) throw invalid_argument("fail_from: n counts from 1");
  std::lock_guard lock(mu_);
  rules_[static_cast<std::size_t>(kind)] = Rule{n, true, code, 0};
}

void FaultInjectingDriver::clear() {
  std::lock_guard lock(mu_);
  rules_.fill(Rule{});
}

void FaultInjectingDriver::report_capabilities(std::optional<DriverCapabilities> c) {
  std::lock_guard lock(mu_);
  reported_ = c;
}

DriverCapabilities FaultInjectingDriver::capabilities() const noexcept {
  {
    std::lock_guard lock(mu_);
    if (reported_) return *reported_;
  }
  return inner_.capabilities();
}

// A withheld capability's call goes to the seam's default, which says "not supported" as a driver
// without it does; otherwise it reaches the inner driver (no fault rules: these calls have no
// DriverCall kind).
void FaultInjectingDriver::multicast_store(device_ptr mc_va, const void* src, std::size_t b) {
  if (capabilities().multicast != DriverCapabilities::Multicast::emulated) Driver::multicast_store(mc_va, src, b);
  inner_.multicast_store(mc_va, src, b);
}

void FaultInjectingDriver::make_current(int d) {
  if (!capabilities().make_current) Driver::make_current(d);
  inner_.make_current(d);
}

void* FaultInjectingDriver::native_stream(Stream s) {
  if (!capabilities().make_current) Driver::native_stream(s);
  return inner_.native_stream(s);
}

std::size_t FaultInjectingDriver::live_physical_bytes(int d) const {
  if (!capabilities().physical_accounting) Driver::live_physical_bytes(d);
  return inner_.live_physical_bytes(d);
}

std::size_t FaultInjectingDriver::calls(DriverCall kind) const {
  std::lock_guard lock(mu_);
  return calls_[static_cast<std::size_t>(kind)];
}

void FaultInjectingDriver::before(DriverCall kind) {
  driver_status code;
  {
    std::lock_guard lock(mu_);
    auto i = static_cast<std::size_t>(kind);
    ++calls_[i];
    Rule& r = rules_[i];
    if (r.first == 0) return;
    ++r.seen;
    bool fail = r.repeat ? r.seen >= r.first : r.seen == r.first;
    if (!fail) return;
    code = r.code;
    if (!r.repeat) r = Rule{};
  }
  ++failures_;
  throw_driver_error(static_cast<int>(code), std::string(to_string(kind)).c_str(),
                     fmt::format("{} (injected)", to_string(code)));
}

#define TORPOR_FORWARD(kind, expr)                       \
  const Observed observed_(observer_, DriverCall::kind); \
  before(DriverCall::kind);                              \
  return inner_.expr

device_ptr FaultInjectingDriver::reserve(std::size_t b, std::size_t a) { TORPOR_FORWARD(reserve, reserve(b, a)); }
void FaultInjectingDriver::free_reservation(device_ptr va, std::size_t b) {
  TORPOR_FORWARD(free_reservation, free_reservation(va, b));
}
PhysicalHandle FaultInjectingDriver::create(int d, std::size_t b, bool e) { TORPOR_FORWARD(create, create(d, b, e)); }
void FaultInjectingDriver::release(PhysicalHandle h) { TORPOR_FORWARD(release, release(h)); }
void FaultInjectingDriver::map(device_ptr va, std::size_t b, PhysicalHandle h, std::size_t o) {
  TORPOR_FORWARD(map, map(va, b, h, o));
}
void FaultInjectingDriver::unmap(device_ptr va, std::size_t b) { TORPOR_FORWARD(unmap, unmap(va, b)); }
void FaultInjectingDriver::set_access(device_ptr va, std::size_t b, std::span<const int> d) {
  TORPOR_FORWARD(set_access, set_access(va, b, d));
}
int FaultInjectingDriver::export_fd(PhysicalHandle h) { TORPOR_FORWARD(export_handle, export_fd(h)); }
PhysicalHandle FaultInjectingDriver::import_fd(int fd) { TORPOR_FORWARD(import_handle, import_fd(fd)); }
PhysicalHandle FaultInjectingDriver::import_fd_of_size(int fd, std::size_t bytes) {
  TORPOR_FORWARD(import_handle, import_fd_of_size(fd, bytes));
}
FabricHandle FaultInjectingDriver::export_fabric(PhysicalHandle h) {
  if (!capabilities().fabric_handles) return Driver::export_fabric(h);
  TORPOR_FORWARD(export_handle, export_fabric(h));
}
PhysicalHandle FaultInjectingDriver::import_fabric(const FabricHandle& h, std::size_t bytes) {
  if (!capabilities().fabric_handles) return Driver::import_fabric(h, bytes);
  TORPOR_FORWARD(import_handle, import_fabric(h, bytes));
}
FabricProbe FaultInjectingDriver::probe_fabric(int device) {
  if (!capabilities().fabric_handles) return Driver::probe_fabric(device);
  return inner_.probe_fabric(device);
}
MulticastHandle FaultInjectingDriver::multicast_create(std::span<const int> d, std::size_t b) {
  TORPOR_FORWARD(multicast_create, multicast_create(d, b));
}
void FaultInjectingDriver::multicast_add_device(MulticastHandle mc, int d) {
  TORPOR_FORWARD(multicast_add_device, multicast_add_device(mc, d));
}
void FaultInjectingDriver::multicast_bind(MulticastHandle mc, std::size_t mo, PhysicalHandle h, std::size_t o,
                                          std::size_t b) {
  TORPOR_FORWARD(multicast_bind, multicast_bind(mc, mo, h, o, b));
}
void FaultInjectingDriver::multicast_unbind(MulticastHandle mc, int d, std::size_t mo, std::size_t b) {
  TORPOR_FORWARD(multicast_unbind, multicast_unbind(mc, d, mo, b));
}
void FaultInjectingDriver::multicast_release(MulticastHandle mc) {
  TORPOR_FORWARD(multicast_release, multicast_release(mc));
}
std::size_t FaultInjectingDriver::multicast_granularity(std::span<const int> d, std::size_t b) {
  TORPOR_FORWARD(multicast_granularity, multicast_granularity(d, b));
}
int FaultInjectingDriver::multicast_export_fd(MulticastHandle mc) {
  TORPOR_FORWARD(multicast_export, multicast_export_fd(mc));
}
MulticastHandle FaultInjectingDriver::multicast_import_fd(int fd) {
  TORPOR_FORWARD(multicast_import, multicast_import_fd(fd));
}
FabricHandle FaultInjectingDriver::multicast_export_fabric(MulticastHandle mc) {
  TORPOR_FORWARD(multicast_export, multicast_export_fabric(mc));
}
MulticastHandle FaultInjectingDriver::multicast_import_fabric(const FabricHandle& h) {
  TORPOR_FORWARD(multicast_import, multicast_import_fabric(h));
}
void* FaultInjectingDriver::host_alloc(std::size_t b) { TORPOR_FORWARD(host_alloc, host_alloc(b)); }
void FaultInjectingDriver::host_free(void* p) { TORPOR_FORWARD(host_free, host_free(p)); }
void FaultInjectingDriver::host_register(void* p, std::size_t b, int d) {
  TORPOR_FORWARD(host_register, host_register(p, b, d));
}
void FaultInjectingDriver::host_unregister(void* p, int d) { TORPOR_FORWARD(host_unregister, host_unregister(p, d)); }
Stream FaultInjectingDriver::stream_create(int d) { TORPOR_FORWARD(stream_create, stream_create(d)); }
void FaultInjectingDriver::stream_destroy(Stream s) { TORPOR_FORWARD(stream_destroy, stream_destroy(s)); }
void FaultInjectingDriver::copy_async(void* dst, const void* src, std::size_t b, Stream s) {
  TORPOR_FORWARD(copy, copy_async(dst, src, b, s));
}
void FaultInjectingDriver::fill_async(device_ptr dst, std::uint8_t v, std::size_t b, Stream s) {
  TORPOR_FORWARD(fill, fill_async(dst, v, b, s));
}
void FaultInjectingDriver::stream_synchronize(Stream s) { TORPOR_FORWARD(stream_synchronize, stream_synchronize(s)); }
void FaultInjectingDriver::device_synchronize(int d) { TORPOR_FORWARD(device_synchronize, device_synchronize(d)); }
Event FaultInjectingDriver::event_create(int d) { TORPOR_FORWARD(event_create, event_create(d)); }
void FaultInjectingDriver::event_destroy(Event e) { TORPOR_FORWARD(event_destroy, event_destroy(e)); }
void FaultInjectingDriver::event_record(Event e, Stream s) { TORPOR_FORWARD(event_record, event_record(e, s)); }
void FaultInjectingDriver::stream_wait_event(Stream s, Event e) {
  TORPOR_FORWARD(stream_wait_event, stream_wait_event(s, e));
}
void FaultInjectingDriver::event_synchronize(Event e) { TORPOR_FORWARD(event_synchronize, event_synchronize(e)); }

void FaultInjectingDriver::hash(std::span<const HashRange> r, Hash128* out, Stream s) {
  TORPOR_FORWARD(hash, hash(r, out, s));
}

#undef TORPOR_FORWARD

}  // namespace torpor
