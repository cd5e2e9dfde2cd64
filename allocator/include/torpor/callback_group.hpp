// CallbackGroup: a Group over a process group the embedding application already has
// (torch.distributed, an engine's own communicator), so collective sleep needs no second
// rendezvous. The embedder supplies two collectives: an all-gather of bytes and a barrier.
//
// Contract of the callbacks (the embedder's group, not torpor, bounds their waits):
//   - all_gather(mine) returns every rank's bytes indexed by rank, exactly size() entries;
//     a reply of another length is an invalid_state naming the group and the rank, never
//     read past; a callback that throws (or, in the C API, returns non-zero) is an error
//     naming the group, the rank and the callback's message.
//   - Every rank calls the same collectives in the same order, as for any Group.
// After a failed collective the group is broken on this rank: every collective throws
// invalid_state until recover(), which clears the state (and recovers the fd subgroup below,
// collectively). It cannot repair the embedder's group: if that one is broken, rebuild it.
//
// File descriptors cannot travel as bytes. The first all_gather_fds bootstraps a
// UnixSocketGroup: rank 0 creates a Rendezvous (a private 0700 directory and a random secret)
// and sends it to every rank through the embedder's all_gather; every rank joins it, and
// all_gather_fds is delegated to it from then on. This works on ONE NODE only (the directory
// must be visible to every rank, and fds are node-local anyway); across nodes use NcclGroup.
// The secret travels over the embedder's transport: that transport must be trusted as much as
// the ranks themselves. timeout() (GroupOptions) bounds the subgroup's waits; rank 0 removes
// the rendezvous directory when the group is destroyed.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "torpor/group.hpp"

namespace torpor {

struct GroupCallbacks {
  std::function<std::vector<std::vector<std::byte>>(std::span<const std::byte> mine)> all_gather;
  std::function<void()> barrier;
};

class CallbackGroup final : public Group {
 public:
  // rank in [0, size), size >= 1, both callbacks set (invalid_argument otherwise).
  CallbackGroup(int rank, int size, GroupCallbacks callbacks, const GroupOptions& options = {});
  ~CallbackGroup() override;
  CallbackGroup(const CallbackGroup&) = delete;
  CallbackGroup& operator=(const CallbackGroup&) = delete;

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  std::string_view kind() const noexcept override { return "torch"; }
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) override;
  std::vector<std::vector<UniqueFd>> all_gather_fds(std::span<const int> mine) override;
  void barrier() override;
  void recover() override;

  // The Unix group carrying fds, once the first all_gather_fds created it (else null).
  const Group* fd_group() const noexcept { return fd_group_.get(); }

 private:
  std::string who() const;
  void check_usable() const;
  [[noreturn]] void fail(const std::string& what, bool malformed);
  std::vector<std::vector<std::byte>> call_all_gather(std::span<const std::byte> mine);
  Group& fds();

  int rank_;
  int size_;
  GroupCallbacks callbacks_;
  GroupOptions options_;
  std::string broken_;                      // empty while usable
  std::unique_ptr<Rendezvous> rendezvous_;  // rank 0: the directory it created
  std::unique_ptr<Group> fd_group_;
};

}  // namespace torpor
