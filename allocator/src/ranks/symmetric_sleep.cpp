// SymmetricHeap, collective sleep and wake of symmetric buffers: the pool calls these around its
// own work (the heap observes its pool). Before a sleep every rank agrees and drops what keeps
// the others' memory alive; after a failed sleep the buffers still awake everywhere get their
// imports back; a wake agrees on the buffers to re-import and re-imports them once the pool
// woke. See symmetric.hpp for the contract, symmetric.cpp for the invariants.
#include <fmt/core.h>

#include <algorithm>

#include "ranks/symmetric_internal.hpp"
#include "torpor/consensus.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"
#include "torpor/symmetric.hpp"

namespace torpor {

using detail::attempt;
using detail::ids_of;

void SymmetricHeap::before_sleep(Pool&, int level, const std::vector<std::string>& tags) {
  std::lock_guard lock(mu_);
  auto affected = in_tags(tags);
  if (affected.empty()) return;
  std::string request = fmt::format("sleep level {} of symmetric buffers {}", level, ids_of(affected));
  try {
    // This device's writes into peers' memory must land before any peer copies its bytes out.
    driver_.device_synchronize(pool_.device());
    agree("sleep", request, "");
  } catch (const group_timeout& e) {
    throw group_timeout(fmt::format("{}: collective {}: {}", who(), request, e.what()), e.missing());
  }
  // Every rank now lets go of what keeps the others' memory alive; then the pool releases ours.
  try {
    step("dropping the peer mappings", [&] {
      std::exception_ptr first;
      for (SymmetricBuffer* b : affected) {
        attempt(first, [&] { teardown_multicast(*b); });
        attempt(first, [&] { drop_imports(*b); });
      }
      if (first) std::rethrow_exception(first);
    });
  } catch (...) {
    // Every rank is here and nothing sleeps: map again what was dropped (a group that failed
    // refuses this at once; then the next wake does it).
    try {
      reimport(affected);
    } catch (const std::exception& e) {
      log::error("{}: restoring the peer mappings after a failed sleep failed: {}", who(), e.what());
    }
    throw;
  }
}

void SymmetricHeap::before_wake(Pool&, const std::vector<std::string>& tags) {
  std::lock_guard lock(mu_);
  wake_work_.reset();
  auto affected = in_tags(tags);
  if (affected.empty()) return;
  std::string request = fmt::format("wake_up of symmetric buffers {}", ids_of(affected));
  std::string needs;
  for (SymmetricBuffer* b : affected) {
    bool complete = b->peers_mapped() && (!b->mc_ || (b->mc_->mapped && b->mc_->bound));
    needs += complete ? '0' : '1';
  }
  std::vector<std::string> all;
  try {
    all = agree("wake_up", request, needs);
  } catch (const group_timeout& e) {
    throw group_timeout(fmt::format("{}: collective {}: {}", who(), request, e.what()), e.missing());
  }
  std::vector<std::uint64_t> work;
  for (std::size_t i = 0; i < affected.size(); ++i)
    if (std::any_of(all.begin(), all.end(), [&](const std::string& s) { return i < s.size() && s[i] == '1'; }))
      work.push_back(affected[i]->id_);
  wake_work_ = std::move(work);
}

void SymmetricHeap::after_sleep(Pool&, int, const std::vector<std::string>& tags, bool ok) {
  // before_sleep dropped every rank's imports of these buffers. When the pool's sleep failed on
  // some rank, the buffers whose parts are still awake on every rank would stay unmapped until a
  // wake: every rank learns every outcome and those get their imports back now. A part asleep
  // anywhere cannot be imported; the wake does it (imports stay all or none).
  std::lock_guard lock(mu_);
  auto affected = in_tags(tags);
  if (affected.empty()) return;
  std::string mine = ok ? "1" : "0";
  for (SymmetricBuffer* b : affected) {
    auto ci = pool_.chunk_info(b->local_);
    mine += ci && ci->awake ? '1' : '0';
  }
  std::vector<std::string> outcomes;
  try {
    outcomes = consensus::gather_text(group_, mine);
  } catch (const std::exception& e) {
    log::error("{}: after a sleep{} the ranks could not compare outcomes ({}); peer mappings of buffers {} are "
               "restored by the next wake",
               who(), ok ? "" : " that failed here", e.what(), ids_of(affected));
    if (ok) throw;
    return;
  }
  if (std::all_of(outcomes.begin(), outcomes.end(), [](const std::string& o) { return !o.empty() && o[0] == '1'; }))
    return;  // asleep everywhere: the wake re-imports
  std::vector<SymmetricBuffer*> work;
  for (std::size_t i = 0; i < affected.size(); ++i)
    if (std::all_of(outcomes.begin(), outcomes.end(),
                    [&](const std::string& o) { return i + 1 < o.size() && o[i + 1] == '1'; }))
      work.push_back(affected[i]);
  if (work.empty()) return;
  try {
    reimport(work);
    log::warn("{}: the sleep failed; the peer mappings of symmetric buffers {} were restored", who(), ids_of(work));
  } catch (const std::exception& e) {
    log::error("{}: restoring the peer mappings of symmetric buffers {} after a failed sleep failed ({}); the next "
               "wake restores them",
               who(), ids_of(work), e.what());
    if (ok) throw;
  }
}

void SymmetricHeap::after_wake(Pool&, const std::vector<std::string>&, bool ok) {
  // Inside Pool::wake_up's handler when !ok: the pool's own exception says why.
  std::string pool_failure = "the pool's wake_up failed on this rank";
  if (!ok) {
    try {
      if (auto p = std::current_exception()) std::rethrow_exception(p);
    } catch (const std::exception& e) {
      pool_failure = fmt::format("the pool's wake_up failed on this rank: {}", e.what());
    } catch (...) {  // NOLINT(bugprone-empty-catch): another type keeps the message above
    }
  }
  std::lock_guard lock(mu_);
  if (!wake_work_) return;  // nothing symmetric in these tags, or after_wake already ran
  std::vector<SymmetricBuffer*> work;
  for (std::uint64_t id : *wake_work_)
    if (auto it = buffers_.find(id); it != buffers_.end()) work.push_back(it->second.get());
  wake_work_.reset();
  if (work.empty()) return;
  std::string request = fmt::format("wake_up of symmetric buffers {}", ids_of(work));
  try {
    step("waking the pool", [&] {
      if (!ok) throw error(pool_failure);
    });
    reimport(work);
  } catch (const group_timeout& e) {
    if (!ok) return;  // the pool rethrows its own error
    throw group_timeout(fmt::format("{}: collective {}: {}", who(), request, e.what()), e.missing());
  } catch (...) {
    if (!ok) return;
    throw;
  }
}

}  // namespace torpor
