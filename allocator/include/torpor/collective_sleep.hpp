// Collective sleep and wake of one pool per rank over any Group (threads, Unix, NCCL, or an
// engine's own process group through CallbackGroup), so a tensor-parallel engine never ends
// with some ranks asleep and others awake.
//
// collective_sleep(pool, group, level, tags), called on every rank:
//   1. agree: every rank all-gathers its request (level and tags, order and duplicates
//      ignored); if any rank asked for something else, every rank throws invalid_argument
//      naming the ranks that differ from rank 0, and no rank sleeps;
//   2. each rank sleeps its own pool;
//   3. every rank all-gathers its outcome. If any rank failed, every rank wakes back up the
//      tags that were awake before the call (the failed rank too: a failed sleep can leave
//      some chunks asleep), so the group is never half asleep, and then every rank throws
//      the failed rank's error type with a message naming each failed rank and its message.
//      At level 2 the rollback wake restores what level 2 keeps; bytes level 2 discards are
//      gone on every rank either way (that is what the level means).
// collective_wake_up(pool, group, tags): the same agreement, each rank wakes, outcomes are
// all-gathered. If any rank failed, the ranks that woke STAY AWAKE and every rank throws,
// naming the ranks still asleep and their messages. Why not put the woken ranks back to
// sleep: that costs a full offload, cannot help the failed rank, and a wake is idempotent,
// so calling collective_wake_up again on every rank once the cause is gone (memory freed)
// completes it, the woken ranks having nothing left to do.
// A group failure (timeout, a broken group) propagates as the group's own error type; see
// group.hpp for recovery. When it strikes the outcome exchange of a sleep, no rank can learn the
// others' outcome: each rank wakes back up what it put to sleep before raising, and the message
// says so (and, for a wake, whether this rank is awake). Returns this rank's report.
#pragma once

#include <string>
#include <vector>

#include "torpor/group.hpp"
#include "torpor/pool.hpp"

namespace torpor {

TransitionReport collective_sleep(Pool& pool, Group& group, int level, const std::vector<std::string>& tags = {});
TransitionReport collective_wake_up(Pool& pool, Group& group, const std::vector<std::string>& tags = {});

}  // namespace torpor
