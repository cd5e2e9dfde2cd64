"""Memory as engines measure it (issue 14, item 4), in CI against fake_torch on the host backend:
segments PyTorch left empty go back to the device when the last pool block using them exits (as
vLLM's allocator does, so the KV cache is sized from the memory really free), and stats() reports
per tag what is mapped, what torpor holds for PyTorch (segments) and what PyTorch's tensors use.
The oracles are PyTorch's own view (the MemPool snapshot) and the sizes the test allocated."""

import sys

import pytest

import fake_torch
import torpor
from conftest import MiB, POISON, TORCH_POOL_OPTIONS, pattern, fresh_torch_layer

# Above the pool's medium limit (256 MiB), so the segment has a chunk of its own and its memory
# goes back to the device with it (sparse on the host backend: nothing is touched).
BIG = 300 * MiB


@pytest.fixture
def torch(monkeypatch):
    torpor.configure(**TORCH_POOL_OPTIONS)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    fresh_torch_layer(monkeypatch)
    yield fake_torch
    torpor.wake_up()


def tag_stats(tag):
    return torpor.stats(0)["tags"][tag]


def test_stats_report_mapped_allocated_and_active_bytes_per_tag(torch):
    with torpor.use_pool("pm.stats"):
        a = torch.empty(3 * MiB)  # large, below 10 MiB: a 20 MiB segment, split
        torch.empty(2 * MiB)  # large too: the rest of the same segment
        big = torch.empty(BIG)  # 10 MiB or more: a segment of its own size
    t = tag_stats("pm.stats")
    assert t["allocated_bytes"] == 20 * MiB + BIG, "torpor holds PyTorch's segments"
    assert t["active_bytes"] == 3 * MiB + 2 * MiB + BIG, "PyTorch's live blocks (rounded to 512 bytes)"
    assert t["mapped_bytes"] >= t["allocated_bytes"], "mapped: whole chunks (slabs included)"
    a.free()
    assert tag_stats("pm.stats")["active_bytes"] == 2 * MiB + BIG
    big.free()
    with torpor.use_pool("pm.stats"):
        pass  # gives the empty big segment back (see below)
    torpor.sleep(1, "pm.stats")
    t = tag_stats("pm.stats")
    assert t["mapped_bytes"] == 0 and t["allocated_bytes"] == 20 * MiB, "asleep: nothing mapped"
    assert t["active_bytes"] == 2 * MiB, "PyTorch's view does not change"
    torpor.wake_up("pm.stats")


def test_empty_segments_go_back_when_the_pool_block_exits(torch):
    with torpor.use_pool("pm.quant") as first:
        wide = torch.empty(BIG)  # the model in a wide type ...
        narrow = torch.empty(2 * MiB)  # ... its narrow copy
        torpor.Pool.torch(0).write(narrow.data_ptr(), pattern(2 * MiB))
        mapped_inside = tag_stats("pm.quant")["mapped_bytes"]
        wide.free()
        assert tag_stats("pm.quant")["mapped_bytes"] == mapped_inside, "still inside: nothing given back"
    t = tag_stats("pm.quant")
    assert t["allocated_bytes"] == 20 * MiB, "the empty segment left torpor (2 MiB is large: a 20 MiB segment)"
    assert t["mapped_bytes"] == mapped_inside - BIG, "its memory went back to the device"
    assert not torpor.Pool.torch(0).contains(wide.data_ptr())
    # PyTorch still lists it in that MemPool: the next block allocates in a new one, so no
    # block of the given-back segment is ever handed out again.
    with torpor.use_pool("pm.quant") as second:
        again = torch.empty(4 * MiB)
    assert second is not first
    assert [s["address"] for s in second.snapshot()] == [again.data_ptr()], "a segment of the new MemPool"
    assert torpor.Pool.torch(0).contains(again.data_ptr())
    # Sleep and wake see both MemPools, skip the given-back segment, keep the live bytes.
    torpor.sleep(1, "pm.quant")
    torpor.wake_up("pm.quant")
    assert torpor.Pool.torch(0).read(narrow.data_ptr(), 2 * MiB) == pattern(2 * MiB)


def test_only_the_outermost_block_gives_segments_back(torch):
    with torpor.use_pool("pm.nested"):
        with torpor.use_pool("pm.nested"):
            t = torch.empty(BIG)
            t.free()
        assert tag_stats("pm.nested")["allocated_bytes"] == BIG, "the outer block still routes to this pool"
        again = torch.empty(BIG)
        assert again.data_ptr() == t.data_ptr(), "PyTorch reuses the free block: it must still be mapped"
        torpor.Pool.torch(0).write(again.data_ptr(), b"ok")
    assert tag_stats("pm.nested")["allocated_bytes"] == BIG, "a live block keeps its segment"


def test_segments_with_live_blocks_stay_and_sleeping_tags_are_left_alone(torch):
    with torpor.use_pool("pm.live"):
        keep = torch.empty(MiB)
    assert tag_stats("pm.live")["allocated_bytes"] == 2 * MiB
    with torpor.use_pool("pm.asleep", memory_class="cache"):
        gone = torch.empty(4 * MiB)
        torpor.sleep(1, "pm.asleep")
        gone.free()
    t = tag_stats("pm.asleep")
    assert t["asleep"] and t["allocated_bytes"] == 20 * MiB, "a sleeping tag's segments are not touched"
    torpor.wake_up("pm.asleep")
    with torpor.use_pool("pm.asleep", memory_class="cache"):
        pass
    assert tag_stats("pm.asleep")["allocated_bytes"] == 0, "given back by the next block once awake"
    assert torpor.Pool.torch(0).contains(keep.data_ptr())


def test_a_tag_holds_several_classes_each_in_its_own_mempool(torch):
    with torpor.use_pool("pm.mixed", memory_class="state") as kept_pool:
        kept = torch.empty(MiB)
    with torpor.use_pool("pm.mixed", memory_class="cache") as lost_pool:
        lost = torch.empty(MiB)
    assert kept_pool is not lost_pool
    pool = torpor.Pool.torch(0)
    pool.write(kept.data_ptr(), pattern(MiB, 1))
    pool.write(lost.data_ptr(), pattern(MiB, 2))
    classes = tag_stats("pm.mixed")["classes"]
    assert classes["state"]["allocated_bytes"] == classes["cache"]["allocated_bytes"] == 2 * MiB
    torpor.sleep(2, "pm.mixed")
    torpor.wake_up("pm.mixed")
    assert pool.read(kept.data_ptr(), MiB) == pattern(MiB, 1)
    assert pool.read(lost.data_ptr(), MiB) == POISON * MiB


def test_pytorch_never_frees_a_segment_torpor_gave_back_or_still_holds(torch, monkeypatch):
    """Segments freed by PyTorch behind torpor's back: torpor gives a retired MemPool's empty
    segments back itself (its free), while PyTorch still lists them in that MemPool; and the
    fake frees an unused pool's free segments at empty_cache (which every torpor.sleep calls)
    and at the MemPool's destruction, as PyTorch does. Were a torpor MemPool ever destroyed
    (pytorch#146431: torpor leaks a reference to each), PyTorch would free the given-back
    segment a second time, and by then torpor has handed that address to another segment: the
    live one would go. So nothing here may reach torpor_torch_free once the registry forgets
    the MemPools (what interpreter shutdown does)."""
    lib = torpor._lib.lib()
    with torpor.use_pool("pm.freed"):
        live = torch.empty(MiB)  # keeps its small segment
        gone = torch.empty(BIG)
        gone.free()
    assert not torpor.Pool.torch(0).contains(gone.data_ptr()), "given back by torpor at the block's exit"
    with torpor.use_pool("pm.freed"):
        again = torch.empty(BIG)  # a new MemPool; torpor reuses the address it got back
    torpor.Pool.torch(0).write(again.data_ptr(), pattern(4096))
    held = lambda: torpor.Pool.torch(0).stats()["tags"]["pm.freed"]["allocated_bytes"]  # noqa: E731
    before = held()
    failures = lib.torpor_torch_failures(None)
    from torpor.torch import routing

    routing.registry.mempools.clear()  # the test's registry forgets every MemPool it made
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    torpor.Pool.torch(0).sleep(1, ["pm.freed"])
    torch.cuda.empty_cache()  # as at the end of torpor.sleep
    torpor.Pool.torch(0).wake_up(["pm.freed"])
    assert lib.torpor_torch_failures(None) == failures, "no free of a segment torpor gave back"
    assert held() == before == 2 * MiB + BIG, "no live segment freed"
    assert torpor.Pool.torch(0).read(again.data_ptr(), 4096) == pattern(4096)
    assert torpor.Pool.torch(0).contains(live.data_ptr())
