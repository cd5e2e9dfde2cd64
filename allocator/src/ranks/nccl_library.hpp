// The one NCCL loader, for NcclGroup (dist/) and the unfused tail's communicator (fusion/,
// through torpor::internal).
//
// libnccl is opened at run time (dlopen; TORPOR_NCCL_LIBRARY overrides the name, read at the
// first load), so binaries start on machines without it. Every symbol either user needs is
// resolved once, at the first call; a library that cannot be opened or lacks a symbol is
// refused as a whole, and why_not says why. The library is never unloaded.
//
// The NVLS kill switch. NCCL creates multicast objects of its own (NVLS) unless
// NCCL_NVLS_ENABLE=0, and reads that variable once per process, at its first communicator.
// So the policy is decided once, before the first communicator (apply_nccl_nvls_policy(),
// called by both users before any NCCL call that creates one), from these rules:
//   - TORPOR_DISABLE_MULTICAST set: NCCL_NVLS_ENABLE=0, overriding the user's own value (torpor
//     promised no multicast object);
//   - else a foreign kill switch (TORCH_SYMM_MEM_DISABLE_MULTICAST, NVSHMEM_DISABLE_NVLS) set and
//     NCCL_NVLS_ENABLE unset: NCCL_NVLS_ENABLE=0;
//   - else the user's NCCL_NVLS_ENABLE (or NCCL's default) stands.
// "Set" means what the options table says (common/options.hpp). nccl_nvls_policy() is the pure
// decision, tested on the host without NCCL.
#pragma once

#include <optional>
#include <string>

#if __has_include(<nccl.h>)
#include <nccl.h>
#define TORPOR_NCCL_HEADER 1
#endif

namespace torpor {

// The environment the NVLS policy reads (nothing: unset).
struct NvlsEnvironment {
  std::optional<std::string> torpor_disable_multicast;          // TORPOR_DISABLE_MULTICAST
  std::optional<std::string> torch_symm_mem_disable_multicast;  // TORCH_SYMM_MEM_DISABLE_MULTICAST
  std::optional<std::string> nvshmem_disable_nvls;              // NVSHMEM_DISABLE_NVLS
  std::optional<std::string> nccl_nvls_enable;                  // NCCL_NVLS_ENABLE
};

struct NvlsAction {
  bool set_nvls_off = false;  // set NCCL_NVLS_ENABLE=0
  std::string why;            // for the log, naming the variables that decided; "" when nothing to do
};

// The policy above. Pure.
NvlsAction nccl_nvls_policy(const NvlsEnvironment& env);
// The process environment's values, through the options table.
NvlsEnvironment nvls_environment();
// Decides and applies the policy once per process, under a lock; later calls do nothing.
void apply_nccl_nvls_policy();

#ifdef TORPOR_NCCL_HEADER

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

  bool usable() const noexcept { return why_not.empty(); }
};

// Opens `name` and resolves every symbol; on failure why_not names the file and what is
// missing, and nothing stays loaded. Does not cache (tests use it on libraries of their own).
NcclLibrary load_nccl_library(const std::string& name);
// The process's NCCL: load_nccl_library(TORPOR_NCCL_LIBRARY or libnccl.so.2) at the first call.
// Check usable().
const NcclLibrary& nccl_library();

#endif

}  // namespace torpor
