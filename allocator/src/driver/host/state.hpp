// HostDriver's internal state, shared by the files of driver/host/ (torpor/host_driver.hpp
// declares HostDriver with its maps of reservations, mappings and handles; this header completes
// the objects they hold): the physical memory behind a handle (Memory: one sealed memfd), a
// multicast object (Multicast: membership and bindings), the live physical bytes per device
// (Counters), and what every file raises misuse with.
//
// Invariants (all under mu_):
//   - every Mapping lies inside one reservation and no two mappings overlap;
//   - a Memory object is alive while a handle entry or a mapping holds it; its destructor
//     closes the memfd and takes its bytes off the owning device's live count;
//   - a reservation can only be freed when nothing is mapped inside it;
//   - a range checked accessible stays mapped until the copy (fill, hash) that checked it is
//     done: those hold mapping_mu_ shared across check and touch (synchronous mode) or
//     register the range as in flight until a worker did it (asynchronous mode); unmap holds
//     mapping_mu_ exclusively and refuses a range still in flight;
//   - every memfd it creates has its size sealed (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
//     and import takes only such memfds: a peer can never truncate memory another process maps.
#pragma once

#include <fcntl.h>
#include <fmt/core.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "torpor/error.hpp"
#include "torpor/host_driver.hpp"

namespace torpor {

namespace host {

inline constexpr int k_invalid = static_cast<int>(driver_status::invalid_value);
inline constexpr int k_oom = static_cast<int>(driver_status::out_of_memory);

// The name every physical memfd gets; import checks it (with the seals) to know torpor's memory.
inline constexpr std::string_view memfd_name = "torpor-physical";
inline constexpr int size_seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

// A call the emulated driver refuses, as CUDA answers misuse: driver_error, invalid_value.
[[noreturn]] inline void misuse(const char* call, const std::string& what) {
  throw_driver_error(k_invalid, call, what);
}

inline std::string errno_text(const char* what) { return fmt::format("{}: {}", what, std::strerror(errno)); }

// A hash of the bytes [lo, hi): what a page-locked host span held when a copy was queued
// (streams.cpp), compared when it runs (in_flight.cpp).
inline std::size_t fingerprint_of(std::uintptr_t lo, std::uintptr_t hi) {
  return std::hash<std::string_view>{}(std::string_view(reinterpret_cast<const char*>(lo), hi - lo));
}

}  // namespace host

struct HostDriver::Counters {
  explicit Counters(int devices) : live(static_cast<std::size_t>(devices)) {}
  std::vector<std::atomic<std::size_t>> live;  // live physical bytes per device
};

struct HostDriver::Memory {
  int fd = -1;
  std::size_t bytes = 0;
  int device = -1;  // owning device in this driver; -1 when imported from another process
  bool exportable = false;
  bool gpu_direct_rdma = false;  // created exportable on a device with gpu_direct_rdma_vmm
  dev_t st_dev = 0;
  ino_t st_ino = 0;
  std::shared_ptr<Counters> counters;
  Memory() = default;
  Memory(const Memory&) = delete;
  Memory& operator=(const Memory&) = delete;
  ~Memory() {
    if (fd >= 0) ::close(fd);
    if (device >= 0 && counters) counters->live[static_cast<std::size_t>(device)] -= bytes;
  }
};

struct HostDriver::Multicast {
  Multicast() = default;
  Multicast(const Multicast&) = delete;
  Multicast& operator=(const Multicast&) = delete;
  ~Multicast() {
    if (token_fd >= 0) ::close(token_fd);
  }
  // The exported name of the object (a memfd whose inode identifies it), made on first export.
  int token_fd = -1;
  dev_t st_dev = 0;
  ino_t st_ino = 0;
  std::size_t bytes = 0;
  std::vector<int> devices;  // the devices named at creation
  std::set<int> added;
  struct Binding {
    std::shared_ptr<Memory> memory;
    std::size_t memory_offset = 0;
    std::size_t mc_offset = 0;
    std::size_t bytes = 0;
  };
  std::map<int, std::vector<Binding>> bindings;  // device -> bindings
};

}  // namespace torpor
