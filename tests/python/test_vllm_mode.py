"""vLLM mode (torpor.vllm.CuMemAllocator) in CI: vLLM's allocator semantics against fake_torch, with
device memory from torpor's host backend. The oracle is what vLLM's CuMemAllocator does with the
same calls (vllm/device_allocator/cumem.py, README's vLLM section): a tag in offload_tags keeps
every byte, any other tag loses every byte, unless torpor knows its parameters. Discarded bytes
come back poisoned (0xFF), so "kept" and "lost" are told apart by the bytes themselves.
vLLM's test_cumem.py restated with real PyTorch on a GPU is in test_engines_gpu.py (the vLLM mode part)."""

import subprocess
import sys
import textwrap

import pytest

import fake_torch
import torpor
from torpor.torch import routing
from torpor.vllm import CuMemAllocator
from conftest import MiB, POISON, REPO, TORCH_POOL_OPTIONS, pattern, subprocess_env, fresh_torch_layer


@pytest.fixture
def torch(monkeypatch):
    torpor.configure(**TORCH_POOL_OPTIONS)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    fresh_torch_layer(monkeypatch)
    monkeypatch.setattr(CuMemAllocator, "instance", None)
    yield fake_torch
    torpor.wake_up()
    free_segments()


def free_segments():
    """Give every segment of this test's pools back (the process's torpor pools outlive the test;
    fake_torch never frees a segment by itself)."""
    lib = torpor._lib.lib()
    for (tag, cls, device), pools in routing.registry.mempools.items():
        for p in pools:
            for seg in routing.own_segments(p, device):
                lib.torpor_torch_free(seg["address"], seg["total_size"], device, None)


def fill(t, seed):
    data = pattern(t._nbytes, seed)
    torpor.Pool.torch(0).write(t.data_ptr(), data)
    return data


def read(t):
    return torpor.Pool.torch(0).read(t.data_ptr(), t._nbytes)


class Engine:
    """What a vLLM worker holds: a model (parameters and a buffer) in "weights", a KV cache in
    "kv_cache", and one more tensor in the default tag."""

    def __init__(self, torch, allocator, prefix="m"):
        with allocator.use_memory_pool(tag="weights"):
            self.w = torch.empty(64 << 10)
            self.b = torch.empty(32 << 10)
            self.rope = torch.empty(16 << 10)  # a buffer computed at load
        self.model = torch.nn.Module(w=self.w, b=self.b)
        with allocator.use_memory_pool(tag="kv_cache"):
            self.kv = torch.empty(256 << 10)
        with allocator.use_memory_pool():
            self.other = torch.empty(8 << 10)
        self.tensors = {"w": self.w, "b": self.b, "rope": self.rope, "kv": self.kv, "other": self.other}
        self.data = {name: fill(t, i + 1) for i, (name, t) in enumerate(self.tensors.items())}

    def kept(self, name):
        return read(self.tensors[name]) == self.data[name]

    def lost(self, name):
        return read(self.tensors[name]) == POISON * self.tensors[name]._nbytes


def test_level_2_without_registration_discards_every_byte_of_every_tag(torch):
    allocator = CuMemAllocator.get_instance()
    e = Engine(torch, allocator)
    allocator.sleep(offload_tags=())
    assert allocator.is_asleep() and allocator.is_asleep("weights") and allocator.is_asleep(["kv_cache"])
    allocator.wake_up()
    assert all(e.lost(n) for n in e.tensors), "vLLM discards every tag that is not offloaded"
    assert not allocator.is_asleep()


def test_offloaded_tags_keep_every_byte_and_the_others_lose_theirs(torch):
    allocator = CuMemAllocator.get_instance()
    e = Engine(torch, allocator)
    torpor.register_parameters(e.model)  # registration changes nothing for an offloaded tag
    allocator.sleep(offload_tags=("weights",))
    allocator.wake_up()
    assert e.kept("w") and e.kept("b") and e.kept("rope")
    assert e.lost("kv") and e.lost("other")
    # The KV cache is torpor's class cache, but vLLM offloads whatever tag it is asked to.
    e.data = {n: fill(t, 7 + i) for i, (n, t) in enumerate(e.tensors.items())}
    allocator.sleep(offload_tags="kv_cache")
    allocator.wake_up()
    assert e.kept("kv") and e.lost("other")
    assert e.lost("w") and e.kept("rope"), "weights not offloaded: registered parameters lost, the rest kept"


def test_a_repeated_sleep_reuses_the_re_marks_of_both_its_steps(torch, monkeypatch):
    """vLLM's sleep re-marks the offloaded tags and the discarded ones apart; an unchanged second
    sleep reuses both (work in PyTorch's default pool in between, as an engine's forward does)."""
    monkeypatch.setenv("TORPOR_PREPARE_SLEEP", "off")  # else the load's preparation takes the first snapshots
    allocator = CuMemAllocator.get_instance()
    e = Engine(torch, allocator)
    torpor.register_parameters(e.model)
    snapshots = []
    real = torch.MemPool.snapshot
    monkeypatch.setattr(torch.MemPool, "snapshot", lambda self: snapshots.append(self) or real(self))
    allocator.sleep(offload_tags=("weights",))
    allocator.wake_up()
    first = len(snapshots)
    assert first > 0
    for seed in (11, 12):
        e.data = {n: fill(t, seed + i) for i, (n, t) in enumerate(e.tensors.items())}
        torch.empty(MiB)  # the engine's own work, outside torpor
        allocator.sleep(offload_tags=("weights",))
        allocator.wake_up()
        assert len(snapshots) == first, "no snapshot: both steps' re-marks still hold"
        assert e.kept("w") and e.kept("b") and e.kept("rope")
        assert e.lost("kv") and e.lost("other")


def test_none_offloads_the_default_tag(torch):
    allocator = CuMemAllocator.get_instance()
    e = Engine(torch, allocator)
    allocator.sleep()
    allocator.wake_up()
    assert e.kept("other") and e.lost("w") and e.lost("kv")


def test_registered_parameters_make_level_2_keep_everything_else_and_copy_no_parameter(torch):
    allocator = CuMemAllocator.get_instance()
    e = Engine(torch, allocator)
    reg = torpor.register_parameters(e.model)
    assert reg.parameters == 2 and reg.nbytes == (64 << 10) + (32 << 10)
    allocator.sleep(offload_tags=())
    tags = torpor.stats(0)["tags"]
    assert tags["weights"]["classes"]["parameter"]["offloaded_bytes"] == 0
    assert tags["weights"]["classes"]["parameter"]["discarded_bytes"] == reg.nbytes
    offloaded = allocator.last_reports["discard"][0]["bytes_offloaded"]
    assert offloaded == 16 << 10, "only the buffer travels to host memory"
    allocator.wake_up(["weights"])
    assert e.kept("rope"), "the buffer comes back bit-exact without vLLM's buffer stash"
    assert e.lost("w") and e.lost("b"), "parameters are discarded (the engine reloads them)"
    allocator.wake_up(["kv_cache"])
    assert e.lost("kv") and e.lost("other"), "tags without registered parameters are discarded in full"


@pytest.mark.parametrize("level", [1, 2])
def test_tags_vllm_did_not_declare_discardable_keep_every_byte_at_both_levels(torch, level, caplog):
    """vLLM keeps "runtime" at both levels and declares "workspace" discardable; a tag vLLM's files
    do not name (a newer vLLM's) is kept rather than lost, and named once in the log. The oracle
    is the bytes written before the sleep (discarded bytes come back as the poison fill)."""
    allocator = CuMemAllocator.get_instance()
    unknown = f"a_tag_vllm_added_later_{level}"  # new to this process: logged here
    tensors = {}
    for tag in ("runtime", "workspace", unknown):
        with allocator.use_memory_pool(tag=tag):
            tensors[tag] = torch.empty(32 << 10)
    data = {tag: fill(t, 40 + i) for i, (tag, t) in enumerate(tensors.items())}
    with caplog.at_level("WARNING", logger="torpor.vllm"):
        for _ in range(2):
            allocator.sleep(offload_tags=("weights",) if level == 1 else ())
            allocator.wake_up(["weights"])
            assert not allocator.is_asleep(list(tensors)), "a selective wake wakes every tag but weights and kv_cache"
            assert read(tensors["runtime"]) == data["runtime"], "runtime state survives both levels"
            assert read(tensors[unknown]) == data[unknown], "a tag vLLM did not declare discardable is kept"
            assert read(tensors["workspace"]) == POISON * tensors["workspace"]._nbytes, "workspace is scratch"
    named = [r for r in caplog.records if unknown in r.getMessage()]
    assert len(named) == 1, "named once in the log, not at every sleep"
    assert not any("'runtime'" in r.getMessage() or "'workspace'" in r.getMessage() for r in caplog.records)


def test_wake_up_ignores_unknown_tags_and_defers_only_weights_and_kv_cache(torch):
    allocator = CuMemAllocator.get_instance()
    e = Engine(torch, allocator)
    allocator.sleep(offload_tags=("weights", "kv_cache", "default"))
    allocator.wake_up(["never_used"])
    states = torpor.torch.tag_states()
    assert (states["weights"], states["kv_cache"], states["default"]) == (True, True, False), "others wake"
    allocator.wake_up(["weights", "never_used"])
    states = torpor.torch.tag_states()
    assert (states["weights"], states["kv_cache"], states["default"]) == (False, True, False)
    allocator.wake_up(["weights"])  # awake already: nothing happens
    allocator.wake_up(["kv_cache"])
    assert all(e.kept(n) for n in e.tensors)
    allocator.wake_up([])
    assert not allocator.is_asleep()


def test_discard_drops_awake_tags_and_keeps_the_policy_of_sleeping_ones(torch):
    allocator = CuMemAllocator.get_instance()
    e = Engine(torch, allocator)
    allocator.discard("kv_cache")  # vLLM's release of the KV cache between rollouts
    states = torpor.torch.tag_states()
    assert (states["weights"], states["kv_cache"], states["default"]) == (False, True, False)
    assert e.kept("w") and e.kept("other"), "other tags stay mapped, bytes untouched"
    allocator.sleep(offload_tags=("weights",))
    allocator.discard(("weights", "unknown"))  # asleep with a backup: the backup stays
    allocator.wake_up()
    assert e.kept("w") and e.kept("rope") and e.lost("kv") and e.lost("other")


def test_usage_counts_segments_asleep_or_not(torch):
    allocator = CuMemAllocator.get_instance()
    assert allocator.get_current_usage() == 0, "vLLM asserts this before loading"
    Engine(torch, allocator)
    usage = allocator.get_current_usage()
    assert usage == sum(t["allocated_bytes"] for t in torpor.stats(0)["tags"].values()) >= 6 * MiB
    allocator.sleep(offload_tags=())
    assert allocator.get_current_usage() == usage


def test_reuse_memory_pool_needs_a_tag_used_before(torch):
    allocator = CuMemAllocator.get_instance()
    with pytest.raises(ValueError, match="Memory pool for tag 'weights' does not exist"):
        allocator.reuse_memory_pool("weights")
    with allocator.use_memory_pool("weights"):
        torch.empty(MiB)
    with allocator.reuse_memory_pool("weights"):
        t = torch.empty(MiB)
    assert torpor.pools()[0].contains(t.data_ptr())


def test_errors_are_runtime_errors_and_torpor_errors(torch):
    allocator = CuMemAllocator.get_instance()
    with pytest.raises(RuntimeError, match="tag '' is not a non-empty string") as info:
        allocator.sleep(offload_tags=("",))
    assert isinstance(info.value, torpor.InvalidArgument) and isinstance(info.value, ValueError)


def test_a_failed_wake_is_a_runtime_error_with_torpors_message_and_can_be_repeated():
    # In its own process: the emulated device gets 64 MiB, filled by another pool while asleep.
    code = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, TESTS)
        import fake_torch
        sys.modules["torch"] = fake_torch
        import torpor
        from torpor.vllm import CuMemAllocator

        torpor.configure(backend="host", va_bytes=1 << 30)
        allocator = CuMemAllocator.get_instance()
        with allocator.use_memory_pool():
            x = fake_torch.empty(40 << 20)
        allocator.sleep()
        other = torpor.Pool(0, backend="host")
        y = other.alloc(40 << 20, "trainer")
        try:
            allocator.wake_up()
        except RuntimeError as e:
            assert isinstance(e, torpor.OutOfMemory) and isinstance(e, MemoryError), type(e).__mro__
            assert isinstance(e, torpor.TorporError) and e.status == torpor.OutOfMemory.status
            print("raised:", e)
        else:
            raise SystemExit("wake_up did not fail")
        assert allocator.is_asleep()
        other.free(y)
        allocator.wake_up()
        assert not allocator.is_asleep()
        print("woke after the memory came back")
        """
    ).replace("TESTS", repr(str(REPO / "tests" / "python")))
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(TORPOR_HOST_DEVICE_MEMORY="64M", TORPOR_LOG="off"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "raised: torpor_wake_up: " in out.stdout and "out of" in out.stdout.lower()
    assert "woke after the memory came back" in out.stdout


# -- Model Runner V2's graph pool (use_cudagraph_pool) -----------------------------------------
# vLLM's contract, from its test_cudagraph_pool_sleep (tests/basic_correctness/test_cumem.py): graphs
# captured inside use_cudagraph_pool allocate under the tag "cudagraph", the pool is backed up at
# both sleep levels and woken by any wake, and a constant allocated in the capture and never
# written by a replay comes back. The oracle: bytewise arithmetic on the inputs, written here.

N = 4096  # bytes per vector


@pytest.fixture
def graph_torch(torch, monkeypatch):
    from torpor.torch import graphs

    monkeypatch.setattr(graphs, "_registry", graphs._Registry(graphs.threading.RLock(), {}, {}, []))
    monkeypatch.setattr(fake_torch.graph, "default_capture_stream", None)
    monkeypatch.setattr(fake_torch.CUDAGraph, "captures", [])  # the fake's log would keep graphs alive
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    yield torch


def put(t, data: bytes):
    torpor.Pool.torch(0).write(t.data_ptr(), data)


def capture_mrv2(torch, allocator, form, w, x):
    """out = x + w + const, bytewise, through an intermediate freed during capture; const is
    allocated inside the capture and filled after it (a replay never writes it). `form`: vLLM's
    two call forms: use_cudagraph_pool() capturing into the pool it yields, or
    use_cudagraph_pool(handle) with the capture naming vLLM's own handle."""
    g = torch.cuda.CUDAGraph()
    handle = (987654, 0)  # vLLM's graph_pool_handle(): a PyTorch pool outside torpor
    ctx = allocator.use_cudagraph_pool() if form == "yielded" else allocator.use_cudagraph_pool(handle)
    tags = []
    with ctx as pool:
        with torch.cuda.graph(g, pool=pool if form == "yielded" else handle, stream=torch.cuda.Stream()):
            tags.append(allocator.current_tag)
            tmp = torch.empty(N)
            const = torch.empty(N)
            out = torch.empty(N)
            torch.launch(lambda: put(tmp, bytes((a + b) % 256 for a, b in zip(read(x), read(w)))))
            torch.launch(lambda: put(out, bytes((a + b) % 256 for a, b in zip(read(tmp), read(const)))))
            tmp.free()
    p = torpor.Pool.torch(0)
    assert p.contains(out.data_ptr()) and p.contains(const.data_ptr()), "graph memory is torpor's"
    put(const, bytes((i * 5 + 1) % 256 for i in range(N)))
    return g, out, const, pool, tags


def oracle(x: bytes, w: bytes, c: bytes) -> bytes:
    return bytes((a + b + d) % 256 for a, b, d in zip(x, w, c))


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("form", ["yielded", "handle"])
def test_mrv2_graphs_captured_in_use_cudagraph_pool_live_in_torpor_sleep_and_replay(graph_torch, form, level):
    torch = graph_torch
    allocator = CuMemAllocator.get_instance()
    assert CuMemAllocator.cudagraph_tag == "cudagraph", "vLLM's tag (is_capturing_into_cumem_pool reads it)"
    with allocator.use_memory_pool(tag="weights"):
        assert allocator.current_tag == "weights"
        w = torch.empty(N)
    with allocator.use_memory_pool(tag="kv_cache"):
        x = torch.empty(N)
    assert allocator.current_tag == "default"
    w_bytes = pattern(N, 3)
    put(w, w_bytes)

    g, out, const, pool, tags = capture_mrv2(torch, allocator, form, w, x)
    assert tags == ["cudagraph"], "current_tag reads the cudagraph tag while capturing"
    assert allocator.current_tag == "default"
    assert [c[1] for c in torch.CUDAGraph.captures] == [tuple(pool)], "the capture went to the yielded pool"
    p = torpor.Pool.torch(0)
    graph_stats = p.stats()["tags"]["cudagraph"]
    assert graph_stats["allocated_bytes"] >= 2 * MiB and graph_stats["mapped_bytes"] >= 2 * MiB

    c_bytes = read(const)
    x_bytes = pattern(N, 9)
    put(x, x_bytes)
    g.replay()
    assert read(out) == oracle(x_bytes, w_bytes, c_bytes)
    allocator.sleep(offload_tags=("weights",) if level == 1 else ())
    asleep = p.stats()["tags"]["cudagraph"]
    assert asleep["asleep"] and asleep["mapped_bytes"] == 0, "sleep gave the graph memory back"
    assert asleep["offloaded_bytes"] == 2 * N, "the graph's allocated blocks (out, const) are backed up"
    allocator.wake_up(["kv_cache"])  # any wake wakes the graph pool (it is not deferrable)
    assert not p.stats()["tags"]["cudagraph"]["asleep"]
    allocator.wake_up(["weights"])
    if level == 2:
        put(w, w_bytes)  # level 2 discarded the weights: the engine reloads them
    assert read(const) == c_bytes, "a constant the replay never writes survives the sleep"
    x_bytes = pattern(N, 11)
    put(x, x_bytes)
    g.replay()  # the same graph, no re-capture
    assert read(out) == oracle(x_bytes, w_bytes, c_bytes)
    assert len(torch.CUDAGraph.captures) == 1


def test_release_cudagraph_pool_frees_the_pool_once_its_graphs_are_gone(graph_torch):
    torch = graph_torch
    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        w = torch.empty(N)
    with allocator.use_memory_pool(tag="kv_cache"):
        x = torch.empty(N)
    g, out, const, pool, _ = capture_mrv2(torch, allocator, "yielded", w, x)
    p = torpor.Pool.torch(0)
    before = p.stats()["tags"]["cudagraph"]["allocated_bytes"]
    with pytest.raises(RuntimeError, match="still alive") as info:
        allocator.release_cudagraph_pool()
    assert isinstance(info.value, torpor.InvalidState)
    assert p.stats()["tags"]["cudagraph"]["allocated_bytes"] == before, "nothing released while a graph lives"
    out.free()
    const.free()
    del g, out, const
    torch.CUDAGraph.captures.clear()
    assert allocator.release_cudagraph_pool() == before >= 2 * MiB
    assert p.stats()["tags"]["cudagraph"]["allocated_bytes"] == 0
    with allocator.use_cudagraph_pool() as again:
        assert tuple(again) != tuple(pool), "a recapture starts in a new, empty pool"
    assert allocator.release_cudagraph_pool() == 0
    with pytest.raises(RuntimeError, match="not a CUDA graph pool handle") as info:
        allocator.release_cudagraph_pool("pool")
    assert isinstance(info.value, torpor.InvalidArgument)


def test_use_cudagraph_pool_turns_nccl_graph_registration_off(graph_torch, monkeypatch, caplog):
    import os

    from torpor.torch import graphs

    allocator = CuMemAllocator.get_instance()
    caplog.set_level("INFO", logger="torpor")
    with allocator.use_cudagraph_pool():
        assert os.environ["NCCL_GRAPH_REGISTER"] == "0"
    with allocator.use_cudagraph_pool():
        pass
    lines = [r for r in caplog.records if "NCCL_GRAPH_REGISTER" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "INFO", "one line, when torpor sets it"

    caplog.clear()
    monkeypatch.setitem(graphs._nccl, "warned", False)
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "1")
    for _ in range(2):
        with allocator.use_cudagraph_pool():
            pass
    assert os.environ["NCCL_GRAPH_REGISTER"] == "1", "the user's value is theirs"
    lines = [r for r in caplog.records if "NCCL_GRAPH_REGISTER" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "WARNING"
    assert "pin" in lines[0].getMessage() and "stale after wake" in lines[0].getMessage()
