"""Values at the edge between Python and the C API (issue 33, items 7 and 8): numbers that a
ctypes conversion would wrap, truncate or read as a default, bool and float where a whole number
is meant, strings the C API would cut at a NUL, and tags that collide with torpor's own naming.
Each is refused with a typed torpor error naming the argument, before anything changes; the
oracle is the pool's own statistics and report after the refusal."""

import os
import pathlib

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


# -- torpor.Pool: sizes and addresses --------------------------------------------------------

WRAPS = [2**64 + 8, 2**64, -1, 1.5, True, "8", None]


def classes(pool, tag="w"):
    return {c: v["allocated_bytes"] for c, v in pool.stats()["tags"][tag]["classes"].items()}


@pytest.mark.parametrize("nbytes", WRAPS)
def test_mark_ranges_refuses_sizes_a_size_t_cannot_hold(pool, nbytes):
    p = pool.alloc(MiB, "w", "state")
    with pytest.raises(torpor.InvalidArgument, match="range 1"):
        pool.mark_ranges([(p, 4096, "parameter"), (p, nbytes, "parameter")])
    assert classes(pool) == {"cache": 0, "parameter": 0, "state": MiB}, "nothing was marked"


@pytest.mark.parametrize("ptr", WRAPS)
def test_mark_ranges_refuses_addresses_a_pointer_cannot_hold(pool, ptr):
    p = pool.alloc(MiB, "w", "state")
    if isinstance(ptr, int) and not isinstance(ptr, bool) and ptr >= 2**64:
        ptr += p  # would wrap to p itself
    with pytest.raises(torpor.InvalidArgument, match="range 0"):
        pool.mark_ranges([(ptr, 8, "parameter")])
    assert classes(pool) == {"cache": 0, "parameter": 0, "state": MiB}, "nothing was marked"


@pytest.mark.parametrize("bad", [5, None, (1, 2), "ab"])
def test_mark_ranges_refuses_what_is_not_a_list_of_ranges(pool, bad):
    pool.alloc(MiB, "w", "state")
    with pytest.raises(torpor.InvalidArgument, match="mark_ranges"):
        pool.mark_ranges(bad if bad is None or isinstance(bad, int) else [bad])
    assert classes(pool)["state"] == MiB


@pytest.mark.parametrize("name", [5, b"w", "w\0x", "w\ud800"])
def test_mark_ranges_refuses_names_the_c_api_cannot_carry(pool, name):
    p = pool.alloc(MiB, "w", "state")
    with pytest.raises(torpor.InvalidArgument, match="name"):
        pool.mark_ranges([(p, MiB, "parameter", "ok"), (p, 8, "parameter", name)])
    assert classes(pool)["state"] == MiB, "nothing was marked"


def test_mark_ranges_still_marks_valid_ranges(pool):
    p = pool.alloc(MiB, "w", "state")
    pool.mark_ranges([(p, 4096, "parameter", "a"), (p + 4096, 4096, torpor.MemoryClass.CACHE)])
    assert classes(pool) == {"cache": 4096, "parameter": 4096, "state": MiB - 8192}


@pytest.mark.parametrize("ptr", [2**64, 2**64 + 1, -1, 1.5, True, "x", None])
def test_pointer_arguments_are_range_checked_before_the_c_api(pool, ptr):
    p = pool.alloc(MiB, "w")
    wrapped = ptr + p if isinstance(ptr, int) and not isinstance(ptr, bool) and ptr >= 2**64 else ptr
    with pytest.raises(torpor.InvalidArgument, match="ptr"):
        pool.free(wrapped)
    with pytest.raises(torpor.InvalidArgument, match="ptr"):
        pool.find(wrapped)
    with pytest.raises(torpor.InvalidArgument, match="ptr"):
        pool.contains(wrapped)
    with pytest.raises(torpor.InvalidArgument, match="ptr"):
        pool.write(wrapped, b"x")
    with pytest.raises(torpor.InvalidArgument, match="ptr"):
        pool.read(wrapped, 1)
    assert pool.find(p) == (p, MiB), "the allocation is still there"


@pytest.mark.parametrize("hook_id", [2**64 + 1, -1, 1.5, True, "1", None])
def test_remove_sleep_hook_refuses_ids_a_c_integer_cannot_hold(pool, hook_id):
    calls = []
    pool.add_sleep_hook(lambda level, tags: calls.append(tags))
    with pytest.raises(torpor.InvalidArgument, match="hook_id"):
        pool.remove_sleep_hook(hook_id)
    pool.alloc(MiB, "w")
    pool.sleep(1)
    assert calls == [["w"]], "the hook is still installed"


@pytest.mark.parametrize("device", [2**32, 2**40, -1, 1.5, True, "0"])
def test_torch_pool_refuses_devices_a_c_int_cannot_hold(device):
    with pytest.raises(torpor.InvalidArgument, match="device"):
        torpor.Pool.torch(device)


@pytest.mark.parametrize("data", ["text", 5, None, [1, 2]])
def test_write_refuses_data_that_is_not_bytes(pool, data):
    p = pool.alloc(MiB, "w")
    pool.write(p, b"\x01" * 8)
    with pytest.raises(torpor.InvalidArgument, match="write: data"):
        pool.write(p, data)
    assert pool.read(p, 8) == b"\x01" * 8


@pytest.mark.parametrize("call", ["sleep", "wake_up", "set_preserve"])
def test_lists_of_tags_or_globs_that_are_not_iterable_are_typed_errors(pool, call):
    pool.alloc(MiB, "w")
    args = {"sleep": (1, 5), "wake_up": (5,), "set_preserve": (5,)}[call]
    with pytest.raises(torpor.InvalidArgument, match="not iterable"):
        getattr(pool, call)(*args)
    assert not pool.stats()["tags"]["w"]["asleep"]


# -- spill_dir and pool options -----------------------------------------------------------


def spill_pool(spill_dir):
    return torpor.Pool(0, backend="host", va_bytes=1 << 30, host_store_limit=1, spill_dir=spill_dir)


@pytest.mark.parametrize("cut", ["a\0b", "a\0"])
def test_spill_dir_with_a_nul_is_refused_not_cut(tmp_path, cut):
    (tmp_path / "a").mkdir()
    with pytest.raises(torpor.InvalidArgument, match="spill_dir.*NUL"):
        spill_pool(str(tmp_path / cut))
    with pytest.raises(torpor.InvalidArgument, match="spill_dir.*NUL"):
        spill_pool(str(tmp_path / cut).encode())


def test_spill_dir_that_is_not_utf8_is_refused_at_construction(tmp_path):
    raw = os.fsencode(tmp_path) + b"/d\xff"
    os.mkdir(raw)
    for spill_dir in (raw, os.fsdecode(raw), pathlib.Path(os.fsdecode(raw))):
        with pytest.raises(torpor.InvalidArgument, match="spill_dir.*UTF-8"):
            spill_pool(spill_dir)


def test_spill_dir_that_is_utf8_spills_and_reports_its_path(tmp_path):
    d = tmp_path / "spill ünïcode"
    d.mkdir()
    for spill_dir in (d, str(d), os.fsencode(d)):
        with spill_pool(spill_dir) as p:
            p.write(p.alloc(MiB, "w"), b"\x07" * MiB)
            p.sleep(1)
            stats = p.stats()
            assert stats["spill_used_bytes"] > 0, "the backup went to disk"
            assert stats["spill_path"].startswith(str(d))
            p.wake_up()


@pytest.mark.parametrize(
    "options, named",
    [
        (dict(spill_dir=5), "spill_dir"),
        (dict(fill_on_wake=[]), "fill_on_wake"),
        (dict(backend=None), "backend"),
        (dict(backend=["host"]), "backend"),
    ],
)
def test_pool_options_of_the_wrong_type_are_typed_errors(options, named):
    with pytest.raises(torpor.InvalidArgument, match=named):
        torpor.Pool(0, **{"backend": "host", "va_bytes": 1 << 30, **options})


# -- wrong types: a typed error that is still a TypeError ------------------------------------


def wrong_typed_calls(pool):
    p = pool.alloc(MiB, "w")
    return {
        "alloc nbytes": lambda: pool.alloc(1.5),
        "alloc tag": lambda: pool.alloc(8, 5),
        "mark_ranges entry": lambda: pool.mark_ranges([5]),
        "mark_ranges ranges": lambda: pool.mark_ranges(None),
        "mark_ranges name": lambda: pool.mark_ranges([(p, 8, "state", 5)]),
        "write data": lambda: pool.write(p, "text"),
        "read ptr": lambda: pool.read("x", 1),
        "sleep tags": lambda: pool.sleep(1, 5),
        "set_preserve globs": lambda: pool.set_preserve(None),
        "spill_dir": lambda: torpor.Pool(0, backend="host", spill_dir=5),
        "Group rank": lambda: tdist.Group(0.9, 1, lambda data: [data], lambda: None),
        "Group barrier": lambda: tdist.Group(0, 1, lambda data: [data], None),
        "add_tag_hooks tag": lambda: torpor.engine.hooks.add_tag_hooks(5, lambda tag, level: None),
        "add_tag_hooks hooks": lambda: torpor.engine.hooks.add_tag_hooks("w"),
    }


def test_wrong_types_raise_invalid_type_which_is_both_invalid_argument_and_type_error(pool):
    assert issubclass(torpor.InvalidType, torpor.InvalidArgument) and issubclass(torpor.InvalidType, TypeError)
    for what, call in wrong_typed_calls(pool).items():
        with pytest.raises(torpor.InvalidType) as caught:
            call()
        assert isinstance(caught.value, TypeError) and isinstance(caught.value, torpor.TorporError), what
    assert list(pool.stats()["tags"]) == ["w"] and pool.stats()["allocations"] == 1


def test_wrong_values_of_the_right_type_stay_invalid_argument_not_type_error(pool):
    for call in (lambda: pool.alloc(2**64), lambda: pool.alloc(8, ""), lambda: pool.mark_ranges([(0, -1, "state")])):
        with pytest.raises(torpor.InvalidArgument) as caught:
            call()
        assert not isinstance(caught.value, TypeError)


@pytest.mark.parametrize("hooks", [dict(before_sleep=5), dict(after_wake="x"), dict()])
def test_add_sleep_hook_refuses_hooks_that_cannot_be_called(pool, hooks):
    pool.alloc(MiB, "w")
    with pytest.raises(torpor.InvalidType, match="add_sleep_hook"):
        pool.add_sleep_hook(**hooks)
    pool.sleep(1)  # no broken hook was installed: the sleep runs
    assert pool.stats()["tags"]["w"]["asleep"]


@pytest.mark.parametrize("nbytes", [2**64 + 5, -1, 1.5, True])
def test_engine_memory_margin_is_range_checked(nbytes):
    before = torpor.engine.memory_margin()
    with pytest.raises(torpor.InvalidArgument, match="memory margin"):
        torpor.engine.set_memory_margin(nbytes)
    assert torpor.engine.memory_margin() == before


@pytest.mark.parametrize("args", [(0, 2**64 + 8, 8, 0), (0, 0, 2**64 + 8, 0), (0, 0, 8, -1), (2**40, 0, 8, 0)])
def test_engine_read_host_copy_is_range_checked(args):
    with pytest.raises(torpor.InvalidArgument, match="read_host_copy"):
        torpor.engine.read_host_copy(*args)
