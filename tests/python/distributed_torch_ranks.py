"""torpor.distributed's PyTorch-embedding path (pool=None) over the stand-in torch.distributed of
test_distributed.py: two ranks as threads, rank r's tensors in the torch pool of device r (fake
PyTorch, host backend). Run by test_distributed.py in a child process (the torch pools of device
1 would outlive the test in the parent's)."""

import sys

import pytest

import fake_torch
import torpor
from conftest import MiB, TORCH_POOL_OPTIONS, fresh_torch_layer
from test_distributed import N, FakeDist, on_ranks
from torpor import distributed as tdist
from torpor import engine
from torpor.torch import routing


@pytest.fixture
def dist():
    return FakeDist(N)


@pytest.fixture
def torch_ranks(dist, monkeypatch):
    """The PyTorch embedding under the stand-in torch.distributed: rank r's tensors live in the
    torch pool of device r (tag "tdist.w"), and each rank sees only its own device, as a process
    per rank would. Yields (tensors, states), states() being {rank: "asleep" or "awake"}."""
    torpor.configure(**TORCH_POOL_OPTIONS)
    fake_torch.distributed = dist
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    fresh_torch_layer(monkeypatch)
    tensors = []
    for r in range(N):
        fake_torch.cuda.set_device(r)
        with torpor.use_pool("tdist.w"):
            tensors.append(fake_torch.empty(MiB))
            freed = fake_torch.empty(2 * MiB)
        freed.free()  # free space: the re-mark inside the sleep makes it cache
    fake_torch.cuda.set_device(0)
    every = routing.devices()
    monkeypatch.setattr(routing, "devices", lambda: [dist.local.rank] if hasattr(dist.local, "rank") else every)

    def states():
        return {r: "asleep" if torpor.Pool.torch(r).stats()["tags"]["tdist.w"]["asleep"] else "awake" for r in range(N)}

    yield tensors, states
    for r in range(N):
        if torpor.Pool.torch(r).stats()["tags"]["tdist.w"]["asleep"]:
            torpor.Pool.torch(r).wake_up(["tdist.w"])


def test_the_pytorch_pools_sleep_collectively_in_libtorpor(dist, torch_ranks):
    """pool=None: the C collective sleep on each rank's torch pool, the re-mark inside it."""
    _, states = torch_ranks
    reports = {}

    def rank(r):
        reports[r] = tdist.sleep(None, 1, group=tdist.Group.from_torch())

    assert on_ranks(dist, rank) == {r: None for r in range(N)}
    assert states() == {r: "asleep" for r in range(N)}
    for r in range(N):
        report = reports[r][r]
        assert report["bytes_offloaded"] + report["bytes_skipped"] == MiB, "only the live tensor is state"
    assert on_ranks(dist, lambda r: tdist.wake_up(None, group=tdist.Group.from_torch())) == {r: None for r in range(N)}
    assert states() == {r: "awake" for r in range(N)}


def test_python_protocol_rolls_back_a_failed_rank(dist, torch_ranks):
    """The PyTorch-embedding path (pool=None) runs the C protocol on the torch pools: one rank
    whose sleep fails inside (its sleep hooks) fails every rank, and the ranks that slept wake
    back up."""
    _, states = torch_ranks

    def refuse_on_rank_1(tag, level):
        if dist.local.rank == 1:
            raise torpor.OutOfMemory("host store full")

    hook = engine.hooks.add_tag_hooks("tdist.w", before_sleep=refuse_on_rank_1)
    try:
        errors = on_ranks(dist, lambda r: tdist.sleep(None, 1, group=tdist.Group.from_torch()))
    finally:
        engine.hooks.remove_tag_hooks(hook)
    for r in range(N):
        assert isinstance(errors[r], torpor.OutOfMemory), errors[r]
        assert "rank(s) [1] failed to sleep" in str(errors[r]) and "host store full" in str(errors[r])
    state = states()
    assert state == {r: "awake" for r in range(N)}


def test_python_protocol_rejects_a_mismatch_before_anything_sleeps(dist, torch_ranks):
    slept = []
    hook = engine.hooks.add_tag_hooks("tdist.w", before_sleep=lambda tag, level: slept.append(dist.local.rank))
    try:
        errors = on_ranks(dist, lambda r: tdist.sleep(None, 1 + r, group=tdist.Group.from_torch()))
    finally:
        engine.hooks.remove_tag_hooks(hook)
    for r in range(N):
        assert isinstance(errors[r], torpor.InvalidArgument) and "rank(s) [1]" in str(errors[r]), errors[r]
    assert slept == []
