// Spill faults: make the disk tier's file system calls fail with a chosen errno, for tests that
// need a full disk (ENOSPC) or a failing read (EIO) where no small file system can be mounted
// (CI that is not root). The real syscalls are what production runs; a selected failure is
// returned by the spill store's wrapper instead of calling the kernel, so the file is exactly
// what it would be after a real failure that wrote nothing.
//
//   SpillFaults::fail(SpillCall::fallocate, ENOSPC);        // every claim of disk space fails
//   SpillFaults::fail(SpillCall::pwrite, ENOSPC, 2);        // the 3rd write from now on fails, ...
//   SpillFaults::clear();
//
// Process-wide (the spill store has no handle a test could reach through a pool) and off unless
// a test selects it: no option, variable or C API entry can. unaligned_reads() counts the reads
// that started off the direct-I/O alignment (the window was read and the bytes moved into place),
// so a test can show that path ran.
//
// A test double: its header lives in allocator/testing/include (torpor::internal), never
// installed; the implementation is in the library beside the store.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

namespace torpor {

enum class SpillCall : int { fallocate, pwrite, pread, count_ };

class SpillFaults {
 public:
  // From the (skip + 1)-th call of `which` on, `count` calls fail with `err` (a positive errno).
  static void fail(SpillCall which, int err, std::size_t skip = 0,
                   std::size_t count = std::numeric_limits<std::size_t>::max());
  static void clear() noexcept;
  // Failures returned since the last clear(), all kinds together.
  static std::size_t failures() noexcept;
  // Calls of `which` made (failed ones included) since the process began.
  static std::uint64_t calls(SpillCall which) noexcept;
  // Reads of the spill file that started at an offset off the alignment, since the process began.
  static std::uint64_t unaligned_reads() noexcept;

  // For the spill store: 0 to make the call, else the errno to fail it with.
  static int take(SpillCall which) noexcept;
  static void count_unaligned_read() noexcept;
};

}  // namespace torpor
