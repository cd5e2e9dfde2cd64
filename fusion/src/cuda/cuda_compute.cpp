// CudaCompute: the cuda backend's Compute. GEMMs are cuBLAS (cublasGemmEx / GemmBatchedEx, bf16
// operands, fp32 accumulation: CUBLAS_COMPUTE_32F), everything else the kernels of kernels/.
// All work goes to one stream, created through the driver seam in the device's primary context
// (the context the CUDA runtime uses), and is capturable:
//   - the cuBLAS workspace is set explicitly (pool memory at a fixed address), so cuBLAS never
//     allocates while a graph is being captured;
//   - scalars are host values read at enqueue time (alpha = 1, beta = 0), and per-step values
//     (the position) live in device memory, so one captured step replays at every position;
//   - capture uses cudaStreamCaptureModeThreadLocal, so other ranks' threads may keep calling
//     the runtime while one rank captures;
//   - a captured step keeps all its memory in the pool, by construction and checked: every
//     buffer it touches is pool memory allocated before capture (the runner, the tail and the
//     cuBLAS workspace); in thread-local capture mode a stray cudaMalloc on the capturing thread
//     fails (an unsafe call during capture) instead of allocating memory the graph would use;
//     and after capture the graph's nodes are walked and a graph with a memory node
//     (cudaMallocAsync / cudaFreeAsync captured: memory owned by CUDA's graph allocator, which
//     no sleep releases) is refused before it is instantiated. graph_allocator_bytes() reports
//     the device's graph-allocator bytes, 0 while this holds;
//   - every call makes the compute's device current for its duration (DeviceGuard), so a rank's
//     thread may have any device current;
//   - the kernels of kernels/ take the torpor::Stream (stream_); only cuBLAS and the runtime's own
//     calls use its native handle (s_).
// cuBLAS results are bit-reproducible run to run on one GPU model (same handle, stream and
// workspace), which the token-for-token comparisons of `torpor stress` rely on.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/core.h>

#include "compute/compute_impl.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/cuda_runtime.hpp"
#include "torpor/error.hpp"
#include "torpor/kernels/native_stream.hpp"
#include "torpor/log.hpp"

namespace torpor::fusion {

void check_cuda(cudaError_t status, const char* call, std::string_view what) {
  if (status == cudaSuccess) return;
  std::string msg = fmt::format("{} ({}): {} ({})", call, what, cudaGetErrorName(status), cudaGetErrorString(status));
  if (status == cudaErrorMemoryAllocation) throw out_of_memory(msg);
  throw driver_error(static_cast<int>(status), call, msg);
}

void check_cublas(cublasStatus_t status, const char* call, std::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  std::string msg =
      fmt::format("{} ({}): {} ({})", call, what, cublasGetStatusName(status), cublasGetStatusString(status));
  if (status == CUBLAS_STATUS_ALLOC_FAILED) throw out_of_memory(msg);
  throw driver_error(static_cast<int>(status), call, msg);
}

void check_launch(int status, const char* kernel, std::string_view what) {
  check_cuda(static_cast<cudaError_t>(status), kernel, what);
}

namespace {

namespace gpu = kernels::gpu;

class CudaGraph final : public Graph {
 public:
  CudaGraph(cudaGraphExec_t exec, cudaStream_t stream, int device) : exec_(exec), stream_(stream), device_(device) {}
  ~CudaGraph() override {
    cudaError_t e = cudaGraphExecDestroy(exec_);
    if (e != cudaSuccess) log::error("cudaGraphExecDestroy (device {}) failed: {}", device_, cudaGetErrorName(e));
  }
  void replay() override { check_cuda(cudaGraphLaunch(exec_, stream_), "cudaGraphLaunch", "replaying a decode step"); }

 private:
  cudaGraphExec_t exec_;
  cudaStream_t stream_;
  int device_;
};

class CudaCompute final : public Compute {
 public:
  CudaCompute(Driver& driver, int device) : driver_(driver), device_(device) {
    check_cuda(cudaSetDevice(device), "cudaSetDevice", fmt::format("device {}", device));
    stream_ = driver.stream_create(device);
    s_ = kernels::native(stream_);
    cublasStatus_t st = cublasCreate(&blas_);
    if (st != CUBLAS_STATUS_SUCCESS) {
      release_stream();
      check_cublas(st, "cublasCreate", fmt::format("device {}", device));
    }
    try {
      check_cublas(cublasSetStream(blas_, s_), "cublasSetStream", "the compute stream");
      check_cublas(cublasSetPointerMode(blas_, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode", "host scalars");
    } catch (...) {
      cublasDestroy(blas_);
      release_stream();
      throw;
    }
  }
  ~CudaCompute() override {
    cublasStatus_t st = cublasDestroy(blas_);
    if (st != CUBLAS_STATUS_SUCCESS)
      log::error("cublasDestroy (device {}) failed: {}", device_, cublasGetStatusName(st));
    release_stream();
  }

  std::string_view backend() const noexcept override { return "cuda"; }
  int device() const noexcept override { return device_; }
  Stream stream() const noexcept override { return stream_; }

  void linear(const bf16* x, const bf16* w, bf16* y, int m, int n, int k) override {
    gemm(x, w, y, CUDA_R_16BF, m, n, k);
  }
  void linear(const bf16* x, const bf16* w, float* y, int m, int n, int k) override {
    gemm(x, w, y, CUDA_R_32F, m, n, k);
  }
  void linear_batched(const bf16* const* x, const bf16* const* w, bf16* const* y, int count, int n, int k) override {
    detail::DeviceGuard guard(device_);  // the caller's thread may have another device current
    // Row-major y_i[1][n] = x_i[1][k] · w_i[n][k]ᵀ is column-major y_iᵀ = w_iᵀ(op T of a k x n) · x_iᵀ.
    const float alpha = 1.f, beta = 0.f;
    check_cublas(cublasGemmBatchedEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, n, 1, k, &alpha,
                                     reinterpret_cast<const void* const*>(w), CUDA_R_16BF, k,
                                     reinterpret_cast<const void* const*>(x), CUDA_R_16BF, k, &beta,
                                     reinterpret_cast<void* const*>(y), CUDA_R_16BF, n, count, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT),
                 "cublasGemmBatchedEx", fmt::format("{} experts x [1 x {}] . [{} x {}]^T", count, k, n, k));
  }

  void embed(const std::int32_t* seq, int seq_stride, const std::int32_t* pos, const bf16* tok_emb, int vocab,
             const bf16* pos_table, bf16* out, int batch, int hidden) override {
    detail::DeviceGuard guard(device_);
    check_launch(gpu::embed(seq, seq_stride, pos, tok_emb, vocab, pos_table, out, batch, hidden, stream_), "embed",
                 "launch");
  }
  void rmsnorm(const bf16* x, const bf16* gamma, bf16* out, int rows, int hidden, float eps) override {
    detail::DeviceGuard guard(device_);
    check_launch(gpu::rmsnorm(x, gamma, out, rows, hidden, eps, stream_), "rmsnorm", "launch");
  }
  void add_rmsnorm(const bf16* a, const bf16* b, const bf16* gamma, bf16* sum_out, bf16* norm_out, int rows, int hidden,
                   float eps) override {
    detail::DeviceGuard guard(device_);
    check_launch(gpu::add_rmsnorm(a, b, gamma, sum_out, norm_out, rows, hidden, eps, stream_), "add_rmsnorm", "launch");
  }
  void attention_decode(const bf16* qkv, bf16* k_cache, bf16* v_cache, const std::int32_t* pos, bf16* out, int batch,
                        int head_dim, int max_seq) override {
    detail::DeviceGuard guard(device_);
    check_launch(gpu::attention_decode(qkv, k_cache, v_cache, pos, out, batch, head_dim, max_seq, stream_),
                 "attention_decode", "launch");
  }
  void router_topk(const float* logits, int rows, int experts, int top_k, std::int32_t* idx, float* weights) override {
    detail::DeviceGuard guard(device_);
    check_launch(gpu::router_topk(logits, rows, experts, top_k, idx, weights, stream_), "router_topk", "launch");
  }
  void silu_mul(const bf16* in, bf16* out, int rows, int inter) override {
    detail::DeviceGuard guard(device_);
    check_launch(gpu::silu_mul(in, out, rows, inter, stream_), "silu_mul", "launch");
  }
  void expert_pointers(const std::int32_t* idx, int count, int top_k, const bf16* const* gate_up_table,
                       const bf16* const* down_table, int experts, const bf16* x_lat, int latent, bf16* gate_up_out,
                       int inter, bf16* act, bf16* y_lat, const kernels::ExpertPointers& out) override {
    detail::DeviceGuard guard(device_);
    check_launch(gpu::expert_pointers(idx, count, top_k, gate_up_table, down_table, experts, x_lat, latent, gate_up_out,
                                      inter, act, y_lat, out, stream_),
                 "expert_pointers", "launch");
  }
  void argmax_next(const float* logits, int batch, int vocab, std::int32_t* seq, int seq_stride,
                   const std::int32_t* pos, const std::int32_t* prompt_len) override {
    detail::DeviceGuard guard(device_);
    check_launch(gpu::argmax_next(logits, batch, vocab, seq, seq_stride, pos, prompt_len, stream_), "argmax_next",
                 "launch");
  }
  void advance(std::int32_t* pos) override {
    detail::DeviceGuard guard(device_);
    check_launch(gpu::advance(pos, stream_), "advance", "launch");
  }

  void synchronize() override {
    detail::DeviceGuard guard(device_);
    check_cuda(cudaStreamSynchronize(s_), "cudaStreamSynchronize", fmt::format("compute stream of device {}", device_));
  }

  bool graphs() const noexcept override { return true; }
  std::unique_ptr<Graph> capture(const std::function<void()>& body) override {
    detail::DeviceGuard guard(device_);
    check_cuda(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture",
               fmt::format("device {}", device_));
    cudaGraph_t graph = nullptr;
    try {
      body();
    } catch (...) {
      // End the capture whatever happened, so the stream is usable again.
      if (cudaStreamEndCapture(s_, &graph) == cudaSuccess && graph != nullptr) cudaGraphDestroy(graph);
      throw;
    }
    check_cuda(cudaStreamEndCapture(s_, &graph), "cudaStreamEndCapture", fmt::format("device {}", device_));
    refuse_memory_nodes(graph);
    cudaGraphExec_t exec = nullptr;
    cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
    cudaError_t d = cudaGraphDestroy(graph);
    check_cuda(e, "cudaGraphInstantiate", fmt::format("device {}", device_));
    if (d != cudaSuccess) {
      cudaGraphExecDestroy(exec);
      check_cuda(d, "cudaGraphDestroy", fmt::format("device {}", device_));
    }
    return std::make_unique<CudaGraph>(exec, s_, device_);
  }

  GraphAllocatorBytes graph_allocator_bytes() override { return detail::graph_allocator_bytes(device_); }

  // cuBLAS asks for 32 MiB on Hopper for its best kernels; the tiny model needs far less, but the
  // recommended size costs nothing here (class cache: never copied on sleep).
  std::size_t workspace_bytes() const noexcept override { return std::size_t{32} << 20; }
  void set_workspace(void* p, std::size_t bytes) override {
    detail::DeviceGuard guard(device_);
    check_cublas(cublasSetWorkspace(blas_, p, bytes), "cublasSetWorkspace",
                 fmt::format("{} bytes of pool memory", bytes));
  }

  void* outside_allocate(std::size_t bytes) override {
    detail::DeviceGuard guard(device_);
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, bytes), "cudaMalloc",
               fmt::format("{} bytes outside the pool on device {}", bytes, device_));
    return p;
  }
  void outside_free(void* p, std::size_t) noexcept override {
    cudaError_t e = cudaFree(p);  // unified addressing: cudaFree finds the pointer's device itself
    if (e != cudaSuccess) log::error("cudaFree (device {}) failed: {}", device_, cudaGetErrorName(e));
  }
  std::uint64_t touch(void* p, std::size_t bytes, std::uint64_t seed) override {
    detail::DeviceGuard guard(device_);
    unsigned long long* sum = nullptr;
    check_cuda(cudaMalloc(&sum, sizeof *sum), "cudaMalloc", "the touch checksum");
    std::uint64_t host = 0;
    try {
      check_cuda(cudaMemsetAsync(sum, 0, sizeof *sum, s_), "cudaMemsetAsync", "the touch checksum");
      check_launch(gpu::touch(p, bytes, seed, sum, stream_), "touch", fmt::format("{} bytes", bytes));
      check_cuda(cudaMemcpyAsync(&host, sum, sizeof host, cudaMemcpyDeviceToHost, s_), "cudaMemcpyAsync",
                 "the checksum");
      synchronize();
    } catch (...) {
      cudaFree(sum);
      throw;
    }
    check_cuda(cudaFree(sum), "cudaFree", "the touch checksum");
    return host;
  }

 private:
  void gemm(const bf16* x, const bf16* w, void* y, cudaDataType_t ytype, int m, int n, int k) {
    detail::DeviceGuard guard(device_);
    // Row-major y[m][n] = x[m][k] · w[n][k]ᵀ  <=>  column-major yᵀ (n x m) = op_T(w: k x n) · xᵀ (k x m).
    const float alpha = 1.f, beta = 0.f;
    check_cublas(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, w, CUDA_R_16BF, k, x, CUDA_R_16BF, k,
                              &beta, y, ytype, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx", fmt::format("[{} x {}] . [{} x {}]^T", m, k, n, k));
  }
  // Destroys `graph` and throws when it has a memory node (see the file note).
  void refuse_memory_nodes(cudaGraph_t graph) const {
    std::size_t nodes = 0;
    try {
      nodes = detail::graph_memory_nodes(graph);
    } catch (...) {
      cudaGraphDestroy(graph);
      throw;
    }
    if (nodes == 0) return;
    cudaGraphDestroy(graph);
    throw error(fmt::format("device {}: the captured decode step has {} CUDA graph memory node(s) (cudaMallocAsync or "
                            "cudaFreeAsync during capture); that memory would belong to CUDA's graph allocator, "
                            "outside the pool, and stay on the device while asleep",
                            device_, nodes));
  }
  void release_stream() noexcept {
    try {
      driver_.stream_destroy(stream_);
    } catch (const std::exception& e) {
      log::error("cuda compute (device {}): destroying its stream failed: {}", device_, e.what());
    }
  }

  Driver& driver_;
  int device_;
  Stream stream_{};
  cudaStream_t s_ = nullptr;
  cublasHandle_t blas_ = nullptr;
};

}  // namespace

std::unique_ptr<Compute> make_cuda_compute(Driver& driver, int device) {
  return std::make_unique<CudaCompute>(driver, device);
}

}  // namespace torpor::fusion
