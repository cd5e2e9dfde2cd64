// SpillStore: the disk tier of the host store. With a host memory limit and a spill directory,
// the backups that do not fit in host memory live in one file of that directory per pool, moved
// between the device and the file through the pinned staging ring.
//
// The file: `torpor-spill-<pid>-<64 random bits>.bin`, created as `.tmp` with O_EXCL (mode
// 0600), locked with flock(LOCK_EX), then renamed to `.bin`, so a `.bin` file is always locked
// while its process lives (the lock goes with the process, however it ends). Creating a store
// first removes stale files of this user in the directory: a `.bin` whose lock can be taken (its
// process is gone) and a `.tmp` whose pid no longer exists. A live process's file is never
// removed. The destructor removes the store's own file, and so does a normal exit of the process
// (an exit handler) for a store never destroyed; the open descriptor keeps the bytes readable.
//
// A forked child inherits the store and the open file (one file description, one lock, shared
// with its parent): the file is the parent's. In the child the store reads but never writes,
// allocates, punches, truncates or removes, so a child that exits normally (destroying its copy
// of the pool) leaves the parent's saved bytes as they were; a sleep in the child that would
// spill is refused with invalid_state.
//
// I/O is direct (O_DIRECT) where the file system takes it, so spilled bytes do not also sit in
// the page cache; where it does not (tmpfs, some network file systems), one log line says so and
// buffered I/O is used. Direct I/O needs aligned offsets, lengths and buffers: extents and writes
// are multiples of `alignment` at aligned offsets; a read of any sub-range reads the aligned
// window around it (the staging ring's slots leave room for it).
//
// A full disk, a quota, a file-size limit (RLIMIT_FSIZE) or `limit` raise out_of_memory naming the
// file and the cause; space is claimed (fallocate) when an extent is allocated, so a full disk
// usually shows before any byte moves. SIGXFSZ is blocked in the writing thread around a write and
// the one the write raised is taken off, so a file-size limit never ends the process.
// fallocate, pwrite and pread go through wrappers that a test can make fail with a chosen errno
// (torpor/testing/spill_faults.hpp), for a full disk where no small file system can be mounted.
// Not thread-safe: the pool locks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "common/range_allocator.hpp"

namespace torpor {

class SpillStore {
 public:
  static constexpr std::size_t alignment = 4096;
  static constexpr const char* file_prefix = "torpor-spill-";

  // Creates `dir` (one level, mode 0700) if missing. limit 0 = no limit but the disk's.
  // Throws invalid_argument when dir is unusable (not a directory, not writable, ...).
  // try_direct_io false: buffered I/O even where O_DIRECT would be taken.
  SpillStore(const std::string& dir, std::size_t limit, bool try_direct_io = true);
  ~SpillStore();
  SpillStore(const SpillStore&) = delete;
  SpillStore& operator=(const SpillStore&) = delete;

  // A file extent of `bytes` (a multiple of alignment) at an aligned offset. Throws out_of_memory
  // when the limit or the disk refuses it; nothing is held then.
  std::uint64_t allocate(std::size_t bytes);
  // An extent from allocate(), exactly. Its disk space goes back (hole punched, tail truncated).
  void free(std::uint64_t offset, std::size_t bytes) noexcept;
  // `bytes` (a multiple of alignment) from an aligned buffer to an aligned offset.
  void write(std::uint64_t offset, const std::byte* buffer, std::size_t bytes);
  // [offset, offset + bytes), any offset, to buffer[0, bytes). buffer is aligned and has room
  // for align_up(bytes, alignment) + alignment bytes.
  void read(std::uint64_t offset, std::byte* buffer, std::size_t bytes);

  const std::string& path() const noexcept { return path_; }
  const std::string& dir() const noexcept { return dir_; }
  bool direct_io() const noexcept { return direct_; }
  std::size_t held_bytes() const noexcept { return held_; }
  std::size_t limit() const noexcept { return limit_; }
  // Whether this process is not the one that created the file (a fork of it).
  bool forked() const noexcept;

  // Removes the stale spill files of this user in `dir` (see above). Returns how many.
  static std::size_t remove_stale(const std::string& dir);

 private:
  void open_file(bool try_direct_io);
  void disable_direct_io(int err) noexcept;
  [[noreturn]] void throw_write_error(int err, std::uint64_t offset, std::size_t bytes) const;
  void truncate_to_extents() noexcept;
  void refuse_in_fork(const char* operation) const;
  void register_live();
  void unlink_file() noexcept;
  static void unlink_at_exit() noexcept;
  std::string free_space_text() const;

  std::string dir_;
  std::string path_;
  std::size_t limit_;
  int fd_ = -1;
  long owner_ = 0;  // the pid that created the file
  bool unlinked_ = false;
  bool direct_ = false;
  bool can_fallocate_ = true;
  std::size_t held_ = 0;
  RangeAllocator space_;
  std::map<std::uint64_t, std::size_t> extents_;  // offset -> bytes
};

}  // namespace torpor
