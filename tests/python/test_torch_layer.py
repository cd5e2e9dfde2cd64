"""The PyTorch embedding (torpor.use_pool, register_parameters, sleep, wake_up, stats,
CuMemAllocator) in CI: against fake_torch, a stand-in for the few PyTorch calls it makes,
with device memory from torpor's host backend through the real pluggable entry points.
The real thing runs in test_torch_gpu.py on a GPU."""

import sys

import pytest

import fake_torch
import torpor
from torpor import engine
from torpor.torch import api, parameters, remark
from torpor.vllm import VLLM_TAG_FATES
from conftest import MiB, POISON, TORCH_POOL_OPTIONS, pattern, fresh_torch_layer


@pytest.fixture
def torch(monkeypatch):
    torpor.configure(**TORCH_POOL_OPTIONS)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    fresh_torch_layer(monkeypatch)
    yield fake_torch
    torpor.wake_up()


def current_tag():
    lib = torpor._lib.lib()
    return lib.torpor_current_tag().decode(), torpor.MemoryClass(lib.torpor_current_class())


def test_use_pool_routes_allocations_to_its_tag_and_restores_the_thread(torch):
    with torpor.use_pool("tl.weights"):
        assert current_tag() == ("tl.weights", torpor.MemoryClass.STATE)
        w = torch.empty(MiB)
        with torpor.use_pool("tl.scratch", memory_class="cache"):
            assert current_tag() == ("tl.scratch", torpor.MemoryClass.CACHE)
            s = torch.empty(3 * MiB)
        assert current_tag() == ("tl.weights", torpor.MemoryClass.STATE)
        with torpor.use_pool("kv_cache"):
            kv = torch.empty(MiB)
    assert current_tag() == ("default", torpor.MemoryClass.STATE)
    pool = torpor.pools()[0]
    assert all(pool.contains(t.data_ptr()) for t in (w, s, kv))
    assert not pool.contains(torch.empty(MiB).data_ptr()), "outside use_pool: PyTorch's own pool"
    tags = torpor.stats(0)["tags"]
    # PyTorch's segment sizes: 1 MiB is small (a 2 MiB segment); 3 MiB is large and below
    # 10 MiB, so it gets a 20 MiB segment to split.
    assert tags["tl.weights"]["classes"]["state"]["allocated_bytes"] == 2 * MiB  # one segment
    assert tags["tl.scratch"]["classes"]["cache"]["allocated_bytes"] == 20 * MiB
    assert tags["kv_cache"]["classes"]["cache"]["allocated_bytes"] >= 2 * MiB, "kv_cache is cache by default"


def test_register_parameters_marks_named_spans_and_reports_the_rest(torch):
    with torpor.use_pool("tl.reg"):
        a = torch.empty(64 * 64 * 4, shape=(64, 64))
        b = torch.empty(256 * 4, shape=(256,))
        torch.empty(8192)  # a buffer
    outside, cpu = torch.empty(4096), torch.CPUTensor(64)
    module = torch.nn.Module(a=a, b=b, c=outside, d=cpu)
    reg = torpor.register_parameters(module, preserve="tl.a", prefix="tl")
    assert (reg.parameters, reg.nbytes, reg.outside) == (2, 16384 + 1024, ["tl.c", "tl.d"])
    assert torpor.stats(0)["tags"]["tl.reg"]["classes"]["parameter"]["allocated_bytes"] == 17408
    with pytest.raises(torpor.InvalidArgument, match="not a torch.nn.Module"):
        torpor.register_parameters(object())
    with pytest.raises(torpor.InvalidArgument, match="preserve glob '' is not a non-empty string"):
        torpor.register_parameters(module, preserve=[""])


def test_sleep_2_follows_what_pytorch_did_with_the_blocks(torch):
    pool = torpor.Pool.torch(0)
    with torpor.use_pool("tl.model"):
        w1 = torch.empty(64 << 10)
        rope = torch.empty(8 << 10)  # a buffer computed at load
        temp = torch.empty(128 << 10)  # a load-time temporary
        old = torch.empty(32 << 10)  # a parameter the loader will replace
    module = torch.nn.Module(w1=w1, w2=old)
    torpor.register_parameters(module)
    with torpor.use_pool("tl.model"):
        new = torch.empty(32 << 10)  # the loader's new storage for w2 ...
        module._parameters["w2"] = new
        old.free()
        flags = torch.empty(32 << 10)  # ... and state that reuses the old parameter's block
    temp.free()
    assert flags.data_ptr() == old.data_ptr(), "the fake reuses the freed block (first fit), as PyTorch may"
    for i, t in enumerate((w1, rope, new, flags)):
        pool.write(t.data_ptr(), pattern(t._nbytes, i))

    reports = torpor.sleep(2, "tl.model")
    # Offloaded: rope and flags, the tails of rounded blocks; never free space or parameters.
    assert reports[0]["bytes_offloaded"] == (8 << 10) + (32 << 10)
    torpor.wake_up("tl.model")
    assert pool.read(rope.data_ptr(), 8 << 10) == pattern(8 << 10, 1)
    assert pool.read(flags.data_ptr(), 32 << 10) == pattern(32 << 10, 3), "stale parameter class was refreshed"
    assert pool.read(w1.data_ptr(), 64 << 10) == POISON * (64 << 10)
    assert pool.read(new.data_ptr(), 32 << 10) == POISON * (32 << 10), "the replacement is a parameter"


def test_entering_a_sleeping_tag_is_refused(torch):
    with torpor.use_pool("tl.sleeper"):
        torch.empty(MiB)  # leaves a cached free MiB that PyTorch would hand out without asking
    torpor.sleep(1, "tl.sleeper")
    with pytest.raises(
        torpor.InvalidState,
        match=r"use_pool: tag 'tl.sleeper' is asleep on device 0 \(level 1\); " r"wake_up\(\['tl.sleeper'\]\)",
    ):
        with torpor.use_pool("tl.sleeper"):
            pytest.fail("entered")
    assert current_tag() == ("default", torpor.MemoryClass.STATE)
    torpor.wake_up("tl.sleeper")
    with torpor.use_pool("tl.sleeper"):
        torch.empty(MiB)


def test_a_refused_segment_raises_torpors_error_from_pytorchs(torch):
    with pytest.raises(
        torpor.InvalidState,
        match=r"PyTorch could not allocate in torpor pool 'tl.slept' on " r"device 0: .*'tl.slept' is asleep",
    ) as info:
        with torpor.use_pool("tl.slept"):
            torch.empty(MiB)
            torpor.sleep(1, "tl.slept")  # inside the block: only torpor_torch_malloc can tell
            torch.empty(4 * MiB)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert current_tag() == ("default", torpor.MemoryClass.STATE)


def test_other_errors_in_a_pool_pass_through(torch):
    with pytest.raises(torch.OutOfMemoryError, match="not torpor's"):
        with torpor.use_pool("tl.other"):
            raise torch.OutOfMemoryError("not torpor's")
    with pytest.raises(KeyError):
        with torpor.use_pool("tl.other"):
            raise KeyError("x")


def test_bad_calls_are_typed_errors(torch):
    with pytest.raises(torpor.InvalidArgument, match="unknown memory class 'nope'"):
        with torpor.use_pool("tl.cls", memory_class="nope"):
            pass
    with pytest.raises(torpor.InvalidArgument, match=r"sleep: level 5 is out of range \(accepted: 0 to 2\)"):
        torpor.sleep(5)  # the one level check of every boundary (torpor.values.sleep_level)
    with pytest.raises(torpor.InvalidType, match="sleep: level True is not a whole number"):
        torpor.sleep(True)
    with pytest.raises(torpor.InvalidArgument, match="sleep: unknown tag 'nope'"):
        torpor.sleep(1, ["nope"])
    with pytest.raises(torpor.InvalidArgument, match="use_pool: tag '' is not a non-empty string"):
        torpor.use_pool("").__enter__()
    with pytest.raises(torpor.InvalidArgument, match="no torpor pool on device 3"):
        torpor.stats(3)
    assert torpor.wake_up([]) == {} and torpor.sleep(1, []) == {}


def test_expandable_segments_are_off_inside_torpor_pools(torch, monkeypatch):
    torch.settings_calls.clear()
    with torpor.use_pool("tl.exp"):
        pass
    assert torch.settings_calls == []
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64, expandable_segments:True")
    off = "max_split_size_mb:64,expandable_segments:False"  # the whole string: PyTorch resets what it omits
    with torpor.use_pool("tl.exp"):
        with torpor.use_pool("tl.exp"):
            assert torch.settings_calls == [off]
        assert torch.settings_calls == [off], "only the outermost exit turns them on"
    assert torch.settings_calls == [off, "max_split_size_mb:64,expandable_segments:True"], "the user's max_split stays"


def test_segments_torpor_did_not_map_are_reported_at_sleep(torch):
    with torpor.use_pool("tl.foreign") as pool:
        torch.empty(MiB)
    pool.extra_segments.append(
        {
            "device": 0,
            "address": 0x7FFF_0000_0000,
            "total_size": 2 * MiB,
            "is_expandable": True,
            "segment_pool_id": pool.id,
            "blocks": [{"size": 2 * MiB, "state": "active_allocated"}],
        }
    )
    with pytest.warns(RuntimeWarning, match=r"1 segment\(s\) of torpor pool 'tl.foreign' .*expandable"):
        torpor.sleep(1, "tl.foreign")


def test_sleep_and_wake_restore_the_current_device(torch):
    with torpor.use_pool("tl.dev"):
        torch.empty(MiB)
    calls = torch.current["set_device_calls"]
    torpor.sleep(1, "tl.dev")
    torpor.wake_up("tl.dev")
    assert torch.current["set_device_calls"] == calls + 2 and torch.cuda.current_device() == 0


def test_vllm_cumem_allocator_maps_offload_tags_to_levels(torch, monkeypatch):
    for tag in ("tl.vllm_weights", "tl.vllm_other"):  # tags of this test, declared discardable as vLLM's own
        monkeypatch.setitem(VLLM_TAG_FATES, tag, "listed")
    allocator = torpor.CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="tl.vllm_weights"):
        torch.empty(MiB)
    with allocator.use_memory_pool(tag="tl.vllm_other"):
        torch.empty(MiB)
    assert allocator.get_current_usage() >= 4 * MiB
    allocator.sleep(offload_tags="tl.vllm_weights")
    tags = torpor.stats(0)["tags"]
    assert (tags["tl.vllm_weights"]["level"], tags["tl.vllm_other"]["level"]) == (1, 2)
    allocator.wake_up(["tl.vllm_weights"])
    tags = torpor.stats(0)["tags"]
    # vLLM: a selective wake defers only "weights" and "kv_cache" (test_vllm_mode.py has the rest).
    assert not tags["tl.vllm_weights"]["asleep"] and not tags["tl.vllm_other"]["asleep"]
    allocator.sleep(offload_tags=())
    allocator.wake_up()
    assert not any(t["asleep"] for t in torpor.stats(0)["tags"].values())


def test_sleep_marks_in_one_call_per_tag_and_collects_only_young_objects(torch, monkeypatch):
    with torpor.use_pool("tl.many"):
        params = {f"w{i}": torch.empty(4096) for i in range(200)}
    module = torch.nn.Module(**params)
    torpor.register_parameters(module)
    lib = torpor._lib.lib()
    calls = {"mark": 0, "mark_ranges": 0}
    for name in calls:
        real = getattr(lib, f"torpor_{name}")

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(lib, f"torpor_{name}", counted)
    generations = []
    real_collect = api.gc.collect
    monkeypatch.setattr(api.gc, "collect", lambda g=2: generations.append(g) or real_collect(g))
    report = torpor.sleep(2, "tl.many")
    assert report[0]["bytes_discarded"] >= 200 * 4096, "every parameter was marked"
    assert calls == {"mark": 0, "mark_ranges": 1}, "one C call marks every block and parameter"
    assert generations == [1], "no full collection by default"
    torpor.wake_up("tl.many")
    torpor.sleep(1, "tl.many", collect=2)
    assert generations == [1, 2]
    torpor.wake_up("tl.many")
    torpor.sleep(1, "tl.many", collect=None)
    assert generations == [1, 2]
    with pytest.raises(torpor.InvalidArgument, match="collect 3"):
        torpor.sleep(1, "tl.many", collect=3)


# -- the last re-mark: kept while nothing changed, redone when anything did ------------------


@pytest.fixture
def counted(torch, monkeypatch):
    """{"snapshot": n, "mark_ranges": n}: calls made by the sleeps that follow."""
    calls = {"snapshot": 0, "mark_ranges": 0}
    real_snapshot = torch.MemPool.snapshot
    monkeypatch.setattr(
        torch.MemPool,
        "snapshot",
        lambda self: calls.__setitem__("snapshot", calls["snapshot"] + 1) or real_snapshot(self),
    )
    lib = torpor._lib.lib()
    real_mark_ranges = lib.torpor_mark_ranges

    def mark_ranges(*args):
        calls["mark_ranges"] += 1
        return real_mark_ranges(*args)

    monkeypatch.setattr(lib, "torpor_mark_ranges", mark_ranges)
    return calls


def classes(tag):
    return {c: v["allocated_bytes"] for c, v in torpor.stats(0)["tags"][tag]["classes"].items() if v["allocated_bytes"]}


def test_an_unchanged_sleep_reuses_the_last_remark_without_a_snapshot(torch, counted):
    with torpor.use_pool("tl.same"):
        w = torch.empty(64 << 10)
        torch.empty(16 << 10)  # state
    module = torch.nn.Module(w=w)
    torpor.register_parameters(module)
    counted.update(snapshot=0, mark_ranges=0)  # what use_pool's exit and register_parameters did
    first = torpor.sleep(1, "tl.same")[0]
    torpor.wake_up("tl.same")
    assert counted == {"snapshot": 1, "mark_ranges": 1}
    again = torpor.sleep(1, "tl.same")[0]
    torpor.wake_up("tl.same")
    assert counted == {"snapshot": 1, "mark_ranges": 1}, "nothing allocated, freed or marked: nothing redone"
    assert again["bytes_offloaded"] + again["bytes_skipped"] == first["bytes_offloaded"] + first["bytes_skipped"]
    torch.live_checks.clear()
    torch.empty(MiB)  # PyTorch's default pool: the counters move, torpor's MemPools hold the same blocks
    torpor.sleep(1, "tl.same")
    torpor.wake_up("tl.same")
    assert counted == {"snapshot": 1, "mark_ranges": 1}, "an allocation elsewhere needs no snapshot"
    assert len(torch.live_checks) == 1, "one check of the MemPool's live blocks instead"
    assert classes("tl.same") == {"parameter": 64 << 10, "state": 16 << 10, "cache": 2 * MiB - (80 << 10)}
    counted.update(snapshot=0)  # classes() read torpor.stats(), which reads the snapshots
    torch._C._cuda_checkPoolLiveAllocations = None  # a PyTorch without the check: the snapshots tell
    try:
        torch.empty(MiB)
        torpor.sleep(1, "tl.same")
        torpor.wake_up("tl.same")
    finally:
        torch._C._cuda_checkPoolLiveAllocations = torch._check_pool_live_allocations
    assert counted == {"snapshot": 1, "mark_ranges": 1}, "the snapshots were taken, equal: no marks"


def test_a_block_allocated_where_a_freed_one_was_is_seen_by_the_next_sleep(torch, counted):
    """The same live addresses, another block: only the count of use_pool blocks tells."""
    with torpor.use_pool("tl.reuse"):
        first = torch.empty(64 << 10)
    torpor.sleep(1, "tl.reuse")
    torpor.wake_up("tl.reuse")
    assert classes("tl.reuse")["state"] == 64 << 10
    first.free()
    with torpor.use_pool("tl.reuse"):
        smaller = torch.empty(16 << 10)  # PyTorch's first fit: the freed block's address
    assert smaller.data_ptr() == first.data_ptr()
    counted.update(snapshot=0, mark_ranges=0)
    torpor.sleep(1, "tl.reuse")
    torpor.wake_up("tl.reuse")
    assert counted == {"snapshot": 1, "mark_ranges": 1}
    assert classes("tl.reuse")["state"] == 16 << 10, "the rest of the freed block is free space"


def test_a_re_mark_of_a_tag_under_another_policy_makes_the_others_of_that_tag_stale(torch, counted):
    """Each (tags, policy) keeps its own last re-mark; one that re-marks a tag's segments
    (here: everything cache) must not leave another's stale view of that tag in place."""
    pool = torpor.Pool.torch(0)
    with torpor.use_pool("tl.policy"):
        s = torch.empty(32 << 10)
    torpor.sleep(1, "tl.policy")
    torpor.wake_up("tl.policy")
    engine.sleep(1, ["tl.policy"], lambda tag, cls, has_parameters: torpor.MemoryClass.CACHE)
    torpor.wake_up("tl.policy")
    pool.write(s.data_ptr(), pattern(32 << 10, 3))
    torpor.sleep(1, "tl.policy")
    torpor.wake_up("tl.policy")
    assert pool.read(s.data_ptr(), 32 << 10) == pattern(32 << 10, 3), "state again, kept"


def test_parameter_spans_are_computed_again_only_when_a_parameter_changed(torch, monkeypatch):
    """The spans of a registered module are kept between sleeps; anything a weight loader or a
    module method can change about a parameter makes them computed again, and right."""
    with torpor.use_pool("tl.spans"):
        a, b, c = torch.empty(8192), torch.empty(8192), torch.empty(16384)
    module = torch.nn.Module(a=a, inner=torch.nn.Module(b=b))
    computed = []
    real = parameters.computed_spans
    monkeypatch.setattr(parameters, "computed_spans", lambda *args: computed.append(1) or real(*args))

    def spans():
        return [(s.name, s.address, s.nbytes) for s in parameters.parameter_spans([(module, "m")])[0]]

    want = [("m.a", a.data_ptr(), 8192), ("m.inner.b", b.data_ptr(), 8192)]
    assert spans() == want and len(computed) == 1
    assert spans() == want and len(computed) == 1, "nothing changed: the kept spans"
    a._address = c.data_ptr()  # p.data = t: the same object, its storage elsewhere
    assert spans() == [("m.a", c.data_ptr(), 8192), ("m.inner.b", b.data_ptr(), 8192)] and len(computed) == 2
    a.shape = (1024,)  # p.data = p.data[:1024]: the same address, fewer bytes
    assert spans() == [("m.a", c.data_ptr(), 4096), ("m.inner.b", b.data_ptr(), 8192)] and len(computed) == 3
    module._modules["inner"]._parameters["b"] = c  # replaced in the dict, no hook
    assert spans()[1] == ("m.inner.b", c.data_ptr(), 16384) and len(computed) == 4
    del module._modules["inner"]._parameters["b"]
    assert spans() == [("m.a", c.data_ptr(), 4096)] and len(computed) == 5
    module._parameters["renamed"] = module._parameters.pop("a")
    assert spans() == [("m.renamed", c.data_ptr(), 4096)] and len(computed) == 6


def test_a_dead_modules_kept_spans_go_with_it(torch):
    with torpor.use_pool("tl.dead"):
        w = torch.empty(4096)
    module = torch.nn.Module(w=w)
    torpor.register_parameters(module)
    assert (id(module), "") in parameters.registry.spans
    del module
    parameters.live_modules()
    assert parameters.registry.spans == {}


def test_sleeps_with_ever_new_tag_lists_keep_a_bounded_number_of_re_marks(torch):
    tags = [f"tl.many{i}" for i in range(remark.REMARKS_KEPT + 4)]
    for tag in tags:
        with torpor.use_pool(tag):
            torch.empty(4096)
    for tag in tags:
        torpor.sleep(1, tag)
        torpor.wake_up(tag)
    kept = [key[1] for key in remark.cache.remarks]
    assert kept == [(t,) for t in tags[-remark.REMARKS_KEPT :]], "the most recent ones, oldest first"


def test_parameters_are_named_as_named_parameters_names_them(torch):
    with torpor.use_pool("tl.names"):
        a, b, c = torch.empty(4096), torch.empty(4096), torch.empty(4096)
    inner = torch.nn.Module(b=b, shared=a, missing=None)
    module = torch.nn.Module(a=a, inner=inner, again=inner, deeper=torch.nn.Module(c=c))
    spans = parameters.parameter_spans([(module, "m")])
    assert [(s.name, s.address, s.nbytes) for s in spans[0]] == [
        ("m.a", a.data_ptr(), 4096),
        ("m.inner.b", b.data_ptr(), 4096),
        ("m.deeper.c", c.data_ptr(), 4096),
    ], "each parameter once, under its first name; a module listed twice is walked once"
    assert [n for n, _ in module.named_parameters(prefix="m")] == ["m.a", "m.inner.b", "m.deeper.c"]


def test_a_tensor_freed_after_a_sleep_is_free_space_at_the_next(torch, counted):
    with torpor.use_pool("tl.freed"):
        torch.empty(64 << 10)  # kept
        temp = torch.empty(128 << 10)
    torpor.sleep(1, "tl.freed")
    torpor.wake_up("tl.freed")
    assert classes("tl.freed")["state"] == 192 << 10
    temp.free()
    report = torpor.sleep(1, "tl.freed")[0]
    assert classes("tl.freed")["state"] == 64 << 10, "the freed block is cache"
    assert report["bytes_offloaded"] + report["bytes_skipped"] == 64 << 10
    torpor.wake_up("tl.freed")


def test_a_block_allocated_in_cached_free_space_after_a_sleep_survives_the_next(torch, counted):
    pool = torpor.Pool.torch(0)
    with torpor.use_pool("tl.grow"):
        torch.empty(64 << 10)
    torpor.sleep(1, "tl.grow")
    torpor.wake_up("tl.grow")
    with torpor.use_pool("tl.grow"):
        late = torch.empty(32 << 10)  # in the segment's free tail, which the last sleep classed cache
    pool.write(late.data_ptr(), pattern(32 << 10, 5))
    torpor.sleep(1, "tl.grow")
    torpor.wake_up("tl.grow")
    assert pool.read(late.data_ptr(), 32 << 10) == pattern(32 << 10, 5)


def test_a_parameter_reassigned_after_a_sleep_is_followed_by_the_next(torch, counted):
    pool = torpor.Pool.torch(0)
    with torpor.use_pool("tl.swap"):
        a, b = torch.empty(32 << 10), torch.empty(32 << 10)
    module = torch.nn.Module(w=a)
    torpor.register_parameters(module)
    torpor.sleep(1, "tl.swap")
    torpor.wake_up("tl.swap")
    module._parameters["w"] = b  # p.data = b: no allocation, no free, only the span moves
    pool.write(a.data_ptr(), pattern(32 << 10, 1))
    torpor.sleep(2, "tl.swap")
    torpor.wake_up("tl.swap")
    assert pool.read(a.data_ptr(), 32 << 10) == pattern(32 << 10, 1), "a is state now"
    assert pool.read(b.data_ptr(), 32 << 10) == POISON * (32 << 10), "b is the parameter"


def test_a_mark_made_by_anyone_after_a_sleep_is_recomputed_by_the_next(torch, counted):
    pool = torpor.Pool.torch(0)
    with torpor.use_pool("tl.marked"):
        s = torch.empty(32 << 10)
    torpor.sleep(1, "tl.marked")
    torpor.wake_up("tl.marked")
    pool.mark(s.data_ptr(), 32 << 10, "parameter")  # not a registered parameter: the next sleep says state
    pool.write(s.data_ptr(), pattern(32 << 10, 2))
    torpor.sleep(2, "tl.marked")
    torpor.wake_up("tl.marked")
    assert pool.read(s.data_ptr(), 32 << 10) == pattern(32 << 10, 2)


def test_a_new_mempool_of_a_tag_after_a_sleep_is_marked_by_the_next(torch, counted):
    with torpor.use_pool("tl.two"):
        torch.empty(32 << 10)
    torpor.sleep(1, "tl.two")
    torpor.wake_up("tl.two")
    with torpor.use_pool("tl.two", memory_class="cache"):
        scratch = torch.empty(32 << 10)
    torpor.sleep(1, "tl.two")
    torpor.wake_up("tl.two")
    assert classes("tl.two")["state"] == 32 << 10, "the cache MemPool's block is cache"
    assert torpor.Pool.torch(0).contains(scratch.data_ptr())


def test_counters_reset_by_pytorch_are_not_trusted(torch):
    assert remark.block_counters(torch, 0) is not None
    with torpor.use_pool("tl.reset"):
        torch.empty(4096)  # a live block: after the reset, allocated - freed is not current
    torch.reset_accumulated_memory_stats(0)
    assert remark.block_counters(torch, 0) is None
