// NcclComm: see nccl_comm.hpp. Invariant: comm is a live communicator from construction to
// destruction; every NCCL result is checked and named. Compiled where CMake found NCCL
// (TORPOR_NCCL); nccl_comm_unavailable.cpp stands in elsewhere.
#include "torpor/nccl_comm.hpp"

#include <fmt/core.h>
#include <nccl.h>

#include <cstring>
#include <span>

#include "ranks/groups/nccl/nccl_library.hpp"
#include "ranks/multicast.hpp"
#include "torpor/consensus.hpp"
#include "torpor/error.hpp"
#include "torpor/group.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

const NcclLibrary& api() { return nccl_library(); }

}  // namespace

struct NcclComm::Impl {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int size = 0;
  int device = 0;

  std::string who() const {
    return fmt::format("tail all-reduce communicator, rank {} of {} (device {})", rank, size, device);
  }
  void check(ncclResult_t r, const char* call) const {
    if (r == ncclSuccess) return;
    throw error(fmt::format("{}: {} failed: {} ({})", who(), call, api().error_string(r), static_cast<int>(r)));
  }
};

bool NcclComm::available(std::string* why_not) {
  if (api().usable()) return true;
  if (why_not != nullptr) *why_not = api().why_not;
  return false;
}

NcclComm::NcclComm(Group& group, int device) : impl_(std::make_unique<Impl>()) {
  Impl& d = *impl_;
  d.rank = group.rank();
  d.size = group.size();
  d.device = device;
  // Every rank learns whether every rank can load NCCL before anyone blocks in init.
  consensus::Outcomes loadable = consensus::run_all_or_none(group, [] {
    std::string why;
    if (!available(&why)) throw unavailable(why);
  });
  if (!loadable.ok())
    throw unavailable(
        fmt::format("{}: rank {} cannot use NCCL: {}", d.who(), loadable.first_failed(), loadable.first().message));

  apply_nccl_nvls_policy();  // before the first NCCL call: the kill switches apply to NCCL too
  ncclUniqueId id{};
  if (d.rank == 0) d.check(api().get_unique_id(&id), "ncclGetUniqueId");
  const std::span<const std::byte> id_bytes(reinterpret_cast<const std::byte*>(&id), d.rank == 0 ? sizeof id : 0);
  auto ids = group.all_gather(id_bytes);
  if (ids[0].size() != sizeof id) throw error(fmt::format("{}: malformed NCCL unique id from rank 0", d.who()));
  std::memcpy(&id, ids[0].data(), sizeof id);

  d.check(api().init_rank(&d.comm, d.size, id, d.rank), "ncclCommInitRank");
}

NcclComm::~NcclComm() {
  if (impl_->comm == nullptr) return;
  // ncclCommDestroy makes the communicator's device current itself (and restores the caller's).
  ncclResult_t r = api().destroy(impl_->comm);
  if (r != ncclSuccess) log::error("{}: ncclCommDestroy failed: {}", impl_->who(), api().error_string(r));
}

void NcclComm::all_reduce_sum_f32(void* buffer, std::size_t count, void* stream) {
  impl_->check(api().all_reduce(buffer, buffer, count, ncclFloat32, ncclSum, impl_->comm,
                                static_cast<cudaStream_t>(stream)),
               "ncclAllReduce");
}

void NcclComm::all_reduce_sum_bf16(void* buffer, std::size_t count, void* stream) {
  impl_->check(api().all_reduce(buffer, buffer, count, ncclBfloat16, ncclSum, impl_->comm,
                                static_cast<cudaStream_t>(stream)),
               "ncclAllReduce");
}

void NcclComm::check() {
  ncclResult_t async = ncclSuccess;
  impl_->check(api().get_async_error(impl_->comm, &async), "ncclCommGetAsyncError");
  impl_->check(async, "an earlier ncclAllReduce (asynchronous error)");
}

}  // namespace torpor
