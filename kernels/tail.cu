// The MoE tail on the GPU: one fused kernel (finalize + Lamport one-shot all-reduce + residual +
// RMSNorm), unicast and multicast variants, plus the unfused path's two kernels. The protocol,
// layout and arithmetic live in tail_protocol.hpp (shared with the CPU reference); this file is
// the CUDA side of it.
//
// Fused kernel, one call (grid <= tail_fused_capacity, so all blocks are resident together):
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
//   3. receive: block b takes rows b, b + grid, ... of this rank's receive rows; each thread polls
//      its vectors from every source (ld.relaxed.sys, until no lane is the sentinel, bounded by
//      %globaltimer; two sources' vectors at once, every pending one re-loaded in each round),
//      sums them in rank order in fp32 (I7), and for output rows writes residual_out and
//      norm_out (block reduction with the fixed tree);
//   4. the last block of the grid (a send-only block whenever there are more blocks than rows,
//      so off the critical path) waits until every block has counted itself in -- every block
//      has read the control block -- and advances it (I4).
// Memory ordering: senders need no fence between clearing and sending (I3 relies on stream
// order: the clear of call s happens a whole kernel before the store of call s + 1 that a peer
// must see before it writes the cleared slot again; with a programmatic launch, call s + 1 does
// nothing before its griddepcontrol.wait, which returns only once call s has completed and its
// memory operations are visible). Pollers read the data with the same load that checks for the
// sentinel, so there is no flag/data ordering to get wrong. The block count (control.arrived) is
// incremented only after the control reads returned their values (past the block's first
// barrier) and read by the updater with ld.acquire: no fence, and nothing waits for a remote
// store's acknowledgement inside the kernel.
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "torpor/error.hpp"
#include "torpor/kernels/tail_kernels.hpp"

namespace torpor::kernels {

namespace {

constexpr int T = tail_block_threads;
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
  asm volatile("st.relaxed.sys.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
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

__device__ __forceinline__ bool has_sentinel(uint4 v) {
  return tail_word_has_sentinel(v.x) || tail_word_has_sentinel(v.y) || tail_word_has_sentinel(v.z) ||
         tail_word_has_sentinel(v.w);
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

// I5/I6: the first failure of a call (any block) writes the record; later ones leave it.
__device__ __noinline__ void record_error(TailControl* c, TailOp op, int rank, int peer, int slot, int token, std::uint64_t call,
                             std::uint64_t waited_ns, std::uint32_t seen_magic) {
  if (atomicCAS(&c->error.flag, 0u, 1u) != 0u) return;
  c->error.op = static_cast<std::uint32_t>(op);
  c->error.rank = rank;
  c->error.peer = peer;
  c->error.slot = slot;
  c->error.token = token;
  c->error.call = call;
  c->error.waited_ns = waited_ns;
  c->error.seen_magic = seen_magic;
  __threadfence_system();
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

// This thread's vectors (threadIdx.x + v * T) of a row of residual_in, loaded before the wait so
// their latency hides behind it, and of gamma.
template <int VPT>
struct RowInputs {
  uint4 residual[VPT];
};

template <int VPT>
__device__ __forceinline__ RowInputs<VPT> load_row_inputs(const TailParams& p, int row) {
  const int V = p.hidden / tail_vector_elems;
  RowInputs<VPT> in;
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const int vec = threadIdx.x + v * T;
    if (vec < V) in.residual[v] = load_input(p.residual_in + static_cast<std::size_t>(row) * p.hidden + vec * tail_vector_elems);
  }
  return in;
}

template <int VPT>
__device__ __forceinline__ void load_gamma(const TailParams& p, uint4 (&gamma)[VPT]) {
  const int V = p.hidden / tail_vector_elems;
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const int vec = threadIdx.x + v * T;
    if (vec < V) gamma[v] = load_input(p.gamma + vec * tail_vector_elems);
  }
}

// Residual + RMSNorm of one output row, given the fp32 sums of this thread's vectors. Every
// thread of the block calls it. s_warp: W floats. residual_out may alias residual_in (each
// element is read, by this thread, before it is written).
template <int VPT>
__device__ __forceinline__ void row_epilogue(const TailParams& p, int row, float (&x)[VPT][tail_vector_elems],
                                             const RowInputs<VPT>& in, const uint4 (&gamma)[VPT], float* s_warp) {
  const int V = p.hidden / tail_vector_elems;
  const std::size_t base = static_cast<std::size_t>(row) * p.hidden;
  float ss = 0.0f;
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const int vec = threadIdx.x + v * T;
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
    *reinterpret_cast<uint4*>(p.residual_out + base + vec * tail_vector_elems) = make_uint4(w[0], w[1], w[2], w[3]);
  }
  // The fixed tree (tail_protocol.hpp): xor butterfly per warp, then warps in order.
#pragma unroll
  for (int m = tail_warp / 2; m >= 1; m /= 2) ss = tail_add(ss, __shfl_xor_sync(0xFFFFFFFFu, ss, m));
  if ((threadIdx.x & (tail_warp - 1)) == 0) s_warp[threadIdx.x / tail_warp] = ss;
  __syncthreads();
  float total = s_warp[0];
#pragma unroll
  for (int w = 1; w < W; ++w) total = tail_add(total, s_warp[w]);
  const float inv = tail_inv_rms(total, p.hidden, p.eps);
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const int vec = threadIdx.x + v * T;
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

// Sources whose vectors a receiving thread waits on together (registers: 4 * VPT each).
constexpr int sources_together = 2;

// This thread's vectors of `row` from sources src0 .. src0 + n - 1 in this rank's part (vectors
// threadIdx.x + v * T of each source's row), loaded and then polled together: every round of
// the wait re-loads all vectors still holding a sentinel at once, so the wait costs one memory
// round trip after the last one lands, not one per vector (a value loaded before it landed is
// stale; re-polling the vectors one after another would pay a round trip for each).
template <int VPT>
struct SourceRows {
  const uint4* row_at[sources_together];
  uint4 got[sources_together][VPT];
};

// -1 when every vector arrived; else the first source (rank) still missing one at the deadline.
template <int VPT>
__device__ __forceinline__ int wait_sources(const TailParams& p, const bf16* own_part, int slot, int src0, int n, int row,
                                            SourceRows<VPT>& in, std::uint64_t& start, std::uint64_t& deadline) {
  const int V = p.hidden / tail_vector_elems;
#pragma unroll
  for (int g = 0; g < sources_together; ++g) {
    if (g >= n) break;
    in.row_at[g] =
        reinterpret_cast<const uint4*>(own_part + tail_slot_offset(slot, src0 + g, row, 0, p.ranks, p.max_tokens, p.hidden));
#pragma unroll
    for (int v = 0; v < VPT; ++v)
      if (threadIdx.x + v * T < V) in.got[g][v] = load_poll(in.row_at[g] + threadIdx.x + v * T);
  }
  for (;;) {
    int missing = -1;
#pragma unroll
    for (int g = sources_together - 1; g >= 0; --g)
#pragma unroll
      for (int v = 0; v < VPT; ++v)
        if (g < n && threadIdx.x + v * T < V && has_sentinel(in.got[g][v])) missing = src0 + g;
    if (missing < 0) return -1;
    const std::uint64_t now = globaltimer();
    if (deadline == 0) {
      start = now;
      deadline = now + p.timeout_ns;
    } else if (now > deadline) {
      return missing;
    }
#pragma unroll
    for (int g = 0; g < sources_together; ++g)
#pragma unroll
      for (int v = 0; v < VPT; ++v)
        if (g < n && threadIdx.x + v * T < V && has_sentinel(in.got[g][v]))
          in.got[g][v] = load_poll(in.row_at[g] + threadIdx.x + v * T);
  }
}

static_assert(offsetof(TailControl, error) + offsetof(TailErrorRecord, flag) + 4 <= 48 && alignof(TailControl) >= 16,
              "the fused kernel reads the control block's header as three 16-byte loads");

template <int VPT, bool MULTICAST>
__global__ void __launch_bounds__(T, 1) tail_fused_kernel(TailParams p) {
  __shared__ std::uint64_t s_table[tail_max_ranks + 1];
  __shared__ std::uint64_t s_calls;
  __shared__ int s_ok;
  __shared__ int s_clear_begin;
  __shared__ int s_clear_end;
  __shared__ float s_warp[W];
  TailControl* c = p.control;
  // Diagnostics: thread 0 of block 0 (and of the updater) stamps its phases (TailTrace).
  const bool tracer = p.trace != nullptr && threadIdx.x == 0 && (blockIdx.x == 0 || blockIdx.x == gridDim.x - 1);
  // stamp[0]: entry; stamp[1 + k]: TailStamp k. In shared memory: no registers held.
  __shared__ std::uint64_t stamp[tail_trace_phases + 1];
  __shared__ long long cycle_stamp;
#define TORPOR_TAIL_STAMP(k) \
  if (tracer) stamp[1 + (k)] = globaltimer()
  if (tracer) {
    for (int k = 1; k <= tail_trace_phases; ++k) stamp[k] = 0;
    cycle_stamp = clock64();
    stamp[0] = globaltimer();
  }

  const int V = p.hidden / tail_vector_elems;
  const int gtid = blockIdx.x * T + threadIdx.x;
  const int gstride = gridDim.x * T;
  const int send_items = p.tokens * V;
  // Everything below may read what the kernels before this one wrote (inputs, control block).
  grid_dependency_wait();
  allow_dependent_launch();
  TORPOR_TAIL_STAMP(tail_stamp_waited);

  // 0. Thread 0 reads the control block: its first 48 bytes, in three independent loads issued
  //    before this thread's partial and used after it, so the two memory latencies overlap.
  //    Nobody writes the block until every block of the call counted in.
  uint4 cw0 = make_uint4(0, 0, 0, 0), cw1 = cw0, cw2 = cw0;
  if (threadIdx.x == 0) {
    const uint4* cw = reinterpret_cast<const uint4*>(c);
    cw0 = __ldcg(cw);
    cw1 = __ldcg(cw + 1);
    cw2 = __ldcg(cw + 2);
  }
  if (threadIdx.x <= p.ranks) s_table[threadIdx.x] = p.peer_table[threadIdx.x];
  // This thread's first partial needs no control state: its input loads overlap thread 0's
  // reads above instead of waiting behind the barrier (usually the only item at small tokens).
  uint4 first = make_uint4(0, 0, 0, 0);
  if (gtid < send_items) first = partial_vector(p, gtid / V, gtid % V);
  TORPOR_TAIL_STAMP(tail_stamp_partial);
  if (threadIdx.x == 0) {
    const std::uint32_t words[12] = {cw0.x, cw0.y, cw0.z, cw0.w, cw1.x, cw1.y, cw1.z, cw1.w, cw2.x, cw2.y, cw2.z, cw2.w};
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
      record_error(c, TailOp::control_lost, p.rank, -1, -1, -1, calls, 0, magic);
      ok = 0;
    } else if (failed_before != 0u) {
      ok = 0;  // an earlier call failed: nothing until reset()
    }
    s_ok = ok;
    s_calls = calls;
    s_clear_begin = static_cast<int>(cb);
    s_clear_end = static_cast<int>(ce);
    TORPOR_TAIL_STAMP(tail_stamp_control_read);
  }
  __syncthreads();
  TORPOR_TAIL_STAMP(tail_stamp_setup);
  // Count this block in: thread 0's control reads returned their values before the barrier
  // (they were written to shared memory), so the updater, which overwrites the control block only
  // after seeing every count, cannot change what they read. A relaxed add: a release here compiles
  // to a fence that held thread 0, and the block behind it, for about a microsecond (--trace).
  if (threadIdx.x == 0) count_in(&c->arrived);

  const int slot = static_cast<int>(s_calls % tail_slot_count);
  const int prev = (slot + tail_slot_count - 1) % tail_slot_count;
  const TailRows recv = tail_receive_rows(p);

  if (s_ok) {
    // 1. Send this rank's partial rows.
    for (int i = gtid; i < send_items; i += gstride) {  // tokens * hidden / 8 fits an int
      const int row = i / V;
      const int vec = i - row * V;
      const uint4 v = i == gtid ? first : partial_vector<4>(p, row, vec);
      const std::size_t off = tail_slot_offset(slot, p.rank, row, vec * tail_vector_elems, p.ranks, p.max_tokens, p.hidden);
      if constexpr (MULTICAST) {
        store_multicast(reinterpret_cast<bf16*>(s_table[p.ranks]) + off, v);
      } else {
        for (int j = 0, d = p.rank; j < p.ranks; ++j, d = d + 1 == p.ranks ? 0 : d + 1) {  // self first, then
                                                                                     // the peers in turn
          if (!tail_receives(p, d, row)) continue;
          store_peer(reinterpret_cast<uint4*>(reinterpret_cast<bf16*>(s_table[d]) + off), v);
        }
      }
    }

    TORPOR_TAIL_STAMP(tail_stamp_sent);

    // 2. Clear this rank's part of the previous slot (I3). After the send, which the peers are
    //    waiting for; before the kernel ends, which is all I3 needs.
    uint4* own = reinterpret_cast<uint4*>(s_table[p.rank]);
    // Rows [clear_begin, clear_end) of one source are contiguous in the slot: plain strided
    // stores per source, no index arithmetic beyond an add.
    const int clear_vectors = (s_clear_end - s_clear_begin) * V;
    const uint4 sentinel = make_uint4(tail_sentinel_pair, tail_sentinel_pair, tail_sentinel_pair, tail_sentinel_pair);
    for (int src = 0; src < p.ranks && clear_vectors > 0; ++src) {
      uint4* rows = own + tail_slot_offset(prev, src, s_clear_begin, 0, p.ranks, p.max_tokens, p.hidden) / tail_vector_elems;
      for (int i = gtid; i < clear_vectors; i += gstride) rows[i] = sentinel;
    }

    TORPOR_TAIL_STAMP(tail_stamp_cleared);

    // 3. Receive: poll, sum in rank order, residual + RMSNorm for output rows.
    const TailRows out = tail_output_rows(p);
    const bf16* own_part = reinterpret_cast<const bf16*>(s_table[p.rank]);
    std::uint64_t start = 0, deadline = 0;
    uint4 gamma[VPT];  // this thread's vectors of gamma, for every row the block finishes
    if (static_cast<int>(blockIdx.x) < recv.count()) load_gamma<VPT>(p, gamma);
    for (int r = blockIdx.x; r < recv.count(); r += gridDim.x) {
      const int row = recv.begin + r;
      const bool output = out.contains(row);
      RowInputs<VPT> in;
      if (output) in = load_row_inputs<VPT>(p, row);
      float x[VPT][tail_vector_elems];
      bool failed = false;
      // Sources in rank order (I7), sources_together at a time.
      for (int src0 = 0; src0 < p.ranks && !failed; src0 += sources_together) {
        const int n = p.ranks - src0 < sources_together ? p.ranks - src0 : sources_together;
        SourceRows<VPT> got;
        const int missing = wait_sources<VPT>(p, own_part, slot, src0, n, row, got, start, deadline);
        if (missing >= 0) {
          record_error(c, MULTICAST ? TailOp::wait_multicast : TailOp::wait_unicast, p.rank, missing, slot, row, s_calls,
                       globaltimer() - start, tail_control_magic);
          failed = true;
          break;
        }
        if (r == blockIdx.x) TORPOR_TAIL_STAMP(tail_stamp_vectors_in);
#pragma unroll
        for (int g = 0; g < sources_together; ++g) {
          if (g >= n) break;
#pragma unroll
          for (int v = 0; v < VPT; ++v) {
            if (threadIdx.x + v * T >= V) continue;
            float f[tail_vector_elems];
            unpack(got.got[g][v], f);
#pragma unroll
            for (int j = 0; j < tail_vector_elems; ++j) x[v][j] = src0 + g == 0 ? f[j] : tail_add(x[v][j], f[j]);
          }
        }
      }
      // Block-uniform: a row with any missing vector is abandoned, and so is the rest.
      if (__syncthreads_or(failed)) break;
      if (r == blockIdx.x) TORPOR_TAIL_STAMP(tail_stamp_block_in);
      if (output) row_epilogue<VPT>(p, row, x, in, gamma, s_warp);
      if (r == blockIdx.x) TORPOR_TAIL_STAMP(tail_stamp_epilogue);
    }
  }

  // 4. The last block advances the control block (I4) once every block has read it. Blocks are
  //    all resident, so the wait is short; it is bounded all the same (I5).
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) {
    std::uint64_t until = 0;
    bool counted = true;
    while (load_acquire(&c->arrived) < gridDim.x) {
      const std::uint64_t now = globaltimer();
      if (until == 0) {
        until = now + p.timeout_ns;
      } else if (now > until) {
        record_error(c, TailOp::block_arrival, p.rank, -1, slot, -1, s_calls, p.timeout_ns, tail_control_magic);
        counted = false;
        break;
      }
    }
    if (counted && s_ok) {
      c->clear_begin[slot] = static_cast<std::uint32_t>(recv.begin);
      c->clear_end[slot] = static_cast<std::uint32_t>(recv.end);
      c->clear_begin[prev] = 0;
      c->clear_end[prev] = 0;
      c->calls = s_calls + 1;
    }
    c->arrived = 0;
    if (tracer) atomicAdd(reinterpret_cast<unsigned long long*>(&p.trace->updater_ns),
                          static_cast<unsigned long long>(globaltimer() - stamp[0]));
  }
  if (tracer && blockIdx.x == 0) {
    // Calls are ordered (each waits for the last), so block 0's thread 0 is the only writer here.
    const std::uint64_t end = globaltimer();
    TailTrace* t = p.trace;
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
    t->cycles += static_cast<std::uint64_t>(clock64() - cycle_stamp);
  }
}

#undef TORPOR_TAIL_STAMP

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
    const RowInputs<VPT> in = load_row_inputs<VPT>(p, row);
    uint4 gamma[VPT];
    load_gamma<VPT>(p, gamma);
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

static_assert(tail_max_vectors_per_thread == 2, "the launchers below instantiate the kernels for 1 and 2 vectors per thread");
int vectors_per_thread(int hidden) {
  const int V = hidden / tail_vector_elems;
  return (V + T - 1) / T;
}

template <int VPT, bool MC>
void* fused_symbol() {
  return reinterpret_cast<void*>(&tail_fused_kernel<VPT, MC>);
}

void* fused_kernel(int hidden, bool multicast) {
  switch (vectors_per_thread(hidden)) {
    case 1: return multicast ? fused_symbol<1, true>() : fused_symbol<1, false>();
    case 2: return multicast ? fused_symbol<2, true>() : fused_symbol<2, false>();
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

std::string tail_device_support(int device, bool multicast) {
  int major = 0, minor = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
  const std::string cc = std::to_string(major) + "." + std::to_string(minor);
  if (major < 7) return "device " + std::to_string(device) + " has compute capability " + cc + "; the fused tail needs 7.0";
  if (multicast && major < 9)
    return "device " + std::to_string(device) + " has compute capability " + cc + "; multimem stores need 9.0";
  cudaFuncAttributes attr{};
  cudaError_t e = cudaFuncGetAttributes(&attr, fused_kernel(64, multicast));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return "no fused-tail kernel image for device " + std::to_string(device) + " (compute capability " + cc + "): " +
           cudaGetErrorName(e) + "; add it to CMAKE_CUDA_ARCHITECTURES";
  }
  return "";
}

void tail_preload(int hidden, bool multicast) {
  const void* kernels[] = {fused_kernel(hidden, multicast), reinterpret_cast<const void*>(&tail_finalize_kernel),
                           residual_norm_kernel(hidden), reinterpret_cast<const void*>(&tail_fill_u16_kernel)};
  for (const void* k : kernels) {
    cudaFuncAttributes attr{};
    check(cudaFuncGetAttributes(&attr, k), "cudaFuncGetAttributes (loading the tail kernels)");
  }
}

int tail_fused_capacity(int hidden, bool multicast) {
  int device = 0, sms = 0, per_sm = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fused_kernel(hidden, multicast), T, 0),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  if (per_sm < 1) throw error("tail kernels: the fused kernel does not fit on device " + std::to_string(device));
  return sms * per_sm;
}

bool tail_programmatic_launch_supported(int device) {
  int major = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  return major >= 9;
}

namespace {

template <int VPT, bool MC>
void launch_fused_as(const TailParams& p, dim3 grid, cudaStream_t stream, bool programmatic) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(T);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = programmatic ? &attribute : nullptr;
  config.numAttrs = programmatic ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&config, tail_fused_kernel<VPT, MC>, p);
  if (e != cudaSuccess) (void)cudaGetLastError();  // report this launch's error, not a stale one
  if (e != cudaSuccess)
    throw error(std::string("launching tail_fused_kernel failed: ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                ")");
}

}  // namespace

void launch_tail_fused(const TailParams& p, int capacity, void* stream, bool programmatic) {
  const int V = p.hidden / tail_vector_elems;
  const long long send_blocks = (static_cast<long long>(p.tokens) * V + T - 1) / T;
  long long grid = send_blocks;
  if (tail_receive_rows(p).count() > grid) grid = tail_receive_rows(p).count();
  if (grid > capacity) grid = capacity;
  if (grid < 1) grid = 1;
  auto s = static_cast<cudaStream_t>(stream);
  const dim3 g(static_cast<unsigned>(grid));
  switch (vectors_per_thread(p.hidden)) {
#define TORPOR_TAIL_CASE(n)                                               \
  case n:                                                                 \
    if (p.multicast) launch_fused_as<n, true>(p, g, s, programmatic);     \
    else launch_fused_as<n, false>(p, g, s, programmatic);                \
    break;
    TORPOR_TAIL_CASE(1)
    TORPOR_TAIL_CASE(2)
#undef TORPOR_TAIL_CASE
    default: throw invalid_argument("tail kernels: hidden " + std::to_string(p.hidden) + " is above 8192");
  }
}

void launch_tail_finalize(const TailParams& p, float* partial, void* stream) {
  const int V = p.hidden / tail_vector_elems;
  long long grid = (static_cast<long long>(p.tokens) * V + T - 1) / T;
  if (grid < 1) grid = 1;
  tail_finalize_kernel<<<static_cast<unsigned>(grid), T, 0, static_cast<cudaStream_t>(stream)>>>(p, partial);
  check_launch("tail_finalize_kernel");
}

void launch_tail_residual_norm(const TailParams& p, const float* reduced, void* stream) {
  const int rows = tail_output_rows(p).count();
  if (rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  switch (vectors_per_thread(p.hidden)) {
    case 1: tail_residual_norm_kernel<1><<<rows, T, 0, s>>>(p, reduced); break;
    case 2: tail_residual_norm_kernel<2><<<rows, T, 0, s>>>(p, reduced); break;
    default: throw invalid_argument("tail kernels: hidden " + std::to_string(p.hidden) + " is above 8192");
  }
  check_launch("tail_residual_norm_kernel");
}

void launch_fill_u16(void* dst, std::uint16_t value, std::size_t elements, void* stream) {
  if (elements == 0) return;
  std::size_t blocks = (elements + T - 1) / T;
  if (blocks > 4096) blocks = 4096;
  tail_fill_u16_kernel<<<static_cast<unsigned>(blocks), T, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<std::uint16_t*>(dst), value, elements);
  check_launch("tail_fill_u16_kernel");
}

}  // namespace torpor::kernels
