// SymmetricHeap, the multicast binding of a buffer: rank 0 creates the object, every rank joins
// it, binds its own part and maps it at the buffer's multicast address; or everything of it is
// torn down. Only buffers the group's decision (multicast.hpp) gave multicast come here. See
// symmetric.cpp for the invariants.
#include <fmt/core.h>

#include "ranks/handle_kinds.hpp"
#include "ranks/symmetric_internal.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"
#include "torpor/symmetric.hpp"

namespace torpor {

using detail::attempt;

void SymmetricHeap::teardown_multicast(SymmetricBuffer& b) {
  if (!b.mc_) return;
  auto& m = *b.mc_;
  const int device = pool_.device();
  std::exception_ptr first;
  if (m.mapped)
    attempt(first, [&] {
      driver_.unmap(m.va, m.bytes);
      m.mapped = false;
    });
  if (m.bound)
    attempt(first, [&] {
      driver_.multicast_unbind(m.handle, device, 0, m.bytes);
      m.bound = false;
    });
  if (m.handle && !m.mapped && !m.bound)
    attempt(first, [&] {
      driver_.multicast_release(m.handle);
      m.handle = {};
      m.added = false;
    });
  if (first) std::rethrow_exception(first);
}

void SymmetricHeap::setup_multicast(SymmetricBuffer& b, SymmetricBuffer::Multicast& m) {
  const bool root = group_.rank() == 0;
  const int device = pool_.device();
  try {
    // Rank 0 creates the object for every rank's device and shares it; each rank then adds its
    // own device. Binding is legal only once every device was added (the driver checks), so the
    // steps are agreed one by one.
    // The object travels as the heap's memory does: a descriptor within a node, a fabric handle
    // over the group's bytes otherwise.
    detail::Exports mine(handle_kind_);
    step("creating the multicast object", [&] {
      teardown_multicast(b);  // what an earlier failure may have left; nothing otherwise
      if (!root) return;
      m.handle = driver_.multicast_create(devices_, m.bytes);
      mine.add(driver_, m.handle);
    });
    const detail::SharedParts shared = mine.exchange(group_);
    step("joining the multicast object", [&] {
      if (!root) {
        if (!shared.holds_exactly(0, 1)) throw error(fmt::format("{}: rank 0 shared no multicast object", who()));
        m.handle = shared.import_multicast(driver_, 0, 0);
      }
      driver_.multicast_add_device(m.handle, device);
      m.added = true;
    });
    step("binding to the multicast object", [&] {
      driver_.multicast_bind(m.handle, 0, own_handle(b), 0, m.bytes);
      m.bound = true;
      driver_.map(m.va, m.bytes, driver_.as_physical(m.handle), 0);
      m.mapped = true;
      driver_.set_access(m.va, m.bytes, std::span(&device, 1));
    });
  } catch (...) {
    try {
      teardown_multicast(b);
    } catch (const std::exception& e) {
      log::error("{}: tearing down a half-made multicast binding of buffer {}: {}", who(), b.id_, e.what());
    }
    throw;
  }
}

}  // namespace torpor
