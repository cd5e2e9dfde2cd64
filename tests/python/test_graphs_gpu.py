"""GPU: CUDA graphs captured into torpor (issue 16), with real PyTorch.

A Llama-style decoder (python/examples/graph_decoder.py, small config) lives in torpor pools and
its decode step is captured once with torpor.graph. Checked, each against an oracle that does
not go through the code under test:

- greedy tokens after sleep(1) and after sleep(2) + weight reload equal the tokens before,
  replaying the same graph object (never captured again); discarded bytes are poisoned (NaN),
  so a graph reading memory it did not rewrite cannot pass;
- sleeping a graph pool's tag raises cudaMemGetInfo's free memory by >= 99.9% of that tag's
  mapped bytes (a graph with a 256 MiB intermediate), and the replay after wake recomputes the
  value a host computation gives;
- the same graph captured with plain torch.cuda.graph keeps its private pool on the device
  while torpor sleeps (the comparison);
- torch.cuda.graph(pool=torpor.graph_pool(tag)) allocates in torpor; mark_state keeps an output
  through level 2; a graph with CUDA graph memory nodes is refused; CUDA's graph allocator
  holds nothing.

Skips (with the reason) without PyTorch or a CUDA device. Run by `scripts/gpu_run.sh graphs`.
"""

import ctypes
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (these tests need torch with CUDA)")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no CUDA device", allow_module_level=True)

import torpor  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python" / "examples"))
from graph_decoder import DecodeStep, DecoderConfig, DecoderForCausalLM, StaticKVCache, generate  # noqa: E402

CFG = DecoderConfig(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
BATCH, PROMPT, NEW = 8, 16, 32
BIG = 256 << 20  # the intermediate of the memory tests, in bytes


class Engine:
    pass


@pytest.fixture(scope="module")
def engine():
    torpor.configure(backend="cuda", fill_on_wake="poison")
    e = Engine()
    with torpor.use_pool("weights"):
        e.model = DecoderForCausalLM(CFG, device="cuda").eval()
    e.model.init_weights(0)
    torpor.register_parameters(e.model)
    e.checkpoint = {n: p.detach().cpu().clone() for n, p in e.model.named_parameters()}
    with torpor.use_pool("kv_cache"):
        e.cache = StaticKVCache(CFG, BATCH)
        e.step = DecodeStep(e.model, e.cache, BATCH)
    e.step.capture(lambda g: torpor.graph(g))
    e.graph = e.step.graph
    gen = torch.Generator().manual_seed(1)
    e.prompt = torch.randint(0, CFG.vocab_size, (BATCH, PROMPT), generator=gen).cuda()
    e.expected = generate(e.model, e.cache, e.step, e.prompt, NEW)
    yield e
    torpor.wake_up()


def reload(e):
    with torch.no_grad():
        for n, p in e.model.named_parameters():
            p.copy_(e.checkpoint[n])


def device_pool():
    return torpor.pools()[torch.cuda.current_device()]


def tag_stats(tag):
    return device_pool().stats()["tags"][tag]


def test_the_decode_graph_keeps_its_memory_in_torpor(engine):
    assert device_pool().contains(engine.step.next_tokens.data_ptr()), "the graph's output is in torpor"
    graph_tag = tag_stats(torpor.tags.CUDA_GRAPH)
    assert graph_tag["classes"]["cache"]["allocated_bytes"] > 0 and graph_tag["mapped_bytes"] > 0
    assert graph_tag["classes"]["state"]["allocated_bytes"] == 0
    assert torpor.graph_memory()["reserved"] == 0, "no graph memory in CUDA's graph allocator"
    # Not a torpor result: a plain PyTorch forward of the same model agrees with the graph.
    with torch.no_grad():
        positions = torch.arange(PROMPT, device="cuda")[None, :].expand(BATCH, PROMPT)
        first = engine.model(engine.prompt, positions, engine.cache)[:, -1].argmax(-1)
    assert torch.equal(first, engine.expected[:, 0])


@pytest.mark.parametrize("level", [1, 2])
def test_same_tokens_after_sleep_replaying_the_same_graph(engine, level):
    torpor.sleep(level)
    stats = tag_stats(torpor.tags.CUDA_GRAPH)
    assert stats["asleep"] and stats["mapped_bytes"] == 0, "the graph pool's memory went back"
    torpor.wake_up(["weights"])
    if level == 2:
        reload(engine)
    torpor.wake_up()
    got = generate(engine.model, engine.cache, engine.step, engine.prompt, NEW)
    assert torch.equal(got, engine.expected), f"greedy tokens after a level-{level} sleep"
    assert engine.step.captures == 1 and engine.step.graph is engine.graph, "no re-capture"


SAMPLED = BIG // 4 // 4096  # elements of the intermediate the output sums


def big_graph(capture):
    """A graph whose intermediate is BIG bytes, every element set to x; out = 3 * the sum of
    every 4096th element = 3 * x * SAMPLED (exact in fp32 for the values used)."""
    x = torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with capture(g):
        big = torch.empty(BIG // 4, device="cuda")
        big.copy_(x.expand(BIG // 4))
        out = big[::4096].sum() * 3
        del big
    return g, x, out


def used_bytes():
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_sleeping_a_graph_tag_returns_its_memory_and_the_replay_recomputes(engine):
    g, x, out = big_graph(lambda graph: torpor.graph(graph, tag="gt.big"))
    x.fill_(2.0)
    g.replay()
    torch.cuda.synchronize()
    assert out.item() == 3 * 2.0 * SAMPLED
    mapped = tag_stats("gt.big")["mapped_bytes"]
    assert mapped >= BIG
    before = used_bytes()
    torpor.sleep(1, ["gt.big"])
    asleep = used_bytes()
    print(f"\ngraph pool 'gt.big': {mapped} bytes mapped; device memory in use fell by {before - asleep} bytes")
    assert before - asleep >= 0.999 * mapped
    torpor.wake_up(["gt.big"])
    assert torch.isnan(out).item(), "the output was discarded (cache), so the next value is the replay's"
    x.fill_(0.5)
    g.replay()
    torch.cuda.synchronize()
    assert out.item() == 3 * 0.5 * SAMPLED


def test_a_graph_captured_outside_torpor_keeps_its_memory_while_torpor_sleeps(engine):
    torch.cuda.empty_cache()  # torch.cuda.graph empties the cache itself: measure after that
    before_capture = used_bytes()
    g, x, out = big_graph(lambda graph: torch.cuda.graph(graph))
    g.replay()
    pool_bytes = sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == g.pool())
    assert pool_bytes >= BIG and not device_pool().contains(out.data_ptr())
    assert used_bytes() - before_capture >= BIG
    torpor.sleep(1)
    try:
        asleep = used_bytes()
        still = sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == g.pool())
        print(f"\ngraph captured outside torpor: {still} bytes of its pool resident while torpor sleeps")
        assert still == pool_bytes, "PyTorch keeps a live graph's private pool"
        assert asleep >= pool_bytes, "and the device still holds it"
    finally:
        torpor.wake_up()
    x.fill_(1.0)
    g.replay()
    torch.cuda.synchronize()
    assert out.item() == 3.0 * SAMPLED
    del g


def test_torch_cuda_graph_with_a_torpor_graph_pool(engine):
    pool_id = torpor.graph_pool("gt.raw")
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool_id):
        y = x * 2 + 1
    assert device_pool().contains(y.data_ptr()) and tag_stats("gt.raw")["classes"]["cache"]["allocated_bytes"] > 0
    torpor.sleep(2, ["gt.raw"])
    assert tag_stats("gt.raw")["mapped_bytes"] == 0
    torpor.wake_up(["gt.raw"])
    g.replay()
    assert torch.equal(y, torch.arange(1 << 20, dtype=torch.float32, device="cuda") * 2 + 1)


def test_mark_state_keeps_a_graph_output_through_level_2(engine):
    x = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torpor.graph(g, tag="gt.state"):
        kept = x * 3
        dropped = x * 5
    g.replay()
    torch.cuda.synchronize()
    torpor.mark_state(kept)
    want = kept.cpu()
    torpor.sleep(2, ["gt.state"])
    torpor.wake_up(["gt.state"])
    assert torch.equal(kept.cpu(), want), "declared state survives level 2 bit-exact, no replay needed"
    assert torch.isnan(dropped).all(), "an undeclared output of a graph pool is cache (poisoned on wake)"


def test_a_graph_with_memory_nodes_is_refused(engine):
    try:
        keep = torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        pytest.skip("this PyTorch has no CUDAGraph(keep_graph=True): memory nodes cannot be listed")
    x = torch.ones(1024, device="cuda")
    with torpor.graph(keep, tag="gt.nodes"):
        y = x + 1
    assert torpor.memory_nodes(keep) == 0
    keep.replay()
    assert torch.equal(y, x + 1)

    cuda = ctypes.CDLL("libcuda.so.1")
    bad = torch.cuda.CUDAGraph(keep_graph=True)
    with pytest.raises(torpor.InvalidState, match=r"has [0-9]+ CUDA graph memory node"):
        with torpor.graph(bad, tag="gt.nodes"):
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            ptr = ctypes.c_uint64(0)
            assert cuda.cuMemAllocAsync(ctypes.byref(ptr), ctypes.c_size_t(1 << 20), stream) == 0
            assert cuda.cuMemFreeAsync(ptr, stream) == 0
    del bad
