// The MoE tail on the GPU: one fused kernel (finalize + Lamport one-shot all-reduce + residual +
// RMSNorm), unicast and multicast variants, plus the unfused path's two kernels. The protocol,
// layout and arithmetic live in tail_protocol.hpp (shared with the CPU reference); this file is
// the CUDA side of it.
//
// Fused kernel, one call (grid <= tail_fused_capacity, so all blocks are resident together). A row
// is finished by C blocks (blocks per row: 1, or a thread-block cluster of 4 or 8 on sm_90+), each
// holding tail_row_lanes / C of the row's lanes; the grid has enough blocks that every thread
// sends at most one vector and a cluster for every receive row:
//   0. wait for the kernels before it on the stream (griddepcontrol.wait: a no-op unless launched
//      as a programmatic dependent, see launch_tail_fused) and let the next kernel launch early;
//      thread 0 reads the control block: magic (I6), error flag (I5: a recorded error makes every
//      later call a no-op until reset), call count -> slot, and the rows of the previous slot
//      still to clear; meanwhile every thread computes its first partial (inputs only); past
//      the barrier, thread 0 counts its block in (control.arrived);
//   1. send: items (row, 16-byte vector) over the whole grid; each computes 8 elements of this
//      rank's partial in fp32 (tail_partial_element: one FMA per expert), rounds to bf16 (one
//      cvt.rn.bf16x2 per pair), sanitises (I2) and stores
//      them with st.relaxed.sys to every destination that receives the row (or one multimem.st
//      to the multicast address);
//   2. clear (I3): every block clears its share of the previous slot's rows in this rank's part;
//   3. receive: cluster q takes rows q, q + clusters, ... of this rank's receive rows; each thread
//      polls its lane's vectors from every source (ld.relaxed.sys, until no lane is the sentinel,
//      bounded by %globaltimer and by the rank's abort word, I5; two sources' vectors at once, every
//      pending one re-loaded in each round), sums them in rank order in fp32 (I7), and for output
//      rows writes residual_out and norm_out (the fixed tree: warps by butterfly, then the row's
//      warps in order: each warp's sum is pushed into every block of the cluster with st.async,
//      and a block waits on its own transaction barrier until all of them landed, bounded by
//      twice the wait bound);
//   4. the last block of the grid (a send-only block whenever there are more blocks than rows,
//      so off the critical path) waits until every block has counted itself in -- every block
//      has read the control block -- and advances it (I4).
// Memory ordering: senders need no fence between clearing and sending (I3: a kernel boundary,
// which griddepcontrol.wait keeps for a programmatic launch, separates them). Pollers read the
// data with the same load that checks for the sentinel, so there is no flag/data ordering to get
// wrong. The block count (control.arrived) is
// incremented only after the control reads returned their values (past the block's first
// barrier) and read by the updater with ld.acquire: no fence, and nothing waits for a remote
// store's acknowledgement inside the kernel. The cluster (C > 1) synchronises once, at entry
// before the wait, so barriers exist before anything is pushed into them; after that only
// st.async and local transaction-barrier waits, neither of which waits for global stores.
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "torpor/error.hpp"
#include "torpor/kernels/native_stream.hpp"
#include "torpor/kernels/tail_kernels.hpp"

namespace torpor::kernels {

namespace {

constexpr int T = tail_row_lanes;
constexpr int W = T / tail_warp;

void check_launch(const char* kernel) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw error(std::string("launching ") + kernel + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                ")");
}

void check(cudaError_t e, const char* call) {
  if (e != cudaSuccess)
    throw error(std::string(call) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

__device__ __forceinline__ std::uint64_t globaltimer() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Programmatic dependent launch (sm_90+). wait: returns once the kernels this launch depends on
// have completed and their memory is visible (immediately when it was not launched as a
// dependent). launch_dependents: the next kernel on the stream may start launching its blocks;
// they run up to their own wait, so nothing of ours is read or overwritten early.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// One more block has read the control block (see the kernel, step 0).
__device__ __forceinline__ void count_in(std::uint32_t* counter) {
  asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
}
__device__ __forceinline__ std::uint32_t load_acquire(const std::uint32_t* p) {
  std::uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The rank's abort word (I5), written by this device's own blocks (record_error): a volatile load
// sees it without a fence.
__device__ __forceinline__ bool abort_set(const std::uint32_t* abort) {
  return abort != nullptr && *static_cast<const volatile std::uint32_t*>(abort) != 0u;
}

// A bounded spin's clock (I5). %globaltimer is read on the first check and then on every 32nd
// only: a read is cheap (bench/results/2026-11-30-tail-clusters-2xh200.md), but the deadline needs
// no finer resolution than a few microseconds against its 5 s default, and the first read's value
// is not used until the 32nd check, so no check waits for it. The abort word is read on the same
// checks (a wait that never spins reads neither).
struct SpinDeadline {
  std::uint64_t start = 0;
  std::uint32_t checks = 0;
  // True once more than timeout_ns passed since the first check, or once `abort` (nullable) is
  // set; `waited`: the time seen then. The caller tells the two apart with abort_set.
  __device__ __forceinline__ bool expired(std::uint64_t timeout_ns, std::uint64_t& waited, const std::uint32_t* abort) {
    const std::uint32_t k = checks++;
    if (k == 0) {
      start = globaltimer();
      return false;
    }
    if ((k & 31u) != 0) return false;
    waited = globaltimer() - start;
    return waited > timeout_ns || abort_set(abort);
  }
};

// Polling load: system scope, so a peer's store (over NVLink, or through multicast) is seen
// without any cached copy in between.
__device__ __forceinline__ uint4 load_poll(const uint4* p) {
  uint4 v;
  asm volatile("ld.relaxed.sys.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void store_peer(uint4* p, uint4 v) {
  asm volatile("st.relaxed.sys.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// One store to the multicast address reaches the same offset in every rank's part.
__device__ __forceinline__ void store_multicast(void* p, uint4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
#else
  // Never selected below sm_90 (tail_device_support says no); trap rather than corrupt.
  (void)p;
  (void)v;
  __trap();
#endif
}

// Two floats to bf16 (round to nearest even) in one instruction; NaN -> tail_bf16_nan, the bits
// tail_float_to_bf16 gives on the CPU.
__device__ __forceinline__ std::uint32_t to_bf16x2(float lo, float hi) {
  std::uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  if (lo != lo) r = (r & 0xFFFF0000u) | tail_bf16_nan;
  if (hi != hi) r = (r & 0x0000FFFFu) | (static_cast<std::uint32_t>(tail_bf16_nan) << 16);
  return r;
}
// I2 on a pair: a half that is the sentinel becomes +0.0.
__device__ __forceinline__ std::uint32_t sanitize_pair(std::uint32_t w) {
  if ((w & 0xFFFFu) == tail_sentinel) w &= 0xFFFF0000u;
  if ((w >> 16) == tail_sentinel) w &= 0x0000FFFFu;
  return w;
}

// Bitwise ors, not ||: no branches in the poll loop. A receiving block has one warp per scheduler,
// so a branch there costs more than the test it skips.
__device__ __forceinline__ bool has_sentinel(uint4 v) {
  return (tail_word_has_sentinel(v.x) | tail_word_has_sentinel(v.y) | tail_word_has_sentinel(v.z) |
          tail_word_has_sentinel(v.w)) != 0;
}

__device__ __forceinline__ void unpack(uint4 v, float (&out)[tail_vector_elems]) {
  const std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = tail_bf16_to_float(static_cast<std::uint16_t>(w[i] & 0xFFFFu));
    out[2 * i + 1] = tail_bf16_to_float(static_cast<std::uint16_t>(w[i] >> 16));
  }
}

__device__ __forceinline__ uint4 load_input(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// I5/I6: the first failure of a call (any block) writes the record; later ones leave it. Every
// failure sets the rank's abort word, so the waits of the rank's other tails give up at once.
// started: blocks of the call that had counted themselves in (not_resident, block_arrival).
// (Fields by value: a reference to the kernel's parameters would copy them to the stack.)
__device__ __noinline__ void record_error(TailControl* c, std::uint32_t* abort, TailOp op, int rank, int peer, int slot,
                                          int token, std::uint64_t call, std::uint64_t waited_ns,
                                          std::uint32_t seen_magic, std::uint32_t started = 0) {
  if (abort != nullptr) atomicExch(abort, 1u);
  if (atomicCAS(&c->error.flag, 0u, 1u) != 0u) return;
  c->error.op = static_cast<std::uint32_t>(op);
  c->error.rank = rank;
  c->error.peer = peer;
  c->error.slot = slot;
  c->error.token = token;
  c->error.call = call;
  c->error.waited_ns = waited_ns;
  c->error.seen_magic = seen_magic;
  c->error.blocks_started = started;
  c->error.blocks = gridDim.x;
  __threadfence_system();
}

// A receiving thread's wait gave up (I5); what to record: `aborted` when the rank's abort word is
// set (an earlier failure, of this tail or another of the rank's), `not_resident` when blocks of
// this call never started -- they have not counted themselves in and the control block has not
// advanced (the updater resets the count only after every block counted in) -- so their sends are
// what is missing, and otherwise the peer's partial that did not come.
__device__ __noinline__ void record_wait_failure(TailControl* c, std::uint32_t* abort, int rank, bool multicast,
                                                 int missing, int slot, int row, std::uint64_t call,
                                                 std::uint64_t waited) {
  if (abort_set(abort)) {
    record_error(c, abort, TailOp::aborted, rank, missing, slot, row, call, waited, tail_control_magic);
    return;
  }
  const std::uint32_t started = load_acquire(&c->arrived);
  const std::uint64_t calls = *static_cast<const volatile std::uint64_t*>(&c->calls);
  if (started < gridDim.x && calls == call) {
    record_error(c, abort, TailOp::not_resident, rank, missing, slot, row, call, waited, tail_control_magic, started);
    return;
  }
  record_error(c, abort, multicast ? TailOp::wait_multicast : TailOp::wait_unicast, rank, missing, slot, row, call,
               waited, tail_control_magic);
}

// Send phase item: this rank's partial of row `row`, vector `vec`, rounded and sanitised. The
// expert loads of a chunk are issued together (one memory latency per `chunk` experts, not one
// per expert); the sum still runs in k order, as on the CPU. A thread's first item, whose latency
// every call pays, takes 8 at once; the send loop's later items take 4, which keeps the fused
// kernel within 128 registers (2 blocks per SM) without spills.
template <int chunk = 8>
__device__ __forceinline__ uint4 partial_vector(const TailParams& p, int row, int vec) {
  const int col = vec * tail_vector_elems;
  const uint4 sv = p.shared_out != nullptr ? load_input(p.shared_out + static_cast<std::size_t>(row) * p.hidden + col)
                                           : make_uint4(0, 0, 0, 0);  // bf16 +0.0
  const float* w = p.topk_weights + static_cast<std::size_t>(row) * p.top_k;
  const bf16* e = p.expert_out + static_cast<std::size_t>(row) * p.top_k * p.hidden + col;
  float acc[tail_vector_elems];
  unpack(sv, acc);
  for (int k0 = 0; k0 < p.top_k; k0 += chunk) {
    uint4 ev[chunk];
    float wk[chunk];
#pragma unroll
    for (int j = 0; j < chunk; ++j) {
      if (k0 + j < p.top_k) {
        ev[j] = load_input(e + static_cast<std::size_t>(k0 + j) * p.hidden);
        wk[j] = w[k0 + j];
      }
    }
#pragma unroll
    for (int j = 0; j < chunk; ++j) {
      if (k0 + j >= p.top_k) break;
      float x[tail_vector_elems];
      unpack(ev[j], x);
#pragma unroll
      for (int i = 0; i < tail_vector_elems; ++i) acc[i] = tail_fma(wk[j], x[i], acc[i]);
    }
  }
  return make_uint4(sanitize_pair(to_bf16x2(acc[0], acc[1])), sanitize_pair(to_bf16x2(acc[2], acc[3])),
                    sanitize_pair(to_bf16x2(acc[4], acc[5])), sanitize_pair(to_bf16x2(acc[6], acc[7])));
}

// Lane `lane`'s vectors (lane + v * tail_row_lanes) of a row of residual_in, loaded before the
// polls so their latency hides behind the wait, and of gamma.
template <int VPT>
struct RowInputs {
  uint4 residual[VPT];
};

template <int VPT>
__device__ __forceinline__ RowInputs<VPT> load_row_inputs(const TailParams& p, int row, int lane) {
  const int V = p.hidden / tail_vector_elems;
  RowInputs<VPT> in;
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const int vec = lane + v * T;
    if (vec < V)
      in.residual[v] = load_input(p.residual_in + static_cast<std::size_t>(row) * p.hidden + vec * tail_vector_elems);
  }
  return in;
}

template <int VPT>
__device__ __forceinline__ void load_gamma(const TailParams& p, int lane, uint4 (&gamma)[VPT]) {
  const int V = p.hidden / tail_vector_elems;
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const int vec = lane + v * T;
    if (vec < V) gamma[v] = load_input(p.gamma + vec * tail_vector_elems);
  }
}

// Residual add of lane `lane`'s vectors of an output row: the residual_out words (rounded to
// bf16) go to `out` (store_residual writes them), the rounded values stay in x, and the lane's
// sum of squares (tail_sum_squares' first level) is returned.
template <int VPT>
__device__ __forceinline__ float add_residual(const TailParams& p, int lane, float (&x)[VPT][tail_vector_elems],
                                              const RowInputs<VPT>& in, uint4 (&out)[VPT]) {
  const int V = p.hidden / tail_vector_elems;
  float ss = 0.0f;
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const int vec = lane + v * T;
    if (vec >= V) continue;
    float r[tail_vector_elems];
    unpack(in.residual[v], r);
    std::uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[i] = to_bf16x2(tail_add(r[2 * i], x[v][2 * i]), tail_add(r[2 * i + 1], x[v][2 * i + 1]));
      x[v][2 * i] = tail_bits_to_float(w[i] << 16);
      x[v][2 * i + 1] = tail_bits_to_float(w[i] & 0xFFFF0000u);
    }
#pragma unroll
    for (int j = 0; j < tail_vector_elems; ++j) ss = tail_add(ss, tail_mul(x[v][j], x[v][j]));
    out[v] = make_uint4(w[0], w[1], w[2], w[3]);
  }
  return ss;
}

// residual_out of lane `lane`'s vectors of a row. residual_out may alias residual_in: every
// element was read, by this thread, before.
template <int VPT>
__device__ __forceinline__ void store_residual(const TailParams& p, int row, int lane, const uint4 (&words)[VPT]) {
  const int V = p.hidden / tail_vector_elems;
  const std::size_t base = static_cast<std::size_t>(row) * p.hidden;
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const int vec = lane + v * T;
    if (vec < V) *reinterpret_cast<uint4*>(p.residual_out + base + vec * tail_vector_elems) = words[v];
  }
}

// The tree's second level: xor butterfly over the 32 lanes of a warp (every lane ends with the
// warp's total).
__device__ __forceinline__ float warp_sum(float ss) {
#pragma unroll
  for (int m = tail_warp / 2; m >= 1; m /= 2) ss = tail_add(ss, __shfl_xor_sync(0xFFFFFFFFu, ss, m));
  return ss;
}

// norm_out of lane `lane`'s vectors of a row, from the rounded residual sums x.
template <int VPT>
__device__ __forceinline__ void store_norm(const TailParams& p, int row, int lane,
                                           const float (&x)[VPT][tail_vector_elems], const uint4 (&gamma)[VPT],
                                           float inv) {
  const int V = p.hidden / tail_vector_elems;
  const std::size_t base = static_cast<std::size_t>(row) * p.hidden;
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const int vec = lane + v * T;
    if (vec >= V) continue;
    const std::uint32_t gw[4] = {gamma[v].x, gamma[v].y, gamma[v].z, gamma[v].w};
    std::uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)  // tail_norm_element, two at a time
      w[i] = to_bf16x2(tail_mul(tail_mul(x[v][2 * i], inv), tail_bits_to_float(gw[i] << 16)),
                       tail_mul(tail_mul(x[v][2 * i + 1], inv), tail_bits_to_float(gw[i] & 0xFFFF0000u)));
    *reinterpret_cast<uint4*>(p.norm_out + base + vec * tail_vector_elems) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Residual + RMSNorm of one output row by one block of tail_row_lanes threads (the unfused
// path), given the fp32 sums of this thread's vectors. s_warp: W floats.
template <int VPT>
__device__ __forceinline__ void row_epilogue(const TailParams& p, int row, float (&x)[VPT][tail_vector_elems],
                                             const RowInputs<VPT>& in, const uint4 (&gamma)[VPT], float* s_warp) {
  uint4 words[VPT];
  const float ss = warp_sum(add_residual<VPT>(p, threadIdx.x, x, in, words));
  store_residual<VPT>(p, row, threadIdx.x, words);
  if ((threadIdx.x & (tail_warp - 1)) == 0) s_warp[threadIdx.x / tail_warp] = ss;
  __syncthreads();
  float total = s_warp[0];
#pragma unroll
  for (int w = 1; w < W; ++w) total = tail_add(total, s_warp[w]);
  store_norm<VPT>(p, row, threadIdx.x, x, gamma, tail_inv_rms(total, p.hidden, p.eps));
}

// Sources whose vectors a receiving thread waits on together (registers: 4 * VPT each).
constexpr int sources_together = 2;

// Lane `lane`'s vectors of `row` from sources src0 .. src0 + n - 1 in this rank's part (vectors
// lane + v * T of each source's row), loaded and then polled together: every round of the wait
// re-loads all vectors still holding a sentinel at once, so the wait costs one memory round trip
// after the last one lands, not one per vector (a value loaded before it landed is stale;
// re-polling the vectors one after another would pay a round trip for each).
template <int VPT>
struct SourceRows {
  const uint4* row_at[sources_together];
  uint4 got[sources_together][VPT];
};

// -1 when every vector arrived; else the first source (rank) still missing one at the deadline.
template <int VPT>
__device__ __forceinline__ int wait_sources(const TailParams& p, const bf16* own_part, int slot, int src0, int n,
                                            int row, int lane, SourceRows<VPT>& in, SpinDeadline& deadline,
                                            std::uint64_t& waited) {
  const int V = p.hidden / tail_vector_elems;
#pragma unroll
  for (int g = 0; g < sources_together; ++g) {
    if (g >= n) break;
    in.row_at[g] = reinterpret_cast<const uint4*>(
        own_part + tail_slot_offset(slot, src0 + g, row, 0, p.ranks, p.max_tokens, p.hidden));
#pragma unroll
    for (int v = 0; v < VPT; ++v)
      if (lane + v * T < V) in.got[g][v] = load_poll(in.row_at[g] + lane + v * T);
  }
  for (;;) {
    // Each vector is tested once a round; the answer decides both whether to wait on and what to
    // re-load.
    bool pending[sources_together][VPT];
    bool any = false;
#pragma unroll
    for (int g = 0; g < sources_together; ++g)
#pragma unroll
      for (int v = 0; v < VPT; ++v) {
        pending[g][v] = g < n && lane + v * T < V && has_sentinel(in.got[g][v]);
        any |= pending[g][v];
      }
    if (!any) return -1;
    if (deadline.expired(p.timeout_ns, waited, p.abort)) {
      for (int g = 0; g < sources_together; ++g)
        for (int v = 0; v < VPT; ++v)
          if (pending[g][v]) return src0 + g;
    }
#pragma unroll
    for (int g = 0; g < sources_together; ++g)
#pragma unroll
      for (int v = 0; v < VPT; ++v)
        if (pending[g][v]) in.got[g][v] = load_poll(in.row_at[g] + lane + v * T);
  }
}

static_assert(offsetof(TailControl, error) + offsetof(TailErrorRecord, flag) + 4 <= 48 && alignof(TailControl) >= 16,
              "the fused kernel reads the control block's header as three 16-byte loads");

// Blocks per row (C): the row's tail_row_lanes lanes are split over a thread-block cluster of C
// blocks of T / C threads (sm_90+), so a row's loads, polls and stores are spread over C
// multiprocessors instead of queueing at one. The warps' partial sums of squares are pushed into
// every block of the cluster (st.async into its shared memory, each store counted off a
// transaction barrier there), so a block waits for the others' sums with one local wait: no
// cluster-wide barrier per row and none at exit, which was faster than a cluster barrier per row
// with the sums read remotely after it and an exit barrier (bench/results/2026-11-30-tail-push-2xh200.md).
// C = 1: one block per row, no cluster.
__device__ __forceinline__ int cluster_block_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  std::uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return static_cast<int>(r);
#else
  return 0;
#endif
}

// Once per kernel, before anything else (it precedes griddepcontrol.wait, so it overlaps the
// kernel before): every block's barriers are initialised, and every block of the cluster has
// started, before any block stores into another's shared memory.
__device__ __forceinline__ void cluster_sync_at_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
#else
  __trap();  // never launched with C > 1 below sm_90 (tail_device_support)
#endif
}

__device__ __forceinline__ std::uint32_t shared_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// A transaction barrier (mbarrier) whose phase completes when this block's one thread has
// arrived, announcing the bytes the phase takes, and st.async stores of that many bytes from the
// cluster's blocks have landed. The announcement may come after some of the stores (the
// barrier's transaction count goes negative meanwhile), so it need not precede the pushes.
__device__ __forceinline__ void row_barrier_init(std::uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // seen by remote st.async
#endif
}
// Relaxed: a release here would wait for this thread's earlier global stores (the peer stores
// and the clear), which nobody in the cluster reads.
__device__ __forceinline__ void row_barrier_expect(std::uint64_t* bar, std::uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.relaxed.cta.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
               "r"(bytes)
               : "memory");
#endif
}
// One try of the row barrier's phase with this parity: true once it completed (acquire at cluster
// scope pairs with the stores' completion, so the pushed sums are visible after it). A try that
// does not complete suspends the thread for a while first.
__device__ __forceinline__ bool row_barrier_try(std::uint64_t* bar, std::uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  std::uint32_t done;
  asm volatile(
      "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(done)
      : "r"(shared_address(bar)), "r"(parity)
      : "memory");
  return done != 0;
#else
  (void)bar, (void)parity;
  return true;
#endif
}
// The rest of a row barrier wait whose first try did not complete: 0 once the phase completed,
// else the nanoseconds waited when twice the wait bound passed (a block of the cluster never
// pushed). Twice: a sibling's push of the row follows its own polls of it, which may take up to
// one bound from about when this wait starts. Out of line, so the wait that completes at its first
// try (row_barrier_wait) carries none of this. The warp's threads run the same tries and read the
// same clock, so they decide together.
__device__ __noinline__ std::uint64_t row_barrier_wait_on(std::uint64_t* bar, std::uint32_t parity,
                                                          std::uint64_t timeout_ns) {
  const std::uint64_t start = globaltimer();
  for (std::uint32_t k = 1;; ++k) {
    if (row_barrier_try(bar, parity)) return 0;
    if ((k & 31u) != 0) continue;
    const std::uint64_t waited = globaltimer() - start;
    if (waited / 2 > timeout_ns) return waited;
  }
}
// Until the phase with this parity completes (true), or twice the wait bound passed (false,
// `waited` set).
__device__ __forceinline__ bool row_barrier_wait(std::uint64_t* bar, std::uint32_t parity, std::uint64_t timeout_ns,
                                                 std::uint64_t& waited) {
  if (row_barrier_try(bar, parity)) return true;
  const std::uint64_t w = row_barrier_wait_on(bar, parity, timeout_ns);
  if (w == 0) return true;
  waited = w;
  return false;
}
// 8 bytes into block `block`'s copy of `local`, counted off block `block`'s copy of `bar`.
__device__ __forceinline__ void push_to_block(uint2* local, std::uint64_t* bar, int block, uint2 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  std::uint32_t at, bar_at;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(at) : "r"(shared_address(local)), "r"(block));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(bar_at) : "r"(shared_address(bar)), "r"(block));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.u32 [%0], {%1, %2}, [%3];" ::"r"(at), "r"(v.x),
               "r"(v.y), "r"(bar_at)
               : "memory");
#else
  (void)local, (void)bar, (void)block, (void)v;
  __trap();
#endif
}

// ---- The fused kernel's phases (the steps of the note at the top), each a device function that
// is inlined into tail_fused_kernel: the same statements in the same order as one body, named.

// Diagnostics (TailTrace): thread 0 of every block stamps its phases. The stamps live in the
// kernel's shared memory, so no registers are held: stamp[0] is the entry, stamp[1 + k] TailStamp
// k; all_sent, all_in and rounds are maxima over the block's threads.
struct FusedTrace {
  bool tracer;  // the call is traced and this is thread 0
  std::uint64_t* stamp;
  long long* cycle_stamp;
  unsigned long long* all_sent;
  unsigned long long* all_in;
  unsigned long long* rounds;

  __device__ __forceinline__ void mark(int k) const {
    if (tracer) stamp[1 + k] = globaltimer();
  }
};

__device__ __forceinline__ void trace_begin(const FusedTrace& t) {
  if (t.tracer) {
    for (int k = 1; k <= tail_trace_phases; ++k) t.stamp[k] = 0;
    *t.cycle_stamp = clock64();
    *t.all_sent = *t.all_in = *t.rounds = 0;
    t.stamp[0] = globaltimer();
  }
}

// Where a thread of the fused kernel stands: its items of the send and clear loops (strided over
// the whole grid) and its lane of the rows its cluster finishes.
struct FusedThread {
  int V;             // 16-byte vectors per row
  int gtid;          // this thread's first item
  int gstride;       // the grid's threads
  int send_items;    // tokens * V
  int block_in_row;  // this block's rank in its cluster
  int lane;          // this thread's lane of the rows it finishes
  int row_group;     // the cluster's index: rows row_group, + row_groups, ...
  int row_groups;
};

template <int C>
__device__ __forceinline__ FusedThread fused_thread(const TailParams& p) {
  constexpr int TB = T / C;  // threads per block
  FusedThread t;
  t.V = p.hidden / tail_vector_elems;
  t.gtid = blockIdx.x * TB + threadIdx.x;
  t.gstride = gridDim.x * TB;
  t.send_items = p.tokens * t.V;
  t.block_in_row = C == 1 ? 0 : cluster_block_rank();
  t.lane = t.block_in_row * TB + threadIdx.x;
  t.row_group = blockIdx.x / C;
  t.row_groups = gridDim.x / C;
  return t;
}

// Step 0's start. With C > 1 the row barriers exist and the cluster has synchronised before
// anything is pushed into them (this precedes griddepcontrol.wait, so it overlaps the kernel
// before). Everything after the wait may read what the kernels before this one wrote (inputs,
// control block).
template <int C>
__device__ __forceinline__ void enter_call(const TailParams& p, std::uint64_t* row_barrier, const FusedTrace& trace) {
  if constexpr (C > 1) {
    if (threadIdx.x == 0) {
      row_barrier_init(&row_barrier[0]);
      row_barrier_init(&row_barrier[1]);
    }
    cluster_sync_at_start();
  }
  grid_dependency_wait();
  allow_dependent_launch();
  trace.mark(tail_stamp_waited);
  if (trace.tracer && blockIdx.x == 0) p.trace->block0_waited = trace.stamp[1 + tail_stamp_waited];
}

// What thread 0 read from the control block in step 0, for the whole block (shared memory).
struct CallControl {
  std::uint64_t* table;  // the peer table: every rank's part, then the multicast address
  std::uint64_t* calls;  // the call count: slot = calls % tail_slot_count
  int* ok;               // the control block is intact and no earlier call failed
  int* clear_begin;      // rows of the previous slot still to clear (I3)
  int* clear_end;
};

// The control block's first 48 bytes.
struct ControlWords {
  uint4 w0, w1, w2;
};

// Step 0, thread 0: three independent loads, issued before this thread's partial and used after
// it, so the two memory latencies overlap. Nobody writes the block until every block of the call
// counted in.
__device__ __forceinline__ ControlWords load_control_words(const TailControl* c) {
  uint4 cw0 = make_uint4(0, 0, 0, 0), cw1 = cw0, cw2 = cw0;
  if (threadIdx.x == 0) {
    const uint4* cw = reinterpret_cast<const uint4*>(c);
    cw0 = __ldcg(cw);
    cw1 = __ldcg(cw + 1);
    cw2 = __ldcg(cw + 2);
  }
  return ControlWords{cw0, cw1, cw2};
}

// Step 0, thread 0: the control block checked (I6: magic and the clear range; I5: a recorded
// error makes the call a no-op until reset) and the call's state published to the block.
__device__ __forceinline__ void decode_control(const TailParams& p, const ControlWords& cw, const CallControl& s) {
  const std::uint32_t words[12] = {cw.w0.x, cw.w0.y, cw.w0.z, cw.w0.w, cw.w1.x, cw.w1.y,
                                   cw.w1.z, cw.w1.w, cw.w2.x, cw.w2.y, cw.w2.z, cw.w2.w};
  const std::uint32_t magic = words[offsetof(TailControl, magic) / 4];
  const std::uint64_t calls = static_cast<std::uint64_t>(words[offsetof(TailControl, calls) / 4]) |
                              (static_cast<std::uint64_t>(words[offsetof(TailControl, calls) / 4 + 1]) << 32);
  const int prev = static_cast<int>((calls + tail_slot_count - 1) % tail_slot_count);
  std::uint32_t cb = 0, ce = 0;
#pragma unroll
  for (int i = 0; i < tail_slot_count; ++i)
    if (i == prev) {
      cb = words[offsetof(TailControl, clear_begin) / 4 + i];
      ce = words[offsetof(TailControl, clear_end) / 4 + i];
    }
  const std::uint32_t failed_before = words[(offsetof(TailControl, error) + offsetof(TailErrorRecord, flag)) / 4];
  int ok = 1;
  if (magic != tail_control_magic || cb > ce || ce > static_cast<std::uint32_t>(p.max_tokens)) {
    record_error(p.control, p.abort, TailOp::control_lost, p.rank, -1, -1, -1, calls, 0, magic);
    ok = 0;
  } else if (failed_before != 0u) {
    ok = 0;  // an earlier call failed: nothing until reset()
  }
  *s.ok = ok;
  *s.calls = calls;
  *s.clear_begin = static_cast<int>(cb);
  *s.clear_end = static_cast<int>(ce);
}

// Step 0 for the whole block: thread 0 reads the control block while every thread computes its
// first partial (usually the only item at small tokens: it needs no control state, so its input
// loads overlap thread 0's reads instead of waiting behind the barrier), and the peer table goes
// to shared memory. Past the barrier thread 0 counts the block in. Returns the first partial.
__device__ __forceinline__ uint4 read_control(const TailParams& p, const FusedThread& t, const CallControl& s,
                                              const FusedTrace& trace) {
  const ControlWords cw = load_control_words(p.control);
  // The peer table goes to shared memory after the partial: a store of a loaded value waits for
  // the load, and the partial's input loads should not wait behind it.
  const std::uint64_t table_entry = threadIdx.x <= p.ranks ? __ldg(p.peer_table + threadIdx.x) : 0;
  uint4 first = make_uint4(0, 0, 0, 0);
  if (t.gtid < t.send_items) first = partial_vector(p, t.gtid / t.V, t.gtid % t.V);
  if (threadIdx.x <= p.ranks) s.table[threadIdx.x] = table_entry;
  trace.mark(tail_stamp_partial);
  if (threadIdx.x == 0) {
    decode_control(p, cw, s);
    trace.mark(tail_stamp_control_read);
  }
  __syncthreads();
  trace.mark(tail_stamp_setup);
  // Count this block in: thread 0's control reads returned their values before the barrier
  // (they were written to shared memory), so the updater, which overwrites the control block
  // only after seeing every count, cannot change what they read. A relaxed add: a release here
  // compiles to a fence that held thread 0, and the block behind it, visibly in --trace
  // (bench/results/2026-11-30-tail-tuned-2xh200.md).
  if (threadIdx.x == 0) count_in(&p.control->arrived);
  return first;
}

// Step 1 (MoE finalize and the all-reduce's send): this rank's partial rows, every vector to
// every rank that receives its row (self first, then the peers in turn), or once to the multicast
// address.
template <bool MULTICAST>
__device__ __forceinline__ void send_partials(const TailParams& p, const FusedThread& t, uint4 first, int slot,
                                              const std::uint64_t* table) {
  for (int i = t.gtid; i < t.send_items; i += t.gstride) {  // tokens * hidden / 8 fits an int
    const int row = i / t.V;
    const int vec = i - row * t.V;
    const uint4 v = i == t.gtid ? first : partial_vector<4>(p, row, vec);
    const std::size_t off =
        tail_slot_offset(slot, p.rank, row, vec * tail_vector_elems, p.ranks, p.max_tokens, p.hidden);
    if constexpr (MULTICAST) {
      store_multicast(reinterpret_cast<bf16*>(table[p.ranks]) + off, v);
    } else {
      for (int j = 0, d = p.rank; j < p.ranks; ++j, d = d + 1 == p.ranks ? 0 : d + 1) {
        if (!tail_receives(p, d, row)) continue;
        store_peer(reinterpret_cast<uint4*>(reinterpret_cast<bf16*>(table[d]) + off), v);
      }
    }
  }
}

// Step 2: this rank's part of the previous slot back to sentinels (I3). After the send, which the
// peers are waiting for; before the kernel ends, which is all I3 needs. Rows [clear_begin,
// clear_end) of one source are contiguous in the slot: plain strided stores per source, no index
// arithmetic beyond an add.
__device__ __forceinline__ void clear_previous_slot(const TailParams& p, const FusedThread& t, const CallControl& s,
                                                    int prev) {
  uint4* own = reinterpret_cast<uint4*>(s.table[p.rank]);
  const int clear_vectors = (*s.clear_end - *s.clear_begin) * t.V;
  const uint4 sentinel = make_uint4(tail_sentinel_pair, tail_sentinel_pair, tail_sentinel_pair, tail_sentinel_pair);
  for (int src = 0; src < p.ranks && clear_vectors > 0; ++src) {
    uint4* rows =
        own + tail_slot_offset(prev, src, *s.clear_begin, 0, p.ranks, p.max_tokens, p.hidden) / tail_vector_elems;
    for (int i = t.gtid; i < clear_vectors; i += t.gstride) rows[i] = sentinel;
  }
}

// The receive side's wait state, kept across a thread's rows: the deadline runs from the
// thread's first poll that found a sentinel.
struct ReceiveWait {
  SpinDeadline deadline;
  std::uint64_t waited = 0;
};

// Step 3, the all-reduce's receive of one row: this lane's vectors from every source, polled
// sources_together at a time and summed in rank order in fp32 (I7) into x. True when a wait gave
// up (recorded; the row's other vectors are then not waited for).
template <int VPT, bool MULTICAST>
__device__ __forceinline__ bool sum_sources(const TailParams& p, const FusedThread& t, const CallControl& s,
                                            const bf16* own_part, int slot, int r, int row,
                                            float (&x)[VPT][tail_vector_elems], ReceiveWait& wait,
                                            const FusedTrace& trace) {
  bool failed = false;
  for (int src0 = 0; src0 < p.ranks && !failed; src0 += sources_together) {
    const int n = p.ranks - src0 < sources_together ? p.ranks - src0 : sources_together;
    SourceRows<VPT> got;
    const int missing = wait_sources<VPT>(p, own_part, slot, src0, n, row, t.lane, got, wait.deadline, wait.waited);
    if (missing >= 0) {
      record_wait_failure(p.control, p.abort, p.rank, MULTICAST, missing, slot, row, *s.calls, wait.waited);
      failed = true;
      break;
    }
    if (r == t.row_group) trace.mark(tail_stamp_vectors_in);
    if (p.trace != nullptr && r == t.row_group && src0 + sources_together >= p.ranks) {
      atomicMax(trace.all_in, static_cast<unsigned long long>(globaltimer()));
      atomicMax(trace.rounds, static_cast<unsigned long long>(wait.deadline.checks));
    }
#pragma unroll
    for (int g = 0; g < sources_together; ++g) {
      if (g >= n) break;
#pragma unroll
      for (int v = 0; v < VPT; ++v) {
        if (t.lane + v * T >= t.V) continue;
        float f[tail_vector_elems];
        unpack(got.got[g][v], f);
#pragma unroll
        for (int j = 0; j < tail_vector_elems; ++j) x[v][j] = src0 + g == 0 ? f[j] : tail_add(x[v][j], f[j]);
      }
    }
  }
  return failed;
}

// A row's warp sums in shared memory: per warp of the row (all C blocks' warps, in lane order)
// {sum of squares (bits), any lane failed}; two rows' worth, each with its barrier (C > 1), so the
// next row's sums can land while this block still reads this row's. A block pushes row i + 2 only
// after its barrier for row i + 1 completed, which needs every block's push of row i + 1, which
// each block makes after reading row i: nothing is overwritten before it is read.
struct RowSums {
  uint2 (*sums)[W];        // [2][W]
  std::uint64_t* barrier;  // [2], C > 1 only
};

// Step 3, the RMSNorm's exchange of row `rows_done` of this cluster: this warp's sum of squares
// and failure flag (`mine`) go to every block of the row -- C == 1: into the block's own shared
// memory, then a block barrier; C > 1: st.async into every block of the cluster, then a wait on
// this block's transaction barrier, bounded by twice the wait bound -- and this lane's
// residual_out is written meanwhile. False when the barrier wait gave up (recorded; every block
// of the cluster gives up on the row, as none completes its barrier).
template <int VPT, int C, bool WITHHOLD_PUSH>
__device__ __forceinline__ bool exchange_row_sums(const TailParams& p, const FusedThread& t, const CallControl& s,
                                                  const RowSums& sums, int buffer, int rows_done, int warp_of_row,
                                                  uint2 mine, bool finish, const uint4 (&words)[VPT], int slot, int row,
                                                  ReceiveWait& wait) {
  constexpr int WB = T / C / tail_warp;  // warps per block
  if constexpr (C == 1) {
    if ((threadIdx.x & (tail_warp - 1)) == 0) sums.sums[buffer][warp_of_row] = mine;
    if (finish) store_residual<VPT>(p, row, t.lane, words);
    __syncthreads();
  } else {
    // The test variant: block 1 of each cluster never pushes its sums of its first row.
    const bool withhold = WITHHOLD_PUSH && t.block_in_row == 1 && rows_done == 0;
    if ((threadIdx.x & (tail_warp - 1)) == 0 && !withhold)
#pragma unroll
      for (int b = 0; b < C; ++b) push_to_block(&sums.sums[buffer][warp_of_row], &sums.barrier[buffer], b, mine);
    if (threadIdx.x == 0) row_barrier_expect(&sums.barrier[buffer], C * WB * sizeof(uint2));
    if (finish) store_residual<VPT>(p, row, t.lane, words);
    if (!row_barrier_wait(&sums.barrier[buffer], static_cast<std::uint32_t>((rows_done >> 1) & 1), p.timeout_ns,
                          wait.waited)) {
      record_error(p.control, p.abort, TailOp::cluster_barrier, p.rank, -1, slot, row, *s.calls, wait.waited,
                   tail_control_magic);
      return false;
    }
  }
  return true;
}

// Step 3, the tree's last level: the row's warp sums in order; and whether any lane of the row
// failed, so the whole cluster abandons it together.
__device__ __forceinline__ float row_total(const uint2 (&sums)[W], bool& row_failed) {
  float total = 0.0f;
  row_failed = false;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    const uint2 e = sums[w];
    total = w == 0 ? __uint_as_float(e.x) : tail_add(total, __uint_as_float(e.x));
    row_failed = row_failed || e.y != 0u;
  }
  return total;
}

// Step 3: poll, sum in rank order, residual + RMSNorm for output rows. Each cluster takes rows
// row_group, row_group + row_groups, ... of this rank's receive rows; each thread its lane's
// vectors of them. Row i of this cluster uses sums[i % 2] and its barrier's phase i / 2.
template <int VPT, int C, bool MULTICAST, bool WITHHOLD_PUSH>
__device__ __forceinline__ void receive_rows(const TailParams& p, const FusedThread& t, const CallControl& s, int slot,
                                             const TailRows& recv, bool cluster_has_rows, const RowSums& sums,
                                             const FusedTrace& trace) {
  const TailRows out = tail_output_rows(p);
  const bf16* own_part = reinterpret_cast<const bf16*>(s.table[p.rank]);
  ReceiveWait wait;
  uint4 gamma[VPT];  // this lane's vectors of gamma, for every row the cluster finishes
  if (cluster_has_rows) load_gamma<VPT>(p, t.lane, gamma);
  int rows_done = 0;
  for (int r = t.row_group; r < recv.count(); r += t.row_groups, ++rows_done) {
    const int buffer = rows_done & 1;
    const int row = recv.begin + r;
    const bool output = out.contains(row);
    RowInputs<VPT> in;
    if (output) in = load_row_inputs<VPT>(p, row, t.lane);
    float x[VPT][tail_vector_elems];
    const bool failed = sum_sources<VPT, MULTICAST>(p, t, s, own_part, slot, r, row, x, wait, trace);
    // The residual of the vectors that arrived is final whatever happens to the rest of the
    // row; a thread whose vectors did not arrive leaves its residual_out untouched.
    const bool finish = output && !failed;
    uint4 words[VPT];
    const float ss = warp_sum(finish ? add_residual<VPT>(p, t.lane, x, in, words) : 0.0f);
    const bool warp_failed = __any_sync(0xFFFFFFFFu, failed);
    if (r == t.row_group) trace.mark(tail_stamp_residual);
    const int warp_of_row = t.block_in_row * (T / C / tail_warp) + threadIdx.x / tail_warp;
    const uint2 mine = make_uint2(__float_as_uint(ss), warp_failed ? 1u : 0u);
    if (!exchange_row_sums<VPT, C, WITHHOLD_PUSH>(p, t, s, sums, buffer, rows_done, warp_of_row, mine, finish, words,
                                                  slot, row, wait))
      break;
    if (r == t.row_group) trace.mark(tail_stamp_row_barrier);
    bool row_failed;
    const float total = row_total(sums.sums[buffer], row_failed);
    if (row_failed) break;  // the same decision in every block of the cluster
    if (r == t.row_group) trace.mark(tail_stamp_block_in);
    if (output) store_norm<VPT>(p, row, t.lane, x, gamma, tail_inv_rms(total, p.hidden, p.eps));
    if (r == t.row_group) trace.mark(tail_stamp_epilogue);
  }
}

// Step 4: the grid's last block advances the control block (I4) once every block has read it.
// Blocks are all resident, so the wait is short; it is bounded all the same (I5).
__device__ __forceinline__ void advance_control(const TailParams& p, const CallControl& s, int slot, int prev,
                                                const TailRows& recv, const FusedTrace& trace) {
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) {
    TailControl* c = p.control;
    SpinDeadline until;
    std::uint64_t waited_here = 0;
    bool counted = true;
    while (load_acquire(&c->arrived) < gridDim.x) {
      // Not on the abort word: leaving before every block counted in would let this call's late
      // counts reach the next call's.
      if (until.expired(p.timeout_ns, waited_here, nullptr)) {
        record_error(c, p.abort, TailOp::block_arrival, p.rank, -1, slot, -1, *s.calls, waited_here, tail_control_magic,
                     load_acquire(&c->arrived));
        counted = false;
        break;
      }
    }
    if (counted && *s.ok) {
      c->clear_begin[slot] = static_cast<std::uint32_t>(recv.begin);
      c->clear_end[slot] = static_cast<std::uint32_t>(recv.end);
      c->clear_begin[prev] = 0;
      c->clear_end[prev] = 0;
      c->calls = *s.calls + 1;
    }
    c->arrived = 0;
    if (trace.tracer)
      atomicAdd(reinterpret_cast<unsigned long long*>(&p.trace->updater_ns),
                static_cast<unsigned long long>(globaltimer() - trace.stamp[0]));
  }
}

// The block's trace entries (the first tail_trace_blocks blocks). Calls are ordered (each waits
// for the last), so this block's thread 0 is the only writer of its entries. block0_waited was
// written when this call's block 0 passed its wait.
__device__ __forceinline__ void trace_block_end(const TailParams& p, const FusedTrace& trace) {
  if (trace.tracer && blockIdx.x < tail_trace_blocks) {
    const std::uint64_t end = globaltimer();
    TailTrace* t = p.trace;
    const std::uint64_t* stamp = trace.stamp;
    const std::uint64_t w = stamp[1 + tail_stamp_waited];
    t->block_waited_ns[blockIdx.x] +=
        static_cast<std::int64_t>(w) -
        static_cast<std::int64_t>(*static_cast<volatile std::uint64_t*>(&t->block0_waited));
    const int which[4] = {tail_stamp_partial, tail_stamp_sent, tail_stamp_cleared, tail_stamp_block_in};
    for (int k = 0; k < 4; ++k)
      if (stamp[1 + which[k]] != 0) t->block_ns[blockIdx.x][k] += stamp[1 + which[k]] - w;
    if (*trace.all_sent != 0) t->block_ns[blockIdx.x][4] += *trace.all_sent - w;
    if (*trace.all_in != 0) t->block_ns[blockIdx.x][5] += *trace.all_in - w;
    t->block_ns[blockIdx.x][6] += *trace.rounds * 1000;  // shown as a count (the bench divides by 1000)
    t->block_ns[blockIdx.x][tail_block_stamps - 1] += end - w;
  }
}

// The call's trace (block 0's thread 0, the only writer: calls are ordered).
__device__ __forceinline__ void trace_call_end(const TailParams& p, const FusedTrace& trace) {
  if (trace.tracer && blockIdx.x == 0) {
    const std::uint64_t end = globaltimer();
    TailTrace* t = p.trace;
    std::uint64_t* stamp = trace.stamp;
    stamp[1 + tail_stamp_end] = end;
    std::uint64_t last = stamp[0];  // a phase this block skipped ends where the one before did
    for (int k = 0; k < tail_trace_phases; ++k) {
      if (stamp[1 + k] != 0) last = stamp[1 + k];
      t->phase_ns[k] += last - stamp[0];
    }
    if (t->last_end != 0) {
      t->gap_ns += static_cast<std::int64_t>(stamp[0]) - static_cast<std::int64_t>(t->last_end);
      t->gaps += 1;
    }
    t->last_end = end;
    t->calls += 1;
    t->cycles += static_cast<std::uint64_t>(clock64() - *trace.cycle_stamp);
  }
}

// WITHHOLD_PUSH: a variant for tests only (launch_tail_fused_withholding_push), whose block 1 of
// each cluster never pushes its sums of its first row, so the row barrier's deadline is exercised.
// The block's shared state is declared here and handed to the phases.
template <int VPT, int C, bool MULTICAST, bool WITHHOLD_PUSH = false>
__global__ void __launch_bounds__(T / C, C) tail_fused_kernel(TailParams p) {
  __shared__ std::uint64_t s_table[tail_max_ranks + 1];
  __shared__ std::uint64_t s_calls;
  __shared__ int s_ok;
  __shared__ int s_clear_begin;
  __shared__ int s_clear_end;
  __shared__ uint2 s_row[2][W];
  __shared__ alignas(8) std::uint64_t s_row_barrier[2];
  __shared__ std::uint64_t stamp[tail_trace_phases + 1];
  __shared__ long long cycle_stamp;
  __shared__ unsigned long long s_all_sent, s_all_in, s_rounds;
  const FusedTrace trace{p.trace != nullptr && threadIdx.x == 0,
                         stamp,
                         &cycle_stamp,
                         &s_all_sent,
                         &s_all_in,
                         &s_rounds};
  trace_begin(trace);
  const FusedThread t = fused_thread<C>(p);
  enter_call<C>(p, s_row_barrier, trace);

  const CallControl s{s_table, &s_calls, &s_ok, &s_clear_begin, &s_clear_end};
  const uint4 first = read_control(p, t, s, trace);  // 0
  const int slot = static_cast<int>(s_calls % tail_slot_count);
  const int prev = (slot + tail_slot_count - 1) % tail_slot_count;
  const TailRows recv = tail_receive_rows(p);
  // Every block reads the same control block, so s_ok is the same in every block of a cluster.
  const bool cluster_has_rows = s_ok && t.row_group < recv.count();
  if (s_ok) {
    send_partials<MULTICAST>(p, t, first, slot, s_table);  // 1
    trace.mark(tail_stamp_sent);
    if (p.trace != nullptr) atomicMax(&s_all_sent, static_cast<unsigned long long>(globaltimer()));
    clear_previous_slot(p, t, s, prev);  // 2
    trace.mark(tail_stamp_cleared);
    receive_rows<VPT, C, MULTICAST, WITHHOLD_PUSH>(p, t, s, slot, recv, cluster_has_rows, RowSums{s_row, s_row_barrier},
                                                   trace);  // 3
  }
  // A block may leave once its last row's barrier completed: every store into its shared memory
  // has landed, and nothing reads another block's. (Or once it gave up on a row barrier: then a
  // sibling has not pushed for twice the bound, past any wait of its own.)
  advance_control(p, s, slot, prev, recv, trace);  // 4
  trace_block_end(p, trace);
  trace_call_end(p, trace);
}

// The partial is rounded to bf16 exactly as the fused kernel sends it, then stored as fp32: the
// all-reduce then sums in fp32 like the fused kernel does, instead of rounding the sum to bf16
// before the residual (a second rounding the fused path does not have, which changed tokens).
static_assert(tail_vector_elems == 8, "the unfused kernels move 8 elements as two float4");
__global__ void __launch_bounds__(T) tail_finalize_kernel(TailParams p, float* partial) {
  const int V = p.hidden / tail_vector_elems;
  const long long items = static_cast<long long>(p.tokens) * V;
  for (long long i = blockIdx.x * static_cast<long long>(T) + threadIdx.x; i < items;
       i += static_cast<long long>(gridDim.x) * T) {
    const int row = static_cast<int>(i / V);
    const int vec = static_cast<int>(i % V);
    float x[tail_vector_elems];
    unpack(partial_vector(p, row, vec), x);
    auto* dst = reinterpret_cast<float4*>(partial + static_cast<std::size_t>(row) * p.hidden + vec * tail_vector_elems);
    dst[0] = make_float4(x[0], x[1], x[2], x[3]);
    dst[1] = make_float4(x[4], x[5], x[6], x[7]);
  }
}

template <int VPT>
__global__ void __launch_bounds__(T) tail_residual_norm_kernel(TailParams p, const float* reduced) {
  __shared__ float s_warp[W];
  const int V = p.hidden / tail_vector_elems;
  const TailRows out = tail_output_rows(p);
  for (int r = blockIdx.x; r < out.count(); r += gridDim.x) {
    const int row = out.begin + r;
    const RowInputs<VPT> in = load_row_inputs<VPT>(p, row, threadIdx.x);
    uint4 gamma[VPT];
    load_gamma<VPT>(p, threadIdx.x, gamma);
    float x[VPT][tail_vector_elems];
#pragma unroll
    for (int v = 0; v < VPT; ++v) {
      const int vec = threadIdx.x + v * T;
      if (vec < V) {
        const auto* src = reinterpret_cast<const float4*>(reduced + static_cast<std::size_t>(row) * p.hidden +
                                                          vec * tail_vector_elems);
        const float4 a = src[0], b = src[1];
        x[v][0] = a.x, x[v][1] = a.y, x[v][2] = a.z, x[v][3] = a.w;
        x[v][4] = b.x, x[v][5] = b.y, x[v][6] = b.z, x[v][7] = b.w;
      }
    }
    row_epilogue<VPT>(p, row, x, in, gamma, s_warp);
    __syncthreads();  // s_warp is rewritten by the next row
  }
}

__global__ void tail_fill_u16_kernel(std::uint16_t* dst, std::uint16_t value, std::size_t elements) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < elements; i += stride)
    dst[i] = value;
}

// The fused kernel's rounding (to_bf16x2) of every float pattern in a range, for the test that
// holds it against the IEEE definition.
__global__ void tail_round_floats_kernel(std::uint32_t first, std::size_t pairs, std::uint32_t* out) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < pairs; i += stride) {
    const std::uint32_t u = first + 2 * static_cast<std::uint32_t>(i);
    out[i] = to_bf16x2(__uint_as_float(u), __uint_as_float(u + 1));
  }
}

static_assert(tail_max_vectors_per_thread == 2,
              "the launchers below instantiate the kernels for 1 and 2 vectors per thread");
int vectors_per_thread(int hidden) {
  const int V = hidden / tail_vector_elems;
  return (V + T - 1) / T;
}

bool valid_blocks_per_row(int c) { return c == 1 || c == 4 || c == 8; }

template <int VPT, bool MC>
const void* fused_symbol(int blocks_per_row) {
  switch (blocks_per_row) {
    case 1: return reinterpret_cast<const void*>(&tail_fused_kernel<VPT, 1, MC>);
    case 4: return reinterpret_cast<const void*>(&tail_fused_kernel<VPT, 4, MC>);
    case 8: return reinterpret_cast<const void*>(&tail_fused_kernel<VPT, 8, MC>);
    default:
      throw invalid_argument("tail kernels: " + std::to_string(blocks_per_row) +
                             " blocks per row; it must be 1, 4 or 8");
  }
}

const void* fused_kernel(int hidden, bool multicast, int blocks_per_row) {
  switch (vectors_per_thread(hidden)) {
    case 1: return multicast ? fused_symbol<1, true>(blocks_per_row) : fused_symbol<1, false>(blocks_per_row);
    case 2: return multicast ? fused_symbol<2, true>(blocks_per_row) : fused_symbol<2, false>(blocks_per_row);
    default: throw invalid_argument("tail kernels: hidden " + std::to_string(hidden) + " is above 8192");
  }
}

const void* residual_norm_kernel(int hidden) {
  switch (vectors_per_thread(hidden)) {
    case 1: return reinterpret_cast<const void*>(&tail_residual_norm_kernel<1>);
    case 2: return reinterpret_cast<const void*>(&tail_residual_norm_kernel<2>);
    default: throw invalid_argument("tail kernels: hidden " + std::to_string(hidden) + " is above 8192");
  }
}

}  // namespace

std::string tail_device_support(int device, bool multicast, int blocks_per_row) {
  int major = 0, minor = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
  const std::string cc = std::to_string(major) + "." + std::to_string(minor);
  if (!valid_blocks_per_row(blocks_per_row))
    return std::to_string(blocks_per_row) + " blocks per row; it must be 1, 4 or 8";
  if (major < 7)
    return "device " + std::to_string(device) + " has compute capability " + cc + "; the fused tail needs 7.0";
  if (multicast && major < 9)
    return "device " + std::to_string(device) + " has compute capability " + cc + "; multimem stores need 9.0";
  if (blocks_per_row > 1 && major < 9)
    return "device " + std::to_string(device) + " has compute capability " + cc + "; " +
           std::to_string(blocks_per_row) + " blocks per row need thread-block clusters (9.0); use 1";
  cudaFuncAttributes attr{};
  cudaError_t e = cudaFuncGetAttributes(&attr, fused_kernel(64, multicast, blocks_per_row));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return "no fused-tail kernel image for device " + std::to_string(device) + " (compute capability " + cc +
           "): " + cudaGetErrorName(e) + "; add it to CMAKE_CUDA_ARCHITECTURES";
  }
  return "";
}

bool tail_clusters_supported(int device) {
  int major = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  return major >= 9;
}

int tail_blocks_per_row(int device, int option, bool few_rows) {
  if (option != 0) return option;
  return few_rows && tail_clusters_supported(device) ? tail_cluster_blocks : 1;
}

void tail_preload(int hidden, bool multicast, int blocks_per_row) {
  const void* kernels[] = {fused_kernel(hidden, multicast, blocks_per_row),
                           reinterpret_cast<const void*>(&tail_finalize_kernel), residual_norm_kernel(hidden),
                           reinterpret_cast<const void*>(&tail_fill_u16_kernel)};
  for (const void* k : kernels) {
    cudaFuncAttributes attr{};
    check(cudaFuncGetAttributes(&attr, k), "cudaFuncGetAttributes (loading the tail kernels)");
  }
}

namespace {

// The launch configuration of a fused call; attributes points into `attributes`.
cudaLaunchConfig_t fused_config(dim3 grid, int blocks_per_row, cudaStream_t stream, bool programmatic,
                                cudaLaunchAttribute (&attributes)[2]) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(static_cast<unsigned>(T / blocks_per_row));
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = 0;
  if (blocks_per_row > 1) {
    attributes[config.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attributes[config.numAttrs].val.clusterDim.x = static_cast<unsigned>(blocks_per_row);
    attributes[config.numAttrs].val.clusterDim.y = 1;
    attributes[config.numAttrs].val.clusterDim.z = 1;
    ++config.numAttrs;
  }
  if (programmatic) {
    attributes[config.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[config.numAttrs].val.programmaticStreamSerializationAllowed = 1;
    ++config.numAttrs;
  }
  return config;
}

}  // namespace

int tail_fused_capacity(int hidden, bool multicast, int blocks_per_row) {
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  const void* kernel = fused_kernel(hidden, multicast, blocks_per_row);
  if (blocks_per_row == 1) {
    int per_sm = 0;
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, T, 0),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    if (per_sm < 1) throw error("tail kernels: the fused kernel does not fit on device " + std::to_string(device));
    return sms * per_sm;
  }
  cudaLaunchAttribute attributes[2];
  // The grid is a placeholder: the answer is how many clusters of this shape fit at once.
  const cudaLaunchConfig_t config =
      fused_config(dim3(static_cast<unsigned>(blocks_per_row)), blocks_per_row, nullptr, false, attributes);
  int clusters = 0;
  check(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config), "cudaOccupancyMaxActiveClusters");
  if (clusters < 1)
    throw error("tail kernels: no cluster of " + std::to_string(blocks_per_row) + " fused-tail blocks fits on device " +
                std::to_string(device));
  return clusters * blocks_per_row;
}

bool tail_programmatic_launch_supported(int device) {
  int major = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  return major >= 9;
}

namespace {

// One fused call of `kernel` (a tail_fused_kernel instance with this blocks_per_row).
void launch_fused(const void* kernel, const TailParams& p, int blocks_per_row, int capacity, Stream stream,
                  bool programmatic) {
  // Enough blocks that every thread sends at most one vector, and a cluster for every receive
  // row; at most what is resident at once, a whole number of clusters.
  const int threads = T / blocks_per_row;
  const int V = p.hidden / tail_vector_elems;
  long long grid = (static_cast<long long>(p.tokens) * V + threads - 1) / threads;
  const long long row_blocks = static_cast<long long>(tail_receive_rows(p).count()) * blocks_per_row;
  if (row_blocks > grid) grid = row_blocks;
  grid = (grid + blocks_per_row - 1) / blocks_per_row * blocks_per_row;
  if (grid > capacity) grid = capacity / blocks_per_row * blocks_per_row;
  if (grid < blocks_per_row) grid = blocks_per_row;
  cudaLaunchAttribute attributes[2];
  const cudaLaunchConfig_t config =
      fused_config(dim3(static_cast<unsigned>(grid)), blocks_per_row, native(stream), programmatic, attributes);
  TailParams args = p;
  void* arg_ptrs[] = {&args};
  const cudaError_t e = cudaLaunchKernelExC(&config, kernel, arg_ptrs);
  if (e != cudaSuccess) (void)cudaGetLastError();  // report this launch's error, not a stale one
  if (e != cudaSuccess)
    throw error(std::string("launching tail_fused_kernel failed: ") + cudaGetErrorName(e) + " (" +
                cudaGetErrorString(e) + ")");
}

}  // namespace

void launch_tail_fused(const TailParams& p, int blocks_per_row, int capacity, Stream stream, bool programmatic) {
  launch_fused(fused_kernel(p.hidden, p.multicast, blocks_per_row), p, blocks_per_row, capacity, stream, programmatic);
}

void launch_tail_fused_withholding_push(const TailParams& p, int capacity, Stream stream) {
  if (p.multicast) throw invalid_argument("launch_tail_fused_withholding_push: the unicast variant only");
  const void* kernel = nullptr;
  switch (vectors_per_thread(p.hidden)) {
    case 1: kernel = reinterpret_cast<const void*>(&tail_fused_kernel<1, tail_cluster_blocks, false, true>); break;
    case 2: kernel = reinterpret_cast<const void*>(&tail_fused_kernel<2, tail_cluster_blocks, false, true>); break;
    default: throw invalid_argument("tail kernels: hidden " + std::to_string(p.hidden) + " is above 8192");
  }
  launch_fused(kernel, p, tail_cluster_blocks, capacity, stream, false);
}

void launch_tail_round_floats(std::uint32_t first, std::size_t count, std::uint16_t* out, Stream stream) {
  if (count % 2 != 0 || first % 2 != 0)
    throw invalid_argument("launch_tail_round_floats: first and count must be even (pairs), got " +
                           std::to_string(first) + " and " + std::to_string(count));
  if (count == 0) return;
  tail_round_floats_kernel<<<1024, T, 0, native(stream)>>>(first, count / 2, reinterpret_cast<std::uint32_t*>(out));
  check_launch("tail_round_floats_kernel");
}

void launch_tail_finalize(const TailParams& p, float* partial, Stream stream) {
  const int V = p.hidden / tail_vector_elems;
  long long grid = (static_cast<long long>(p.tokens) * V + T - 1) / T;
  if (grid < 1) grid = 1;
  tail_finalize_kernel<<<static_cast<unsigned>(grid), T, 0, native(stream)>>>(p, partial);
  check_launch("tail_finalize_kernel");
}

void launch_tail_residual_norm(const TailParams& p, const float* reduced, Stream stream) {
  const int rows = tail_output_rows(p).count();
  if (rows == 0) return;
  const cudaStream_t s = native(stream);
  switch (vectors_per_thread(p.hidden)) {
    case 1: tail_residual_norm_kernel<1><<<rows, T, 0, s>>>(p, reduced); break;
    case 2: tail_residual_norm_kernel<2><<<rows, T, 0, s>>>(p, reduced); break;
    default: throw invalid_argument("tail kernels: hidden " + std::to_string(p.hidden) + " is above 8192");
  }
  check_launch("tail_residual_norm_kernel");
}

void launch_fill_u16(void* dst, std::uint16_t value, std::size_t elements, Stream stream) {
  if (elements == 0) return;
  std::size_t blocks = (elements + T - 1) / T;
  if (blocks > 4096) blocks = 4096;
  tail_fill_u16_kernel<<<static_cast<unsigned>(blocks), T, 0, native(stream)>>>(static_cast<std::uint16_t*>(dst), value,
                                                                                elements);
  check_launch("tail_fill_u16_kernel");
}

}  // namespace torpor::kernels
