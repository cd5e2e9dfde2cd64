// NcclGroup: a Group whose bytes travel over NCCL (what carries fabric handles between nodes),
// on top of a node-local bootstrap Group that carries everything NCCL cannot: the NCCL unique id,
// POSIX file descriptors (all_gather_fds goes to the bootstrap), and the naming of a missing rank.
//
// libnccl.so.2 is opened at run time (dlopen; TORPOR_NCCL_LIBRARY overrides the name), like
// libcuda, so binaries start on machines without it. Only the cuda backend can host it.
//
// Timeouts: a collective is enqueued on the group's own stream, followed by a device-to-host copy
// of a flag; the host polls the flag until timeout(). When it runs out the communicator is
// aborted (ncclCommAbort stops the kernels), and the bootstrap group is asked who is there: the
// ranks that do not answer within its timeout are the ones named in the group_timeout.
// Recovery, as for every Group: recover() on every rank recovers the bootstrap group and builds
// a new communicator.
//
// Multicast: before the process's first communicator, TORPOR_DISABLE_MULTICAST sets
// NCCL_NVLS_ENABLE=0 (over the user's own value), and a foreign kill switch
// (TORCH_SYMM_MEM_DISABLE_MULTICAST, NVSHMEM_DISABLE_NVLS) sets it when the user has not, so
// NCCL creates no multicast object either; the unfused tail's communicator follows the same
// policy (one NCCL loader for both).
#pragma once

#include <memory>
#include <string>

#include "torpor/driver.hpp"
#include "torpor/group.hpp"

namespace torpor {

class NcclGroup final : public Group {
 public:
  // Whether libnccl.so.2 can be loaded here; `why_not` says why not.
  static bool available(std::string* why_not = nullptr);

  // Collective over `bootstrap`, whose ranks are this group's ranks. `driver` must be the cuda
  // backend (throws invalid_argument otherwise); `device` is this rank's GPU. The bootstrap group
  // must outlive this one.
  NcclGroup(Group& bootstrap, Driver& driver, int device, const GroupOptions& options = {});
  ~NcclGroup() override;
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int rank() const noexcept override;
  int size() const noexcept override;
  std::string_view kind() const noexcept override { return "nccl"; }
  // Descriptors go through the bootstrap group, so this group carries them exactly where the
  // bootstrap does: a TCP bootstrap (ranks that share no Unix socket, as across nodes) carries
  // bytes only, and a symmetric heap over this group then shares fabric handles.
  bool carries_fds() const noexcept override;
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) override;
  std::vector<std::vector<UniqueFd>> all_gather_fds(std::span<const int> mine) override;
  void barrier() override;
  void recover() override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace torpor
