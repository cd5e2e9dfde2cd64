// NcclComm: an NCCL communicator over a Group's ranks for device buffers, used by the unfused
// MoE tail (fusion/) for its all-reduce (enqueued on the caller's stream, so it can be captured
// in a CUDA graph). NcclGroup moves host bytes for the symmetric layer; this one reduces device
// memory in place and owns nothing else. It is the way code outside the allocator reaches NCCL:
// this header carries no NCCL or CUDA type, so it is installed and usable in every build (without
// NCCL support, available() says so and the constructor throws unavailable).
//
// NCCL comes from the loader NcclGroup uses (ranks/nccl/nccl_library.hpp: opened at run time,
// TORPOR_NCCL_LIBRARY overrides the name), so binaries start without it; available() says why it
// cannot be used. The unique id travels over the Group. The NVLS policy
// (ranks/multicast.hpp) is applied before the first NCCL call, so a multicast kill switch keeps
// NCCL from creating a multicast object.
//
// The communicator is created blocking (ncclCommInitRank), unlike NcclGroup's bounded
// non-blocking init: a non-blocking communicator would make every later ncclAllReduce able to
// return ncclInProgress, also inside a CUDA graph capture, which this path does not handle. Every
// rank has confirmed over the Group that it can load NCCL before anyone enters the init.
//
// Teardown: destroy every CUDA graph that captured all_reduce() before the communicator (NCCL
// 2.28 hung on teardown with live graphs).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace torpor {

class Group;

class NcclComm {
 public:
  static bool available(std::string* why_not = nullptr);

  // Collective over `group`; `device` is this rank's GPU, which must be current on the calling
  // thread (ncclCommInitRank creates the communicator on the current device).
  NcclComm(Group& group, int device);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // In-place sum of `count` fp32 at `buffer` over every rank, on `stream` (a cudaStream_t).
  void all_reduce_sum_f32(void* buffer, std::size_t count, void* stream);
  // The same for bf16 (the bench's "NCCL all-reduce alone" reference).
  void all_reduce_sum_bf16(void* buffer, std::size_t count, void* stream);
  // Throws error when NCCL reported an asynchronous error (a peer failed, a network error).
  void check();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace torpor
