// The NCCL loader and the NVLS policy. See nccl_library.hpp.
#include "ranks/nccl_library.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <mutex>
#include <utility>

#include "common/options.hpp"
#include "torpor/log.hpp"

#if defined(TORPOR_HAVE_CUDA) && defined(TORPOR_NCCL_HEADER)
#include <dlfcn.h>

#include <type_traits>
#endif

namespace torpor {

namespace {

bool switch_set(options::id key, const std::optional<std::string>& value) {
  return options::switch_set(options::option(key), value);
}

std::string named(options::id key, const std::optional<std::string>& value) {
  return fmt::format("{}={}", options::option(key).name, value.value_or(""));
}

}  // namespace

NvlsAction nccl_nvls_policy(const NvlsEnvironment& env) {
  using options::id;
  const bool user_set = env.nccl_nvls_enable.has_value() && !env.nccl_nvls_enable->empty();
  if (switch_set(id::disable_multicast, env.torpor_disable_multicast)) {
    const std::string torpor = named(id::disable_multicast, env.torpor_disable_multicast);
    if (!user_set)
      return {true, fmt::format("{} is set, so NCCL_NVLS_ENABLE=0 (NCCL creates no multicast object)", torpor)};
    if (*env.nccl_nvls_enable == "0") return {};
    return {true, fmt::format("{} overrides the user's NCCL_NVLS_ENABLE={}: NCCL_NVLS_ENABLE=0 (NCCL creates no "
                              "multicast object)",
                              torpor, *env.nccl_nvls_enable)};
  }
  if (user_set) return {};  // the user's own setting wins over a foreign kill switch
  const std::pair<id, const std::optional<std::string>*> foreign[] = {{id::torch_symm_mem_disable_multicast,
                                                                       &env.torch_symm_mem_disable_multicast},
                                                                      {id::nvshmem_disable_nvls,
                                                                       &env.nvshmem_disable_nvls}};
  for (const auto& [key, value] : foreign)
    if (switch_set(key, *value))
      return {true, fmt::format("{} is set and NCCL_NVLS_ENABLE is not, so NCCL_NVLS_ENABLE=0 (NCCL creates no "
                                "multicast object)",
                                named(key, *value))};
  return {};
}

NvlsEnvironment nvls_environment() {
  using options::id;
  return {options::raw(id::disable_multicast), options::raw(id::torch_symm_mem_disable_multicast),
          options::raw(id::nvshmem_disable_nvls), options::raw(id::nccl_nvls_enable)};
}

void apply_nccl_nvls_policy() {
  // NCCL reads NCCL_NVLS_ENABLE once per process; deciding once keeps every communicator of the
  // process under the same decision, and call_once is the lock around setenv.
  static std::once_flag once;
  std::call_once(once, [] {
    const NvlsAction action = nccl_nvls_policy(nvls_environment());
    if (!action.set_nvls_off) return;
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
    log::info("{}", action.why);
  });
}

#if defined(TORPOR_HAVE_CUDA) && defined(TORPOR_NCCL_HEADER)

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
  return a;
}

const NcclLibrary& nccl_library() {
  static const NcclLibrary library = load_nccl_library(options::nccl_library());
  return library;
}

#endif

}  // namespace torpor
