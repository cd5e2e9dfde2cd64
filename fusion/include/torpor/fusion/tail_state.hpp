// Where a fused tail keeps its state, for tests, tools and anyone who wants to look at it (not for
// the hot path). The bytes follow kernels/include/torpor/kernels/tail_protocol.hpp (TailControl;
// the slots' layout, tail_slot_offset).
#pragma once

#include <cstddef>
#include <optional>

#include "torpor/fusion/tail.hpp"

namespace torpor {
class SymmetricBuffer;
}

namespace torpor::fusion {

struct TailState {
  void* control = nullptr;  // device memory of this rank (CPU memory on the host backend)
  std::size_t control_bytes = 0;
  SymmetricBuffer* slots = nullptr;  // slots->local(): this rank's part; slots->peer_table(): the table
  std::size_t slot_bytes = 0;        // bytes of the part the protocol uses
  int capacity_blocks = 0;           // GPU: the fused grid's bound at one block per row (0 on the host backend)
  int blocks_per_row_few_rows = 0;   // GPU: blocks sharing a row in calls of <= kernels::tail_cluster_max_rows rows
  int blocks_per_row_many_rows = 0;  // GPU: ... in larger calls (TailOptions::blocks_per_row resolved)
};

// The fused tail's state; nothing for the unfused path.
std::optional<TailState> tail_state(const Tail& tail);

}  // namespace torpor::fusion
