"""GPU: the engine modes (issue 14) with real PyTorch on a CUDA device.

- vLLM mode: the tests of vLLM's tests/basic_correctness/test_cumem.py that do not start an
  engine (the commits are in README's vLLM section), restated against torpor.vllm.CuMemAllocator.
  They measure as vLLM's do (vllm-project/vllm tests/basic_correctness/test_cumem.py at 04a070d):
  the device's free memory from torch.cuda.mem_get_info grows across a sleep; here it must grow
  by at least the bytes the tags hold, and fall back at wake. torpor's per-tag mapped_bytes is
  checked beside it, never instead of it.
- torch_memory_saver mode: its test/examples/*.py that apply to CUDA in one process (simple,
  cpu_backup, nested_region, rl_example, training_engine), restated against torpor.tms.
  multi_device needs two GPUs with one region each; it is skipped with one GPU. cuda_graph (its
  preload-mode run: the graph's memory paused with its tag) goes through torpor.graph.

Every test uses tags of its own (the pools are process-wide). Skips (with the reason) without
PyTorch or a CUDA device. Run by `scripts/gpu_run.sh engines`.
"""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (these tests need torch with CUDA)")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no CUDA device", allow_module_level=True)

import torpor  # noqa: E402
from torpor.tms import torch_memory_saver as tms  # noqa: E402
from torpor.vllm import VLLM_TAG_FATES, CuMemAllocator  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture(scope="module", autouse=True)
def configured():
    torpor.configure(backend="cuda", fill_on_wake="poison")
    yield
    torpor.wake_up()


def mapped(*tags) -> int:
    st = torpor.stats(0)["tags"]
    return sum(st[t]["mapped_bytes"] for t in tags if t in st)


def device_free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


# -- vLLM's test_cumem.py ---------------------------------------------------------------------


def test_vllm_basic_cumem():
    allocator = CuMemAllocator.get_instance()
    x = torch.zeros(1024, 1024, device="cuda")  # PyTorch's own memory
    with allocator.use_memory_pool(tag="e.basic"):
        y = torch.zeros(1024, 1024, device="cuda") + 1
        z = torch.zeros(1024, 1024, device="cuda") + 2
    assert torch.allclose(x + y + z, torch.full_like(x, 3))
    before = mapped("e.basic")
    assert before >= y.nbytes + z.nbytes
    free_bytes = device_free()
    allocator.sleep(offload_tags="e.basic")
    free_bytes_after_sleep = device_free()
    assert free_bytes_after_sleep - free_bytes >= y.nbytes + z.nbytes, "the device got the tag's memory back"
    assert mapped("e.basic") == 0
    allocator.wake_up()
    assert free_bytes_after_sleep - device_free() >= y.nbytes + z.nbytes, "wake mapped it again"
    assert mapped("e.basic") == before
    assert torch.allclose(x + y + z, torch.full_like(x, 3))


def test_vllm_discard_tags():
    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool("weights"):
        weights = torch.ones(1024, 1024, device="cuda")
    with allocator.use_memory_pool("kv_cache"):
        kv = torch.ones(512, 512, device="cuda")
    before = mapped("weights", "kv_cache")
    allocator.discard("kv_cache")
    after = mapped("weights", "kv_cache")
    assert before - after >= kv.nbytes and after >= weights.nbytes
    assert torch.allclose(weights, torch.ones_like(weights))
    allocator.wake_up()
    assert kv.shape == (512, 512)
    allocator.sleep(offload_tags="weights")
    allocator.wake_up()
    assert torch.allclose(weights, torch.ones_like(weights))
    del weights, kv


def test_vllm_level_2_discards_every_byte_of_an_unregistered_weights_tag(monkeypatch):
    # vLLM's test poisons the remapped memory with 0xA5; torpor's pools poison it themselves
    # (fill_on_wake="poison": 0xFF). The tag stands for "weights": declared discardable unless listed.
    monkeypatch.setitem(VLLM_TAG_FATES, "e.l2", "listed")
    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool("e.l2"):
        fake_weight = torch.full((4096,), 0x44, dtype=torch.uint8, device="cuda")
        ordinary = torch.full((4096,), 0x55, dtype=torch.uint8, device="cuda")
    pointers = (fake_weight.data_ptr(), ordinary.data_ptr())
    allocator.sleep(offload_tags=())
    allocator.wake_up()
    torch.cuda.synchronize()
    assert (fake_weight.data_ptr(), ordinary.data_ptr()) == pointers
    assert torch.all(fake_weight == 0xFF) and torch.all(ordinary == 0xFF)


def test_vllm_level_2_with_registered_parameters_keeps_everything_but_the_parameters():
    # torpor's upgrade (not in vLLM's tests): the buffer needs no stash, no parameter goes to host.
    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool("e.reg"):
        model = torch.nn.Linear(256, 256, device="cuda")
        model.register_buffer("table", torch.arange(4096, dtype=torch.float32, device="cuda"))
    torpor.register_parameters(model, prefix="e.reg")
    table = model.table.clone()
    allocator.sleep(offload_tags=())
    parameters = torpor.stats(0)["tags"]["e.reg"]["classes"]["parameter"]
    allocator.wake_up()
    assert torch.equal(model.table, table), "the buffer came back bit-exact"
    assert torch.all(torch.isnan(model.weight)), "the parameter was discarded (poisoned)"
    assert parameters["offloaded_bytes"] == 0, f"no parameter copied to host: {parameters}"
    assert parameters["discarded_bytes"] >= model.weight.nbytes + model.bias.nbytes


def test_vllm_cumem_with_cudagraph():
    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool("e.graph_w"):
        weight = torch.eye(1024, device="cuda")
    with allocator.use_memory_pool(tag="e.graph_discard"):
        cache = torch.empty(1024, 1024, device="cuda")

    def model(x):
        out = x @ weight
        cache[: out.size(0)].copy_(out)
        return out + 1

    x = torch.empty(128, 1024, device="cuda")
    model(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = model(x)
    before = mapped("e.graph_w", "e.graph_discard")
    assert before >= weight.nbytes + cache.nbytes
    free_bytes = device_free()
    allocator.sleep(offload_tags="e.graph_w")
    free_bytes_after_sleep = device_free()
    assert free_bytes_after_sleep - free_bytes >= weight.nbytes + cache.nbytes, "the device got the memory back"
    assert mapped("e.graph_w", "e.graph_discard") == 0
    allocator.wake_up()
    assert free_bytes_after_sleep - device_free() >= weight.nbytes + cache.nbytes, "wake mapped it again"
    assert mapped("e.graph_w", "e.graph_discard") == before
    x.random_()
    graph.replay()
    assert torch.allclose(x, cache[: x.size(0)])
    assert torch.allclose(y, x + 1)


def test_vllm_failed_wake_is_a_runtime_error_and_can_be_repeated():
    allocator = CuMemAllocator.get_instance()
    alloc_bytes = int(torch.cuda.mem_get_info()[1] * 0.7)
    with allocator.use_memory_pool("e.error"):
        x = torch.empty(alloc_bytes, dtype=torch.uint8, device="cuda")
    allocator.sleep(offload_tags=())
    y = torch.empty(alloc_bytes, dtype=torch.uint8, device="cuda")
    with pytest.raises(RuntimeError) as e:
        allocator.wake_up()
    assert isinstance(e.value, torpor.TorporError)
    del y
    torch.cuda.empty_cache()
    allocator.wake_up()
    assert not allocator.is_asleep()
    del x


# -- torch_memory_saver's test/examples ---------------------------------------------------------


def test_tms_simple():
    normal = torch.full((1_000_000,), 100, dtype=torch.uint8, device="cuda")
    with tms.region(tag="e.simple"):
        pauseable = torch.full((1_000_000_000,), 100, dtype=torch.uint8, device="cuda")
    address = pauseable.data_ptr()
    before = device_free()
    tms.pause("e.simple")
    paused = device_free()
    assert paused - before > 0.9 * GiB
    tms.resume("e.simple")
    assert paused - device_free() > 0.9 * GiB
    assert pauseable.data_ptr() == address
    assert normal[:3].tolist() == [100, 100, 100]


def test_tms_cuda_graph():
    """torch_memory_saver's test/examples/cuda_graph.py, preload mode (the graph pauseable)."""
    with tms.region(tag="e.kv"):
        kv = torch.full((5, 100_000_000), 1, dtype=torch.float32, device="cuda")
    static_input = torch.zeros((5,), dtype=torch.float32, device="cuda")
    result = {}

    def fn():
        answer = (static_input + kv.mean(dim=1)).mean()
        result["out"] = (torch.ones((1_000_000_000,), device="cuda") * answer).mean()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up, as the example
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with tms.cuda_graph(g, tag="e.graph"):
        fn()
    static_input[...] = 100
    g.replay()
    assert result["out"].item() == 101
    torch.cuda.empty_cache()
    before = device_free()
    tms.pause("e.kv")
    after_kv = device_free()
    assert after_kv - before > 400_000_000
    tms.pause("e.graph")
    assert device_free() - after_kv > 3_000_000_000, "the graph's 4 GB intermediate went back"
    other = torch.zeros((2_500_000_000,), dtype=torch.uint8, device="cuda")
    del other
    torch.cuda.empty_cache()
    tms.resume("e.graph")
    tms.resume("e.kv")
    kv[...] = 2
    static_input[...] = 200
    g.replay()  # the same graph, no re-capture
    assert result["out"].item() == 202


@pytest.mark.parametrize("backend", ["mmap", "pinned"])
def test_tms_cpu_backup(backend):
    """test/examples/cpu_backup.py at 4a43c97: both backends, then the zero-copy slot's address."""
    with tms.region(tag="e.cpu", enable_cpu_backup=True, cpu_backup_backend=backend):
        with_backup = torch.full((20_000_000,), 10, dtype=torch.uint8, device="cuda")
        typed = torch.randn((10, 20, 30), dtype=torch.float32, device="cuda")
        typed_expected = typed.cpu()
    with tms.region(tag="e.cpu", enable_cpu_backup=False):
        without_backup = torch.full((20_000_000,), 20, dtype=torch.uint8, device="cuda")
    tms.pause("e.cpu")
    actual = tms.get_cpu_backup(typed)
    assert actual is not None and torch.equal(actual, typed_expected)
    unrelated = torch.full((20_000_000,), 30, dtype=torch.uint8, device="cuda")
    tms.resume("e.cpu")
    assert with_backup[:3].tolist() == [10, 10, 10]
    assert without_backup[:3].tolist() != [20, 20, 20]
    assert tms.get_cpu_backup(typed) is None
    tms.retain_cpu_backup = True
    try:
        tms.pause("e.cpu")
        tms.resume("e.cpu")
        assert torch.equal(tms.get_cpu_backup(typed), typed_expected), "retained after resume"
    finally:
        tms.retain_cpu_backup = False
    tms.pause("e.cpu")
    tms.resume("e.cpu")
    assert tms.get_cpu_backup(typed) is None
    del unrelated
    expected = torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8)
    with tms.region(tag=f"e.zc.{backend}", enable_cpu_backup=True, cpu_backup_backend=backend):
        retained = expected.to("cuda")
    tms.pause(f"e.zc.{backend}")
    first = tms.get_cpu_backup(retained, zero_copy=True)
    first_ptr = first.data_ptr()
    assert torch.equal(first, expected)
    assert first.is_pinned() == (backend == "pinned")
    tms.retain_cpu_backup = True
    try:
        tms.resume(f"e.zc.{backend}")
        after = tms.get_cpu_backup(retained, zero_copy=True)
        assert after.data_ptr() == first_ptr and torch.equal(after, expected)
        retained.add_(1)
        tms.pause(f"e.zc.{backend}")
        assert torch.equal(first, (expected + 1)), "the pause renewed the slot in place"
    finally:
        tms.retain_cpu_backup = False
    tms.resume(f"e.zc.{backend}")
    assert tms.get_cpu_backup(retained) is None
    assert torch.equal(retained.cpu(), expected + 1)


def test_tms_nested_region():
    with tms.region(tag="e.outer", enable_cpu_backup=True):
        outer = torch.full((MiB,), 1, dtype=torch.uint8, device="cuda")
        with tms.region(tag="e.inner", enable_cpu_backup=False):
            inner = torch.full((MiB,), 2, dtype=torch.uint8, device="cuda")
        after = torch.full((MiB,), 3, dtype=torch.uint8, device="cuda")
    tms.pause("e.inner")
    assert mapped("e.inner") == 0 and mapped("e.outer") > 0
    tms.resume("e.inner")
    tms.pause("e.outer")
    tms.resume("e.outer")
    assert outer[:2].tolist() == [1, 1] and after[:2].tolist() == [3, 3]
    assert inner[:2].tolist() != [2, 2], "the inner region had no backup"


def test_tms_rl_example_and_training_engine():
    # An inference engine (weights with backup, KV cache without) and a trainer taking turns.
    with tms.region(tag="e.rl_weights", enable_cpu_backup=True):
        weights = torch.randn(64 * MiB // 4, device="cuda")
    with tms.region(tag="e.rl_kv"):
        kv = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    expected = weights.clone().cpu()
    for step in range(3):
        tms.pause("e.rl_kv")
        tms.pause("e.rl_weights")
        assert mapped("e.rl_weights", "e.rl_kv") == 0
        trainer = torch.randn(256 * MiB // 4, device="cuda")  # the trainer's turn
        expected += 1
        del trainer
        torch.cuda.empty_cache()
        tms.resume("e.rl_weights")
        weights += 1  # the "weight sync"
        tms.resume("e.rl_kv")
        kv.fill_(step)
        assert torch.equal(weights.cpu(), expected)


def test_tms_multi_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("torch_memory_saver's multi_device example needs two GPUs (one region on each)")
    for d in range(2):
        with torch.cuda.device(d), tms.region(tag=f"e.dev{d}", enable_cpu_backup=True):
            x = torch.full((MiB,), d + 1, dtype=torch.uint8, device=f"cuda:{d}")
        tms.pause(f"e.dev{d}")
        tms.resume(f"e.dev{d}")
        assert x[:2].tolist() == [d + 1, d + 1]
