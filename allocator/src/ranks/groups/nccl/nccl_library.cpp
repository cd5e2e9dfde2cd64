// The NCCL loader. See nccl_library.hpp.
#include "ranks/groups/nccl/nccl_library.hpp"

#include <dlfcn.h>
#include <fmt/core.h>

#include <type_traits>

#include "common/options.hpp"
#include "ranks/groups/nccl/nccl_info.hpp"

namespace torpor {

NcclLibrary load_nccl_library(const std::string& name) {
  NcclLibrary a;
  a.name = name;
  a.handle = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (a.handle == nullptr) {
    const char* e = ::dlerror();
    a.why_not = fmt::format("{} could not be loaded ({}); install NCCL or set TORPOR_NCCL_LIBRARY", name,
                            e != nullptr ? e : "unknown");
    return a;
  }
  std::string missing;
  auto resolve = [&](auto& slot, const char* symbol) {
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(::dlsym(a.handle, symbol));
    if (slot == nullptr) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", symbol);
  };
  resolve(a.get_version, "ncclGetVersion");
  resolve(a.get_unique_id, "ncclGetUniqueId");
  resolve(a.init_rank, "ncclCommInitRank");
  resolve(a.init_rank_config, "ncclCommInitRankConfig");
  resolve(a.get_async_error, "ncclCommGetAsyncError");
  resolve(a.all_gather, "ncclAllGather");
  resolve(a.all_reduce, "ncclAllReduce");
  resolve(a.finalize, "ncclCommFinalize");
  resolve(a.abort, "ncclCommAbort");
  resolve(a.destroy, "ncclCommDestroy");
  resolve(a.error_string, "ncclGetErrorString");
  if (!missing.empty()) {
    NcclLibrary refused;
    refused.name = name;
    refused.why_not = fmt::format("{} lacks {} (NCCL 2.14 or newer is needed)", name, missing);
    ::dlclose(a.handle);
    return refused;
  }
  a.get_version(&a.version);
  // By name only: the image's nccl.h may predate them, and nothing calls them yet.
  a.comm_suspend = ::dlsym(a.handle, "ncclCommSuspend") != nullptr && ::dlsym(a.handle, "ncclCommResume") != nullptr;
  return a;
}

const NcclLibrary& nccl_library() {
  static const NcclLibrary library = load_nccl_library(options::nccl_library());
  return library;
}

NcclInfo nccl_info() {
  const NcclLibrary& l = nccl_library();
  NcclInfo info;
  info.built = true;
  info.usable = l.usable();
  info.name = l.name;
  info.why_not = l.why_not;
  info.version = l.version;
  info.comm_suspend = l.comm_suspend;
  return info;
}

}  // namespace torpor
