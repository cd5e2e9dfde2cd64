// FusedTail: the Lamport tail's state and its host side (see tail_impl.hpp, and the protocol's
// invariants in kernels/include/torpor/kernels/tail_protocol.hpp).
//
// The protocol's buffers, allocated here as class state, so sleep (any level) offloads and
// restores them bit for bit and the next call continues where the last one stopped:
//   slots    a SymmetricBuffer ("tail.slots"); its peer table is the protocol's table;
//   control  this rank's TailControl ("tail.control");
//   abort    the rank's abort word ("tail.abort"), one per heap: every fused tail made on the heap
//            shares it, so once a call of one of them has failed, the waits of the others give
//            up at once instead of each waiting out its bound (a decode step runs one tail per
//            layer in a row, with no check in between).
// Nothing is re-initialised on wake. reset() makes the protocol's start state, collectively:
// wait for this rank's work, barrier (every rank idle), fill this rank's part with the sentinel,
// write a fresh control block and clear the abort word, barrier (every rank clean before anyone
// calls again). The calls themselves, and the copies of the control block, run through the tail's
// TailOps.
#include <fmt/core.h>

#include <map>
#include <mutex>

#include "tail/tail_impl.hpp"
#include "torpor/consensus.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor::fusion::detail {

using kernels::TailControl;
using kernels::TailOp;

class SharedAbortWord {
 public:
  explicit SharedAbortWord(Pool& pool)
      : pool_(pool), word_(pool.allocate(sizeof(std::uint32_t), {tags::weights, MemoryClass::state, "tail.abort"})) {}
  ~SharedAbortWord() {
    try {
      pool_.deallocate(word_);
    } catch (const std::exception& e) {
      log::error("tail: freeing the abort word: {}", e.what());
    }
  }
  SharedAbortWord(const SharedAbortWord&) = delete;
  SharedAbortWord& operator=(const SharedAbortWord&) = delete;
  std::uint32_t* get() const noexcept { return static_cast<std::uint32_t*>(word_); }

 private:
  Pool& pool_;
  void* word_;
};

namespace {

// The heap's abort word: the one its live fused tails hold, or a new one (cleared by the new
// tail's reset()). Keyed by the heap's address; an entry whose tails are all gone is replaced.
std::shared_ptr<SharedAbortWord> abort_word_of(SymmetricHeap& heap) {
  static std::mutex mu;
  static std::map<const SymmetricHeap*, std::weak_ptr<SharedAbortWord>> words;
  std::lock_guard lock(mu);
  for (auto it = words.begin(); it != words.end();) it = it->second.expired() ? words.erase(it) : std::next(it);
  if (auto live = words[&heap].lock()) return live;
  auto word = std::make_shared<SharedAbortWord>(heap.pool());
  words[&heap] = word;
  return word;
}

}  // namespace

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
  std::string launch_note;
  auto set_up = [&] {
    control_ = pool_.allocate(sizeof(TailControl), {tags::weights, MemoryClass::state, "tail.control"});
    abort_ = abort_word_of(heap_);
    launch_note = ops_->prepare_fused(multicast_);
  };
  consensus::Outcomes outcomes;
  try {
    outcomes = consensus::run_all_or_none(group_, set_up, [this] { release(); });
  } catch (...) {
    release();
    throw;
  }
  if (!outcomes.ok())
    throw setup_failed(fmt::format("the fused tail's state could not be set up on rank {}: {}", outcomes.first_failed(),
                                   outcomes.first().message));
  try {
    reset();
  } catch (...) {
    release();
    throw;
  }
  log::info("{}: {}; slots {} per rank, control block at {}{}", who(), reason_, bytes, control_, launch_note);
}

FusedTail::~FusedTail() { release(); }

void FusedTail::release() noexcept {
  ops_->release();  // calls still in flight touch the memory freed below
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
  abort_.reset();
}

std::size_t FusedTail::slot_bytes() const noexcept {
  return kernels::tail_slot_bytes(ranks_, shape_.max_tokens, shape_.hidden);
}

void FusedTail::run(const TailArgs& args, Stream stream) {
  kernels::TailParams p = params(args, stream);
  // Sleeping state faults on the host backend and is an illegal address on a GPU (which poisons
  // the context): refuse instead.
  if (pool_.asleep(slots_->tag()))
    throw invalid_state(
        fmt::format("{}: its state (tag '{}') is asleep; wake the pool before calling the tail", who(), slots_->tag()));
  p.multicast = multicast_;
  p.peer_table = static_cast<const std::uint64_t*>(slots_->peer_table());
  p.control = static_cast<TailControl*>(control_);
  p.abort = abort_->get();
  ops_->fused(p, stream);
  if (ops_->synchronous()) check();  // a call that has finished is checked at once
}

void FusedTail::check() {
  const TailControl c = ops_->read_control(control_);
  const auto& e = c.error;
  if (e.flag != 0) {
    const auto op = static_cast<TailOp>(e.op);
    if (op == TailOp::wait_unicast || op == TailOp::wait_multicast)
      throw timeout_error(fmt::format(
          "tail fusion ({}): rank {} waited {:.1f} ms for rank {}'s partial of token {} in slot {} (call {}) and gave "
          "up "
          "(TailOptions::wait_timeout {} ms): rank {} did not make the same call, or its tail state was lost; later "
          "calls do nothing until reset() on every rank",
          op == TailOp::wait_multicast ? "fused multicast" : "fused unicast", e.rank,
          static_cast<double>(e.waited_ns) / 1e6, e.peer, e.token, e.slot, e.call, options_.wait_timeout.count(),
          e.peer));
    if (op == TailOp::aborted)
      throw timeout_error(fmt::format(
          "tail fusion ({}): rank {} stopped waiting for rank {}'s partial of token {} in slot {} (call {}) at once: "
          "an earlier call of a tail on rank {} had already failed (that tail's check() names the cause); later calls "
          "do nothing until reset() on every rank",
          multicast_ ? "fused multicast" : "fused unicast", e.rank, e.peer, e.token, e.slot, e.call, e.rank));
    if (op == TailOp::not_resident)
      throw timeout_error(fmt::format(
          "tail fusion: on rank {} a wait for rank {}'s partial of token {} in slot {} (call {}) ran out after {:.1f} "
          "ms while only {} of the call's {} blocks had started: the fused grid was not resident at once (another "
          "kernel, or an MPS limit, holding the device's multiprocessors), so the blocks that had not started never "
          "sent; later calls do nothing until reset() on every rank",
          e.rank, e.peer, e.token, e.slot, e.call, static_cast<double>(e.waited_ns) / 1e6, e.blocks_started, e.blocks));
    if (op == TailOp::cluster_barrier)
      throw timeout_error(fmt::format(
          "tail fusion: on rank {} a block waited {:.1f} ms for its cluster's sums of squares of token {} (slot {}, "
          "call {}) and gave up: a block of the cluster never pushed its part; later calls do nothing until reset() "
          "on every rank",
          e.rank, static_cast<double>(e.waited_ns) / 1e6, e.token, e.slot, e.call));
    if (op == TailOp::block_arrival)
      throw timeout_error(fmt::format(
          "tail fusion: on rank {} the call's last block waited {:.1f} ms for the call's other blocks to start ({} "
          "of {} had; slot {}, call {}) and gave up without advancing the control block: the fused grid was not "
          "resident at once (another kernel holding the device's multiprocessors?); later calls do nothing until "
          "reset() on every rank",
          e.rank, static_cast<double>(e.waited_ns) / 1e6, e.blocks_started, e.blocks, e.slot, e.call));
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
  ops_->initialise(slots_->local(), slot_bytes() / sizeof(bf16), control_, kernels::tail_fresh_control(),
                   abort_->get());
}

void FusedTail::reset() {
  ops_->wait_idle();  // calls in flight on this rank finish first
  group_.barrier();   // every rank idle: nobody stores into a part being cleared
  initialise_local();
  group_.barrier();  // every part clean before any rank calls again
}

}  // namespace torpor::fusion::detail
