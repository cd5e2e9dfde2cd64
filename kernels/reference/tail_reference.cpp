// The CPU reference of the MoE tail: the fused kernel's protocol and arithmetic on one thread per
// rank (see tail_protocol.hpp for the invariants, tail.cu for the GPU side).
//
// Where the GPU spreads a phase over blocks, this runs it in order on one thread; the protocol
// does not depend on that order (I1-I7). Peer stores are 64-bit release stores of 4 elements
// and polls are acquire loads (std::atomic_ref) that check every element for the sentinel, so
// the same code is correct for ranks that are threads or processes sharing the slots' memory. Multicast stores
// go through the hook (HostDriver::multicast_store, which writes every bound part).
//
// Waiting: a rank polls an element until it is no longer the sentinel; after a few spins it
// yields, and after a millisecond it sleeps between polls, so many ranks on few cores still make
// progress. The deadline is TailParams::timeout_ns from the first poll that had to wait; a wait
// also gives up as soon as it sees the rank's abort word set (I5: an earlier failure of any of
// the rank's tails), and every failure recorded here sets that word.
#include "torpor/kernels/tail_reference.hpp"

#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include "torpor/error.hpp"

namespace torpor::kernels {

namespace {

// Words are built with memcpy from element arrays: element e of a word is bits [16e, 16e + 16).
static_assert(std::endian::native == std::endian::little, "the CPU reference assumes a little-endian host");

using clock_type = std::chrono::steady_clock;

const std::uint16_t* bits(const bf16* p) { return reinterpret_cast<const std::uint16_t*>(p); }
std::uint16_t* bits(bf16* p) { return reinterpret_cast<std::uint16_t*>(p); }

// I5: the first failure of a control block writes its record; every failure sets the abort word.
void record_error(const TailParams& p, TailOp op, int peer, int slot, int token, std::uint64_t call,
                  std::uint64_t waited_ns, std::uint32_t seen_magic) {
  if (p.abort != nullptr) std::atomic_ref<std::uint32_t>(*p.abort).store(1u, std::memory_order_release);
  TailControl* c = p.control;
  const int rank = p.rank;
  std::atomic_ref<std::uint32_t> flag(c->error.flag);
  std::uint32_t expected = 0;
  if (!flag.compare_exchange_strong(expected, 1u)) return;
  c->error.op = static_cast<std::uint32_t>(op);
  c->error.rank = rank;
  c->error.peer = peer;
  c->error.slot = slot;
  c->error.token = token;
  c->error.call = call;
  c->error.waited_ns = waited_ns;
  c->error.seen_magic = seen_magic;
}

// The bounded wait of one call (I5).
class Waiter {
 public:
  Waiter(std::uint64_t timeout_ns, const std::uint32_t* abort)
      : timeout_(std::chrono::nanoseconds(timeout_ns)), abort_(abort) {}

  // Polls the 4-element word at a until none of its elements is the sentinel (true, the word in
  // out), or the deadline passed or the abort word is set (false; aborted() says which).
  bool wait(const std::uint64_t* a, std::uint64_t& out) {
    std::atomic_ref<std::uint64_t> ref(*const_cast<std::uint64_t*>(a));  // only loads through it
    for (unsigned n = 0;; ++n) {
      out = ref.load(std::memory_order_acquire);
      if (!tail_word_has_sentinel(static_cast<std::uint32_t>(out)) &&
          !tail_word_has_sentinel(static_cast<std::uint32_t>(out >> 32)))
        return true;
      if (n < 64) continue;
      if (abort_ != nullptr &&
          std::atomic_ref<std::uint32_t>(*const_cast<std::uint32_t*>(abort_)).load(std::memory_order_acquire) != 0) {
        aborted_ = true;
        return false;
      }
      const auto now = clock_type::now();
      if (!started_) {
        started_ = true;
        start_ = now;
      } else if (now - start_ > timeout_) {
        return false;
      }
      if (now - start_ < std::chrono::milliseconds(1))
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  bool aborted() const { return aborted_; }
  std::uint64_t waited_ns() const {
    return started_ ? static_cast<std::uint64_t>(
                          std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now() - start_).count())
                    : 0;
  }

 private:
  std::chrono::nanoseconds timeout_;
  const std::uint32_t* abort_;
  bool aborted_ = false;
  bool started_ = false;
  clock_type::time_point start_{};
};

// This rank's partial of one row, rounded and sanitised (I2).
void partial_row(const TailParams& p, int row, std::uint16_t* out) {
  const std::uint16_t* expert = bits(p.expert_out) + static_cast<std::size_t>(row) * p.top_k * p.hidden;
  const float* w = p.topk_weights + static_cast<std::size_t>(row) * p.top_k;
  const std::uint16_t* shared =
      p.shared_out != nullptr ? bits(p.shared_out) + static_cast<std::size_t>(row) * p.hidden : nullptr;
  for (int col = 0; col < p.hidden; ++col)
    out[col] = tail_sanitize(tail_float_to_bf16(
        tail_partial_element(expert + col, w, p.top_k, p.hidden, shared != nullptr ? shared + col : nullptr)));
}

// Residual + RMSNorm of one row from its fp32 sums (the kernel's row_epilogue).
void residual_norm_row(const TailParams& p, int row, const float* sum, std::vector<float>& x) {
  const std::size_t base = static_cast<std::size_t>(row) * p.hidden;
  const std::uint16_t* res_in = bits(p.residual_in) + base;
  std::uint16_t* res_out = bits(p.residual_out) + base;
  std::uint16_t* norm_out = bits(p.norm_out) + base;
  const std::uint16_t* gamma = bits(p.gamma);
  x.resize(static_cast<std::size_t>(p.hidden));
  for (int col = 0; col < p.hidden; ++col) {
    const std::uint16_t r = tail_float_to_bf16(tail_add(tail_bf16_to_float(res_in[col]), sum[col]));
    res_out[col] = r;  // after reading res_in[col]: residual_out may alias residual_in
    x[static_cast<std::size_t>(col)] = tail_bf16_to_float(r);
  }
  const float inv = tail_inv_rms(reference_sum_squares(x.data(), p.hidden), p.hidden, p.eps);
  for (int col = 0; col < p.hidden; ++col)
    norm_out[col] = tail_norm_element(x[static_cast<std::size_t>(col)], inv, gamma[col]);
}

// The call's state from the control block (step 0).
struct CallControl {
  std::uint64_t calls = 0;        // this call's number
  int slot = 0;                   // calls % tail_slot_count
  int prev = 0;                   // the slot before it
  std::uint32_t clear_begin = 0;  // rows of the previous slot still to clear (I3)
  std::uint32_t clear_end = 0;
};

// Where source `source`'s row `row` of slot `s` lies in rank `rank`'s part.
std::uint16_t* slot_at(const TailParams& p, int rank, int s, int source, int row) {
  return reinterpret_cast<std::uint16_t*>(static_cast<std::uintptr_t>(p.peer_table[rank])) +
         tail_slot_offset(s, source, row, 0, p.ranks, p.max_tokens, p.hidden);
}

// Step 0: the control block (I6: magic and the clear range, recorded when lost; I5: a recorded
// error makes the call a no-op). nullopt: nothing to do.
std::optional<CallControl> read_control(const TailParams& p) {
  TailControl* c = p.control;
  const std::uint32_t magic = c->magic;
  CallControl call;
  call.calls = c->calls;
  call.slot = static_cast<int>(call.calls % tail_slot_count);
  call.prev = (call.slot + tail_slot_count - 1) % tail_slot_count;
  call.clear_begin = c->clear_begin[call.prev];
  call.clear_end = c->clear_end[call.prev];
  if (magic != tail_control_magic || call.clear_begin > call.clear_end ||
      call.clear_end > static_cast<std::uint32_t>(p.max_tokens)) {
    record_error(p, TailOp::control_lost, -1, -1, -1, call.calls, 0, magic);
    return std::nullopt;
  }
  if (std::atomic_ref<std::uint32_t>(c->error.flag).load(std::memory_order_acquire) != 0) return std::nullopt;
  return call;
}

// Step 1: this rank's part of the previous slot back to sentinels (I3). Nobody stores there
// before call s + 2.
void clear_previous_slot(const TailParams& p, const CallControl& call) {
  for (int source = 0; source < p.ranks; ++source)
    for (std::uint32_t row = call.clear_begin; row < call.clear_end; ++row) {
      std::uint16_t* d = slot_at(p, p.rank, call.prev, source, static_cast<int>(row));
      for (int col = 0; col < p.hidden; ++col) d[col] = tail_sentinel;
    }
}

// Step 2 (MoE finalize and the all-reduce's send): this rank's partial rows, to every rank that
// receives the row (self first, then the peers in turn), or once through the multicast hook.
// Stores move 4 elements (64 bits) at a time; rows are 128-byte aligned (hidden is a multiple of
// 64).
void send_partials(const TailParams& p, const CallControl& call, const ReferenceHooks& hooks) {
  const int words = p.hidden / 4;
  std::vector<std::uint16_t> row_bits(static_cast<std::size_t>(p.hidden));
  for (int row = 0; row < p.tokens; ++row) {
    partial_row(p, row, row_bits.data());
    if (p.multicast) {
      const std::uint64_t mc = p.peer_table[p.ranks];
      hooks.multicast_store(mc + tail_slot_offset(call.slot, p.rank, row, 0, p.ranks, p.max_tokens, p.hidden) *
                                     sizeof(bf16),
                            row_bits.data(), row_bits.size() * sizeof(bf16));
      continue;
    }
    for (int j = 0; j < p.ranks; ++j) {
      const int d = (p.rank + j) % p.ranks;
      if (!tail_receives(p, d, row)) continue;
      auto* dst = reinterpret_cast<std::uint64_t*>(slot_at(p, d, call.slot, p.rank, row));
      for (int w = 0; w < words; ++w) {
        std::uint64_t v;
        std::memcpy(&v, row_bits.data() + w * 4, sizeof v);
        std::atomic_ref<std::uint64_t>(dst[w]).store(v, std::memory_order_release);
      }
    }
  }
}

// Step 3, the all-reduce's receive of one row: every source's partial, polled 4 elements at a
// time (every element of a word is checked, as the GPU checks its 16-byte vectors) and summed in
// rank order in fp32 (I7) into sum. False when a wait gave up (recorded).
bool sum_sources(const TailParams& p, const CallControl& call, int row, Waiter& waiter, std::vector<float>& sum) {
  const int words = p.hidden / 4;
  for (int source = 0; source < p.ranks; ++source) {
    const auto* a = reinterpret_cast<const std::uint64_t*>(slot_at(p, p.rank, call.slot, source, row));
    for (int w = 0; w < words; ++w) {
      std::uint64_t v = 0;
      if (!waiter.wait(a + w, v)) {
        const TailOp op = waiter.aborted() ? TailOp::aborted
                          : p.multicast    ? TailOp::wait_multicast
                                           : TailOp::wait_unicast;
        record_error(p, op, source, call.slot, row, call.calls, waiter.waited_ns(), tail_control_magic);
        return false;
      }
      for (int e = 0; e < 4; ++e) {
        const float f = tail_bf16_to_float(static_cast<std::uint16_t>(v >> (16 * e)));
        float& acc = sum[static_cast<std::size_t>(w * 4 + e)];
        acc = source == 0 ? f : tail_add(acc, f);
      }
    }
  }
  return true;
}

// Step 3: every row this rank receives (all of them must land before the slot is cleared again);
// residual + RMSNorm for the output rows. The first failed wait ends the step.
void receive_rows(const TailParams& p, const CallControl& call) {
  const TailRows recv = tail_receive_rows(p);
  const TailRows out = tail_output_rows(p);
  Waiter waiter(p.timeout_ns, p.abort);
  std::vector<float> sum(static_cast<std::size_t>(p.hidden)), x;
  for (int row = recv.begin; row < recv.end; ++row) {
    if (!sum_sources(p, call, row, waiter, sum)) return;
    if (out.contains(row)) residual_norm_row(p, row, sum.data(), x);
  }
}

// Step 4: the control block advanced (I4): this call's receive rows are the next call's to clear.
void advance_control(const TailParams& p, const CallControl& call) {
  TailControl* c = p.control;
  const TailRows recv = tail_receive_rows(p);
  c->clear_begin[call.slot] = static_cast<std::uint32_t>(recv.begin);
  c->clear_end[call.slot] = static_cast<std::uint32_t>(recv.end);
  c->clear_begin[call.prev] = 0;
  c->clear_end[call.prev] = 0;
  c->calls = call.calls + 1;
}

}  // namespace

float reference_sum_squares(const float* x, int hidden) {
  constexpr int lanes = tail_row_lanes;
  std::array<float, lanes> lane{};
  const int vectors = hidden / tail_vector_elems;
  for (int j = 0; j < lanes; ++j)
    for (int v = j; v < vectors; v += lanes)
      for (int e = 0; e < tail_vector_elems; ++e) {
        const float xi = x[v * tail_vector_elems + e];
        lane[static_cast<std::size_t>(j)] = tail_add(lane[static_cast<std::size_t>(j)], tail_mul(xi, xi));
      }
  float total = 0.0f;
  for (int w = 0; w < lanes / tail_warp; ++w) {
    float* l = lane.data() + w * tail_warp;
    // xor butterfly: lane 0 ends with ((l0 + l16) + (l8 + l24)) + ..., exactly as on the GPU.
    for (int m = tail_warp / 2; m >= 1; m /= 2)
      for (int i = 0; i < m; ++i) l[i] = tail_add(l[i], l[i + m]);
    total = w == 0 ? l[0] : tail_add(total, l[0]);
  }
  return total;
}

void reference_fill_sentinel(bf16* dst, std::size_t elements) {
  std::uint16_t* d = bits(dst);
  for (std::size_t i = 0; i < elements; ++i) d[i] = tail_sentinel;
}

void reference_finalize(const TailParams& p, bf16* partial) {
  for (int row = 0; row < p.tokens; ++row)
    partial_row(p, row, bits(partial) + static_cast<std::size_t>(row) * p.hidden);
}

void reference_residual_norm(const TailParams& p, const float* sum) {
  const TailRows out = tail_output_rows(p);
  std::vector<float> x;
  for (int row = out.begin; row < out.end; ++row)
    residual_norm_row(p, row, sum + static_cast<std::size_t>(row) * p.hidden, x);
}

void reference_tail_fused(const TailParams& p, const ReferenceHooks& hooks) {
  if (p.multicast && !hooks.multicast_store)
    throw invalid_argument("reference_tail_fused: the multicast variant needs ReferenceHooks::multicast_store");
  const std::optional<CallControl> call = read_control(p);  // 0
  if (!call) return;
  clear_previous_slot(p, *call);   // 1
  send_partials(p, *call, hooks);  // 2
  receive_rows(p, *call);          // 3
  advance_control(p, *call);       // 4
}

}  // namespace torpor::kernels
