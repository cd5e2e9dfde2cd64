// The pool's tag hooks (TagHooks in pool.hpp): the registry, and the two calls the sleep and
// wake entry points make around the engine.
//
// Design: hooks are called outside Pool::State::mu (a hook may read stats, mark, allocate), so
// the registry has a lock of its own and a call works on a snapshot of shared entries. Each
// entry carries an `active` flag checked right before every call: once remove() returns, no new
// call of that hook starts, even from a snapshot taken earlier (one already running ends
// normally). Which tags a call concerns (mapped before a sleep, fully mapped after a wake) is
// decided by the caller under mu and passed in, so the registry knows nothing of chunks.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "torpor/pool.hpp"

namespace torpor {

class TagHookRegistry {
 public:
  struct Entry {
    std::uint64_t id = 0;
    std::string tag;
    TagHooks hooks;
    std::atomic<bool> active{true};
  };
  using Snapshot = std::vector<std::shared_ptr<Entry>>;

  std::uint64_t add(const std::string& tag, TagHooks hooks);
  void remove(std::uint64_t id);
  Snapshot snapshot() const;
  // The distinct tags that have live hooks, in the order their first hook was added.
  static std::vector<std::string> tags_of(const Snapshot& hooks);

  // before_unmap of every hook of `tags` (in `tags` order, each tag's hooks in the order added).
  // On a throw: after_map for the tags whose before_unmap hooks all returned, then rethrow.
  // Returns the tags whose hooks ran (the ones a failed sleep must map again).
  static std::vector<std::string> before_unmap(const Snapshot& hooks, const std::vector<std::string>& tags);
  // after_map of every hook of `tags`. Every hook is called even when one throws; with
  // `rethrow` the first exception is rethrown after all ran, else it is logged.
  static void after_map(const Snapshot& hooks, const std::vector<std::string>& tags, bool rethrow);

 private:
  mutable std::mutex mu_;
  std::uint64_t next_ = 1;
  std::vector<std::shared_ptr<Entry>> entries_;
};

}  // namespace torpor
