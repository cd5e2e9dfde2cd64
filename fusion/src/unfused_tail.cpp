// UnfusedTail: the path the fused kernel replaces, and the fallback when some rank cannot run
// it. Three steps per call:
//   finalize   this rank's partial of every row, rounded to bf16 (the same partials the fused
//              kernel sends);
//   all-reduce GPU: ncclAllReduce (sum, fp32 of the bf16-rounded partials) in place on a scratch
//              buffer, on the caller's stream (capturable): for two ranks the fp32 sum is exactly
//              the fused kernel's (addition commutes), so both paths give the same bits; with
//              more ranks NCCL's summation order may differ from rank order in the last bit.
//              Host backend: the Group's all-gather, summed in rank order in fp32, bit for bit
//              what the fused path gives;
//   epilogue   residual + RMSNorm of the output rows with the fused kernel's arithmetic.
// The scratch buffer is pool memory of class cache in "weights": sleep may drop its bytes, since
// every call rewrites it before reading.
#include <fmt/format.h>

#include <vector>

#include "nccl_comm.hpp"
#include "tail_impl.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

#if defined(TORPOR_KERNELS_CUDA)
#include "cuda_runtime.hpp"
#include "torpor/kernels/tail_kernels.hpp"
#endif

namespace torpor::fusion::detail {

UnfusedTail::UnfusedTail(SymmetricHeap& heap, const TailShape& shape, const TailOptions& options, std::string reason)
    : TailBase(heap, shape, options, TailPath::unfused, std::move(reason)) {
  if (!cuda_) return;
#if defined(TORPOR_KERNELS_CUDA)
  {
    DeviceGuard guard(device_);
    kernels::tail_preload(shape_.hidden, false, 1);
  }
  const std::size_t bytes = static_cast<std::size_t>(shape_.max_tokens) * static_cast<std::size_t>(shape_.hidden) * sizeof(float);
  scratch_ = pool_.allocate(bytes, {tags::weights, MemoryClass::cache, "tail.scratch"});
  try {
    if (ranks_ > 1) comm_ = std::make_unique<NcclComm>(group_, device_);
  } catch (...) {
    pool_.deallocate(scratch_);
    scratch_ = nullptr;
    throw;
  }
#else
  throw unavailable(fmt::format("{}: the cuda backend needs a build with TORPOR_CUDA=ON", who()));
#endif
}

UnfusedTail::~UnfusedTail() {
#if defined(TORPOR_KERNELS_CUDA)
  if (cuda_) {
    try {
      DeviceGuard guard(device_);
      cudaError_t e = cudaDeviceSynchronize();  // calls in flight use the scratch and the communicator
      if (e != cudaSuccess) log::error("{}: waiting for calls in flight: {}", who(), cudaGetErrorString(e));
    } catch (const std::exception& e) {
      log::error("{}: waiting for calls in flight: {}", who(), e.what());
    }
  }
#endif
  comm_.reset();
  if (scratch_ != nullptr) {
    try {
      pool_.deallocate(scratch_);
    } catch (const std::exception& e) {
      log::error("{}: freeing the scratch buffer: {}", who(), e.what());
    }
  }
}

void UnfusedTail::run(const TailArgs& args, Stream stream) {
  const kernels::TailParams p = params(args, stream);
  const std::size_t elements = static_cast<std::size_t>(p.tokens) * static_cast<std::size_t>(p.hidden);
  if (!cuda_) {
    std::vector<bf16> partial(elements);
    kernels::reference_finalize(p, partial.data());
    auto all = group_.all_gather(std::as_bytes(std::span<const bf16>(partial)));
    std::vector<float> sum(elements);
    for (std::size_t r = 0; r < all.size(); ++r) {
      if (all[r].size() != elements * sizeof(bf16))
        throw invalid_argument(fmt::format("{}: rank {} sent {} bytes of partials, this rank expected {} ({} tokens): "
                                           "every rank must pass the same TailArgs::tokens",
                                           who(), r, all[r].size(), elements * sizeof(bf16), p.tokens));
      const auto* b = reinterpret_cast<const std::uint16_t*>(all[r].data());
      for (std::size_t i = 0; i < elements; ++i) {
        const float f = kernels::tail_bf16_to_float(b[i]);
        sum[i] = r == 0 ? f : kernels::tail_add(sum[i], f);
      }
    }
    kernels::reference_residual_norm(p, sum.data());
    return;
  }
#if defined(TORPOR_KERNELS_CUDA)
  if (pool_.asleep(tags::weights))
    throw invalid_state(fmt::format("{}: its scratch buffer (tag '{}') is asleep; wake the pool before calling "
                                    "the tail",
                                    who(), tags::weights));
  DeviceGuard guard(device_);
  void* s = cuda_stream(stream);
  auto* scratch = static_cast<float*>(scratch_);
  kernels::launch_tail_finalize(p, scratch, s);
  if (comm_) comm_->all_reduce_sum_f32(scratch, elements, s);
  kernels::launch_tail_residual_norm(p, scratch, s);
#endif
}

void UnfusedTail::check() {
  if (comm_) comm_->check();
}

void UnfusedTail::reset() {
  // No state survives a call; stay collective so both paths can be reset the same way.
  group_.barrier();
}

}  // namespace torpor::fusion::detail
