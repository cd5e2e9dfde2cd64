"""CUDA graphs in torpor (torpor.graph, graph_pool, mark_state) in CI: against fake_torch, whose
graphs record "kernels" (Python functions over host-backend bytes) at capture and run them at
replay, with the private-pool behaviour PyTorch has (allocations of the capturing stream go to
the capture's pool; blocks freed during capture stay cached there). The oracle is plain Python
arithmetic on the inputs; discarded bytes come back poisoned (0xFF), so a graph that replayed
from stale memory, or memory that was not released, shows.

These tests rely on a simplification of the fake: a CUDA graph is a list of Python closures run
at replay, not captured kernels, so what a real capture does besides allocating (a kernel
reading memory while it captures, cuBLAS workspaces, graph memory nodes, NCCL registration) is
not here. Their GPU twin, with real PyTorch graphs captured into torpor's pools, slept and
replayed: test_graphs_gpu.py (scripts/gpu_run.sh python)."""

import sys

import pytest

import fake_torch
import torpor
from torpor.torch import graphs
from conftest import MiB, POISON, TORCH_POOL_OPTIONS, fresh_torch_layer

N = 4096  # bytes per vector


@pytest.fixture
def torch(monkeypatch):
    torpor.configure(**TORCH_POOL_OPTIONS)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    fresh_torch_layer(monkeypatch)
    monkeypatch.setattr(graphs, "_registry", graphs._Registry(graphs.threading.RLock(), {}, {}, []))
    monkeypatch.setattr(fake_torch.graph, "default_capture_stream", None)
    yield fake_torch
    torpor.wake_up()


def pool():
    return torpor.Pool.torch(0)


def current_tag():
    lib = torpor._lib.lib()
    return lib.torpor_current_tag().decode(), torpor.MemoryClass(lib.torpor_current_class())


def write(t, data: bytes):
    pool().write(t.data_ptr(), data)


def read(t) -> bytes:
    return pool().read(t.data_ptr(), t._nbytes)


def expected(x: bytes, w: bytes) -> bytes:
    """The graph's math, written independently: out = (3 * x + w) mod 256, bytewise."""
    return bytes((3 * a + b) % 256 for a, b in zip(x, w))


def capture_step(torch, x, w, keep_tmp=False):
    """Capture out = tmp + w with tmp = 3 * x: tmp is an intermediate freed during capture (its
    block stays in the graph pool), out the static output. Returns out (and tmp if kept)."""
    tmp = torch.empty(N)
    out = torch.empty(N)
    torch.launch(lambda: write(tmp, bytes((3 * a) % 256 for a in read(x))))
    torch.launch(lambda: write(out, bytes((a + b) % 256 for a, b in zip(read(tmp), read(w)))))
    if not keep_tmp:
        tmp.free()
        return out
    return out, tmp


def model(torch, tag="tg.weights"):
    with torpor.use_pool(tag):
        w = torch.empty(N)
    with torpor.use_pool("kv_cache"):
        x = torch.empty(N)  # the static input: rewritten before every replay, so cache is right
    w_bytes = bytes((i * 7 + 1) % 256 for i in range(N))
    write(w, w_bytes)
    return w, x, w_bytes


def test_graph_memory_is_released_by_sleep_and_the_same_graph_replays_after_wake(torch):
    w, x, w_bytes = model(torch)
    g = torch.cuda.CUDAGraph()
    with torpor.graph(g, tag="tg.graph"):
        assert current_tag() == ("tg.graph", torpor.MemoryClass.CACHE), "capture allocates in the graph's tag"
        out = capture_step(torch, x, w)
    assert current_tag() == ("default", torpor.MemoryClass.STATE)
    assert pool().contains(out.data_ptr()) and g.pool.id in graphs._registry.pools
    graph_stats = pool().stats()["tags"]["tg.graph"]
    assert graph_stats["classes"]["cache"]["allocated_bytes"] >= 2 * MiB, "one 2 MiB segment, class cache"

    for level in (1, 2):
        x_bytes = bytes((i * 13 + level) % 256 for i in range(N))
        write(x, x_bytes)
        g.replay()
        assert read(out) == expected(x_bytes, w_bytes)
        torpor.sleep(level, ["tg.weights", "kv_cache", "tg.graph"])
        stats = pool().stats()["tags"]["tg.graph"]
        assert stats["asleep"] and stats["mapped_bytes"] == 0, "the graph pool gave its memory back"
        assert stats["offloaded_bytes"] == 0, "no byte of the graph pool is kept: replays recompute them"
        assert stats["discarded_bytes"] == stats["classes"]["cache"]["allocated_bytes"] >= 2 * MiB
        torpor.wake_up()
        assert read(out) == POISON * N, "the graph's output was discarded, not kept"
        write(x, x_bytes)  # the engine writes the static input before a replay
        g.replay()  # same graph object, no re-capture
        assert read(out) == expected(x_bytes, w_bytes), f"replay after a level-{level} sleep"
    assert len([c for c in torch.CUDAGraph.captures if c[0] is g]) == 1


def test_mark_state_keeps_declared_tensors_and_nothing_else(torch):
    w, x, w_bytes = model(torch)
    g = torch.cuda.CUDAGraph()
    with torpor.graph(g, tag="tg.graph"):
        out, tmp = capture_step(torch, x, w, keep_tmp=True)
        scratch = torch.empty(N)  # captured but never written by the graph: a dead tensor
    torpor.mark_state(out, name="static_out")
    torpor.mark_state(scratch)
    write(x, bytes(range(256)) * (N // 256))
    g.replay()
    want = read(out)
    write(scratch, b"\x5a" * N)
    scratch.free()
    del scratch  # a declared tensor that dies is forgotten: its block is free space again
    torpor.sleep(2, "tg.graph")
    stats = pool().stats()["tags"]["tg.graph"]
    assert stats["offloaded_bytes"] == N, "exactly the declared output travels"
    torpor.wake_up("tg.graph")
    assert read(out) == want, "declared state survives level 2 bit-exact"
    assert read(tmp) == POISON * N, "an undeclared tensor of a graph pool is cache"


def test_a_state_graph_pool_keeps_its_allocated_blocks_and_drops_free_ones(torch):
    w, x, w_bytes = model(torch)
    g = torch.cuda.CUDAGraph()
    with torpor.graph(g, tag="tg.stateful", memory_class="state"):
        out, tmp = capture_step(torch, x, w, keep_tmp=True)
        dead = torch.empty(N)
        dead.free()
    write(x, bytes(N))
    g.replay()
    want_out, want_tmp = read(out), read(tmp)
    assert pool().stats()["tags"]["tg.stateful"]["classes"]["state"]["allocated_bytes"] >= 2 * MiB
    torpor.sleep(2, "tg.stateful")
    stats = pool().stats()["tags"]["tg.stateful"]
    assert stats["offloaded_bytes"] == 2 * N, "the two allocated blocks; the free ones are not copied"
    torpor.wake_up("tg.stateful")
    assert (read(out), read(tmp)) == (want_out, want_tmp)
    with pytest.raises(torpor.InvalidArgument, match="graph pool of class state, not cache"):
        torpor.graph_pool("tg.stateful")


def test_a_capture_after_a_sleep_is_seen_by_the_next_even_at_a_freed_blocks_address(torch):
    """A capture allocates in torpor's MemPool without use_pool: it counts as routing too, so the
    next sleep does not trust its last re-mark (the live addresses alone would look the same)."""
    w, x, w_bytes = model(torch)
    g = torch.cuda.CUDAGraph()
    with torpor.graph(g, tag="tg.again", memory_class="state"):
        out, tmp = capture_step(torch, x, w, keep_tmp=True)
    torpor.sleep(2, "tg.again")
    assert pool().stats()["tags"]["tg.again"]["offloaded_bytes"] == 2 * N
    torpor.wake_up("tg.again")
    tmp.free()
    again = torch.cuda.CUDAGraph()
    with torpor.graph(again, tag="tg.again", memory_class="state"):
        half = torch.empty(N // 2)  # first fit: where tmp was
    assert half.data_ptr() == tmp.data_ptr()
    torpor.sleep(2, "tg.again")
    assert pool().stats()["tags"]["tg.again"]["offloaded_bytes"] == N + N // 2, "tmp's other half is free space"
    torpor.wake_up("tg.again")


def test_expandable_segments_off_keeps_the_users_other_allocator_settings(torch, monkeypatch):
    """PyTorch resets every setting the string it is given leaves out: torpor writes the user's
    whole string with only expandable_segments changed, and the original back after."""
    user = "max_split_size_mb:64, expandable_segments:True,garbage_collection_threshold:0.6"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")  # PYTORCH_ALLOC_CONF wins
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", user)
    torch.settings_calls.clear()
    with torpor.use_pool("tg.conf"):
        with torpor.use_pool("tg.conf2"):  # nested: one write each way
            torch.empty(N)
        assert torch.settings_calls == [
            "max_split_size_mb:64,expandable_segments:False,garbage_collection_threshold:0.6"
        ]
    assert torch.settings_calls[1:] == [
        "max_split_size_mb:64,expandable_segments:True,garbage_collection_threshold:0.6"
    ]


def test_torch_cuda_graph_with_a_torpor_graph_pool_allocates_in_torpor(torch, monkeypatch):
    w, x, w_bytes = model(torch)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    torch.settings_calls.clear()
    pool_id = torpor.graph_pool("tg.raw")
    assert torpor.graph_pool("tg.raw") == pool_id and graphs.is_graph_pool(pool_id)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool_id):  # the engine's own call, only its pool argument changed
        assert current_tag() == ("tg.raw", torpor.MemoryClass.CACHE)
        assert torch.settings_calls == ["expandable_segments:False"]
        out = capture_step(torch, x, w)
    assert current_tag() == ("default", torpor.MemoryClass.STATE)
    assert torch.settings_calls == ["expandable_segments:False", "expandable_segments:True"]
    assert pool().contains(out.data_ptr())
    x_bytes = bytes((i * 5) % 256 for i in range(N))
    torpor.sleep(2, ["tg.raw", "kv_cache"])
    assert pool().stats()["tags"]["tg.raw"]["mapped_bytes"] == 0
    torpor.wake_up()
    write(x, x_bytes)
    g.replay()
    assert read(out) == expected(x_bytes, w_bytes)

    # A capture into a pool that is not torpor's is passed through untouched: outside torpor.
    other = torch.cuda.CUDAGraph()
    with torch.cuda.graph(other):
        assert current_tag() == ("default", torpor.MemoryClass.STATE)
        outside = torch.empty(N)
    assert not pool().contains(outside.data_ptr())


def test_torpor_graph_captures_on_its_own_stream_per_tag(torch):
    w, x, _ = model(torch)
    a, b, c = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torpor.graph(a, tag="tg.s1"):
        capture_step(torch, x, w)
    with torpor.graph(b, tag="tg.s1"):
        capture_step(torch, x, w)
    with torpor.graph(c, tag="tg.s2"):
        capture_step(torch, x, w)
    assert a.stream is b.stream and a.stream is not c.stream
    assert a.stream is not torch.cuda.graph.default_capture_stream
    mine = torch.cuda.Stream()
    d = torch.cuda.CUDAGraph()
    with torpor.graph(d, pool=a.pool_id, stream=mine):  # another graph sharing a's pool
        capture_step(torch, x, w)
    assert d.stream is mine and d.pool_id == a.pool_id


def test_misuse_is_refused_with_typed_errors(torch):
    w, x, _ = model(torch)
    torpor.graph_pool("tg.g")
    with pytest.raises(torpor.InvalidArgument, match="use_pool: tag 'tg.g' is a CUDA graph pool"):
        torpor.use_pool("tg.g").__enter__()
    with pytest.raises(torpor.InvalidArgument, match="graph_pool: tag 'tg.weights' already holds tensors"):
        torpor.graph_pool("tg.weights")
    with pytest.raises(torpor.InvalidArgument, match="not a torpor graph pool"):
        with torpor.graph(torch.cuda.CUDAGraph(), pool=(123456, 0)):
            pytest.fail("captured")
    with pytest.raises(torpor.InvalidArgument, match="is the graph pool of tag 'tg.g', not 'tg.h'"):
        with torpor.graph(torch.cuda.CUDAGraph(), pool=torpor.graph_pool("tg.g"), tag="tg.h"):
            pytest.fail("captured")
    with pytest.raises(torpor.InvalidArgument, match="must be cache or state"):
        torpor.graph_pool("tg.p", memory_class="parameter")
    with pytest.raises(torpor.InvalidArgument, match="mark_state: the tensor .* is not inside a torpor pool"):
        torpor.mark_state(torch.empty(N))
    with pytest.raises(torpor.InvalidArgument, match="mark_state: CPUTensor is not a CUDA tensor"):
        torpor.mark_state(torch.CPUTensor(64))
    # A pool of device 0 used for a capture on device 1: PyTorch would allocate outside torpor.
    device0 = torpor.graph_pool("tg.g")
    torch.current["device"] = 1
    try:
        with pytest.raises(torpor.InvalidArgument, match="belongs to device 0, but the capture runs on device 1"):
            with torch.cuda.graph(torch.cuda.CUDAGraph(), pool=device0):
                pytest.fail("captured")
    finally:
        torch.current["device"] = 0
    g = torch.cuda.CUDAGraph()
    with torpor.graph(g, tag="tg.g"):
        capture_step(torch, x, w)
    torpor.sleep(1, "tg.g")
    with pytest.raises(torpor.InvalidState, match="graph: tag 'tg.g' is asleep on device 0"):
        with torpor.graph(torch.cuda.CUDAGraph(), tag="tg.g"):
            pytest.fail("captured")
    assert current_tag() == ("default", torpor.MemoryClass.STATE)
    torpor.wake_up("tg.g")


def test_a_failed_capture_restores_the_thread(torch):
    g = torch.cuda.CUDAGraph()
    with pytest.raises(KeyError):
        with torpor.graph(g, tag="tg.fail"):
            raise KeyError("inside the capture")
    assert current_tag() == ("default", torpor.MemoryClass.STATE)
    assert graphs._capturing.depth == 0
    with pytest.raises(KeyError):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), pool=torpor.graph_pool("tg.fail")):
            raise KeyError("inside a raw capture")
    assert current_tag() == ("default", torpor.MemoryClass.STATE)


def cuda_usable() -> bool:
    try:
        torpor.Pool(0, backend="cuda", va_bytes=1 << 30).close()
    except torpor.Unavailable:
        return False
    return True


def test_graph_memory_and_memory_nodes_ask_the_library_which_needs_a_gpu(torch):
    """Both go through the library's one walk of CUDA graph memory (torpor_graph_memory_nodes,
    torpor_graph_memory), which answers Unavailable, naming the cuda backend, without a usable GPU
    (the GPU twin counts real nodes: test_graphs_gpu.py). A graph without a kept cudaGraph_t has
    no nodes to count, GPU or not."""
    if cuda_usable():
        pytest.skip("a usable GPU: test_graphs_gpu.py checks the counts there")

    class KeptGraph:
        def raw_cuda_graph(self):
            return 0x7F00DEAD0000  # never read: the library refuses before any driver call

    with pytest.raises(torpor.Unavailable, match="^torpor_graph_memory_nodes: the cuda backend"):
        torpor.memory_nodes(KeptGraph())
    with pytest.raises(torpor.Unavailable, match="^torpor_graph_memory: the cuda backend"):
        torpor.graph_memory()
    assert torpor.memory_nodes(torch.CUDAGraph()) is None, "no raw_cuda_graph: nothing kept to count"
    with pytest.raises(torpor.InvalidArgument, match="memory_nodes: graph"):
        torpor.memory_nodes(type("Negative", (), {"raw_cuda_graph": lambda self: -5})())
