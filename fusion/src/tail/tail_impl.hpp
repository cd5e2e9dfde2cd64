// The two implementations behind fusion/tail.hpp's Tail (internal to torpor_fusion):
//   FusedTail    the Lamport protocol in kernels/include/torpor/kernels/tail_protocol.hpp, one
//                kernel per call (device kernels) or its CPU reference. Owns the slots (a
//                SymmetricBuffer) and the control block (a pool allocation), and shares the rank's
//                abort word with the heap's other fused tails, all class state in "weights", so a
//                level-2 sleep keeps them and wake needs no re-initialisation.
//   UnfusedTail  finalize, an all-reduce (NCCL on GPUs, the Group's all-gather with the CPU
//                reference), residual + RMSNorm. Keeps no state between calls.
// TailBase holds what both share: the shape, the options, the path and its reason, the per-call
// validation of TailArgs, and the TailOps (tail_ops.hpp) through which every call runs, chosen once
// at construction from the driver's capabilities.
#pragma once

#include <memory>
#include <string>

#include "tail/tail_ops.hpp"
#include "torpor/fusion/tail.hpp"
#include "torpor/group.hpp"
#include "torpor/kernels/tail_protocol.hpp"
#include "torpor/pool.hpp"
#include "torpor/symmetric.hpp"

namespace torpor::fusion::detail {

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
  std::unique_ptr<TailOps> ops_;
};

// The abort word (tail_protocol.hpp, I5) that every fused tail of one heap shares on this rank:
// one small allocation of class state in "weights", freed with the last tail that uses it.
class SharedAbortWord;

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
  // How calls are launched (device kernels; the defaults with the CPU reference).
  FusedLaunch launch() const noexcept { return ops_->fused_launch(); }

 private:
  void initialise_local();  // this rank's part and control block, nothing in flight
  void release() noexcept;

  SymmetricBuffer* slots_ = nullptr;
  void* control_ = nullptr;
  std::shared_ptr<SharedAbortWord> abort_;
  bool multicast_ = false;
};

class UnfusedTail final : public TailBase {
 public:
  // Collective where the all-reduce has a communicator (NCCL).
  UnfusedTail(SymmetricHeap& heap, const TailShape& shape, const TailOptions& options, std::string reason);
  ~UnfusedTail() override;

  void run(const TailArgs& args, Stream stream) override;
  void check() override;
  void reset() override;
};

}  // namespace torpor::fusion::detail
