"""Host memory under the user's control through torpor.Pool on the host backend: the options
(skip_unchanged, host_store_limit, the disk tier), release_host_store, prepare_host_store, the
host bytes in stats(), and marks applied in one call (mark_ranges)."""

import os

import pytest

import torpor
from conftest import MiB, pattern


def host_pool(**options):
    return torpor.Pool(0, backend="host", va_bytes=1 << 30, fill_on_wake="poison", **options)


def test_skip_unchanged_keeps_copies_after_wake_and_release_gives_them_back():
    with host_pool() as pool:
        p = pool.alloc(3 * MiB, "weights", "state")
        pool.write(p, pattern(3 * MiB))
        pool.sleep(1)
        pool.wake_up()
        st = pool.stats()
        assert st["retained_bytes"] == 3 * MiB, "the default keeps the host copy after wake"
        assert st["host_store_bytes"] >= 3 * MiB
        assert pool.sleep(1)["bytes_offloaded"] == 0, "unchanged: nothing copied"
        pool.wake_up()
        released = pool.release_host_store()
        assert released == st["host_store_bytes"]
        st = pool.stats()
        assert st["retained_bytes"] == 0 and st["host_store_bytes"] == 0
        assert pool.sleep(1)["bytes_offloaded"] == 3 * MiB, "no copy left: everything travels again"
        pool.wake_up()
        assert pool.read(p, 3 * MiB) == pattern(3 * MiB)


def test_without_skip_unchanged_wake_keeps_no_copy():
    with host_pool(skip_unchanged=False) as pool:
        p = pool.alloc(MiB, "weights", "state")
        pool.write(p, pattern(MiB, 2))
        pool.sleep(1)
        pool.wake_up()
        assert pool.stats()["retained_bytes"] == 0
        assert pool.sleep(1)["bytes_offloaded"] == MiB
        pool.wake_up()
        assert pool.read(p, MiB) == pattern(MiB, 2)


def test_prepare_host_store_pins_what_the_sleep_needs():
    with host_pool() as pool:
        p = pool.alloc(4 * MiB, "weights", "parameter", "w")
        pool.write(p, pattern(4 * MiB, 3))
        added = pool.prepare_host_store(wait=True)
        assert added >= 4 * MiB
        st = pool.stats()
        assert st["host_store_pinned_bytes"] == added and st["host_store_pinning_bytes"] == 0
        assert pool.prepare_host_store(wait=True) == 0, "already prepared"
        pool.sleep(1)
        assert pool.stats()["host_store_bytes"] == added, "the sleep used the prepared store"
        pool.wake_up()
        assert pool.read(p, 4 * MiB) == pattern(4 * MiB, 3)


def test_a_spill_dir_beyond_the_limit_puts_backups_on_disk_and_reads_them_back(
    tmp_path,
):
    with host_pool(host_store_limit=1, spill_dir=tmp_path) as pool:
        p = pool.alloc(3 * MiB + 100, "weights", "state")
        data = os.urandom(3 * MiB + 100)
        pool.write(p, data)
        report = pool.sleep(1)
        assert report["bytes_spilled"] == 3 * MiB + 100
        st = pool.stats()
        assert st["spill_used_bytes"] >= 3 * MiB and os.path.dirname(st["spill_path"]) == str(tmp_path)
        assert os.path.exists(st["spill_path"])
        pool.wake_up()
        assert pool.read(p, 3 * MiB + 100) == data
    assert not os.path.exists(st["spill_path"]), "the spill file goes with the pool"


def test_bad_host_options_are_refused_with_the_accepted_range(tmp_path):
    with pytest.raises(torpor.InvalidArgument, match="host_store_limit"):
        host_pool(host_store_limit=-1)
    with pytest.raises(torpor.InvalidArgument, match="needs host_store_limit"):
        host_pool(spill_dir=tmp_path)


def test_mark_ranges_applies_every_range_in_one_call_or_none(pool):
    seg = pool.alloc(4 * MiB, "weights", "state")
    pool.mark_ranges(
        [
            (seg, MiB, "cache"),
            (seg + MiB, 2 * MiB, torpor.MemoryClass.PARAMETER, "layers.0.w"),
            (seg + 2 * MiB, MiB, "state"),  # later wins where ranges overlap
        ]
    )
    classes = pool.stats()["tags"]["weights"]["classes"]
    assert classes["cache"]["allocated_bytes"] == MiB
    assert classes["parameter"]["allocated_bytes"] == MiB
    assert classes["state"]["allocated_bytes"] == 2 * MiB
    with pytest.raises(torpor.InvalidArgument, match="range 1"):
        pool.mark_ranges([(seg, 4 * MiB, "cache"), (seg + 3 * MiB, 2 * MiB, "parameter")])
    assert pool.stats()["tags"]["weights"]["classes"]["cache"]["allocated_bytes"] == MiB, "nothing applied"
    pool.mark_ranges([])
