// Host entry points of the MoE-tail CUDA kernels (kernels/tail.cu). Built only with TORPOR_CUDA
// (TORPOR_KERNELS_CUDA is then defined for users of torpor_kernels). Every launcher enqueues on
// `stream` (a torpor::Stream of the current device, or Stream{} for CUDA's default stream;
// capturable in a CUDA graph), on the calling thread's current device, and throws torpor::error
// naming the kernel and the CUDA error when the launch fails.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "torpor/kernels/tail_protocol.hpp"
#include "torpor/stream.hpp"

namespace torpor::kernels {

// Blocks per row of the fused kernel: a row's tail_row_lanes lanes are split over a cluster of
// this many blocks (tail_row_lanes / blocks_per_row threads each), which spreads a row's loads,
// polls and stores over as many multiprocessors. 1, 4 or 8; above 1 needs compute capability
// 9.0 (thread-block clusters).
// The default (TailOptions::blocks_per_row = 0), per call: a call that receives at most
// tail_cluster_max_rows rows uses clusters of tail_cluster_blocks blocks per row where clusters
// exist; a larger call one block per row. A cluster shortens a call of a handful of rows by
// spreading each row over more multiprocessors; with many rows every multiprocessor is busy anyway
// and the wider blocks keep more loads in flight (the "1 / 4 / 8 blocks per row" column of
// bench/results/2026-11-30-tail-push-2xh200.md).
inline constexpr int tail_cluster_blocks = 4;
inline constexpr int tail_cluster_max_rows = 32;
// Whether `device` has thread-block clusters (compute capability 9.0+).
bool tail_clusters_supported(int device);
// Blocks per row on `device` for calls of few rows (<= tail_cluster_max_rows) or many, given
// TailOptions::blocks_per_row (`option`: 0 = the default above, else that value).
int tail_blocks_per_row(int device, int option, bool few_rows);

// "" when the fused kernels can run on `device` (the current device) with `blocks_per_row`, else
// why not: compute capability below 7.0 (9.0 for multicast or more than one block per row), a
// blocks_per_row that is not 1, 4 or 8, or no kernel image for it in this build.
std::string tail_device_support(int device, bool multicast, int blocks_per_row);

// How many blocks of the fused kernel fit on the current device at once (a whole number of
// clusters): the fused grid never exceeds it, so every block of a call is resident together
// (senders never wait behind spinning receivers).
int tail_fused_capacity(int hidden, bool multicast, int blocks_per_row);

// Loads every kernel the tail uses for `hidden` on the current device now (the CUDA runtime may
// load modules lazily, at first launch), so the first call can be captured in a graph.
void tail_preload(int hidden, bool multicast, int blocks_per_row);

// Whether `device` can launch the fused kernel as a programmatic dependent (compute capability
// 9.0+): it then starts launching while the kernel before it on the stream finishes, and waits for
// that kernel's completion (griddepcontrol.wait) before it reads or writes anything.
bool tail_programmatic_launch_supported(int device);

// One fused call (see tail_protocol.hpp). `capacity` from tail_fused_capacity with the same
// blocks_per_row; `programmatic`: launch as a programmatic dependent of the previous kernel on
// the stream (only where tail_programmatic_launch_supported). Captured in a CUDA graph, that
// becomes a programmatic edge.
void launch_tail_fused(const TailParams& p, int blocks_per_row, int capacity, Stream stream, bool programmatic);

// For tests only: a fused call (unicast, tail_cluster_blocks blocks per row, `capacity` from
// tail_fused_capacity for that) whose block 1 of every cluster never pushes its sums of squares
// of its first row, so the row barrier's deadline (I5) decides how the call ends.
void launch_tail_fused_withholding_push(const TailParams& p, int capacity, Stream stream);

// For tests only: out[i] = the bf16 bits the fused kernel's rounding (cvt.rn.bf16x2, NaN made
// canonical) gives for the float with bits first + i, for i < count (count even, first even).
void launch_tail_round_floats(std::uint32_t first, std::size_t count, std::uint16_t* out, Stream stream);

// The unfused path's kernels: partial[t][*] for every row (rounded to bf16 like the fused
// partials, stored as fp32 so the all-reduce sums in fp32 as the fused kernel does), and
// residual + RMSNorm of the output rows from the all-reduced fp32 sums.
void launch_tail_finalize(const TailParams& p, float* partial, Stream stream);
void launch_tail_residual_norm(const TailParams& p, const float* reduced, Stream stream);

// Fills `elements` 16-bit words at dst (2-byte aligned) with `value`.
void launch_fill_u16(void* dst, std::uint16_t value, std::size_t elements, Stream stream);

}  // namespace torpor::kernels
