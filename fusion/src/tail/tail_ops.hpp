// TailOps: where one tail's work runs, chosen once when the tail is built, from the driver's
// capabilities (DriverCapabilities::compute), as Compute is for the runner:
//   CudaTailOps       the CUDA kernels of kernels/tail.cu and, for the unfused all-reduce, NCCL;
//                     enqueued on the caller's stream of this rank's device (capturable);
//   ReferenceTailOps  the CPU reference of the same protocol and arithmetic (kernels/reference)
//                     on the calling thread, over pool memory the CPU reads directly, and the
//                     Group's all-gather for the unfused all-reduce; every call has finished when it
//                     returns.
// The tails (tail_impl.hpp) are written once against this interface: FusedTail uses the fused
// operations, UnfusedTail the unfused ones. The ops hold what only one implementation needs (the
// CUDA tail's own stream, launch shapes, scratch buffer and communicator; the reference's
// multicast hook). Internal to torpor_fusion.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "torpor/fusion/tail.hpp"
#include "torpor/kernels/tail_protocol.hpp"

namespace torpor::fusion::detail {

// How the fused kernel is launched (device kernels), for few and for many rows.
struct LaunchShape {
  int blocks_per_row = 1;
  int capacity = 0;  // the grid's bound: blocks resident at once
};
struct FusedLaunch {
  LaunchShape few_rows;   // calls of <= kernels::tail_cluster_max_rows rows
  LaunchShape many_rows;  // larger calls
};

// Whether this rank can run the fused protocol, and its multicast variant: "" = yes, else why not.
struct FusedSupport {
  std::string fused_why_not;
  std::string multicast_why_not;
};

class TailOps {
 public:
  virtual ~TailOps() = default;

  // True when every call has finished when it returns (so the tail checks its outcome at once);
  // false when calls are enqueued on streams.
  virtual bool synchronous() const noexcept = 0;
  // Throws invalid_argument when the caller's stream cannot carry this rank's calls.
  virtual void check_stream(Stream stream) const = 0;

  // --- the fused path -------------------------------------------------------------------------
  // What this rank can run with the tail's shape and options (never throws for a device that
  // cannot: the other ranks are waiting for the answer).
  virtual FusedSupport fused_support() = 0;
  // Readies the fused path for the tail's shape: the kernels loaded, the launch shapes chosen,
  // what check() and reset() use created; `multicast`: the slots are bound to a multicast object.
  // Returns what the tail's log line adds ("" when nothing).
  virtual std::string prepare_fused(bool multicast) = 0;
  virtual FusedLaunch fused_launch() const noexcept = 0;
  // One fused call (tail_protocol.hpp).
  virtual void fused(const kernels::TailParams& p, Stream stream) = 0;
  // The control block at `control`, once this rank's calls before it have finished.
  virtual kernels::TailControl read_control(const void* control) = 0;
  // Fills this rank's slots (`elements` bf16) with the sentinel, writes `fresh` to the control
  // block and clears the rank's abort word; done when it returns. Nothing of this rank may be in
  // flight.
  virtual void initialise(void* slots, std::size_t elements, void* control, const kernels::TailControl& fresh,
                          std::uint32_t* abort) = 0;
  // Waits until no call of this rank is in flight (a timed-out kernel exits by its deadline).
  virtual void wait_idle() = 0;

  // --- the unfused path -----------------------------------------------------------------------
  // Readies the unfused path: kernels loaded, scratch allocated and, collectively over the group,
  // the all-reduce's communicator created where there is one.
  virtual void prepare_unfused() = 0;
  // One unfused call: finalize, all-reduce over the group, residual + RMSNorm.
  virtual void unfused(const kernels::TailParams& p, Stream stream) = 0;
  // Throws when the all-reduce reported an asynchronous failure.
  virtual void check_unfused() = 0;

  // Waits for this rank's calls in flight, then gives back what the ops hold (stream, scratch,
  // communicator). Logs and never throws; idempotent. The tail calls it before it frees the memory
  // its calls use.
  virtual void release() noexcept = 0;
};

// `who` names the tail in messages (called only when there is something to say).
using TailName = std::function<std::string()>;

// CudaTailOps where the driver runs device kernels, ReferenceTailOps where it runs the CPU
// reference; throws unavailable when this build has no CUDA kernels for a driver that wants them.
std::unique_ptr<TailOps> make_tail_ops(SymmetricHeap& heap, const TailShape& shape, const TailOptions& options,
                                       TailName who);

std::unique_ptr<TailOps> make_reference_tail_ops(SymmetricHeap& heap, const TailShape& shape,
                                                 const TailOptions& options, TailName who);
#if defined(TORPOR_KERNELS_CUDA)
std::unique_ptr<TailOps> make_cuda_tail_ops(SymmetricHeap& heap, const TailShape& shape, const TailOptions& options,
                                            TailName who);
#endif

}  // namespace torpor::fusion::detail
