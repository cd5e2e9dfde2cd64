// The two implementations behind fusion/tail.hpp's Tail (internal to torpor_fusion):
//   FusedTail    one kernel per call (GPU) or the CPU reference (host backend) of the Lamport
//                protocol in kernels/include/torpor/kernels/tail_protocol.hpp. Owns the slots
//                (a SymmetricBuffer) and the control block (a pool allocation), both class state
//                in "weights", so a level-2 sleep keeps them and wake needs no re-initialisation.
//   UnfusedTail  finalize, an all-reduce (NCCL on GPUs, the Group's all-gather on the host
//                backend), residual + RMSNorm. Keeps no state between calls.
// TailBase holds what both share: the shape, the options, the path and its reason, and the
// per-call validation of TailArgs.
#pragma once

#include <memory>
#include <string>

#include "torpor/fusion/tail.hpp"
#include "torpor/group.hpp"
#include "torpor/host_driver.hpp"
#include "torpor/kernels/tail_protocol.hpp"
#include "torpor/kernels/tail_reference.hpp"
#include "torpor/pool.hpp"
#include "torpor/symmetric.hpp"

namespace torpor::fusion::detail {

class NcclComm;

// Setting up the fused tail's state failed on some rank; thrown on every rank (after they
// agreed), so make_tail falls back to the unfused path everywhere or nowhere.
class setup_failed : public error {
 public:
  using error::error;
};

class TailBase : public Tail {
 public:
  TailPath path() const noexcept override { return path_; }
  const std::string& reason() const noexcept override { return reason_; }
  const TailShape& shape() const noexcept override { return shape_; }

 protected:
  TailBase(SymmetricHeap& heap, const TailShape& shape, const TailOptions& options, TailPath path, std::string reason);
  // Validates `args` and `stream` (throws invalid_argument naming the field and the fix) and
  // fills the per-call part of the kernel parameters.
  kernels::TailParams params(const TailArgs& args, Stream stream) const;
  std::string who() const;
  static void* cuda_stream(Stream s) noexcept { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(s.value)); }

  SymmetricHeap& heap_;
  Pool& pool_;
  Group& group_;
  TailShape shape_;
  TailOptions options_;
  TailPath path_;
  std::string reason_;
  int rank_ = 0;
  int ranks_ = 0;
  int device_ = 0;
  bool cuda_ = false;  // the cuda backend (else host: device memory is CPU memory)
};

class FusedTail final : public TailBase {
 public:
  // Collective. Allocates the slots (asking for multicast when `want_multicast`), the control
  // block, and initialises them on every rank.
  FusedTail(SymmetricHeap& heap, const TailShape& shape, const TailOptions& options, bool want_multicast,
            const std::string& unicast_reason);
  ~FusedTail() override;

  void run(const TailArgs& args, Stream stream) override;
  void check() override;
  void reset() override;

  void* control() const noexcept { return control_; }
  SymmetricBuffer* slots() const noexcept { return slots_; }
  std::size_t slot_bytes() const noexcept;
  // cuda: how a call is launched (kernels::launch_tail_fused), for few and for many rows.
  struct LaunchShape {
    int blocks_per_row = 1;
    int capacity = 0;  // the grid's bound: blocks resident at once
  };
  const LaunchShape& few_rows() const noexcept { return few_rows_; }
  const LaunchShape& many_rows() const noexcept { return many_rows_; }

 private:
  kernels::TailControl read_control();
  void initialise_local();  // this rank's part and control block, nothing in flight
  void release() noexcept;

  SymmetricBuffer* slots_ = nullptr;
  void* control_ = nullptr;
  bool multicast_ = false;
  kernels::ReferenceHooks hooks_;  // host backend
  LaunchShape few_rows_;           // cuda: calls of <= kernels::tail_cluster_max_rows rows
  LaunchShape many_rows_;          // cuda: larger calls
  std::string launch_note_;        // cuda: the launch shapes, for the log
  bool programmatic_ = false;      // cuda: launch calls as programmatic dependents
  void* stream_ = nullptr;         // cuda: this op's own stream for check() and reset()
};

class UnfusedTail final : public TailBase {
 public:
  // Collective on the cuda backend (the NCCL communicator).
  UnfusedTail(SymmetricHeap& heap, const TailShape& shape, const TailOptions& options, std::string reason);
  ~UnfusedTail() override;

  void run(const TailArgs& args, Stream stream) override;
  void check() override;
  void reset() override;

 private:
  void* scratch_ = nullptr;  // cuda: [max_tokens][hidden] bf16 partials, reduced in place
  std::unique_ptr<NcclComm> comm_;
};

}  // namespace torpor::fusion::detail
