// The MoE tail's Lamport protocol: memory layout, control block, error record, and the exact
// fp32 arithmetic, shared by the CUDA kernels (kernels/tail.cu) and the CPU reference
// (kernels/reference/tail_reference.cpp). Both include this header, so they agree bit for bit.
// This is the one description of the protocol: the kernels, the reference, fusion/ (which owns
// the buffers) and the README point here and say only what is theirs.
//
// Buffers (all torpor memory of class state in the "weights" tag, so they survive level-2 sleep):
//   slots    one SymmetricBuffer; rank r's part is [3 slots][R source ranks][max_tokens][hidden]
//            bf16. Source s stores its partial of row t into part d at [slot][s][t][*] of every
//            destination rank d (unicast: over the peer table; multicast: one multimem store to
//            the multicast address, which lands in every part).
//   control  one TailControl per rank in its own memory.
//   table    the slots' peer table: R + 1 uint64 (every rank's part as mapped here, then the
//            multicast address or 0).
// Start (and reset after a failure): every element of every slot is the sentinel and every
// control block is fresh (tail_fresh_control), set up with every rank idle; that makes I1 true
// for call 0.
//
// Invariants (call s uses slot s % 3; `calls` in the control block counts finished calls):
//   I1  Before call s, slot s % 3 of every part holds the sentinel (-0.0, 0x8000) in every element
//       a source will store into; the reader polls until no element it needs is the sentinel.
//   I2  Senders never store the sentinel: a partial that rounds to -0.0 is sent as +0.0. NaN is
//       sent as is (its bits are never 0x8000), so NaN propagates instead of hanging or vanishing.
//   I3  Clearing: during call s (after its own send) each rank clears, in its own part, the rows of slot
//       (s - 1) % 3 that peers stored there during call s - 1 (control.clear_*), then marks the
//       range empty. Peers store into that slot next at call s + 2. That store is issued only
//       after the peer has seen at least one of this rank's call-(s + 1) stores (every rank
//       receives at least one row from every source in every call, see receive_rows), and this
//       rank issues those only after its whole call-s kernel has finished, clears included
//       (stream order; a call launched as a programmatic dependent touches nothing before its
//       griddepcontrol.wait, which returns only after the previous kernel completed). So no clear can overwrite a
//       next-round store, whatever the block scheduling, with no grid-wide barrier. (The slot of call s - 2, (s + 1) %
//       3, was cleared during call s - 1 and is written by peers at call s + 1: also a kernel boundary away.)
//   I4  The control block advances inside the call (GPU: the grid's last block, once every block
//       has read the control block and counted itself in through `arrived`; CPU: the
//       rank's thread), so CUDA graph replays advance it: calls += 1, clear range of slot s % 3
//       = rows this rank received, clear range of slot (s - 1) % 3 = empty.
//   I5  Every wait is bounded: past the deadline (TailParams::timeout_ns, from the first poll) the
//       waiter writes one error record (the first failure wins) and gives up; the call's outputs
//       are then unspecified, later calls do nothing until reset() (they see the record), and
//       check() on the host raises timeout_error naming rank, peer, slot, token, call and op.
//       Every failure also sets the rank's abort word (TailParams::abort, one per rank, shared by
//       all the rank's tails): a wait of any of them that still spins when it sees the word set
//       gives up at once (op aborted), so a lost peer costs a decode step of L layers one bound,
//       not L (each layer's tail is its own kernel in the step's graph, with its own record).
//       Only reset() clears the word. On the GPU a wait also tells a missing peer from its own
//       grid not being resident at once (op not_resident: blocks of the call never started, so
//       their sends never happened), and a cluster's row barrier is bounded by twice the bound
//       (a sibling block's own waits, which precede its push, take up to one bound).
//   I6  A control block whose magic is wrong (lost, zeroed) is never trusted: the call records
//       op = control_lost and does nothing (its peers then time out waiting for it).
//   I7  Determinism: partials are rounded to bf16 once; the reader sums the R partials of an
//       element in rank order 0 .. R-1 in fp32, adds the residual, rounds residual_out to bf16,
//       and RMSNorm uses that rounded value with a fixed reduction tree (tail_sum_squares). Every
//       rank and every call computes the same bits, on the GPU and on the CPU.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "torpor/host_device.hpp"
#include "torpor/kernels/bf16.hpp"

namespace torpor::kernels {

inline constexpr int tail_slot_count = 3;
inline constexpr std::uint16_t tail_sentinel = 0x8000;            // bf16 -0.0
inline constexpr std::uint32_t tail_sentinel_pair = 0x80008000u;  // two sentinels in one word
inline constexpr std::uint32_t tail_control_magic = 0x4C494154u;  // "TAIL"
inline constexpr int tail_max_ranks = 16;
inline constexpr int tail_max_hidden = 8192;
inline constexpr int tail_hidden_multiple = 64;
// One 16-byte vector = 8 bf16: the unit every thread loads, stores and polls.
inline constexpr int tail_vector_elems = 8;
// The lane layout a row's reduction follows on the GPU and the CPU: tail_row_lanes lanes, lane j
// owning vectors j and j + tail_row_lanes of the row. On the GPU a lane is a thread: one block of
// tail_row_lanes threads per row, or a cluster of blocks that split the lanes (blocks per row,
// TailOptions::blocks_per_row). 512: a row's epilogue is issue-bound on few warps
// (bench/results/2026-11-30-tail-tuned-2xh200.md, the step to 512 threads).
inline constexpr int tail_row_lanes = 512;
inline constexpr int tail_warp = 32;
inline constexpr int tail_max_vectors_per_thread = tail_max_hidden / tail_vector_elems / tail_row_lanes;  // 2

// What a failed call was doing.
enum class TailOp : std::uint32_t {
  none = 0,
  wait_unicast = 1,     // polling for a peer's partial stored over the peer table
  wait_multicast = 2,   // polling for a peer's partial stored through the multicast address
  control_lost = 3,     // the control block's magic was wrong (zeroed, lost, never initialised)
  block_arrival = 4,    // GPU: the updating block waited for the call's other blocks to start
  aborted = 5,          // a wait gave up at once: an earlier failure on this rank set the abort word
  not_resident = 6,     // GPU: a wait ran out while blocks of this rank's call had not started
  cluster_barrier = 7,  // GPU: a block waited past twice the bound for its cluster's sums of a row
};

// Written once per failure (the first one wins: flag goes 0 -> 1 atomically), read by check().
struct TailErrorRecord {
  std::uint32_t flag;  // 0: no error
  std::uint32_t op;    // TailOp
  std::int32_t rank;   // the rank that gave up
  std::int32_t peer;   // whose partial did not arrive (-1: not a wait)
  std::int32_t slot;
  std::int32_t token;            // the row it waited for (-1: not a wait)
  std::uint64_t call;            // the control block's call count at the failing call
  std::uint64_t waited_ns;       // how long it waited
  std::uint32_t seen_magic;      // control_lost: the magic found
  std::uint32_t blocks_started;  // GPU, not_resident and block_arrival: blocks of the call that had started
  std::uint32_t blocks;          // ... of the call's grid
  std::uint32_t reserved;
};

// One per rank, in its own device memory. Plain data: the kernels and the CPU reference read
// and write it in place; reset() writes a fresh one.
struct alignas(16) TailControl {
  std::uint32_t magic;    // tail_control_magic once initialised
  std::uint32_t arrived;  // GPU: blocks of the running call that have read this block (the updater resets it)
  std::uint64_t calls;    // finished calls; the next call uses slot calls % 3
  // Rows [clear_begin, clear_end) of each slot, for every source rank, that peers stored into
  // during its last use and that are not cleared yet (bytes to clear = rows * R * hidden * 2).
  std::uint32_t clear_begin[tail_slot_count];
  std::uint32_t clear_end[tail_slot_count];
  TailErrorRecord error;
};

inline TailControl tail_fresh_control() {
  TailControl c{};
  c.magic = tail_control_magic;
  return c;
}

struct TailRows {
  int begin = 0;
  int end = 0;
  TORPOR_HD int count() const { return end - begin; }
  TORPOR_HD bool contains(int t) const { return t >= begin && t < end; }
};

// Reduce-scatter split: rank r of R produces rows [floor(T r / R), floor(T (r + 1) / R)).
TORPOR_HD TailRows tail_token_share(int tokens, int rank, int ranks) {
  return TailRows{static_cast<int>(static_cast<long long>(tokens) * rank / ranks),
                  static_cast<int>(static_cast<long long>(tokens) * (rank + 1) / ranks)};
}
// The rank whose share holds row t (the inverse of tail_token_share).
TORPOR_HD int tail_token_owner(int t, int tokens, int ranks) {
  return static_cast<int>((static_cast<long long>(ranks) * (t + 1) - 1) / tokens);
}

// Diagnostics for tuning (GPU only; torpor_bench_tail --trace): where the fused kernel's time
// goes. Thread 0 of block 0 (it sends and receives row 0) adds, every call, the %globaltimer
// nanoseconds from its entry to each stamp below; the grid's last block adds the time from its
// entry to its control-block update. Every block's thread 0 (the first tail_trace_blocks blocks)
// adds its own times from its griddepcontrol.wait to a few stamps (block_ns), and when that wait
// returned after block 0's (block_waited_ns). All sums over `calls`.
inline constexpr int tail_trace_blocks = 256;
inline constexpr int tail_block_stamps = 8;
enum TailStamp : int {
  tail_stamp_waited,        // griddepcontrol.wait returned
  tail_stamp_control_read,  // thread 0 has the control block
  tail_stamp_partial,       // thread 0's first partial is computed
  tail_stamp_setup,         // the block passed the barrier after both
  tail_stamp_sent,          // thread 0 issued its partial's stores
  tail_stamp_cleared,       // thread 0 issued its clear stores
  tail_stamp_vectors_in,    // thread 0's vectors of row 0 from every source are in
  tail_stamp_residual,      // thread 0 added the residual and has its warp's sum of squares
  tail_stamp_row_barrier,   // thread 0 passed the row's barrier (the block's, or its transaction barrier with C > 1)
  tail_stamp_block_in,      // every thread's of the row are (every block of its cluster)
  tail_stamp_epilogue,      // row 0's outputs are written
  tail_stamp_end,           // the block is done
  tail_trace_phases
};
struct TailTrace {
  std::uint64_t calls;
  std::uint64_t phase_ns[tail_trace_phases];
  std::int64_t gap_ns;     // entry minus the previous call's block-0 end (negative: launched early)
  std::uint64_t gaps;      // calls that had a previous one
  std::uint64_t last_end;  // %globaltimer at the previous call's block-0 end
  std::uint64_t updater_ns;
  std::uint64_t cycles;         // clock64 from entry to end (cycles / ns = the SM clock in GHz)
  std::uint64_t block0_waited;  // scratch: %globaltimer when block 0's wait returned this call
  // Per block b < tail_trace_blocks: its wait's return minus block 0's, and from its wait's return
  // to: 0 thread 0's first partial, 1 its send, 2 its clear, 3 first row in (0 for a block
  // without rows), 4 every thread's send, 5 every thread's vectors of the first row in; 6 the
  // most poll rounds any thread needed for them (a count, not ns); 7 end.
  std::int64_t block_waited_ns[tail_trace_blocks];
  std::uint64_t block_ns[tail_trace_blocks][tail_block_stamps];
};

// Everything one rank's call needs, for the kernel and for the CPU reference. Tensor pointers
// are this rank's (device memory on the GPU; CPU addresses on the host backend).
struct TailParams {
  const bf16* expert_out = nullptr;     // [tokens][top_k][hidden]
  const float* topk_weights = nullptr;  // [tokens][top_k]
  const bf16* shared_out = nullptr;     // [tokens][hidden] or nullptr
  const bf16* residual_in = nullptr;    // [tokens][hidden]
  const bf16* gamma = nullptr;          // [hidden]
  bf16* residual_out = nullptr;         // [tokens][hidden]
  bf16* norm_out = nullptr;             // [tokens][hidden]
  int tokens = 0;
  int hidden = 0;
  int top_k = 1;
  int max_tokens = 0;
  int ranks = 0;
  int rank = 0;
  float eps = 1e-6f;
  bool reduce_scatter = false;
  bool multicast = false;
  const std::uint64_t* peer_table = nullptr;  // ranks + 1 entries
  TailControl* control = nullptr;
  std::uint64_t timeout_ns = 0;
  // This rank's abort word (I5), in its own memory, shared by every tail of the rank: 0 until a
  // call of any of them fails. nullptr: none (the waits are bounded by timeout_ns only).
  std::uint32_t* abort = nullptr;
  TailTrace* trace = nullptr;  // diagnostics only (GPU): nullptr = no tracing
};

// Rows this rank receives (and therefore clears next call): its share in reduce-scatter mode,
// every row otherwise. Multicast stores land in every part, so the multicast variant receives
// every row. With fewer tokens than ranks every rank receives every row, so that each rank
// always hears from every source in every call (invariant I3 depends on it).
TORPOR_HD TailRows tail_receive_rows(const TailParams& p) {
  if (p.reduce_scatter && !p.multicast && p.tokens >= p.ranks) return tail_token_share(p.tokens, p.rank, p.ranks);
  return TailRows{0, p.tokens};
}
// Rows this rank writes outputs for.
TORPOR_HD TailRows tail_output_rows(const TailParams& p) {
  return p.reduce_scatter ? tail_token_share(p.tokens, p.rank, p.ranks) : TailRows{0, p.tokens};
}
// Whether `dest` receives row t from every source (same rule as tail_receive_rows).
TORPOR_HD bool tail_receives(const TailParams& p, int dest, int t) {
  if (p.reduce_scatter && !p.multicast && p.tokens >= p.ranks) return tail_token_owner(t, p.tokens, p.ranks) == dest;
  return true;
}

// Element offset of [slot][source][row][col] inside one rank's part.
TORPOR_HD std::size_t tail_slot_offset(int slot, int source, int row, int col, int ranks, int max_tokens, int hidden) {
  return ((static_cast<std::size_t>(slot) * static_cast<std::size_t>(ranks) + static_cast<std::size_t>(source)) *
              static_cast<std::size_t>(max_tokens) +
          static_cast<std::size_t>(row)) *
             static_cast<std::size_t>(hidden) +
         static_cast<std::size_t>(col);
}
inline std::size_t tail_slot_bytes(int ranks, int max_tokens, int hidden) {
  return static_cast<std::size_t>(tail_slot_count) * static_cast<std::size_t>(ranks) *
         static_cast<std::size_t>(max_tokens) * static_cast<std::size_t>(hidden) * sizeof(bf16);
}

// --- arithmetic: explicit round-to-nearest operations; the compiler never contracts them into
// FMAs (the one FMA, in the partial, is written as one) -----------------------------------------

TORPOR_HD float tail_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TORPOR_HD float tail_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
// a * b + c with one rounding (fused multiply-add, correctly rounded on the GPU and by std::fma
// on the CPU, so both give the same bits): the partial's accumulation step.
TORPOR_HD float tail_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
TORPOR_HD float tail_bits_to_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
TORPOR_HD std::uint32_t tail_float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
TORPOR_HD float tail_bf16_to_float(std::uint16_t b) { return tail_bits_to_float(static_cast<std::uint32_t>(b) << 16); }
// Round to nearest even; every NaN becomes the canonical bf16 NaN 0x7FFF (CUDART_NAN_BF16). On
// the GPU one cvt.rn.bf16x2.f32 converts two elements (tail.cu), and a select makes its NaNs
// canonical whatever the hardware gives; here, the same bits by integer arithmetic.
inline constexpr std::uint16_t tail_bf16_nan = 0x7FFF;
TORPOR_HD std::uint16_t tail_float_to_bf16(float f) {
  std::uint32_t u = tail_float_to_bits(f);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu) != 0) return tail_bf16_nan;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
// I2: what a sender stores for a partial element.
TORPOR_HD std::uint16_t tail_sanitize(std::uint16_t b) { return b == tail_sentinel ? std::uint16_t{0} : b; }
// Whether either half of w is the sentinel. Branch-free, since the GPU's polls run it on every
// word of every round: a half equal to the sentinel is a zero half of x = w ^ tail_sentinel_pair,
// and (x - 0x00010001) & ~x & 0x80008000 is non-zero exactly when some half of x is zero (a half
// sets its flag only if it is zero or borrows from a zero half below it, when the answer is yes
// anyway).
TORPOR_HD bool tail_word_has_sentinel(std::uint32_t w) {
  const std::uint32_t x = w ^ tail_sentinel_pair;
  return ((x - 0x00010001u) & ~x & 0x80008000u) != 0u;
}

// One element of this rank's partial: (shared) + sum over k in order of weight_k * expert_k, each
// step one fused multiply-add. `expert` points at element [t][0][col]; consecutive k are
// `hidden` apart.
TORPOR_HD float tail_partial_element(const std::uint16_t* expert, const float* weights, int top_k, int hidden,
                                     const std::uint16_t* shared) {
  float acc = shared != nullptr ? tail_bf16_to_float(*shared) : 0.0f;
  for (int k = 0; k < top_k; ++k)
    acc = tail_fma(weights[k], tail_bf16_to_float(expert[static_cast<std::size_t>(k) * hidden]), acc);
  return acc;
}

// The reciprocal RMS from the row's sum of squares.
TORPOR_HD float tail_inv_rms(float sum_squares, int hidden, float eps) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_squares, static_cast<float>(hidden)), eps)));
#else
  return 1.0f / std::sqrt(sum_squares / static_cast<float>(hidden) + eps);
#endif
}

// The row's sum of squares follows one fixed tree (the GPU block's, replayed on the CPU by
// tail_reference.cpp): lane j of tail_row_lanes sums x^2 of vectors j, j + 512, ... (elements
// in order) from 0.0f; each warp of 32 lanes combines by xor butterfly (offsets 16, 8, 4, 2, 1:
// v[i] = v[i] + v[i ^ m]); the warp totals are added in warp order starting from warp 0's.

TORPOR_HD std::uint16_t tail_norm_element(float x, float inv_rms, std::uint16_t gamma) {
  return tail_float_to_bf16(tail_mul(tail_mul(x, inv_rms), tail_bf16_to_float(gamma)));
}

}  // namespace torpor::kernels
