// HostDriver's fabric handles: the 64 bytes of a CUmemFabricHandle, emulated as (exporting pid,
// its memfd's number, the memfd's inode, size, emulated node). The importer takes the descriptor
// with pidfd_open + pidfd_getfd (same user, ptrace permission) and checks the inode, so no
// descriptor travels and any byte transport (TCP) carries the handle.
//
// HostDriverOptions::fabric (TORPOR_HOST_FABRIC) injects the IMEX failure modes with the error
// codes a real driver gives: no fabric support, no IMEX channel, an import not permitted. The
// probe answers from that setting alone. node_name tells emulated nodes apart, so ranks of
// different nodes must use fabric handles instead of descriptors.
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "driver/host/state.hpp"

namespace torpor {

using host::k_invalid;
using host::misuse;

namespace {

// The emulated CUmemFabricHandle. Native integers: both ends run on one machine.
constexpr std::array<char, 8> fabric_magic = {'T', 'R', 'P', 'F', 'A', 'B', '0', '1'};
struct FabricBlob {
  std::array<char, 8> magic;
  std::int32_t pid;
  std::int32_t fd;
  std::uint64_t st_dev;
  std::uint64_t st_ino;
  std::uint64_t bytes;
  std::int32_t node;
};
static_assert(sizeof(FabricBlob) <= fabric_handle_bytes);

constexpr int k_not_permitted = static_cast<int>(driver_status::not_permitted);

// A descriptor closed at scope exit (the driver layer does not use the group's UniqueFd).
struct ScopedFd {
  int fd = -1;
  explicit ScopedFd(int f) : fd(f) {}
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() {
    if (fd >= 0) ::close(fd);
  }
};

const char* no_channel_words = "no IMEX channel (emulated by TORPOR_HOST_FABRIC=no-channel): "
                               "/dev/nvidia-caps-imex-channels/channel0 is missing on this node";

}  // namespace

FabricHandle HostDriver::export_fabric(PhysicalHandle handle) {
  const char* call = "cuMemExportToShareableHandle(fabric)";
  if (options_.fabric == HostDriverOptions::Fabric::off)
    throw_driver_error(static_cast<int>(driver_status::not_supported), call,
                       "the emulated devices have no fabric handle support (TORPOR_HOST_FABRIC=off)");
  if (options_.fabric == HostDriverOptions::Fabric::no_channel)
    throw_driver_error(k_not_permitted, call, no_channel_words);
  std::lock_guard lock(mu_);
  const HandleEntry& e = entry(handle, call);
  if (!e.memory) misuse(call, "multicast objects are not shared as fabric handles by the host backend");
  if (!e.memory->exportable) misuse(call, "handle was not created exportable");
  FabricBlob b{};
  b.magic = fabric_magic;
  b.pid = static_cast<std::int32_t>(::getpid());
  b.fd = e.memory->fd;  // open while the handle lives, as a fabric export is valid while its handle is
  b.st_dev = static_cast<std::uint64_t>(e.memory->st_dev);
  b.st_ino = static_cast<std::uint64_t>(e.memory->st_ino);
  b.bytes = e.memory->bytes;
  b.node = options_.node;
  FabricHandle out;
  std::memcpy(out.bytes.data(), &b, sizeof b);
  return out;
}

PhysicalHandle HostDriver::import_fabric(const FabricHandle& handle, std::size_t bytes) {
  const char* call = "cuMemImportFromShareableHandle(fabric)";
  if (options_.fabric == HostDriverOptions::Fabric::off)
    throw_driver_error(static_cast<int>(driver_status::not_supported), call,
                       "the emulated devices have no fabric handle support (TORPOR_HOST_FABRIC=off)");
  if (options_.fabric == HostDriverOptions::Fabric::no_channel)
    throw_driver_error(k_not_permitted, call, no_channel_words);
  if (options_.fabric == HostDriverOptions::Fabric::import_refused)
    throw_driver_error(k_not_permitted, call,
                       "the import was not permitted (emulated by TORPOR_HOST_FABRIC=import-refused): this "
                       "process has no access to the IMEX channel the exporter's memory belongs to");
  FabricBlob b{};
  std::memcpy(&b, handle.bytes.data(), sizeof b);
  if (b.magic != fabric_magic || b.pid <= 0 || b.fd < 0)
    misuse(call, "the 64 bytes are not a fabric handle exported by the host backend");
  ScopedFd taken(-1);
  if (b.pid == ::getpid()) {
    taken.fd = ::fcntl(b.fd, F_DUPFD_CLOEXEC, 0);
    if (taken.fd < 0)
      misuse(call, fmt::format("descriptor {} of this process is not open: the exporter released the memory the "
                               "handle names",
                               b.fd));
  } else {
    ScopedFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, b.pid, 0)));
    if (pidfd.fd < 0)
      throw_driver_error(k_invalid, call,
                         fmt::format("the exporting process {} (node {}) is gone: {}", b.pid, b.node,
                                     std::strerror(errno)));
    taken.fd = static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd.fd, b.fd, 0));
    if (taken.fd < 0) {
      const int err = errno;
      if (err == EPERM)
        throw_driver_error(k_not_permitted, call,
                           fmt::format("pidfd_getfd of process {} was not permitted: the host backend's fabric "
                                       "emulation needs ptrace access to the exporter (same user; "
                                       "kernel.yama.ptrace_scope 0, or run the ranks under one parent)",
                                       b.pid));
      if (err == EBADF)
        throw_driver_error(k_invalid, call,
                           fmt::format("descriptor {} of process {} is not open: the exporter released the memory "
                                       "the handle names",
                                       b.fd, b.pid));
      throw_driver_error(k_invalid, call,
                         fmt::format("pidfd_getfd of descriptor {} of process {} failed: {}", b.fd, b.pid,
                                     std::strerror(err)));
    }
  }
  struct stat st {};
  if (::fstat(taken.fd, &st) != 0 || static_cast<std::uint64_t>(st.st_dev) != b.st_dev ||
      static_cast<std::uint64_t>(st.st_ino) != b.st_ino)
    throw_driver_error(k_invalid, call,
                       fmt::format("descriptor {} of process {} is no longer the memory the handle names (the "
                                   "exporter released it)",
                                   b.fd, b.pid));
  if (b.bytes != bytes)
    misuse(call, fmt::format("the fabric handle names {} bytes; its exporter announced {}", b.bytes, bytes));
  return import_checked(taken.fd, bytes);
}

FabricProbe HostDriver::probe_fabric(int device) {
  check_device(device, "probe_fabric");
  FabricProbe p;
  switch (options_.fabric) {
    case HostDriverOptions::Fabric::on:
    case HostDriverOptions::Fabric::import_refused:
      p.cause = FabricProbe::Cause::supported;
      p.call = "cuMemExportToShareableHandle";
      p.detail = fmt::format("the host backend's emulated fabric on node {}", options_.node);
      break;
    case HostDriverOptions::Fabric::off:
      p.cause = FabricProbe::Cause::device_without_fabric;
      p.call = "cuDeviceGetAttribute";
      p.detail = "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0 (TORPOR_HOST_FABRIC=off)";
      break;
    case HostDriverOptions::Fabric::no_channel:
      p.cause = FabricProbe::Cause::no_imex_channel;
      p.code = k_not_permitted;
      p.call = "cuMemExportToShareableHandle";
      p.detail = fmt::format("CUDA_ERROR_NOT_PERMITTED ({}): {}", k_not_permitted, no_channel_words);
      break;
  }
  return p;
}

std::string HostDriver::node_name() { return fmt::format("{}/host-node-{}", Driver::node_name(), options_.node); }

}  // namespace torpor
