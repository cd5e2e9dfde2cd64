// SymmetricHeap, the mappings: this rank's share of a new buffer (its part, its peer table, the
// address ranges it reserves) and the peers' parts, exported, exchanged, imported and mapped at
// their fixed addresses, or dropped. See symmetric.cpp for the invariants.
#include <fmt/core.h>

#include <algorithm>

#include "common/range_allocator.hpp"
#include "ranks/handle_kinds.hpp"
#include "ranks/symmetric_internal.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"
#include "torpor/symmetric.hpp"

namespace torpor {

using detail::attempt;

void SymmetricHeap::place_local(SymmetricBuffer& b, const SymmetricBufferOptions& o, bool use_multicast,
                                std::size_t alignment) {
  const int n = group_.size();
  const int me = group_.rank();
  const std::size_t granularity = pool_.granularity();
  b.local_ = pool_.allocate(b.part_bytes_, {o.tag, MemoryClass::state, o.name, /*dedicated=*/true});
  auto ci = pool_.chunk_info(b.local_);
  if (!ci || !ci->dedicated || ci->offset != 0 || ci->bytes != b.part_bytes_)
    throw error(fmt::format("{}: the pool placed symmetric buffer part ({} bytes) inside a shared chunk; it must "
                            "have a chunk of its own",
                            who(), b.part_bytes_));
  std::string table_name = (o.name.empty() ? fmt::format("symmetric.{}", next_id_) : o.name) + ".peers";
  b.table_ = pool_.allocate((static_cast<std::size_t>(n) + 1) * sizeof(std::uint64_t),
                            {options_.table_tag, MemoryClass::state, table_name});
  b.peer_range_ = pool_.reserve_address_range(static_cast<std::size_t>(n) * b.part_bytes_);
  for (int r = 0; r < n; ++r)
    b.peer_va_[static_cast<std::size_t>(r)] =
        r == me ? reinterpret_cast<device_ptr>(b.local_) : b.peer_range_ + static_cast<std::size_t>(r) * b.part_bytes_;
  if (use_multicast) {
    SymmetricBuffer::Multicast m;
    m.bytes = b.part_bytes_;
    std::size_t slack = alignment > granularity ? alignment : 0;
    m.range = pool_.reserve_address_range(m.bytes + slack);
    m.va = align_up(m.range, alignment);
    b.mc_ = m;
  }
}

void SymmetricHeap::write_table(SymmetricBuffer& b) {
  std::vector<std::uint64_t> t;
  t.reserve(b.peer_va_.size() + 1);
  for (device_ptr va : b.peer_va_) t.push_back(va);
  t.push_back(b.mc_ ? b.mc_->va : 0);
  pool_.copy(b.table_, t.data(), t.size() * sizeof(std::uint64_t));
}

detail::SharedParts SymmetricHeap::share_parts(const std::vector<SymmetricBuffer*>& work) {
  detail::Exports mine(handle_kind_);
  step("exporting this rank's parts", [&] {
    for (SymmetricBuffer* b : work) mine.add(driver_, own_handle(*b));
  });
  return mine.exchange(group_);
}

void SymmetricHeap::import_peers(SymmetricBuffer& b, const detail::SharedParts& shared, std::size_t i) {
  const int me = group_.rank();
  const int device = pool_.device();
  for (int r = 0; r < group_.size(); ++r) {
    auto& imp = b.imports_[static_cast<std::size_t>(r)];
    if (r == me || imp.mapped) continue;
    if (!imp.handle) {
      const bool fabric = shared.kind == HandleKind::fabric;
      if (!shared.has(r, i))
        throw error(fmt::format("{}: rank {} sent no {} for symmetric buffer {}", who(), r,
                                fabric ? "fabric handle" : "handle", b.id_));
      // Every rank's part is part_bytes_ long.
      try {
        imp.handle = shared.import_part(driver_, r, i, b.part_bytes_);
      } catch (const driver_error& e) {
        if (!fabric) throw;
        throw driver_error(e.code(), e.call(),
                           fmt::format("{}: importing rank {}'s part of symmetric buffer {} (fabric handle): {}", who(),
                                       r, b.id_, e.what()));
      }
    }
    device_ptr va = b.peer_va_[static_cast<std::size_t>(r)];
    driver_.map(va, b.part_bytes_, imp.handle, 0);
    imp.mapped = true;
    try {
      driver_.set_access(va, b.part_bytes_, std::span(&device, 1));
    } catch (...) {
      try {
        driver_.unmap(va, b.part_bytes_);
        imp.mapped = false;
      } catch (const std::exception& e) {
        log::error("{}: unmapping rank {}'s part of buffer {} after a failed set_access: {}", who(), r, b.id_,
                   e.what());
      }
      throw;
    }
  }
}

void SymmetricHeap::drop_imports(SymmetricBuffer& b) {
  std::exception_ptr first;
  for (std::size_t r = 0; r < b.imports_.size(); ++r) {
    auto& imp = b.imports_[r];
    if (imp.mapped)
      attempt(first, [&] {
        driver_.unmap(b.peer_va_[r], b.part_bytes_);
        imp.mapped = false;
      });
    // A handle whose mapping could not be removed is kept: releasing it would not free anything.
    if (imp.handle && !imp.mapped)
      attempt(first, [&] {
        driver_.release(imp.handle);
        imp.handle = {};
      });
  }
  if (first) std::rethrow_exception(first);
}

void SymmetricHeap::reimport(const std::vector<SymmetricBuffer*>& work) {
  detail::SharedParts shared = share_parts(work);
  try {
    step("mapping the peers' parts", [&] {
      for (std::size_t i = 0; i < work.size(); ++i) import_peers(*work[i], shared, i);
    });
  } catch (...) {
    for (SymmetricBuffer* b : work) {
      try {
        drop_imports(*b);
      } catch (const std::exception& e) {
        log::error("{}: dropping the peer mappings of buffer {} after a failure: {}", who(), b->id_, e.what());
      }
    }
    throw;
  }
  for (SymmetricBuffer* b : work) {
    if (b->mc_) setup_multicast(*b, *b->mc_);
  }
}

}  // namespace torpor
