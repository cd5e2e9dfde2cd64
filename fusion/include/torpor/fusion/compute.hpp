// Compute: where the runner's and the tiny model's math runs, one per rank (one device).
//
//   HostCompute  the CPU reference kernels (kernels/reference), computed before returning; the
//                host backend's device pointers are CPU addresses, so they read pool memory
//                directly;
//   CudaCompute  cuBLAS for the GEMMs (bf16 in, fp32 accumulation) and the small CUDA kernels of
//                kernels/, enqueued on one stream; decode steps are captured in CUDA graphs.
//
// The model code is written once against this interface. Every call enqueues on stream() (the
// same Stream the tail op gets) and is capturable; nothing allocates on the hot path. The cuBLAS
// workspace is pool memory handed in with set_workspace(), so its address is fixed through
// sleep and captured graphs stay valid.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>

#include "torpor/driver.hpp"
#include "torpor/kernels/bf16.hpp"
#include "torpor/kernels/moe_ops.hpp"

namespace torpor::fusion {

// Bytes CUDA's own graph allocator holds on a device: the memory nodes of every graph of the
// process (0 on the host backend, which has no graphs).
struct GraphAllocatorBytes {
  std::size_t used = 0;
  std::size_t reserved = 0;
};

// A recorded sequence of work (a CUDA graph exec on GPU), replayed on the compute's stream.
class Graph {
 public:
  virtual ~Graph() = default;
  virtual void replay() = 0;
};

class Compute {
 public:
  virtual ~Compute() = default;
  virtual std::string_view backend() const noexcept = 0;  // "host" or "cuda", for reports
  virtual int device() const noexcept = 0;
  virtual Stream stream() const noexcept = 0;

  // GEMMs: y[m][n] = x[m][k] · w[n][k]ᵀ.
  virtual void linear(const bf16* x, const bf16* w, bf16* y, int m, int n, int k) = 0;
  virtual void linear(const bf16* x, const bf16* w, float* y, int m, int n, int k) = 0;
  // Pointer arrays in device memory (filled by expert_pointers on the device).
  virtual void linear_batched(const bf16* const* x, const bf16* const* w, bf16* const* y, int count, int n, int k) = 0;

  // The small ops: see kernels/moe_ops.hpp for each one's math.
  virtual void embed(const std::int32_t* seq, int seq_stride, const std::int32_t* pos, const bf16* tok_emb, int vocab,
                     const bf16* pos_table, bf16* out, int batch, int hidden) = 0;
  virtual void rmsnorm(const bf16* x, const bf16* gamma, bf16* out, int rows, int hidden, float eps) = 0;
  virtual void add_rmsnorm(const bf16* a, const bf16* b, const bf16* gamma, bf16* sum_out, bf16* norm_out, int rows,
                           int hidden, float eps) = 0;
  virtual void attention_decode(const bf16* qkv, bf16* k_cache, bf16* v_cache, const std::int32_t* pos, bf16* out,
                                int batch, int head_dim, int max_seq) = 0;
  virtual void router_topk(const float* logits, int rows, int experts, int top_k, std::int32_t* idx,
                           float* weights) = 0;
  virtual void silu_mul(const bf16* in, bf16* out, int rows, int inter) = 0;
  virtual void expert_pointers(const std::int32_t* idx, int count, int top_k, const bf16* const* gate_up_table,
                               const bf16* const* down_table, int experts, const bf16* x_lat, int latent,
                               bf16* gate_up_out, int inter, bf16* act, bf16* y_lat,
                               const kernels::ExpertPointers& out) = 0;
  virtual void argmax_next(const float* logits, int batch, int vocab, std::int32_t* seq, int seq_stride,
                           const std::int32_t* pos, const std::int32_t* prompt_len) = 0;
  virtual void advance(std::int32_t* pos) = 0;

  // Waits for everything enqueued on stream().
  virtual void synchronize() = 0;

  // CUDA graphs: capture() records what `body` enqueues (nothing runs); replay() runs it.
  // HostCompute has no graphs (graphs() is false; capture throws). A captured graph keeps all
  // its memory in the pool: capture refuses (throws) a graph with CUDA graph memory nodes, so
  // graph_allocator_bytes() stays 0 as far as this compute's graphs go.
  virtual bool graphs() const noexcept = 0;
  virtual std::unique_ptr<Graph> capture(const std::function<void()>& body) = 0;
  virtual GraphAllocatorBytes graph_allocator_bytes() = 0;

  // Bytes of pool memory the GEMM library wants as its workspace (0: none); set_workspace hands
  // it over (it must stay allocated, at the same address, for the compute's life).
  virtual std::size_t workspace_bytes() const noexcept = 0;
  virtual void set_workspace(void* p, std::size_t bytes) = 0;

  // Memory outside every torpor pool (cudaMalloc on GPU; anonymous host memory on the host
  // backend): what a trainer takes while the engine sleeps. touch() writes a pattern over it and
  // returns its checksum, synchronously.
  virtual void* outside_allocate(std::size_t bytes) = 0;
  virtual void outside_free(void* p, std::size_t bytes) noexcept = 0;
  virtual std::uint64_t touch(void* p, std::size_t bytes, std::uint64_t seed) = 0;
};

// HostCompute where the driver's capabilities say the CPU reference runs (the host backend),
// CudaCompute where device kernels do (the cuda backend; throws unavailable when this build has no
// CUDA kernels). The driver must outlive the compute.
std::unique_ptr<Compute> make_compute(Driver& driver, int device);

}  // namespace torpor::fusion
