// HostDriver's sharing between processes by POSIX descriptor: an export is a dup of the
// handle's memfd (passable with SCM_RIGHTS), an import takes only a size-sealed memfd named
// torpor-physical, so a peer can never hand over memory that could shrink under a mapping.
//
// Memory exported by this same driver (ranks that are threads) is imported as the same Memory
// object, so the accounting sees one piece of memory kept alive by two handles. The import of
// a fabric handle (fabric.cpp) ends here too, once it holds the exporter's descriptor.
#include <sys/stat.h>
#include <unistd.h>

#include <optional>

#include "driver/host/state.hpp"

namespace torpor {

using host::errno_text;
using host::k_oom;
using host::memfd_name;
using host::misuse;
using host::size_seals;

int HostDriver::export_fd(PhysicalHandle handle) {
  const char* call = "cuMemExportToShareableHandle";
  std::lock_guard lock(mu_);
  const HandleEntry& e = entry(handle, call);
  if (!e.memory) misuse(call, "multicast objects are exported by the multicast layer, not as fds here");
  if (!e.memory->exportable) misuse(call, "handle was not created exportable");
  int fd = ::fcntl(e.memory->fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) throw_driver_error(k_oom, call, errno_text("dup"));
  return fd;
}

PhysicalHandle HostDriver::import_fd(int fd) { return import_checked(fd, std::nullopt); }

PhysicalHandle HostDriver::import_fd_of_size(int fd, std::size_t bytes) { return import_checked(fd, bytes); }

namespace {

// What /proc says the descriptor is ("/memfd:torpor-physical (deleted)", "pipe:[123]", a path).
std::string describe_fd(int fd) {
  char buf[256] = {};
  ssize_t n = ::readlink(fmt::format("/proc/self/fd/{}", fd).c_str(), buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string("?");
}

}  // namespace

PhysicalHandle HostDriver::import_checked(int fd, std::optional<std::size_t> announced) {
  const char* call = "cuMemImportFromShareableHandle";
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) misuse(call, fmt::format("fd {} is not open", fd));
  const std::string what = describe_fd(fd);
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (!S_ISREG(st.st_mode) || !what.starts_with(fmt::format("/memfd:{}", memfd_name)) || seals < 0 ||
      (seals & size_seals) != size_seals)
    misuse(call, fmt::format("fd {} ({}) is not physical memory exported by torpor: only a size-sealed memfd named "
                             "{} is imported",
                             fd, what, memfd_name));
  if (st.st_size <= 0 || static_cast<std::size_t>(st.st_size) % options_.granularity != 0)
    misuse(call, fmt::format("fd {} is not exported physical memory (size {})", fd, st.st_size));
  if (announced && static_cast<std::size_t>(st.st_size) != *announced)
    misuse(call, fmt::format("fd {} holds {} bytes; its exporter announced {}", fd, st.st_size, *announced));
  std::lock_guard lock(mu_);
  // Memory exported by this same driver (ranks that are threads): share the object, so the
  // accounting sees one piece of memory kept alive by two handles.
  std::shared_ptr<Memory> mem;
  for (auto& [id, e] : handles_)
    if (e.memory && e.memory->st_dev == st.st_dev && e.memory->st_ino == st.st_ino) mem = e.memory;
  for (auto& [va, m] : mappings_)
    if (!mem && m.memory && m.memory->st_dev == st.st_dev && m.memory->st_ino == st.st_ino) mem = m.memory;
  if (!mem) {
    mem = std::make_shared<Memory>();
    mem->fd = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (mem->fd < 0) throw_driver_error(k_oom, call, errno_text("dup"));
    mem->bytes = static_cast<std::size_t>(st.st_size);
    mem->exportable = true;
    mem->st_dev = st.st_dev;
    mem->st_ino = st.st_ino;
  }
  std::uint64_t id = next_id_++;
  handles_[id] = HandleEntry{mem, nullptr};
  return PhysicalHandle{id};
}

}  // namespace torpor
