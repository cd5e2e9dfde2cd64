// CudaTailOps: the tail on the CUDA kernels of kernels/tail.cu, for drivers whose compute is
// device kernels (the cuda backend); built with TORPOR_CUDA only.
//
// Every call enqueues on the caller's stream with this rank's device current for its duration
// (DeviceGuard: a rank's thread may have any device current), so it can be captured in a CUDA
// graph. The fused path keeps its own stream (created through the driver seam, in the device's
// primary context, which the runtime shares) for check() and reset(), which must not wait behind
// the caller's work. The unfused path keeps a scratch buffer of pool memory and an NCCL
// communicator. release() waits for every call in flight on the device before either goes.
#include <cuda_runtime.h>
#include <fmt/core.h>

#include "cuda/cuda_runtime.hpp"
#include "tail/tail_ops.hpp"
#include "torpor/error.hpp"
#include "torpor/group.hpp"
#include "torpor/kernels/native_stream.hpp"
#include "torpor/kernels/tail_kernels.hpp"
#include "torpor/log.hpp"
#include "torpor/nccl_comm.hpp"
#include "torpor/pool.hpp"
#include "torpor/symmetric.hpp"

namespace torpor::fusion::detail {

namespace {

class CudaTailOps final : public TailOps {
 public:
  CudaTailOps(SymmetricHeap& heap, const TailShape& shape, const TailOptions& options, TailName who)
      : pool_(heap.pool()),
        group_(heap.group()),
        shape_(shape),
        options_(options),
        device_(heap.pool().device()),
        who_(std::move(who)) {}
  ~CudaTailOps() override { release(); }

  bool synchronous() const noexcept override { return false; }
  void check_stream(Stream s) const override {
    if (s.value != 0 && s.device != device_)
      throw invalid_argument(fmt::format("{}: the stream belongs to device {}; run the tail on a stream of device {}",
                                         who_(), s.device, device_));
  }

  FusedSupport fused_support() override {
    FusedSupport s;
    try {
      DeviceGuard guard(device_);
      const int blocks = kernels::tail_blocks_per_row(device_, options_.blocks_per_row, true);  // the wider one
      s.fused_why_not = kernels::tail_device_support(device_, false, blocks);
      if (s.fused_why_not.empty()) s.multicast_why_not = kernels::tail_device_support(device_, true, blocks);
    } catch (const std::exception& e) {
      s.fused_why_not = fmt::format("probing the device failed: {}", e.what());
    }
    return s;
  }

  std::string prepare_fused(bool multicast) override {
    DeviceGuard guard(device_);
    stream_ = pool_.driver().stream_create(device_);
    // Two launch shapes: few rows (clusters by default, where they exist) and many rows.
    launch_.few_rows.blocks_per_row = kernels::tail_blocks_per_row(device_, options_.blocks_per_row, true);
    launch_.many_rows.blocks_per_row = kernels::tail_blocks_per_row(device_, options_.blocks_per_row, false);
    for (LaunchShape* l : {&launch_.few_rows, &launch_.many_rows}) {
      kernels::tail_preload(shape_.hidden, multicast, l->blocks_per_row);
      l->capacity = kernels::tail_fused_capacity(shape_.hidden, multicast, l->blocks_per_row);
    }
    programmatic_ = options_.programmatic_launch && kernels::tail_programmatic_launch_supported(device_);
    return fmt::format("; blocks per row {} up to {} rows, else {}{}", launch_.few_rows.blocks_per_row,
                       kernels::tail_cluster_max_rows, launch_.many_rows.blocks_per_row,
                       programmatic_ ? "; calls launch as programmatic dependents" : "");
  }
  FusedLaunch fused_launch() const noexcept override { return launch_; }

  void fused(const kernels::TailParams& p, Stream stream) override {
    DeviceGuard guard(device_);
    const LaunchShape& l =
        kernels::tail_receive_rows(p).count() <= kernels::tail_cluster_max_rows ? launch_.few_rows : launch_.many_rows;
    kernels::launch_tail_fused(p, l.blocks_per_row, l.capacity, stream, programmatic_);
  }

  kernels::TailControl read_control(const void* control) override {
    kernels::TailControl c{};
    DeviceGuard guard(device_);
    const cudaStream_t s = kernels::native(stream_);
    TORPOR_CUDA_CHECK(cudaMemcpyAsync(&c, control, sizeof c, cudaMemcpyDeviceToHost, s),
                      who_() + ": reading the control block");
    TORPOR_CUDA_CHECK(cudaStreamSynchronize(s), who_() + ": reading the control block");
    return c;
  }

  void initialise(void* slots, std::size_t elements, void* control, const kernels::TailControl& fresh,
                  std::uint32_t* abort) override {
    DeviceGuard guard(device_);
    const cudaStream_t s = kernels::native(stream_);
    kernels::launch_fill_u16(slots, kernels::tail_sentinel, elements, stream_);
    TORPOR_CUDA_CHECK(cudaMemcpyAsync(control, &fresh, sizeof fresh, cudaMemcpyHostToDevice, s),
                      who_() + ": writing the control block");
    TORPOR_CUDA_CHECK(cudaMemsetAsync(abort, 0, sizeof *abort, s), who_() + ": clearing the abort word");
    TORPOR_CUDA_CHECK(cudaStreamSynchronize(s), who_() + ": initialising the slots");
  }

  void wait_idle() override {
    DeviceGuard guard(device_);
    // Calls in flight on this device finish first (a timed-out kernel exits by its deadline).
    TORPOR_CUDA_CHECK(cudaDeviceSynchronize(), who_() + ": waiting for calls in flight before reset");
  }

  void prepare_unfused() override {
    prepared_unfused_ = true;
    {
      DeviceGuard guard(device_);
      kernels::tail_preload(shape_.hidden, false, 1);
    }
    const std::size_t bytes =
        static_cast<std::size_t>(shape_.max_tokens) * static_cast<std::size_t>(shape_.hidden) * sizeof(float);
    scratch_ = pool_.allocate(bytes, {tags::weights, MemoryClass::cache, "tail.scratch"});
    if (group_.size() > 1) {
      DeviceGuard guard(device_);  // NcclComm creates its communicator on the current device
      comm_ = std::make_unique<NcclComm>(group_, device_);
    }
  }

  void unfused(const kernels::TailParams& p, Stream stream) override {
    if (pool_.asleep(tags::weights))
      throw invalid_state(fmt::format("{}: its scratch buffer (tag 'weights') is asleep; wake the pool before calling "
                                      "the tail",
                                      who_()));
    const std::size_t elements = static_cast<std::size_t>(p.tokens) * static_cast<std::size_t>(p.hidden);
    DeviceGuard guard(device_);
    auto* scratch = static_cast<float*>(scratch_);
    kernels::launch_tail_finalize(p, scratch, stream);
    // NcclComm takes the native handle (it calls NCCL, which speaks cudaStream_t).
    if (comm_) comm_->all_reduce_sum_f32(scratch, elements, kernels::native(stream));
    kernels::launch_tail_residual_norm(p, scratch, stream);
  }

  void check_unfused() override {
    if (comm_) comm_->check();
  }

  void release() noexcept override {
    if (stream_ || prepared_unfused_) wait_for_the_device();
    if (stream_) {
      try {
        pool_.driver().stream_destroy(stream_);
      } catch (const std::exception& e) {
        log::error("{}: destroying its stream: {}", who_(), e.what());
      }
      stream_ = Stream{};
    }
    comm_.reset();
    if (scratch_ != nullptr) {
      try {
        pool_.deallocate(scratch_);
      } catch (const std::exception& e) {
        log::error("{}: freeing the scratch buffer: {}", who_(), e.what());
      }
      scratch_ = nullptr;
    }
    prepared_unfused_ = false;
  }

 private:
  // Calls still in flight on any stream of this device use the stream, the scratch, the
  // communicator and the tail's memory.
  void wait_for_the_device() noexcept {
    try {
      DeviceGuard guard(device_);
      cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) log::error("{}: waiting for calls in flight: {}", who_(), cudaGetErrorString(e));
    } catch (const std::exception& e) {
      log::error("{}: waiting for calls in flight: {}", who_(), e.what());
    }
  }

  Pool& pool_;
  Group& group_;
  TailShape shape_;
  TailOptions options_;
  int device_ = 0;
  TailName who_;
  // The fused path.
  Stream stream_{};  // this op's own stream, for check() and reset()
  FusedLaunch launch_;
  bool programmatic_ = false;  // launch calls as programmatic dependents
  // The unfused path.
  bool prepared_unfused_ = false;
  void* scratch_ = nullptr;  // [max_tokens][hidden] fp32 partials, reduced in place
  std::unique_ptr<NcclComm> comm_;
};

}  // namespace

std::unique_ptr<TailOps> make_cuda_tail_ops(SymmetricHeap& heap, const TailShape& shape, const TailOptions& options,
                                            TailName who) {
  return std::make_unique<CudaTailOps>(heap, shape, options, std::move(who));
}

}  // namespace torpor::fusion::detail
