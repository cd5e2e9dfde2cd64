"""The fake torch itself (tests/python/fake_torch.py) against hand-computed oracles: the torpor
tests lean on it behaving as PyTorch's caching allocator does, so each behaviour it models is
checked here on its own, with a recording allocator instead of torpor (the addresses and sizes
below are worked out by hand from the rules in the fake's note, which restate
c10/cuda/CUDACachingAllocator.cpp: round to 512 bytes, 2 MiB small segments, 20 MiB large
segments below 10 MiB, best fit, split thresholds of 512 bytes / more than 1 MiB, merging with
free neighbours, blocks per stream)."""

import threading

import pytest

import fake_torch as torch

MiB = 1 << 20
KiB = 1 << 10


class Recorder:
    """A pluggable allocator that hands out segments 1 GiB apart, up to `capacity` bytes live."""

    def __init__(self, capacity=1 << 40):
        self.capacity, self.live, self.next = capacity, {}, 1 << 40
        self.mallocs, self.frees = [], []

    def malloc(self, nbytes, dev, stream):
        if sum(self.live.values()) + nbytes > self.capacity:
            return 0
        ptr, self.next = self.next, self.next + (1 << 30)
        self.live[ptr] = nbytes
        self.mallocs.append((ptr, nbytes))
        return ptr

    def free(self, ptr, nbytes, dev, stream):
        assert self.live.pop(ptr) == nbytes, "freed with the size it was allocated with"
        self.frees.append((ptr, nbytes))


def blocks(pool):
    """[(segment offset of the block, size, state)] of every segment, in address order."""
    return [[(b["address"] - s["address"], b["size"], b["state"]) for b in s["blocks"]] for s in pool.snapshot()]


A, F = "active_allocated", "inactive"


def snap_of(pool, t):
    return next(s for s in pool.snapshot() if s["address"] == t.data_ptr())["blocks"]


def test_blocks_split_and_merge_as_pytorch_carves_them():
    rec = Recorder()
    pool = torch.MemPool(rec)
    with torch.cuda.memory.use_mem_pool(pool):
        a = torch.empty(1000)  # 1024 after rounding
        b = torch.empty(1536)
        c = torch.empty(100)  # 512
    assert rec.mallocs == [(1 << 40, 2 * MiB)], "one small segment"
    s = a.data_ptr()
    assert (b.data_ptr() - s, c.data_ptr() - s) == (1024, 2560)
    assert blocks(pool) == [[(0, 1024, A), (1024, 1536, A), (2560, 512, A), (3072, 2 * MiB - 3072, F)]]
    b.free()
    assert blocks(pool) == [[(0, 1024, A), (1024, 1536, F), (2560, 512, A), (3072, 2 * MiB - 3072, F)]]
    a.free()
    assert blocks(pool) == [[(0, 2560, F), (2560, 512, A), (3072, 2 * MiB - 3072, F)]], "merged with the next"
    with torch.cuda.memory.use_mem_pool(pool):
        d = torch.empty(2048)  # best fit: the 2560-byte block, split (512 left)
    assert d.data_ptr() == s
    assert blocks(pool) == [[(0, 2048, A), (2048, 512, F), (2560, 512, A), (3072, 2 * MiB - 3072, F)]]
    c.free()
    assert blocks(pool) == [[(0, 2048, A), (2048, 2 * MiB - 2048, F)]], "merged with both neighbours"
    d.free()
    assert blocks(pool) == [[(0, 2 * MiB, F)]]
    assert rec.frees == [], "a live pool keeps its segments"


def test_large_requests_get_20_mib_segments_split_only_above_1_mib():
    rec = Recorder()
    pool = torch.MemPool(rec)
    with torch.cuda.memory.use_mem_pool(pool):
        e = torch.empty(3 * MiB)
        f = torch.empty(16 * MiB + 512 * KiB)  # 17 MiB are left: 512 KiB more is not worth a split
        g = torch.empty(512)  # small: never from a large segment
        h = torch.empty(11 * MiB)  # 10 MiB or more: a segment of its own, rounded to 2 MiB
    sizes = [n for _, n in rec.mallocs]
    assert sizes == [20 * MiB, 2 * MiB, 12 * MiB]
    assert f.data_ptr() == e.data_ptr() + 3 * MiB
    snap = {s["address"]: s for s in pool.snapshot()}
    assert [(b["size"], b["state"]) for b in snap[e.data_ptr()]["blocks"]] == [(3 * MiB, A), (17 * MiB, A)]
    assert snap[g.data_ptr()]["segment_type"] == "small" and snap[e.data_ptr()]["segment_type"] == "large"
    assert [(b["size"], b["state"]) for b in snap[h.data_ptr()]["blocks"]] == [(12 * MiB, A)], "1 MiB left: no split"
    with torch.cuda.memory.use_mem_pool(pool):
        i = torch.empty(20 * MiB + 512 * KiB)  # a 22 MiB segment, 1.5 MiB left: split
    assert [(b["size"], b["state"]) for b in snap_of(pool, i)] == [(20 * MiB + 512 * KiB, A), (MiB + 512 * KiB, F)]


def test_empty_cache_releases_only_unused_pools_wholly_free_segments_through_their_allocator():
    rec = Recorder()
    pool = torch.MemPool(rec)
    with torch.cuda.memory.use_mem_pool(pool):
        keep = torch.empty(MiB)  # small segment 1
        gone = torch.empty(3 * MiB)  # large segment 2
    small, large = rec.mallocs
    gone.free()
    torch.cuda.empty_cache()
    assert rec.frees == [], "the MemPool lives: its cached segments stay (pytorch#145168)"
    del pool  # the destructor releases the pool and empties its cache
    assert rec.frees == [large], "the wholly free segment went back through the pool's allocator"
    torch.cuda.empty_cache()
    assert rec.frees == [large], "a segment holding a live block stays"
    keep.free()
    torch.cuda.empty_cache()
    assert rec.frees == [large, small]


def test_a_graph_keeps_its_pool_until_it_is_reset():
    rec = Recorder()
    pool = torch.MemPool(rec)
    g = torch.CUDAGraph()
    with torch.cuda.graph(g, pool=pool.id):
        t = torch.empty(4 * KiB)
    t.free()
    del pool
    torch.cuda.empty_cache()
    assert rec.frees == [], "the graph still uses the pool"
    g.reset()
    torch.cuda.empty_cache()
    assert rec.frees == rec.mallocs


def test_a_failed_segment_allocation_frees_released_pools_and_retries_once():
    rec = Recorder(capacity=22 * MiB)
    old = torch.MemPool(rec)
    with torch.cuda.memory.use_mem_pool(old):
        torch.empty(3 * MiB).free()  # a cached 20 MiB segment
    del old  # nothing uses it now, but its cache is emptied only by the destructor's emptyCache
    assert rec.live == {}, "the destructor emptied it"
    busy = torch.MemPool(rec)
    with torch.cuda.memory.use_mem_pool(busy):
        torch.empty(3 * MiB)  # 20 of 22 MiB
    released = torch.MemPool(rec)
    g = torch.CUDAGraph()
    with torch.cuda.graph(g, pool=released.id):
        torch.empty(MiB).free()  # a cached 2 MiB segment: 22 of 22 MiB
    del released  # the graph still uses the pool: its destructor's emptyCache leaves it
    g.reset()  # now nothing uses it; no emptyCache ran since
    assert len(rec.live) == 2
    fresh = torch.MemPool(rec)
    with torch.cuda.memory.use_mem_pool(fresh):
        t = torch.empty(MiB)  # fails once, the released pool's 2 MiB go back, the retry succeeds
    assert rec.frees[-1][1] == 2 * MiB and t.data_ptr() in rec.live
    with pytest.raises(torch.OutOfMemoryError):
        with torch.cuda.memory.use_mem_pool(fresh):
            torch.empty(3 * MiB)


def test_threads_allocate_at_once_each_on_its_stream_and_in_its_own_pool():
    rec = Recorder()
    pools = [torch.MemPool(rec) for _ in range(4)]
    shared = torch.MemPool(rec)
    barrier = threading.Barrier(4)
    out, errors = {}, []

    def work(i):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                with torch.cuda.memory.use_mem_pool(pools[i]):
                    barrier.wait()  # every thread routes to its pool at once
                    mine = [torch.empty(4 * KiB) for _ in range(50)]
                with torch.cuda.memory.use_mem_pool(shared):
                    many = [torch.empty(512 * (1 + j % 7)) for j in range(200)]
                outside = torch.empty(4 * KiB)
            out[i] = (stream, mine, many, outside)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, (stream, mine, many, outside) in out.items():
        own = {s["address"]: s for s in pools[i].snapshot()}
        assert all(any(a <= t.data_ptr() < a + s["total_size"] for a, s in own.items()) for t in mine)
        every = [s for p in pools + [shared] for s in p.snapshot()]
        assert not any(
            s["address"] <= outside.data_ptr() < s["address"] + s["total_size"] for s in every
        ), "outside use_mem_pool: in no pool, whatever the other threads route to"
        segs = [s for s in shared.snapshot() if s["stream"] == id(stream)]
        assert all(any(s["address"] <= t.data_ptr() < s["address"] + s["total_size"] for s in segs) for t in many)
    # Under the allocator's lock no two live blocks overlap and every segment is tiled exactly.
    for seg in shared.snapshot():
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        ends = [(b["address"], b["address"] + b["size"]) for b in seg["blocks"]]
        assert all(e0 == s1 for (_, e0), (s1, _) in zip(ends, ends[1:]))
    # A block freed on one stream is not handed to another.
    (s0, _, many0, _), (s1, _, _, _) = out[0], out[1]
    many0[0].free()
    with torch.cuda.stream(s1), torch.cuda.memory.use_mem_pool(shared):
        other = torch.empty(many0[0]._nbytes)
    assert other.data_ptr() != many0[0].data_ptr()
    with torch.cuda.stream(s0), torch.cuda.memory.use_mem_pool(shared):
        same = torch.empty(many0[0]._nbytes)
    assert same.data_ptr() == many0[0].data_ptr(), "its own stream reuses it"
