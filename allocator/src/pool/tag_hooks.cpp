// Tag hooks: registry and calls (design in tag_hooks.hpp; the rules users rely on are TagHooks'
// in pool.hpp). Pool::add_tag_hooks / remove_tag_hooks are here too, next to what they touch.
#include "pool/tag_hooks.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <exception>

#include "pool/pool_state.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor {

std::uint64_t TagHookRegistry::add(const std::string& tag, TagHooks hooks) {
  if (tag.empty()) throw invalid_argument("add_tag_hooks: the tag is empty (hooks belong to one named tag)");
  if (!hooks.before_unmap && !hooks.after_map)
    throw invalid_argument(fmt::format("add_tag_hooks: tag '{}': before_unmap and after_map are both empty", tag));
  auto e = std::make_shared<Entry>();
  e->tag = tag;
  e->hooks = std::move(hooks);
  std::lock_guard lock(mu_);
  e->id = next_++;
  entries_.push_back(e);
  return e->id;
}

void TagHookRegistry::remove(std::uint64_t id) {
  std::lock_guard lock(mu_);
  auto it = std::find_if(entries_.begin(), entries_.end(), [&](const auto& e) { return e->id == id; });
  if (it == entries_.end())
    throw invalid_argument(fmt::format("remove_tag_hooks: {} is not a tag hook of this pool (removed twice?)", id));
  (*it)->active.store(false);
  entries_.erase(it);
}

TagHookRegistry::Snapshot TagHookRegistry::snapshot() const {
  std::lock_guard lock(mu_);
  return entries_;
}

std::vector<std::string> TagHookRegistry::tags_of(const Snapshot& hooks) {
  std::vector<std::string> out;
  for (const auto& e : hooks)
    if (std::find(out.begin(), out.end(), e->tag) == out.end()) out.push_back(e->tag);
  return out;
}

std::vector<std::string> TagHookRegistry::before_unmap(const Snapshot& hooks, const std::vector<std::string>& tags) {
  std::vector<std::string> done;
  for (const auto& tag : tags) {
    try {
      for (const auto& e : hooks)
        if (e->tag == tag && e->hooks.before_unmap && e->active.load()) e->hooks.before_unmap(tag);
    } catch (...) {
      // The sleep is refused with nothing moved: what was torn down over mapped memory is re-made.
      // The refusing tag's own earlier hooks are not undone: a tag's hooks are one step to the
      // caller, and after_map is idempotent, so it is mapped again too.
      done.push_back(tag);
      after_map(hooks, done, false);
      throw;
    }
    done.push_back(tag);
  }
  return done;
}

void TagHookRegistry::after_map(const Snapshot& hooks, const std::vector<std::string>& tags, bool rethrow) {
  std::exception_ptr first;
  for (const auto& tag : tags) {
    for (const auto& e : hooks) {
      if (e->tag != tag || !e->hooks.after_map || !e->active.load()) continue;
      try {
        e->hooks.after_map(tag);
      } catch (const std::exception& ex) {
        if (!first) first = std::current_exception();
        if (!rethrow) log::error("after_map hook {} of tag '{}' failed: {}", e->id, tag, ex.what());
      } catch (...) {
        if (!first) first = std::current_exception();
        if (!rethrow) log::error("after_map hook {} of tag '{}' failed (not a std::exception)", e->id, tag);
      }
    }
  }
  if (first && rethrow) std::rethrow_exception(first);
}

std::uint64_t Pool::add_tag_hooks(const std::string& tag, TagHooks hooks) {
  return state_->tag_hooks.add(tag, std::move(hooks));
}

void Pool::remove_tag_hooks(std::uint64_t id) { state_->tag_hooks.remove(id); }

}  // namespace torpor
