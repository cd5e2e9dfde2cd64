"""The sleep hooks (Pool.add_sleep_hook over torpor_add_sleep_hook) and the engine seam's tag
hooks (torpor.engine.hooks.add_tag_hooks). Oracles: the bytes a wake restores (conftest.pattern), the
calls the hooks recorded, and the pool's own asleep flags."""

import inspect
import sys

import pytest

import fake_torch
import torpor
from conftest import MiB, TORCH_POOL_OPTIONS, fresh_torch_layer, pattern
from torpor import engine
from torpor.values import SleepLevel


def test_a_pool_sleep_hook_runs_before_the_sleep_and_can_refuse_it(pool):
    a = pool.alloc(MiB, "weights", "parameter", "w")
    pool.write(a, pattern(MiB, 5))
    calls = []

    def before(level, tags):
        calls.append(("sleep", level, tags))
        if refuse:
            raise torpor.Unavailable("the test refuses")
        pool.mark(a, MiB, "state")  # inside the sleep: level 2 then keeps the parameter

    refuse = True
    hook = pool.add_sleep_hook(before, lambda tags, ok: calls.append(("wake", tags, ok)))
    with pytest.raises(torpor.Unavailable, match="the test refuses"):
        pool.sleep(2)
    assert not pool.stats()["tags"]["weights"]["asleep"], "a refused sleep moves nothing"
    refuse = False
    pool.sleep(2)
    pool.wake_up()
    assert pool.read(a, MiB) == pattern(MiB, 5), "the hook's mark applied to the sleep it ran in"
    assert calls[1:] == [("sleep", 2, ["weights"]), ("wake", ["weights"], True)]
    assert isinstance(calls[1][1], SleepLevel)
    pool.remove_sleep_hook(hook)
    pool.sleep(1)
    pool.wake_up()
    assert len(calls) == 3, "a removed hook is not called"
    with pytest.raises(torpor.InvalidArgument, match="is not a sleep hook of this pool"):
        pool.remove_sleep_hook(hook)


def test_a_hook_that_raises_a_non_torpor_error_refuses_as_internal_and_is_reraised(pool):
    pool.alloc(MiB, "kv_cache", "cache")
    pool.add_sleep_hook(lambda level, tags: {}["missing"])
    with pytest.raises(KeyError):
        pool.sleep(1)
    assert not pool.stats()["tags"]["kv_cache"]["asleep"]


@pytest.fixture
def torch(monkeypatch):
    torpor.configure(**TORCH_POOL_OPTIONS)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    fresh_torch_layer(monkeypatch)
    yield fake_torch
    torpor.wake_up()


def test_tag_hooks_run_inside_every_sleep_and_wake_of_their_tag(torch):
    with engine.use_pool("eng.a"):
        x = torch.empty(64 << 10)
    with engine.use_pool("eng.b"):
        torch.empty(64 << 10)
    pool = torpor.Pool.torch(0)
    pool.write(x.data_ptr(), pattern(64 << 10, 2))
    calls = []
    hook = engine.hooks.add_tag_hooks(
        "eng.a",
        before_sleep=lambda tag, level: calls.append(("before", tag, level, pool.stats()["tags"][tag]["asleep"])),
        after_wake=lambda tag, ok: calls.append(("after", tag, ok)),
    )
    try:
        engine.sleep(1, ["eng.a", "eng.b"])
        engine.wake_up(None)
        engine.sleep(1, ["eng.b"])
        engine.wake_up(["eng.b"])
    finally:
        engine.hooks.remove_tag_hooks(hook)
    assert calls == [("before", "eng.a", 1, False), ("after", "eng.a", True)], "only eng.a's, before it moved"
    assert pool.read(x.data_ptr(), 64 << 10) == pattern(64 << 10, 2)
    with pytest.raises(KeyError, match="is not a tag hook"):
        engine.hooks.remove_tag_hooks(hook)


def test_a_tag_hook_that_raises_aborts_the_sleep_with_its_error(torch):
    with engine.use_pool("eng.c"):
        torch.empty(64 << 10)

    def refuse(tag, level):
        raise torpor.InvalidState(f"{tag} is in use by the engine")

    hook = engine.hooks.add_tag_hooks("eng.c", before_sleep=refuse)
    try:
        with pytest.raises(torpor.InvalidState, match="eng.c is in use by the engine"):
            torpor.sleep(1, ["eng.c"])
        with pytest.raises(RuntimeError, match="eng.c is in use"), engine.as_runtime_errors():
            engine.sleep(2, ["eng.c"])
    finally:
        engine.hooks.remove_tag_hooks(hook)
    assert not torpor.torch.tag_states()["eng.c"], "nothing slept"
    torpor.sleep(1, ["eng.c"])
    assert torpor.torch.tag_states()["eng.c"]


def test_the_hook_bus_runs_the_re_mark_with_the_sleeps_policy_then_the_tag_hooks(torch):
    """One sleep hook per device pool, in the order its code says: the re-mark first, with the
    policy the sleep handed over, so a tag hook sees the classes the sleep will act on."""
    with engine.use_pool("eng.order"):  # class state: the whole segment is state until a re-mark
        torch.empty(64 << 10)
    pool = torpor.Pool.torch(0)
    before = pool.stats()["tags"]["eng.order"]
    assert before["classes"]["cache"]["allocated_bytes"] == 0
    seen = []

    def cache_bytes_now(tag, level):
        seen.append(pool.stats()["tags"][tag]["classes"]["cache"]["allocated_bytes"])

    hook = engine.hooks.add_tag_hooks("eng.order", before_sleep=cache_bytes_now)
    try:
        engine.sleep(1, ["eng.order"], policy=lambda tag, cls, has_parameters: torpor.MemoryClass.CACHE)
        engine.wake_up(["eng.order"])
        engine.sleep(1, ["eng.order"])  # no policy: the MemPool's class, state, again
    finally:
        engine.hooks.remove_tag_hooks(hook)
    assert seen[0] == before["allocated_bytes"], "the policy's re-mark ran before the tag hook"
    assert seen[1] < before["allocated_bytes"], "the next sleep's re-mark, with its own policy, ran first too"


def test_the_engine_seam_names_its_contract_and_implements_nothing():
    """torpor.engine is a facade: every name of its contract is defined where its concept lives
    (torpor.torch, torpor.errors, torpor.pool), and it defines no function or class itself."""
    assert sorted(engine.__all__) == sorted(set(engine.__all__))
    for name in engine.__all__:
        obj = getattr(engine, name)
        home = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)
        assert home and home != "torpor.engine", f"engine.{name} is defined in engine.py"
    own = [n for n, v in vars(engine).items() if callable(v) and getattr(v, "__module__", None) == "torpor.engine"]
    assert own == [], own
    assert engine.hooks.add_tag_hooks and engine.graphs.capture_into, "the hook bus and graph capture are there"
