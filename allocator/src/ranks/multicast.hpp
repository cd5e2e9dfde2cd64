// Every multicast (NVLS) decision torpor makes, in one place: the kill switches, one device's
// probe, the group's collective decision, and the policy that keeps NCCL's own NVLS under the
// same switches.
//
// The kill switches: TORPOR_DISABLE_MULTICAST=1, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
// NVSHMEM_DISABLE_NVLS=1, NCCL_NVLS_ENABLE=0 ("set" means what the options table says,
// common/options.hpp). They are read on every call (tests set them) and are honoured by the
// driver seam itself too: CudaDriver refuses cuMulticastCreate while one is set.
//
// One device (probe_multicast): multicast is usable only when the device reports
// CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, the driver library has every multicast entry point,
// and no kill switch is set. The switches are read first, so a disabled machine never even
// queries multicast state.
//
// The group (decide_multicast): each rank probes its own device; the verdicts are all-gathered
// through consensus (consensus.hpp: the one wire of every agreement) and ANDed, so every rank
// reaches the same answer. When the ranks are separate processes, every
// driver must also be able to share a multicast object across processes (HostDriver emulates
// multicast inside one driver instance only, so its thread ranks must share one HostDriver).
// When the answer is no, nothing multicast is ever called (not even the granularity query), and
// rank 0 logs one warning naming the cause and the rank it came from. A group of one rank does
// not use multicast either (logged at info: nothing is lost).
//
// NCCL (the NVLS policy). NCCL creates multicast objects of its own (NVLS) unless
// NCCL_NVLS_ENABLE=0, and reads that variable once per process, at its first communicator. So
// the policy is decided once, before the first communicator (apply_nccl_nvls_policy(), called by
// every NCCL user before any call that creates one), from these rules:
//   - TORPOR_DISABLE_MULTICAST set: NCCL_NVLS_ENABLE=0, overriding the user's own value (torpor
//     promised no multicast object);
//   - else a foreign kill switch (TORCH_SYMM_MEM_DISABLE_MULTICAST, NVSHMEM_DISABLE_NVLS) set and
//     NCCL_NVLS_ENABLE unset: NCCL_NVLS_ENABLE=0;
//   - else the user's NCCL_NVLS_ENABLE (or NCCL's default) stands.
// nccl_nvls_policy() is the pure decision, tested on the host without NCCL.
#pragma once

#include <optional>
#include <string>

#include "torpor/driver.hpp"
#include "torpor/group.hpp"
#include "torpor/symmetric.hpp"

namespace torpor {

// --- the kill switches and one device -----------------------------------------------------------

// "NAME=value" of the first kill switch that is set, or nothing.
std::optional<std::string> multicast_kill_switch();

struct MulticastProbe {
  bool usable = false;
  bool attribute = false;     // the device says it supports multicast
  bool entry_points = false;  // the driver library has the calls
  std::optional<std::string> kill_switch;
  std::string reason;  // why not usable ("" when usable)
};

MulticastProbe probe_multicast(Driver& driver, int device);

// --- the group ----------------------------------------------------------------------------------

// Collective: every rank of `group` calls it with its own driver and device.
MulticastDecision decide_multicast(Group& group, Driver& driver, int device);

// --- NCCL's NVLS ----------------------------------------------------------------------------------

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

}  // namespace torpor
