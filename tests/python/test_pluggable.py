"""The pluggable-allocator path without PyTorch: the entry points PyTorch calls
(torpor_torch_malloc/free, through ctypes as PyTorch would), and the class refresh that
torpor.sleep() applies to PyTorch's segments before sleeping (torpor.torch.marks), run on
segments laid out the way PyTorch's caching allocator lays them out."""

import ctypes

import pytest

import torpor
from torpor import _lib
from torpor.torch import marks
from torpor.pool import MemoryClass
from conftest import MiB, POISON, TORCH_POOL_OPTIONS, pattern


@pytest.fixture(scope="module")
def lib():
    # One configuration per process (the pools are process-wide), the same in every test.
    torpor.configure(**TORCH_POOL_OPTIONS)
    return _lib.lib()


@pytest.fixture
def segment(lib):
    """A function allocating a segment as PyTorch does: in the thread's current tag and class."""
    made = []

    def make(nbytes, tag, memory_class=MemoryClass.STATE, device=0):
        _lib.check(lib.torpor_set_current_tag(tag.encode()))
        _lib.check(lib.torpor_set_current_class(int(memory_class)))
        ptr = lib.torpor_torch_malloc(nbytes, device, None)
        assert ptr, _lib.last_error()
        made.append((ptr, nbytes, device))
        return ptr

    yield make
    _lib.check(lib.torpor_set_current_tag(None))
    _lib.check(lib.torpor_set_current_class(int(MemoryClass.STATE)))
    for ptr, nbytes, device in made:
        lib.torpor_torch_free(ptr, nbytes, device, None)


def failures(lib):
    status = ctypes.c_int(0)
    return lib.torpor_torch_failures(ctypes.byref(status)), status.value


def test_segments_land_in_the_current_tag_and_class(lib, segment):
    w = segment(2 * MiB, "py.weights")
    kv = segment(4 * MiB, "py.kv_cache", MemoryClass.CACHE)
    pool = torpor.Pool.torch(0)
    assert pool.backend == "host" and pool.find(w) == (w, 2 * MiB) and pool.find(kv) == (kv, 4 * MiB)
    tags = pool.stats()["tags"]
    assert tags["py.weights"]["classes"]["state"]["allocated_bytes"] == 2 * MiB
    assert tags["py.kv_cache"]["classes"]["cache"]["allocated_bytes"] == 4 * MiB
    assert lib.torpor_current_tag() == b"py.kv_cache" and MemoryClass(lib.torpor_current_class()) is MemoryClass.CACHE


def test_a_failed_malloc_returns_null_and_keeps_the_reason(lib, segment):
    segment(2 * MiB, "py.sleeper")
    pool = torpor.Pool.torch(0)
    pool.sleep(1, "py.sleeper")
    before, _ = failures(lib)
    assert lib.torpor_torch_malloc(2 * MiB, 0, None) is None
    count, status = failures(lib)
    assert count == before + 1 and status == torpor.InvalidState.status
    assert "torpor_torch_malloc(2097152 bytes, device 0, tag 'py.sleeper', class state)" in _lib.last_error()
    assert "is asleep" in _lib.last_error()
    pool.wake_up("py.sleeper")
    assert lib.torpor_torch_malloc(2 * MiB, 77, None) is None
    assert "device 77" in _lib.last_error()


def test_configure_is_refused_once_pools_use_other_options(lib, segment):
    segment(2 * MiB, "py.cfg")
    torpor.configure(**TORCH_POOL_OPTIONS)  # the same: fine
    with pytest.raises(torpor.InvalidState, match=r"device\(s\) 0 already exist with other options"):
        torpor.configure(**{**TORCH_POOL_OPTIONS, "fill_on_wake": "zero"})
    with pytest.raises(torpor.InvalidArgument, match="unknown fill_on_wake"):
        torpor.configure(fill_on_wake="sometimes")


def pytorch_segment(address, blocks):
    """A MemPool.snapshot() segment: blocks as (size, state), in address order."""
    out, at = [], address
    for size, state in blocks:
        out.append({"address": at, "size": size, "requested_size": size, "state": state})
        at += size
    return {"address": address, "total_size": at - address, "device": 0, "is_expandable": False, "blocks": out}


def test_refresh_then_level_2_keeps_state_drops_parameters_and_free_space(lib, segment):
    seg = segment(2 * MiB, "py.weights")
    pool = torpor.Pool.torch(0)
    pool.write(seg, pattern(2 * MiB))
    # A segment as a model leaves it: a parameter, a buffer computed at load (rotary
    # frequencies), a block freed by load-time temporaries, another parameter, free tail.
    layout = [
        (64 << 10, "active_allocated"),  # layers.0.w
        (8 << 10, "active_allocated"),  # rope.inv_freq (buffer: state)
        (128 << 10, "inactive"),  # freed temporary
        (64 << 10, "active_allocated"),
    ]  # layers.1.w
    layout.append((2 * MiB - sum(s for s, _ in layout), "inactive"))
    offsets = [sum(s for s, _ in layout[:i]) for i in range(len(layout))]
    # Stale classes from an earlier life of the segment: the buffer's block was a parameter.
    pool.mark(seg + offsets[1], 8 << 10, "parameter", "old.weight")
    spans = [
        marks.Span("layers.0.w", seg + offsets[0], 64 << 10),
        marks.Span("layers.1.w", seg + offsets[3], 60 << 10),  # a tensor smaller than its block
        marks.Span("elsewhere.w", 0x1000, 4096),
    ]  # not in this pool
    plan = marks.plan([pytorch_segment(seg, layout)], MemoryClass.STATE, spans)
    assert plan.parameters == 2 and plan.parameter_bytes == 124 << 10 and plan.foreign == []
    marks.apply(pool, plan)
    classes = pool.stats()["tags"]["py.weights"]["classes"]
    assert classes["parameter"]["allocated_bytes"] == 124 << 10
    assert classes["state"]["allocated_bytes"] == (8 << 10) + (4 << 10)  # the buffer, a block's tail
    report = pool.sleep(2, "py.weights")
    assert report["bytes_offloaded"] == 12 << 10, "only state travels: never free space, never parameters"
    pool.wake_up("py.weights")
    got, want = pool.read(seg, 2 * MiB), pattern(2 * MiB)
    buf = slice(offsets[1], offsets[2])
    assert got[buf] == want[buf], "the buffer computed at load survives without a backup"
    assert got[offsets[0] : offsets[1]] == POISON * (64 << 10), "parameters come back for reloading"
    assert got[offsets[2] : offsets[3]] == POISON * (128 << 10), "free space was not kept"
    tail = slice(offsets[3] + (60 << 10), offsets[4])
    assert got[tail] == want[tail], "the rest of a parameter's block is state"


def test_refreshed_parameter_names_match_preserve_globs(lib, segment):
    seg = segment(2 * MiB, "py.preserve")
    pool = torpor.Pool.torch(0)
    pool.write(seg, pattern(2 * MiB, 3))
    pool.set_preserve(["embed.*"])
    try:
        spans = [marks.Span("embed.weight", seg, MiB), marks.Span("head.weight", seg + MiB, MiB)]
        marks.apply(pool, marks.plan([pytorch_segment(seg, [(2 * MiB, "active_allocated")])], MemoryClass.STATE, spans))
        pool.sleep(2, "py.preserve")
        pool.wake_up("py.preserve")
        got = pool.read(seg, 2 * MiB)
        assert got[:MiB] == pattern(2 * MiB, 3)[:MiB]
        assert got[MiB:] == POISON * MiB
    finally:
        pool.set_preserve([])


def test_a_kv_cache_tag_refreshes_to_cache_and_expandable_segments_are_reported():
    seg = pytorch_segment(1 << 40, [(MiB, "active_allocated"), (MiB, "active_pending_free"), (MiB, "inactive")])
    foreign = dict(pytorch_segment(1 << 41, [(MiB, "active_allocated")]), is_expandable=True)
    plan = marks.plan([seg, foreign], MemoryClass.CACHE, [])
    assert [(m.address - (1 << 40), m.memory_class) for m in plan.marks] == [
        (0, MemoryClass.CACHE),
        (MiB, MemoryClass.CACHE),
        (2 * MiB, MemoryClass.CACHE),
    ]
    assert plan.foreign == [1 << 41]
    # A block still in use by another stream ("active_pending_free") is not free space.
    plan = marks.plan([seg], MemoryClass.STATE, [])
    assert [m.memory_class for m in plan.marks] == [MemoryClass.STATE, MemoryClass.STATE, MemoryClass.CACHE]


def test_snapshot_blocks_without_addresses_are_placed_in_order():
    seg = {
        "address": 4096,
        "total_size": 3 * 4096,
        "blocks": [{"size": 4096, "state": "inactive"}, {"size": 8192, "state": "active_allocated"}],
    }
    assert list(marks.segment_blocks(seg)) == [(4096, 4096, "inactive"), (8192, 8192, "active_allocated")]
