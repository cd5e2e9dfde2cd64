// The CPU twin of the MoE-tail kernels (kernels/reference/tail_reference.cpp): the same protocol
// (tail_protocol.hpp: sentinel, three slots, control block, error record, bounded waits) run by
// one thread per rank over host memory (HostDriver's memory on the host backend, shared between
// threads or processes), and the same arithmetic, so it produces the same bits as the GPU. The
// host backend runs it; GPU tests use it as the oracle.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "torpor/kernels/tail_protocol.hpp"

namespace torpor::kernels {

struct ReferenceHooks {
  // The multicast store (HostDriver::multicast_store): `bytes` from `src` land at mc_va + i in
  // every part bound to the multicast object. Required when TailParams::multicast is set.
  std::function<void(std::uint64_t mc_va, const void* src, std::size_t bytes)> multicast_store;
};

// One fused call of this rank, on the calling thread (the kernel's phases 0-4, see tail.cu).
// Failures are recorded in the control block, as on the GPU; it never throws for them.
void reference_tail_fused(const TailParams& p, const ReferenceHooks& hooks = {});

// Unfused pieces. partial: [tokens][hidden], every row, rounded and sanitised like the fused
// partials. sum: [tokens][hidden] fp32 all-reduced partials; writes the output rows.
void reference_finalize(const TailParams& p, bf16* partial);
void reference_residual_norm(const TailParams& p, const float* sum);

// The row's sum of squares with the GPU block's tree (tail_protocol.hpp).
float reference_sum_squares(const float* x, int hidden);

// Fills `elements` bf16 at dst with the sentinel.
void reference_fill_sentinel(bf16* dst, std::size_t elements);

}  // namespace torpor::kernels
