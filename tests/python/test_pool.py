"""torpor.Pool over the C API on the host backend: tags, classes, sleep/wake byte survival,
same addresses, reports."""

import pytest

import torpor
from conftest import MiB, POISON, pattern


def test_allocations_are_counted_per_tag_and_class(pool):
    pool.alloc(3 * MiB, "weights", "parameter", "layers.0.w")
    pool.alloc(4096, "weights", torpor.MemoryClass.STATE, "flags")
    pool.alloc(2 * MiB, "kv_cache", 2)
    st = pool.stats()
    assert pool.backend == "host" and st["device"] == 0
    assert sorted(st["tags"]) == ["kv_cache", "weights"] == pool.tags()
    w = st["tags"]["weights"]["classes"]
    assert w["parameter"]["allocated_bytes"] == 3 * MiB
    assert w["state"]["allocated_bytes"] == 4096
    assert st["tags"]["kv_cache"]["classes"]["cache"]["allocated_bytes"] == 2 * MiB
    assert st["mapped_bytes"] >= 5 * MiB


def test_documents_that_outgrow_the_last_ones_size_are_read_whole(pool):
    """The JSON buffer starts at the size the last document needed: a larger one is still read
    whole (tags with long names make the stats and the tag list grow past it)."""
    pool.alloc(4096, "t.first", "state")
    assert pool.tags() == ["t.first"]
    assert list(pool.stats()["tags"]) == ["t.first"]
    names = [f"t.{i:03d}." + "x" * 200 for i in range(60)]
    for name in names:
        pool.alloc(4096, name, "state")
    assert pool.tags() == sorted(["t.first", *names])
    assert sorted(pool.stats()["tags"]) == sorted(["t.first", *names])
    assert pool.tags() == sorted(["t.first", *names]), "and again, at the remembered size"


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_keeps_bytes_by_class_and_level(pool, level):
    param = pool.alloc(MiB, "weights", "parameter", "layers.0.w")
    state = pool.alloc(MiB, "weights", "state", "rope.inv_freq")
    cache = pool.alloc(MiB, "kv_cache", "cache")
    data = {p: pattern(MiB, seed=i) for i, p in enumerate((param, state, cache))}
    for p, d in data.items():
        pool.write(p, d)
    before = pool.stats()["mapped_bytes"]
    report = pool.sleep(level)
    assert report["operation"] == "sleep" and report["level"] == level
    assert report["bytes_released"] == before and pool.stats()["mapped_bytes"] == 0
    assert report["bytes_offloaded"] == (2 * MiB if level == 1 else MiB)
    assert pool.wake_up()["operation"] == "wake_up"
    assert pool.read(state, MiB) == data[state], "state survives every level"
    assert pool.read(param, MiB) == (data[param] if level == 1 else POISON * MiB)
    assert pool.read(cache, MiB) == POISON * MiB, "cache is always discarded"


def test_preserve_globs_keep_matching_parameters_through_level_2(pool):
    embed = pool.alloc(MiB, "weights", "parameter", "embed.weight")
    layer = pool.alloc(MiB, "weights", "parameter", "layers.0.w")
    pool.write(embed, pattern(MiB, 1))
    pool.write(layer, pattern(MiB, 2))
    pool.set_preserve(["embed.*"])
    pool.sleep(2)
    pool.wake_up()
    assert pool.read(embed, MiB) == pattern(MiB, 1)
    assert pool.read(layer, MiB) == POISON * MiB


def test_mark_reclassifies_a_range_inside_an_allocation(pool):
    # What the PyTorch embedding does: a segment is state, the parameters inside it are marked.
    seg = pool.alloc(2 * MiB, "weights", "state")
    pool.write(seg, pattern(2 * MiB))
    pool.mark(seg + 4096, 8192, "parameter", "layers.1.w")
    stats = pool.stats()["tags"]["weights"]["classes"]
    assert stats["parameter"]["allocated_bytes"] == 8192
    assert stats["state"]["allocated_bytes"] == 2 * MiB - 8192
    report = pool.sleep(2)
    assert report["bytes_offloaded"] == 2 * MiB - 8192, "the parameter range does not travel"
    pool.wake_up()
    got = pool.read(seg, 2 * MiB)
    assert got[:4096] == pattern(2 * MiB)[:4096]
    assert got[4096 : 4096 + 8192] == POISON * 8192
    assert got[4096 + 8192 :] == pattern(2 * MiB)[4096 + 8192 :]


def test_rl_wake_order_weights_first_then_kv_cache(pool):
    w = pool.alloc(MiB, "weights", "state")
    kv = pool.alloc(MiB, "kv_cache", "cache")
    pool.write(w, pattern(MiB))
    pool.sleep(2)
    pool.wake_up(["weights"])
    st = pool.stats()["tags"]
    assert not st["weights"]["asleep"] and st["kv_cache"]["asleep"]
    assert st["kv_cache"]["mapped_bytes"] == 0
    assert pool.read(w, MiB) == pattern(MiB)
    pool.wake_up("kv_cache")
    assert pool.find(kv) == (kv, MiB), "same address after wake"
    pool.write(kv, pattern(MiB, 5))
    assert pool.read(kv, MiB) == pattern(MiB, 5)


def test_sleep_is_idempotent_and_level_1_deepens_to_level_2(pool):
    p = pool.alloc(MiB, "weights", "parameter", "w")
    pool.write(p, pattern(MiB))
    pool.sleep(1)
    again = pool.sleep(1)
    assert again["bytes_released"] == 0 and again["bytes_offloaded"] == 0
    assert pool.stats()["tags"]["weights"]["offloaded_bytes"] == MiB
    pool.sleep(2)
    assert pool.stats()["tags"]["weights"]["offloaded_bytes"] == 0, "level 2 drops the parameter copy"
    pool.wake_up()
    pool.wake_up()
    assert pool.read(p, MiB) == POISON * MiB


def test_level_0_and_empty_tag_lists_do_nothing(pool):
    p = pool.alloc(MiB, "weights", "state")
    assert pool.sleep(0)["bytes_released"] == 0
    assert pool.sleep(2, tags=[]) == {} and pool.wake_up(tags=[]) == {}
    assert not pool.stats()["tags"]["weights"]["asleep"]
    pool.write(p, b"still here")
    assert pool.read(p, 10) == b"still here"


def test_free_while_asleep_and_reuse_after_wake(pool):
    a = pool.alloc(MiB, "weights", "state")
    b = pool.alloc(MiB, "weights", "state")
    pool.write(b, pattern(MiB))
    pool.sleep(1)
    pool.free(a)
    pool.wake_up()
    assert pool.read(b, MiB) == pattern(MiB)
    assert pool.stats()["tags"]["weights"]["allocations"] == 1


def test_wake_report_counts_restored_and_filled_bytes(pool):
    pool.alloc(MiB, "weights", "state")
    pool.alloc(MiB, "kv_cache", "cache")
    pool.sleep(1)
    r = pool.wake_up()
    assert r["bytes_restored"] == MiB and r["bytes_filled"] == MiB
    assert r["seconds"] >= 0 and isinstance(r["phases"], dict)
    assert pool.last_report() == r


def test_closed_pool_and_stale_handle(pool):
    p = torpor.Pool(0, backend="host", va_bytes=1 << 30)
    handle = p.handle
    p.close()
    p.close()
    with pytest.raises(torpor.InvalidArgument, match="closed"):
        p.stats()
    stale = torpor.Pool.__new__(torpor.Pool)
    stale._handle, stale._owned, stale.device = handle, False, 0
    with pytest.raises(torpor.InvalidHandle, match="not a live pool"):
        stale.sleep(1)


def test_a_with_block_closes_the_pool_and_close_is_idempotent():
    with torpor.Pool(0, backend="host", va_bytes=1 << 30) as p:
        p.alloc(1 << 20, "weights", "state")
    with pytest.raises(torpor.InvalidArgument, match="was closed"):
        p.handle
    p.close()  # again: nothing to do
