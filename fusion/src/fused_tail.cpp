// FusedTail: the Lamport tail's state and its host side (see tail_impl.hpp, and the protocol's
// invariants in kernels/include/torpor/kernels/tail_protocol.hpp).
//
// The protocol's buffers, allocated here as class state, so sleep (any level) offloads and
// restores them bit for bit and the next call continues where the last one stopped:
//   slots    a SymmetricBuffer ("tail.slots"); its peer table is the protocol's table;
//   control  this rank's TailControl ("tail.control").
// Nothing is re-initialised on wake. reset() makes the protocol's start state, collectively:
// wait for this rank's work, barrier (every rank idle), fill this rank's part with the sentinel
// and write a fresh control block, barrier (every rank clean before anyone calls again).
#include <fmt/format.h>

#include <cstring>

#include "tail_impl.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

#if defined(TORPOR_KERNELS_CUDA)
#include "cuda_runtime.hpp"
#include "torpor/kernels/tail_kernels.hpp"
#endif

namespace torpor::fusion::detail {

using kernels::TailControl;
using kernels::TailOp;

FusedTail::FusedTail(SymmetricHeap& heap, const TailShape& shape, const TailOptions& options, bool want_multicast,
                     const std::string& unicast_reason)
    : TailBase(heap, shape, options, TailPath::fused_unicast, "") {
  const std::size_t bytes = kernels::tail_slot_bytes(ranks_, shape_.max_tokens, shape_.hidden);
  // Collective, all-or-nothing across ranks (the heap's contract); asks the group for multicast.
  slots_ = &heap_.allocate(bytes, {tags::weights, "tail.slots", want_multicast});
  multicast_ = slots_->multicast_address() != nullptr;
  path_ = multicast_ ? TailPath::fused_multicast : TailPath::fused_unicast;
  if (multicast_) {
    reason_ = "fused multicast: every rank can use multicast";
  } else {
    std::string why = unicast_reason;
    if (why.empty()) {
      auto d = heap_.multicast_decision();
      why = d && !d->reason.empty() ? d->reason : "the group decided against multicast";
    }
    reason_ = fmt::format("fused unicast: multicast not used ({})", why);
  }

  // Local setup; its outcome is agreed on before anyone waits in reset()'s barrier.
  std::string failure;
  try {
    control_ = pool_.allocate(sizeof(TailControl), {tags::weights, MemoryClass::state, "tail.control"});
    if (cuda_) {
#if defined(TORPOR_KERNELS_CUDA)
      DeviceGuard guard(device_);
      cudaStream_t s = nullptr;
      TORPOR_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), who());
      stream_ = s;
      // Two launch shapes: few rows (clusters by default, where they exist) and many rows.
      few_rows_.blocks_per_row = kernels::tail_blocks_per_row(device_, options_.blocks_per_row, true);
      many_rows_.blocks_per_row = kernels::tail_blocks_per_row(device_, options_.blocks_per_row, false);
      for (LaunchShape* l : {&few_rows_, &many_rows_}) {
        kernels::tail_preload(shape_.hidden, multicast_, l->blocks_per_row);
        l->capacity = kernels::tail_fused_capacity(shape_.hidden, multicast_, l->blocks_per_row);
      }
      programmatic_ = options_.programmatic_launch && kernels::tail_programmatic_launch_supported(device_);
      launch_note_ = fmt::format("; blocks per row {} up to {} rows, else {}", few_rows_.blocks_per_row,
                                 kernels::tail_cluster_max_rows, many_rows_.blocks_per_row);
#else
      throw unavailable("this build has no CUDA kernels");
#endif
    } else if (multicast_) {
      auto* host = dynamic_cast<HostDriver*>(&pool_.driver());
      if (host == nullptr) throw unavailable("the host multicast emulation needs the HostDriver itself");
      hooks_.multicast_store = [host](std::uint64_t va, const void* src, std::size_t n) {
        host->multicast_store(static_cast<device_ptr>(va), src, n);
      };
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  std::vector<std::vector<std::byte>> outcomes;
  try {
    outcomes = group_.all_gather(std::span<const std::byte>(reinterpret_cast<const std::byte*>(failure.data()), failure.size()));
  } catch (...) {
    release();
    throw;
  }
  for (std::size_t r = 0; r < outcomes.size(); ++r) {
    if (outcomes[r].empty()) continue;
    release();
    throw setup_failed(fmt::format("the fused tail's state could not be set up on rank {}: {}", r,
                                   std::string(reinterpret_cast<const char*>(outcomes[r].data()), outcomes[r].size())));
  }
  try {
    reset();
  } catch (...) {
    release();
    throw;
  }
  log::info("{}: {}; slots {} per rank, control block at {}{}{}", who(), reason_, bytes, control_, launch_note_,
            programmatic_ ? "; calls launch as programmatic dependents" : "");
}

FusedTail::~FusedTail() { release(); }

void FusedTail::release() noexcept {
#if defined(TORPOR_KERNELS_CUDA)
  if (stream_ != nullptr) {
    try {
      DeviceGuard guard(device_);
      // Calls still in flight on any stream of this device touch the memory freed below.
      cudaError_t e = cudaDeviceSynchronize();
      if (e == cudaSuccess) e = cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
      if (e != cudaSuccess) log::error("{}: destroying its stream: {}", who(), cudaGetErrorString(e));
    } catch (const std::exception& e) {
      log::error("{}: destroying its stream: {}", who(), e.what());
    }
    stream_ = nullptr;
  }
#endif
  if (control_ != nullptr) {
    try {
      pool_.deallocate(control_);
    } catch (const std::exception& e) {
      log::error("{}: freeing the control block: {}", who(), e.what());
    }
    control_ = nullptr;
  }
  if (slots_ != nullptr) {
    try {
      heap_.free(*slots_);
    } catch (const std::exception& e) {
      log::error("{}: freeing the slots: {}", who(), e.what());
    }
    slots_ = nullptr;
  }
}

std::size_t FusedTail::slot_bytes() const noexcept {
  return kernels::tail_slot_bytes(ranks_, shape_.max_tokens, shape_.hidden);
}

void FusedTail::run(const TailArgs& args, Stream stream) {
  kernels::TailParams p = params(args, stream);
  // Sleeping state faults on the host backend and is an illegal address on a GPU (which poisons
  // the context): refuse instead.
  if (pool_.asleep(slots_->tag()))
    throw invalid_state(fmt::format("{}: its state (tag '{}') is asleep; wake the pool before calling the tail", who(),
                                    slots_->tag()));
  p.multicast = multicast_;
  p.peer_table = static_cast<const std::uint64_t*>(slots_->peer_table());
  p.control = static_cast<TailControl*>(control_);
  if (!cuda_) {
    kernels::reference_tail_fused(p, hooks_);
    check();  // the host backend's run() is its own sync point
    return;
  }
#if defined(TORPOR_KERNELS_CUDA)
  DeviceGuard guard(device_);
  const LaunchShape& l = kernels::tail_receive_rows(p).count() <= kernels::tail_cluster_max_rows ? few_rows_ : many_rows_;
  kernels::launch_tail_fused(p, l.blocks_per_row, l.capacity, cuda_stream(stream), programmatic_);
#endif
}

TailControl FusedTail::read_control() {
  TailControl c{};
  if (!cuda_) {
    std::memcpy(&c, control_, sizeof c);  // only this rank's thread writes it
    return c;
  }
#if defined(TORPOR_KERNELS_CUDA)
  DeviceGuard guard(device_);
  auto s = static_cast<cudaStream_t>(stream_);
  TORPOR_CUDA_CHECK(cudaMemcpyAsync(&c, control_, sizeof c, cudaMemcpyDeviceToHost, s), who() + ": reading the control block");
  TORPOR_CUDA_CHECK(cudaStreamSynchronize(s), who() + ": reading the control block");
#endif
  return c;
}

void FusedTail::check() {
  const TailControl c = read_control();
  const auto& e = c.error;
  if (e.flag != 0) {
    const auto op = static_cast<TailOp>(e.op);
    if (op == TailOp::wait_unicast || op == TailOp::wait_multicast)
      throw timeout_error(fmt::format(
          "tail fusion ({}): rank {} waited {:.1f} ms for rank {}'s partial of token {} in slot {} (call {}) and gave up "
          "(TailOptions::wait_timeout {} ms): rank {} did not make the same call, or its tail state was lost; later "
          "calls do nothing until reset() on every rank",
          op == TailOp::wait_multicast ? "fused multicast" : "fused unicast", e.rank,
          static_cast<double>(e.waited_ns) / 1e6, e.peer, e.token, e.slot, e.call, options_.wait_timeout.count(), e.peer));
    if (op == TailOp::block_arrival)
      throw timeout_error(fmt::format(
          "tail fusion: on rank {} the call's last block waited {:.1f} ms for the call's other blocks to start (slot {}, "
          "call {}) and gave up without advancing the control block: the fused grid was not resident at once (another "
          "kernel holding the device's multiprocessors?); later calls do nothing until reset() on every rank",
          e.rank, static_cast<double>(e.waited_ns) / 1e6, e.slot, e.call));
    if (op == TailOp::control_lost)
      throw invalid_state(fmt::format(
          "tail fusion: rank {}'s control block is not valid (magic {:#x}, expected {:#x}): its state was lost or "
          "overwritten; nothing ran. Call reset() on every rank",
          e.rank, e.seen_magic, kernels::tail_control_magic));
    throw error(fmt::format("tail fusion: rank {} recorded an unknown failure (op {})", e.rank, e.op));
  }
  if (c.magic != kernels::tail_control_magic)
    throw invalid_state(fmt::format("tail fusion: rank {}'s control block is not valid (magic {:#x}, expected {:#x}): "
                                    "its state was lost or overwritten. Call reset() on every rank",
                                    rank_, c.magic, kernels::tail_control_magic));
}

void FusedTail::initialise_local() {
  const TailControl fresh = kernels::tail_fresh_control();
  const std::size_t elements = slot_bytes() / sizeof(bf16);
  if (!cuda_) {
    kernels::reference_fill_sentinel(static_cast<bf16*>(slots_->local()), elements);
    std::memcpy(control_, &fresh, sizeof fresh);
    return;
  }
#if defined(TORPOR_KERNELS_CUDA)
  DeviceGuard guard(device_);
  auto s = static_cast<cudaStream_t>(stream_);
  kernels::launch_fill_u16(slots_->local(), kernels::tail_sentinel, elements, s);
  TORPOR_CUDA_CHECK(cudaMemcpyAsync(control_, &fresh, sizeof fresh, cudaMemcpyHostToDevice, s), who() + ": writing the control block");
  TORPOR_CUDA_CHECK(cudaStreamSynchronize(s), who() + ": initialising the slots");
#endif
}

void FusedTail::reset() {
  if (cuda_) {
#if defined(TORPOR_KERNELS_CUDA)
    DeviceGuard guard(device_);
    // Calls in flight on this device finish first (a timed-out kernel exits by its deadline).
    TORPOR_CUDA_CHECK(cudaDeviceSynchronize(), who() + ": waiting for calls in flight before reset");
#endif
  }
  group_.barrier();  // every rank idle: nobody stores into a part being cleared
  initialise_local();
  group_.barrier();  // every part clean before any rank calls again
}

}  // namespace torpor::fusion::detail
