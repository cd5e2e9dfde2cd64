// SpillStore; the design note and invariants are in spill_store.hpp.
#include "pool/store/spill_store.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/core.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <string_view>

#include "torpor/error.hpp"
#include "torpor/log.hpp"
#include "torpor/testing/spill_faults.hpp"

namespace torpor {

namespace {

// Far beyond any disk: the extent allocator's offsets are file offsets.
constexpr std::size_t file_span = std::size_t{1} << 50;

std::string errno_text(int err) { return std::strerror(err); }

bool disk_full(int err) { return err == ENOSPC || err == EDQUOT || err == EFBIG; }

std::uint64_t random_tag() {
  std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// The pid in "torpor-spill-<pid>-<tag>.tmp", or -1.
long pid_of(std::string_view name) {
  name.remove_prefix(std::string_view(SpillStore::file_prefix).size());
  long pid = 0;
  std::size_t i = 0;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) pid = pid * 10 + (name[i] - '0');
  return i > 0 && i < name.size() && name[i] == '-' && pid > 0 ? pid : -1;
}

// Whether the file at `path` (not followed if a link) is a regular file of this user.
bool ours(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid();
}

void prepare_dir(const std::string& dir) {
  if (dir.empty()) throw invalid_argument("spill directory: empty path");
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw invalid_argument(fmt::format("spill directory {}: cannot create it: {}", dir, errno_text(errno)));
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw invalid_argument(fmt::format("spill directory {} is not a directory", dir));
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw invalid_argument(fmt::format("spill directory {} is not writable: {}", dir, errno_text(errno)));
}

// Test-selected failures (torpor/testing/spill_faults.hpp). `armed` keeps the production path to
// one relaxed load per call; the rest is under a mutex, taken only while a test has selected one.
struct FaultState {
  std::atomic<bool> armed{false};
  std::mutex mu;
  struct Rule {
    int err = 0;
    std::size_t skip = 0;
    std::size_t count = 0;
  };
  Rule rules[static_cast<int>(SpillCall::count_)];
  std::size_t failures = 0;
  std::atomic<std::uint64_t> calls[static_cast<int>(SpillCall::count_)] = {};
  std::atomic<std::uint64_t> unaligned_reads{0};
};

FaultState& fault_state() {
  static auto* s = new FaultState;  // never destroyed: exit handlers may still spill or read
  return *s;
}

// The three file system calls of the store, each failing instead when a test selected it.
int sys_fallocate(int fd, int mode, off_t off, off_t len) {
  if (int err = SpillFaults::take(SpillCall::fallocate)) {
    errno = err;
    return -1;
  }
  return ::fallocate(fd, mode, off, len);
}

ssize_t sys_pwrite(int fd, const void* buf, std::size_t n, off_t off) {
  if (int err = SpillFaults::take(SpillCall::pwrite)) {
    errno = err;
    return -1;
  }
  return ::pwrite(fd, buf, n, off);
}

ssize_t sys_pread(int fd, void* buf, std::size_t n, off_t off) {
  if (int err = SpillFaults::take(SpillCall::pread)) {
    errno = err;
    return -1;
  }
  return ::pread(fd, buf, n, off);
}

}  // namespace

void SpillFaults::fail(SpillCall which, int err, std::size_t skip, std::size_t count) {
  auto i = static_cast<int>(which);
  if (i < 0 || i >= static_cast<int>(SpillCall::count_) || err <= 0)
    throw invalid_argument(fmt::format("SpillFaults::fail: call {} or errno {} out of range", i, err));
  FaultState& s = fault_state();
  std::lock_guard lock(s.mu);
  s.rules[i] = {err, skip, count};
  s.armed.store(true);
}

void SpillFaults::clear() noexcept {
  FaultState& s = fault_state();
  std::lock_guard lock(s.mu);
  for (auto& r : s.rules) r = {};
  s.failures = 0;
  s.armed.store(false);
}

std::size_t SpillFaults::failures() noexcept {
  FaultState& s = fault_state();
  std::lock_guard lock(s.mu);
  return s.failures;
}

std::uint64_t SpillFaults::calls(SpillCall which) noexcept {
  auto i = static_cast<int>(which);
  return i >= 0 && i < static_cast<int>(SpillCall::count_) ? fault_state().calls[i].load() : 0;
}

std::uint64_t SpillFaults::unaligned_reads() noexcept { return fault_state().unaligned_reads.load(); }

void SpillFaults::count_unaligned_read() noexcept {
  fault_state().unaligned_reads.fetch_add(1, std::memory_order_relaxed);
}

int SpillFaults::take(SpillCall which) noexcept {
  FaultState& s = fault_state();
  s.calls[static_cast<int>(which)].fetch_add(1, std::memory_order_relaxed);
  if (!s.armed.load(std::memory_order_relaxed)) return 0;
  std::lock_guard lock(s.mu);
  FaultState::Rule& r = s.rules[static_cast<int>(which)];
  if (r.err == 0 || r.count == 0) return 0;
  if (r.skip > 0) {
    --r.skip;
    return 0;
  }
  --r.count;
  ++s.failures;
  return r.err;
}

namespace {

// While alive, SIGXFSZ is blocked in this thread, and one that a write past RLIMIT_FSIZE raised
// here is taken off again before the mask is restored: the write fails with EFBIG, which becomes
// out_of_memory, instead of the default action ending the process mid-sleep. A SIGXFSZ that was
// already pending stays pending.
class FileSizeSignalGuard {
 public:
  FileSizeSignalGuard() noexcept {
    ::sigemptyset(&only_);
    ::sigaddset(&only_, SIGXFSZ);
    blocked_ = ::pthread_sigmask(SIG_BLOCK, &only_, &old_) == 0;
    was_pending_ = pending();
  }
  ~FileSizeSignalGuard() {
    if (!blocked_) return;
    if (!was_pending_ && pending()) {
      timespec now{0, 0};
      ::sigtimedwait(&only_, nullptr, &now);
    }
    ::pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  FileSizeSignalGuard(const FileSizeSignalGuard&) = delete;
  FileSizeSignalGuard& operator=(const FileSizeSignalGuard&) = delete;

 private:
  static bool pending() noexcept {
    sigset_t p;
    return ::sigpending(&p) == 0 && ::sigismember(&p, SIGXFSZ) == 1;
  }
  sigset_t only_{};
  sigset_t old_{};
  bool blocked_ = false;
  bool was_pending_ = false;
};

// The stores of this process, so that a normal exit removes their files even where a pool is
// never destroyed (the one behind PyTorch's allocator lives until the process ends). Never
// destroyed itself: exit handlers and static destructors run in no order torpor controls.
struct LiveStores {
  std::mutex mu;
  std::set<SpillStore*> stores;
};

LiveStores& live_stores() {
  static auto* live = new LiveStores;
  return *live;
}

}  // namespace

void SpillStore::unlink_at_exit() noexcept {
  LiveStores& live = live_stores();
  std::lock_guard lock(live.mu);
  for (SpillStore* s : live.stores) s->unlink_file();
}

void SpillStore::unlink_file() noexcept {
  if (unlinked_ || forked() || fd_ < 0) return;
  // The open descriptor keeps the bytes readable until it closes: a wake after this still works.
  // Someone else may have removed the file already (a caller cleaning up its directory, as
  // torch_memory_saver's disk_backup example does before exit): it is gone, as wanted, and its
  // bytes stayed readable through the descriptor; that is no error. A different file that took
  // its name since is someone else's and stays.
  unlinked_ = true;
  struct stat mine {};
  struct stat there {};
  if (::fstat(fd_, &mine) != 0) return;
  if (::stat(path_.c_str(), &there) != 0) {
    if (errno == ENOENT)
      log::debug("spill: {} was already removed (by someone else); nothing was lost", path_);
    else
      log::error("spill: cannot check {} before removing it: {}; it stays", path_, errno_text(errno));
    return;
  }
  if (there.st_dev != mine.st_dev || there.st_ino != mine.st_ino) {
    log::warn("spill: {} is no longer this pool's spill file (another file took its name); left alone", path_);
    return;
  }
  if (::unlink(path_.c_str()) != 0 && errno != ENOENT)
    log::error("spill: removing {} failed: {}; remove it by hand (the next pool in {} removes it as stale)", path_,
               errno_text(errno), dir_);
}

void SpillStore::register_live() {
  static const bool registered = std::atexit([] { SpillStore::unlink_at_exit(); }) == 0;
  if (!registered) log::warn("spill: cannot register the exit handler; {} stays if the pool outlives main()", path_);
  LiveStores& live = live_stores();
  std::lock_guard lock(live.mu);
  live.stores.insert(this);
}

std::size_t SpillStore::remove_stale(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return 0;
  std::size_t removed = 0;
  while (dirent* e = ::readdir(d)) {
    std::string_view name(e->d_name);
    if (name.rfind(file_prefix, 0) != 0) continue;
    std::string path = dir + "/" + std::string(name);
    if (ends_with(name, ".bin")) {
      int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
      if (fd < 0) continue;
      struct stat st {};
      // The lock is free only once its process is gone (a live one holds it from creation on).
      if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid() &&
          ::flock(fd, LOCK_EX | LOCK_NB) == 0 && ::unlink(path.c_str()) == 0)
        ++removed;
      ::close(fd);
    } else if (ends_with(name, ".tmp")) {
      long pid = pid_of(name);
      if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH && ours(path) &&
          ::unlink(path.c_str()) == 0)
        ++removed;
    }
  }
  ::closedir(d);
  return removed;
}

SpillStore::SpillStore(const std::string& dir, std::size_t limit, bool try_direct_io)
    : dir_(dir), limit_(limit), space_(file_span) {
  prepare_dir(dir_);
  if (std::size_t n = remove_stale(dir_); n > 0)
    log::info("spill: removed {} stale file(s) of processes that are gone from {}", n, dir_);
  open_file(try_direct_io);
  register_live();
}

void SpillStore::open_file(bool try_direct_io) {
  std::string base = fmt::format("{}/{}{}-{:016x}", dir_, file_prefix, ::getpid(), random_tag());
  std::string tmp = base + ".tmp";
  fd_ = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd_ < 0) throw invalid_argument(fmt::format("spill: cannot create {}: {}", tmp, errno_text(errno)));
  path_ = base + ".bin";
  owner_ = ::getpid();
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0 || ::rename(tmp.c_str(), path_.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    ::close(fd_);
    fd_ = -1;
    throw invalid_argument(fmt::format("spill: cannot lock and name {}: {}", path_, errno_text(err)));
  }
  if (!try_direct_io) {
    log::info("spill: {}: buffered I/O (direct I/O not asked for)", path_);
    return;
  }
  int flags = ::fcntl(fd_, F_GETFL);
  direct_ = flags >= 0 && ::fcntl(fd_, F_SETFL, flags | O_DIRECT) == 0;
  if (direct_)
    log::info("spill: {}: direct I/O (O_DIRECT)", path_);
  else
    log::info("spill: {} does not take direct I/O (O_DIRECT: {}); buffered I/O, so the page cache may hold "
              "spilled bytes for a while",
              dir_, errno_text(errno));
}

bool SpillStore::forked() const noexcept { return ::getpid() != owner_; }

void SpillStore::refuse_in_fork(const char* operation) const {
  if (!forked()) return;
  throw invalid_state(fmt::format("spill: cannot {} in {}: the file belongs to process {}, and this process ({}) is a "
                                  "fork of it; create a new pool in the child to spill there",
                                  operation, path_, owner_, ::getpid()));
}

SpillStore::~SpillStore() {
  {
    LiveStores& live = live_stores();
    std::lock_guard lock(live.mu);
    live.stores.erase(this);
  }
  if (fd_ < 0) return;
  unlink_file();  // not in a fork: the parent's file, of which only this process's descriptor goes
  ::close(fd_);
}

std::string SpillStore::free_space_text() const {
  struct statvfs v {};
  if (::fstatvfs(fd_, &v) != 0) return "free space unknown";
  return fmt::format("{} bytes free on its file system", static_cast<std::uint64_t>(v.f_bavail) * v.f_frsize);
}

std::uint64_t SpillStore::allocate(std::size_t bytes) {
  refuse_in_fork("claim disk space");
  if (bytes == 0 || bytes % alignment != 0)
    throw error(fmt::format("internal: spill extent of {} bytes is not a multiple of {}", bytes, alignment));
  if (limit_ != 0 && held_ + bytes > limit_)
    throw out_of_memory(fmt::format("spill: {} more bytes in {} would pass the spill limit of {} bytes ({} held)",
                                    bytes, dir_, limit_, held_));
  auto off = space_.allocate(bytes, alignment);
  if (!off) throw out_of_memory(fmt::format("spill: no file offset left for {} bytes in {}", bytes, path_));
  if (can_fallocate_ &&
      sys_fallocate(fd_, FALLOC_FL_KEEP_SIZE, static_cast<off_t>(*off), static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    if (disk_full(err)) {
      space_.free(*off, bytes);
      throw out_of_memory(fmt::format("spill: claiming {} bytes of disk in {} failed: {} ({})", bytes, path_,
                                      errno_text(err), free_space_text()));
    }
    can_fallocate_ = false;  // not supported here: the writes will tell
    log::debug("spill: fallocate is not available in {} ({}); disk space is claimed by the writes", dir_,
               errno_text(err));
  }
  extents_[*off] = bytes;
  held_ += bytes;
  return *off;
}

void SpillStore::free(std::uint64_t offset, std::size_t bytes) noexcept {
  auto it = extents_.find(offset);
  if (it == extents_.end() || it->second != bytes) {
    log::error("spill: freeing an unknown extent [{}, +{}) of {}", offset, bytes, path_);
    return;
  }
  extents_.erase(it);
  held_ -= bytes;
  try {
    space_.free(offset, bytes);
  } catch (const std::exception& e) {
    log::error("spill: {}", e.what());
  }
  if (forked()) return;  // the space is the parent's to give back
  if (can_fallocate_)
    ::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset), static_cast<off_t>(bytes));
  truncate_to_extents();
}

void SpillStore::truncate_to_extents() noexcept {
  std::uint64_t end = extents_.empty() ? 0 : extents_.rbegin()->first + extents_.rbegin()->second;
  struct stat st {};
  if (::fstat(fd_, &st) == 0 && static_cast<std::uint64_t>(st.st_size) > end &&
      ::ftruncate(fd_, static_cast<off_t>(end)) != 0)
    log::warn("spill: truncating {} failed: {}", path_, errno_text(errno));
}

void SpillStore::disable_direct_io(int err) noexcept {
  int flags = ::fcntl(fd_, F_GETFL);
  if (flags >= 0) ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT);
  direct_ = false;
  log::warn("spill: {} refused a direct write ({}); buffered I/O from now on", path_, errno_text(err));
}

void SpillStore::throw_write_error(int err, std::uint64_t offset, std::size_t bytes) const {
  std::string what =
      fmt::format("spill: writing {} bytes at offset {} of {} failed: {}", bytes, offset, path_, errno_text(err));
  if (disk_full(err))
    throw out_of_memory(fmt::format("{} ({}{}); the bytes stay in device memory", what, free_space_text(),
                                    err == EFBIG ? ", or the file-size limit RLIMIT_FSIZE" : ""));
  throw error(what);
}

void SpillStore::write(std::uint64_t offset, const std::byte* buffer, std::size_t bytes) {
  refuse_in_fork("write spilled bytes");
  FileSizeSignalGuard no_sigxfsz;
  std::size_t done = 0;
  while (done < bytes) {
    ssize_t n = sys_pwrite(fd_, buffer + done, bytes - done, static_cast<off_t>(offset + done));
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    int err = n == 0 ? ENOSPC : errno;
    if (err == EINTR) continue;
    if (err == EINVAL && direct_) {
      disable_direct_io(err);
      continue;
    }
    throw_write_error(err, offset + done, bytes - done);
  }
}

void SpillStore::read(std::uint64_t offset, std::byte* buffer, std::size_t bytes) {
  std::uint64_t lo = offset / alignment * alignment;
  std::uint64_t hi = align_up(offset + bytes, alignment);
  std::size_t want = static_cast<std::size_t>(hi - lo);
  std::size_t done = 0;
  while (done < want) {
    ssize_t n = sys_pread(fd_, buffer + done, want - done, static_cast<off_t>(lo + done));
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    int err = n == 0 ? 0 : errno;
    if (err == EINTR) continue;
    if (err == EINVAL && direct_) {
      disable_direct_io(err);
      continue;
    }
    // The window was written whole (writes are whole extents' aligned pieces): a short read is
    // a file that changed under us.
    if (done >= offset - lo + bytes) break;
    throw error(fmt::format("spill: reading {} bytes at offset {} of {} failed: {}", want - done, lo + done, path_,
                            n == 0 ? std::string("unexpected end of file") : errno_text(err)));
  }
  if (offset != lo) {
    std::memmove(buffer, buffer + (offset - lo), bytes);
    SpillFaults::count_unaligned_read();
  }
}

}  // namespace torpor
