// The tail bench's measurements of the machine, each in the same run as the tail numbers:
//   link       SM stores into a peer's memory through its mapping, the path the fused tail's
//              partials take (16-byte stores, grid-stride): GB/s;
//   ping-pong  one thread per GPU bouncing a counter through the peer's memory (st.relaxed.sys
//              to the peer, ld.relaxed.sys polling its own): the one-way latency of a store seen
//              by the peer, the floor under any Lamport exchange;
//   loads      one thread's dependent loads of one word (local memory at system and GPU scope,
//              the peer's at system scope): the round trip a Lamport poll pays per round; and
//              the smallest step of %globaltimer, the clock the tail's --trace reads;
//   empty      a kernel that does nothing, optionally launched as a programmatic dependent
//              (what the fused tail does): the per-call cost of a kernel boundary in a graph.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace torpor::bench {

namespace {

void check_launch(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

__global__ void peer_store_kernel(uint4* dst, const uint4* src, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n; i += stride)
    dst[i] = src[i];
}

// Rank 0 starts: it writes 1 to the peer, waits for 1 in its own word, writes 2, waits for 2, ...
// rank 1 waits for k, then answers k. `rounds` round trips; the counter never repeats a value.
// A peer that never answers ends the kernel after ~10 s (the time then says so) instead of hanging.
__global__ void ping_pong_kernel(std::uint32_t* own, std::uint32_t* peer, int rounds, bool starter) {
  std::uint64_t t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (std::uint32_t k = 1; k <= static_cast<std::uint32_t>(rounds); ++k) {
    if (starter) asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(peer), "r"(k) : "memory");
    std::uint32_t seen = 0;
    for (std::uint32_t spins = 0;; ++spins) {
      asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(seen) : "l"(own) : "memory");
      if (seen == k) break;
      if ((spins & 0xFFFu) == 0xFFFu) {
        std::uint64_t now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - t0 > 10'000'000'000ull) return;
      }
    }
    if (!starter) asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(peer), "r"(k) : "memory");
  }
}

__device__ __forceinline__ std::uint64_t globaltimer() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// out[0]: ns for `n` dependent loads of *p (the next address depends on the last value, masked
// with `mask`, which is 0 at run time: the compiler cannot drop the dependency); out[1]: the last
// value (keeps the loads alive); out[2]: the smallest non-zero step between two reads of
// %globaltimer; out[3]: ns for 100000 reads of %globaltimer in a loop.
template <int SCOPE>
__global__ void load_latency_kernel(const std::uint32_t* p, int n, std::uint32_t mask, std::uint64_t* out) {
  std::uint32_t v = 0;
  const std::uint64_t t0 = globaltimer();
  for (int i = 0; i < n; ++i) {
    const std::uint32_t* a = p + (v & mask);
    if constexpr (SCOPE == 0) asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(a) : "memory");
    if constexpr (SCOPE == 1) asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(a) : "memory");
  }
  const std::uint64_t t1 = globaltimer();
  std::uint64_t step = ~std::uint64_t{0}, last = globaltimer();
  for (int i = 0; i < 100000; ++i) {
    const std::uint64_t now = globaltimer();
    if (now != last && now - last < step) step = now - last;
    last = now;
  }
  const std::uint64_t t2 = globaltimer();
  out[0] = t1 - t0;
  out[1] = v;
  out[2] = step;
  out[3] = t2 - t1;  // ns for the 100000 reads (and the loop around them)
}

// The Lamport exchange alone, for the floor under the fused tail: thread i of each rank sends one
// 16-byte vector holding its call number e to the same vector of the peer (st.relaxed.sys) and
// polls one vector of its own buffer until the peer's e arrived (ld.relaxed.sys); call numbers
// only grow, so no slot needs clearing. `features` adds the fused kernel's other work one piece at
// a time: 1 the partial's 9 input loads first (folded in under a mask that is 0 at run time);
// 2 a copy to itself too (own[n + i], polled as well); 4 two more local stores after the send
// (the clear); 8 poll the vector another block's thread sent (a transpose of i, as a row's
// receiver does). Instruction fetch: 16 runs 1024 FMAs as straight-line code (16 KB) after the
// wait, 64 (with 16) runs that code once before the wait too, from the same addresses. A peer that never
// answers ends the wait after ~2^26 polls.
__device__ __noinline__ float straight_line_fmas(float a, float b) {
  float acc[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) acc[k] = a + k;
#pragma unroll
  for (int s = 0; s < 128; ++s)
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] = fmaf(acc[k], b, static_cast<float>(s * 8 + k));
  float r = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) r += acc[k];
  return r;
}
// 256 FMAs of straight-line code (4 KB) that the hops below skip over.
__device__ __forceinline__ float big_block(float a) {
#pragma unroll
  for (int s = 0; s < 256; ++s) a = fmaf(a, 0.999f, static_cast<float>(s));
  return a;
}
__global__ void lamport_floor_kernel(uint4* own, uint4* peer, std::uint32_t* calls, const uint4* inputs, int n,
                                     int features, std::uint32_t mask) {
  float work = 0.0f;
  if ((features & 64) && (features & 16)) work += straight_line_fmas(static_cast<float>(threadIdx.x), 0.5f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const std::uint32_t e = calls[i] + 1;
  if (features & 16) work += straight_line_fmas(static_cast<float>(e), 0.5f);
  // 128: 12 hops, each a taken branch over 4 KB of code never run (mask is 0); 256: the same hops
  // over a few bytes.
  if (features & 128) {
#pragma unroll
    for (int h = 0; h < 12; ++h) {
      if (mask != 0) work = big_block(work + static_cast<float>(h));
      work = work * 1.5f + static_cast<float>(h);
    }
  }
  if (features & 256) {
#pragma unroll
    for (int h = 0; h < 12; ++h) {
      if (mask != 0) work = work * 3.0f;
      work = work * 1.5f + static_cast<float>(h);
    }
  }
  std::uint32_t fold = __float_as_uint(work);
  if (features & 1) {
    uint4 x[9];
#pragma unroll
    for (int k = 0; k < 9; ++k) x[k] = __ldg(inputs + static_cast<std::size_t>(k) * n + i);
#pragma unroll
    for (int k = 0; k < 9; ++k) fold += x[k].x ^ x[k].y ^ x[k].z ^ x[k].w;
  }
  const std::uint32_t v = e + (fold & mask);
  if (features & 2)
    asm volatile("st.relaxed.sys.global.v4.u32 [%0], {%1, %1, %1, %1};" ::"l"(own + n + i), "r"(v) : "memory");
  asm volatile("st.relaxed.sys.global.v4.u32 [%0], {%1, %1, %1, %1};" ::"l"(peer + i), "r"(v) : "memory");
  if (features & 4) {
    own[2 * n + 2 * i] = make_uint4(v, v, v, v);
    own[2 * n + 2 * i + 1] = make_uint4(v, v, v, v);
  }
  const int blocks = n / 128;
  const int j = (features & 8) && n % 128 == 0 ? (i % 128) * blocks + i / 128 : i;
  for (int src = (features & 2) ? 0 : 1; src < 2; ++src) {
    const uint4* at = src == 0 ? own + n + j : own + j;
    for (std::uint32_t spins = 0; spins < (1u << 26); ++spins) {
      uint4 seen;
      asm volatile("ld.relaxed.sys.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(seen.x), "=r"(seen.y), "=r"(seen.z), "=r"(seen.w)
                   : "l"(at)
                   : "memory");
      if (seen.x >= e && seen.w >= e) break;
    }
  }
  calls[i] = e;
}

__global__ void empty_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace

void launch_peer_store(void* dst, const void* src, std::size_t bytes, int blocks, void* stream) {
  peer_store_kernel<<<blocks, 512, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<uint4*>(dst),
                                                                           static_cast<const uint4*>(src), bytes / 16);
  check_launch("peer_store_kernel");
}

void launch_ping_pong(void* own, void* peer, int rounds, bool starter, void* stream) {
  ping_pong_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<std::uint32_t*>(own),
                                                                   static_cast<std::uint32_t*>(peer), rounds, starter);
  check_launch("ping_pong_kernel");
}

// ns per dependent load at system (scope 0) or GPU (scope 1) scope, and the globaltimer step;
// synchronous (a probe, run once).
void load_latency(const void* p, int scope, double* ns_per_load, double* timer_step_ns, double* timer_read_ns) {
  constexpr int n = 4000;
  std::uint64_t* out = nullptr;
  cudaError_t e = cudaMalloc(&out, 4 * sizeof(std::uint64_t));
  if (e == cudaSuccess) {
    if (scope == 0)
      load_latency_kernel<0><<<1, 1>>>(static_cast<const std::uint32_t*>(p), n, 0u, out);
    else
      load_latency_kernel<1><<<1, 1>>>(static_cast<const std::uint32_t*>(p), n, 0u, out);
    e = cudaGetLastError();
  }
  std::uint64_t host[4] = {};
  if (e == cudaSuccess) e = cudaMemcpy(host, out, sizeof host, cudaMemcpyDeviceToHost);
  if (out != nullptr) (void)cudaFree(out);
  if (e != cudaSuccess) throw std::runtime_error(std::string("load_latency_kernel: ") + cudaGetErrorString(e));
  *ns_per_load = static_cast<double>(host[0]) / n;
  *timer_step_ns = static_cast<double>(host[2]);
  *timer_read_ns = static_cast<double>(host[3]) / 100000.0;
}

namespace {
// A launch on `stream`, as a programmatic dependent of the kernel before it when `programmatic`;
// the config points at `attribute`.
cudaLaunchConfig_t launch_config(int blocks, int threads, void* stream, bool programmatic,
                                 cudaLaunchAttribute& attribute) {
  attribute = cudaLaunchAttribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.stream = static_cast<cudaStream_t>(stream);
  config.attrs = programmatic ? &attribute : nullptr;
  config.numAttrs = programmatic ? 1 : 0;
  return config;
}
}  // namespace

void launch_lamport_floor(void* own, void* peer, std::uint32_t* calls, const void* inputs, int n, int features,
                          void* stream) {
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = launch_config((n + 127) / 128, 128, stream, true, attribute);
  const cudaError_t e =
      cudaLaunchKernelEx(&config, lamport_floor_kernel, static_cast<uint4*>(own), static_cast<uint4*>(peer), calls,
                         static_cast<const uint4*>(inputs), n, features, 0u);
  if (e != cudaSuccess) throw std::runtime_error(std::string("lamport_floor_kernel: ") + cudaGetErrorString(e));
}

void launch_empty(int blocks, int threads, bool programmatic, void* stream) {
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = launch_config(blocks, threads, stream, programmatic, attribute);
  const cudaError_t e = cudaLaunchKernelEx(&config, empty_kernel);
  if (e != cudaSuccess) throw std::runtime_error(std::string("empty_kernel: ") + cudaGetErrorString(e));
}

}  // namespace torpor::bench
