// The one NCCL loader, for NcclGroup (ranks/nccl/nccl_group.cpp) and NcclComm (the device
// all-reduce of the unfused tail, torpor/nccl_comm.hpp). Compiled only where CMake found nccl.h with
// the CUDA backend (TORPOR_NCCL, decided once in the top-level CMakeLists.txt); elsewhere the
// *_unavailable.cpp files stand in and say why.
//
// libnccl is opened at run time (dlopen; TORPOR_NCCL_LIBRARY overrides the name, read at the
// first load), so binaries start on machines without it. Every symbol either user needs is
// resolved once, at the first call; a library that cannot be opened or lacks a symbol is
// refused as a whole, and why_not says why. The library is never unloaded.
//
// Every user applies the NVLS policy (ranks/multicast.hpp: apply_nccl_nvls_policy) before its
// first communicator, so the multicast kill switches hold for NCCL's own NVLS too.
#pragma once

#include <nccl.h>

#include <string>

namespace torpor {

struct NcclLibrary {
  std::string name;     // the file opened
  std::string why_not;  // "" when usable
  void* handle = nullptr;
  int version = 0;  // ncclGetVersion: 22703 for 2.27.3
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) init_rank = nullptr;               // blocking (NcclComm)
  decltype(&ncclCommInitRankConfig) init_rank_config = nullptr;  // non-blocking, bounded (NcclGroup)
  decltype(&ncclCommGetAsyncError) get_async_error = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclCommFinalize) finalize = nullptr;
  decltype(&ncclCommAbort) abort = nullptr;
  decltype(&ncclCommDestroy) destroy = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  // Optional: communicator suspend and resume (NCCL 2.29.7 and later), which give NCCL's own
  // device memory back while asleep. Reported by nccl_info(); not needed to load.
  bool comm_suspend = false;

  bool usable() const noexcept { return why_not.empty(); }
};

// Opens `name` and resolves every symbol; on failure why_not names the file and what is
// missing, and nothing stays loaded. Does not cache (tests use it on libraries of their own).
NcclLibrary load_nccl_library(const std::string& name);
// The process's NCCL: load_nccl_library(TORPOR_NCCL_LIBRARY or libnccl.so.2) at the first call.
// Check usable().
const NcclLibrary& nccl_library();

}  // namespace torpor
