// The Pool's thin calls: each takes the lock and asks the state or one of its parts, with no
// policy of its own. The preserve globs (sleep_plan.hpp applies them), tags and whether one is
// asleep, trim() (the empty slabs and the retried releases), address ranges carved from the
// pool's reservation, sleep observers, copies through the driver, and the host store's
// prepare/release/wait (pool/store/host_store.hpp).
#include <fmt/core.h>

#include <algorithm>
#include <utility>

#include "common/text.hpp"
#include "pool/pool_state.hpp"
#include "pool/sleep_plan.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"
#include "torpor/pool.hpp"

namespace torpor {

void Pool::set_preserve(std::vector<std::string> globs) {
  for (const auto& g : globs) {
    if (g.empty()) throw invalid_argument("set_preserve: empty glob");
    check_no_nul(g, fmt::format("glob '{}'", g.substr(0, g.find('\0'))), "set_preserve");
  }
  std::lock_guard lock(state_->mu);
  state_->preserve = std::move(globs);
}

std::vector<std::string> Pool::preserve() const {
  std::lock_guard lock(state_->mu);
  return state_->preserve;
}

bool Pool::asleep(std::string_view tag) const {
  std::lock_guard lock(state_->mu);
  auto it = state_->tags.find(tag);
  if (it == state_->tags.end()) throw invalid_argument(fmt::format("asleep: unknown tag '{}'", tag));
  return it->second.asleep;
}

std::vector<std::string> Pool::tags() const {
  std::lock_guard lock(state_->mu);
  std::vector<std::string> out;
  for (auto& [t, s] : state_->tags) out.push_back(t);
  return out;
}

std::size_t Pool::trim() {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  std::size_t released = 0;
  std::vector<Chunk*> empty;
  for (auto& [va, c] : s.chunks)
    if (c->slab() && c->allocations.empty()) empty.push_back(c.get());
  for (Chunk* c : empty) {
    std::size_t b = c->awake ? c->bytes : 0;
    s.dispose_chunk(*c);
    released += b;
  }
  s.retry_stranded_mappings();
  s.retry_pending_releases();
  return released;
}

device_ptr Pool::reserve_address_range(std::size_t bytes) {
  if (bytes == 0) throw invalid_argument("reserve_address_range: size 0");
  State& s = *state_;
  std::lock_guard lock(s.mu);
  std::size_t rounded = align_up(bytes, granularity_);
  auto off = s.va.allocate(rounded, granularity_);
  if (!off)
    throw out_of_memory(fmt::format("reserve_address_range: {} bytes do not fit in the pool's VA reservation "
                                    "({} free, largest hole {}); raise PoolOptions::va_bytes",
                                    rounded, s.va.free_bytes(), s.va.largest_free()));
  device_ptr va = va_base_ + *off;
  s.address_ranges[va] = rounded;
  return va;
}

void Pool::release_address_range(device_ptr va) {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  auto it = s.address_ranges.find(va);
  if (it == s.address_ranges.end())
    throw invalid_argument(fmt::format("release_address_range: {:#x} is not a range from reserve_address_range", va));
  s.va.free(va - va_base_, it->second);
  s.address_ranges.erase(it);
}

FillOnWake Pool::set_fill_on_wake(FillOnWake fill) {
  if (fill != FillOnWake::none && fill != FillOnWake::zero && fill != FillOnWake::poison)
    throw invalid_argument(
        fmt::format("set_fill_on_wake: {} is not a fill (0 none, 1 zero, 2 poison)", static_cast<int>(fill)));
  std::lock_guard lock(state_->mu);  // a wake reads it under mu
  return std::exchange(options_.fill_on_wake, fill);
}

void Pool::add_observer(SleepObserver* observer) {
  if (observer == nullptr) throw invalid_argument("add_observer: null observer");
  std::lock_guard lock(state_->mu);
  auto& v = state_->observers;
  if (std::find(v.begin(), v.end(), observer) == v.end()) v.push_back(observer);
}

void Pool::remove_observer(SleepObserver* observer) {
  std::lock_guard lock(state_->mu);
  auto& v = state_->observers;
  v.erase(std::remove(v.begin(), v.end(), observer), v.end());
}

void Pool::copy(void* dst, const void* src, std::size_t bytes) {
  constexpr auto top = std::numeric_limits<std::uintptr_t>::max();
  for (const void* p : {static_cast<const void*>(dst), src})
    if (bytes > top - reinterpret_cast<std::uintptr_t>(p))
      throw invalid_argument(fmt::format("copy: [{}, +{}) wraps around the end of the address space", p, bytes));
  if (bytes > 0 && (dst == nullptr || src == nullptr)) throw invalid_argument("copy: NULL pointer");
  std::lock_guard lock(state_->mu);
  driver_.copy_async(dst, src, bytes, state_->streams[0]);
  driver_.stream_synchronize(state_->streams[0]);
}

std::size_t Pool::release_host_store() {
  std::lock_guard lock(state_->mu);
  // Retained copies only save a future copy; asleep backups are needed and stay.
  for (auto& [va, c] : state_->chunks) state_->drop_all_copies(c->retained);
  return state_->host.release_unused();
}

std::size_t Pool::prepare_host_store(std::size_t bytes) {
  std::lock_guard lock(state_->mu);
  return state_->host.prepare(bytes != 0 ? bytes : level1_host_bytes(*state_));
}

std::size_t Pool::sleep_host_bytes(int level, const std::vector<std::string>& tags) const {
  if (level < 0 || level > 2) throw invalid_argument(fmt::format("sleep_host_bytes: level {} is not 0, 1 or 2", level));
  std::lock_guard lock(state_->mu);
  const std::vector<std::string> resolved = state_->resolve_tags(tags, "sleep_host_bytes");
  return torpor::sleep_host_bytes(*state_, &resolved, static_cast<SleepLevel>(level));
}

void Pool::wait_host_store() {
  state_->host.pinner().wait_all();  // thread-safe: other calls go on meanwhile
  std::lock_guard lock(state_->mu);
  state_->host.wait_pinning();  // notes a refusal (and waits for blocks added meanwhile)
}

}  // namespace torpor
