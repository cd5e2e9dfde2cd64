// UnfusedTail: the path the fused kernel replaces, and the fallback when some rank cannot run
// it. Three steps per call, each run through the tail's TailOps (tail_ops.hpp):
//   finalize   this rank's partial of every row, rounded to bf16 (the same partials the fused
//              kernel sends);
//   all-reduce device kernels: ncclAllReduce (sum, fp32 of the bf16-rounded partials) in place on
//              a scratch buffer, on the caller's stream (capturable): for two ranks the fp32 sum is
//              exactly the fused kernel's (addition commutes), so both paths give the same bits;
//              with more ranks NCCL's summation order may differ from rank order in the last bit.
//              CPU reference: the Group's all-gather, summed in rank order in fp32, bit for bit
//              what the fused path gives;
//   epilogue   residual + RMSNorm of the output rows with the fused kernel's arithmetic.
// The scratch buffer (device kernels) is pool memory of class cache in "weights": sleep may drop
// its bytes, since every call rewrites it before reading.
#include "tail/tail_impl.hpp"

namespace torpor::fusion::detail {

UnfusedTail::UnfusedTail(SymmetricHeap& heap, const TailShape& shape, const TailOptions& options, std::string reason)
    : TailBase(heap, shape, options, TailPath::unfused, std::move(reason)) {
  ops_->prepare_unfused();
}

UnfusedTail::~UnfusedTail() { ops_->release(); }

void UnfusedTail::run(const TailArgs& args, Stream stream) { ops_->unfused(params(args, stream), stream); }

void UnfusedTail::check() { ops_->check_unfused(); }

void UnfusedTail::reset() {
  // No state survives a call; stay collective so both paths can be reset the same way.
  group_.barrier();
}

}  // namespace torpor::fusion::detail
