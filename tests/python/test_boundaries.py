"""Values at the edge between Python and the C API (issue 33, items 7 and 8): numbers that a
ctypes conversion would wrap, truncate or read as a default, bool and float where a whole number
is meant, strings the C API would cut at a NUL, and tags that collide with torpor's own naming.
Each is refused with a typed torpor error naming the argument, before anything changes; the
oracle is the pool's own statistics and report after the refusal."""

import pytest

import torpor
from conftest import MiB
from torpor import distributed as tdist
from torpor.values import SleepLevel

# torpor.h: rank in [0, size), size in [1, 65536], timeout_ms in [0, 86400000].
GROUP_SIZE_MAX = 65536
GROUP_TIMEOUT_MS_MAX = 86400000


def solo(rank=0, size=1, **kw):
    """A group whose collectives are this process alone (every rank's bytes are ours)."""
    return tdist.Group(rank, size, lambda data: [data] * size, lambda: None, **kw)


# -- torpor.distributed --------------------------------------------------------------------


@pytest.mark.parametrize("level", [2**40, 2**32 + 1, 1.9, True, False, "1", -1, 3, None])
def test_collective_sleep_refuses_levels_that_are_not_0_1_or_2(pool, level):
    pool.alloc(MiB, "w")
    with solo() as group:
        with pytest.raises(torpor.InvalidArgument, match="level"):
            tdist.sleep(pool, level=level, group=group)
    assert not pool.stats()["tags"]["w"]["asleep"], "nothing slept"


@pytest.mark.parametrize("level", [0, 1, 2, SleepLevel.OFFLOAD])
def test_collective_sleep_takes_each_documented_level(pool, level):
    pool.alloc(MiB, "w")
    with solo() as group:
        report = tdist.sleep(pool, level=level, group=group)
        assert report["level"] == int(level)
        tdist.wake_up(pool, group=group)


@pytest.mark.parametrize("timeout_ms", [2**40, 2**31, GROUP_TIMEOUT_MS_MAX + 1, -1, 1.5, True, "10"])
def test_group_refuses_timeouts_outside_the_documented_range(timeout_ms):
    with pytest.raises(torpor.InvalidArgument, match="timeout_ms"):
        solo(timeout_ms=timeout_ms)


@pytest.mark.parametrize("timeout_ms", [0, 1, GROUP_TIMEOUT_MS_MAX])
def test_group_takes_timeouts_inside_the_documented_range(timeout_ms):
    with solo(timeout_ms=timeout_ms) as group:
        assert (group.rank, group.size) == (0, 1)


@pytest.mark.parametrize(
    "rank, size, named",
    [
        (True, 2, "rank"),
        (0.9, 1, "rank"),
        ("0", 1, "rank"),
        (-1, 1, "rank"),
        (1, 1, "rank"),
        (2**32, 1, "rank"),
        (0, True, "size"),
        (0, 1.0, "size"),
        (0, 0, "size"),
        (0, GROUP_SIZE_MAX + 1, "size"),
        (0, 2**32 + 1, "size"),
    ],
)
def test_group_refuses_ranks_and_sizes_that_are_not_whole_and_in_range(rank, size, named):
    with pytest.raises(torpor.InvalidArgument, match=named):
        tdist.Group(rank, size, lambda data: [data], lambda: None)


def test_group_refuses_collectives_that_cannot_be_called():
    with pytest.raises(torpor.InvalidArgument, match="all_gather"):
        tdist.Group(0, 1, None, lambda: None)
    with pytest.raises(torpor.InvalidArgument, match="barrier"):
        tdist.Group(0, 1, lambda data: [data], "barrier")
