"""vLLM as it is today (issue 26): the tag hooks (vLLM's register_tag_hooks over torpor's hook bus,
Pool.add_tag_hooks / torpor_add_tag_hooks), vLLM's sleep options, parameter registration kept true
across weight updates, and the field cases. fake_torch and torpor's host backend; discarded bytes
come back poisoned (0xFF). Oracles: the bytes the test wrote, the calls hooks recorded, and what
vLLM's own policy does with the same calls (a negative control that must fail under it)."""

import pytest

import torpor
from torpor import vllm as tvllm
from torpor.vllm import CuMemAllocator
from conftest import MiB, pattern
from test_vllm_mode import fill, read, torch  # noqa: F401 - the fixture

# -- tag hooks: the pool ---------------------------------------------------------------------


def test_pool_tag_hooks_run_before_the_unmap_and_after_the_map_in_order(pool):
    kv = pool.alloc(MiB, "kv_cache", "state", "kv")
    pool.alloc(MiB, "weights", "parameter", "w")
    pool.write(kv, pattern(MiB, 3))
    calls = []

    def before(tag):
        calls.append(("unmap", tag, pool.read(kv, 16) == pattern(MiB, 3)[:16]))

    first = pool.add_tag_hooks("kv_cache", before, lambda tag: calls.append(("map", tag, pool.read(kv, 16))))
    pool.add_tag_hooks("kv_cache", None, lambda tag: calls.append(("map2", tag)))
    pool.add_tag_hooks("weights", lambda tag: calls.append(("unmap", tag)), lambda tag: calls.append(("map", tag)))
    pool.sleep(1)
    assert calls == [
        ("unmap", "kv_cache", True),
        ("unmap", "weights"),
    ], "tag order, bytes still mapped"
    calls.clear()
    pool.wake_up(["kv_cache"])
    assert calls == [
        ("map", "kv_cache", pattern(MiB, 3)[:16]),
        ("map2", "kv_cache"),
    ], "weights is still asleep"
    calls.clear()
    pool.wake_up()
    assert [c[:2] for c in calls] == [("map", "kv_cache"), ("map2", "kv_cache"), ("map", "weights")]
    pool.remove_tag_hooks(first)
    with pytest.raises(torpor.InvalidArgument, match="is not a tag hook"):
        pool.remove_tag_hooks(first)
    with pytest.raises(torpor.InvalidType):
        pool.add_tag_hooks("kv_cache")
    with pytest.raises(torpor.InvalidType):
        pool.add_tag_hooks("", print)


def test_a_pool_tag_hook_that_raises_refuses_the_sleep_with_its_own_error(pool):
    kv = pool.alloc(MiB, "kv_cache", "state", "kv")
    pool.write(kv, pattern(MiB, 4))
    calls = []

    def busy(tag):
        raise KeyError(f"{tag}: transfer in flight")

    pool.add_tag_hooks("kv_cache", busy, lambda tag: calls.append(("map", tag)))
    with pytest.raises(KeyError, match="transfer in flight"):
        pool.sleep(2)
    assert not pool.stats()["tags"]["kv_cache"]["asleep"], "nothing moved"
    assert calls == [("map", "kv_cache")], "what before_unmap began is mapped again (rollback)"
    assert pool.read(kv, MiB) == pattern(MiB, 4)


# -- tag hooks: vLLM's register_tag_hooks ------------------------------------------------------


def test_vllm_register_tag_hooks_fire_where_vllms_allocator_runs_them(torch):  # noqa: F811 - the fixture
    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        w = torch.empty(64 << 10)
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = torch.empty(128 << 10)
    kv_bytes = fill(kv, 8)
    fill(w, 9)
    calls = []
    unregister_kv = tvllm.register_tag_hooks(
        "kv_cache",
        lambda: calls.append(("kv before_unmap", read(kv) == kv_bytes)),
        lambda: calls.append(("kv after_map",)),
    )
    unregister_w = tvllm.register_tag_hooks(
        "weights", lambda: calls.append(("w before_unmap",)), lambda: calls.append(("w after_map",))
    )
    try:
        allocator.sleep(offload_tags=("weights",))  # level 1: weights kept, KV cache discarded
        assert calls == [
            ("w before_unmap",),
            ("kv before_unmap", True),
        ], "each before its unmap, KV still intact"
        calls.clear()
        allocator.sleep(offload_tags=("weights",))
        assert calls == [], "nothing mapped, nothing unmapped"
        allocator.wake_up(["weights"])
        assert calls == [("w after_map",)], "kv_cache is still asleep: not fully mapped"
        calls.clear()
        allocator.wake_up(["kv_cache"])
        assert calls == [
            ("kv after_map",),
            ("w after_map",),
        ], "every fully mapped tag, once per wake"
        calls.clear()
        allocator.discard(("kv_cache",))
        assert calls == [("kv before_unmap", False)], "discard unmaps: KV bytes are the woken (poisoned) ones"
        calls.clear()
        allocator.wake_up(None)
        assert calls == [("kv after_map",), ("w after_map",)]
    finally:
        unregister_kv()
        unregister_w()
    calls.clear()
    allocator.sleep(offload_tags=())
    allocator.wake_up(None)
    assert calls == [], "unregistered hooks are not called"
    with pytest.raises(KeyError):
        unregister_kv()
    with pytest.raises(RuntimeError, match="must be callable"):
        tvllm.register_tag_hooks("kv_cache", None, print)
