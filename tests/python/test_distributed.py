"""torpor.distributed over a stand-in torch.distributed: two ranks as threads of this process,
each with its own host-backend pool, exchanging through all_gather_object and barrier as the
real module does. The oracle for restored bytes is conftest.pattern, per rank."""

import sys
import threading
import types

import pytest

import torpor
from conftest import MiB, pattern
from torpor import distributed as tdist

N = 2


class FakeDist(types.ModuleType):
    """all_gather_object / barrier / get_rank over threads; each thread is one rank."""

    def __init__(self, size):
        super().__init__("torch.distributed")
        self.size = size
        self.local = threading.local()
        self.slots = [None] * size
        self.barrier_ = threading.Barrier(size, timeout=30)
        self.calls = []  # (rank, what, group) as the ranks made them

    def is_initialized(self):
        return True

    def get_rank(self, group=None):
        return self.local.rank

    def get_world_size(self, group=None):
        return self.size

    def all_gather_object(self, out, obj, group=None):
        self.calls.append((self.local.rank, "all_gather_object", group))
        self.barrier_.wait()
        self.slots[self.local.rank] = obj
        self.barrier_.wait()
        out[:] = list(self.slots)
        self.barrier_.wait()

    def barrier(self, group=None):
        self.calls.append((self.local.rank, "barrier", group))
        self.barrier_.wait()


@pytest.fixture
def dist(monkeypatch):
    fake = FakeDist(N)
    torch = types.ModuleType("torch")
    torch.distributed = fake
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    return fake


def on_ranks(dist, fn):
    """fn(rank) on one thread per rank; {rank: exception or None}."""
    errors = {}

    def run(r):
        dist.local.rank = r
        try:
            fn(r)
            errors[r] = None
        except Exception as e:  # noqa: BLE001 - collected for the test's asserts
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


@pytest.fixture
def ranks():
    pools = [torpor.Pool(0, backend="host", va_bytes=1 << 30, fill_on_wake="poison") for _ in range(N)]
    ptrs = []
    for r, p in enumerate(pools):
        a = p.alloc(MiB, "weights", "state", "w")
        b = p.alloc(MiB, "kv_cache", "state", "kv")
        p.write(a, pattern(MiB, seed=10 + r))
        p.write(b, pattern(MiB, seed=20 + r))
        ptrs.append((a, b))
    yield pools, ptrs
    for p in pools:
        p.close()


def intact(pools, ptrs, r):
    a, b = ptrs[r]
    return pools[r].read(a, MiB) == pattern(MiB, seed=10 + r) and pools[r].read(b, MiB) == pattern(MiB, seed=20 + r)


def test_from_torch_sleeps_and_wakes_every_rank_bit_exact(dist, ranks):
    pools, ptrs = ranks
    asleep = {}

    def rank(r):
        group = tdist.Group.from_torch("tp")
        assert (group.rank, group.size) == (r, N)
        report = tdist.sleep(pools[r], 1, group=group)
        assert report["operation"] == "sleep"
        asleep[r] = pools[r].stats()["mapped_bytes"] == 0
        tdist.wake_up(pools[r], group=group)
        group.close()

    assert on_ranks(dist, rank) == {r: None for r in range(N)}
    assert asleep == {r: True for r in range(N)}
    assert all(intact(pools, ptrs, r) for r in range(N))
    assert {g for _, _, g in dist.calls} == {"tp"}, "every exchange goes over the group it was given"


def test_a_mismatched_request_is_rejected_everywhere_and_nothing_sleeps(dist, ranks):
    pools, ptrs = ranks

    def rank(r):
        with tdist.Group.from_torch() as group:
            tdist.sleep(
                pools[r],
                1,
                tags="weights" if r == 1 else ["kv_cache", "weights"],
                group=group,
            )

    errors = on_ranks(dist, rank)
    for r in range(N):
        assert isinstance(errors[r], torpor.InvalidArgument), errors[r]
        assert "rank(s) [1]" in str(errors[r])
        assert pools[r].stats()["mapped_bytes"] > 0
        assert intact(pools, ptrs, r)


def test_a_failing_exchange_is_a_torpor_error_naming_the_rank(dist, ranks):
    pools, _ = ranks

    def broken(data):
        raise ConnectionError("NCCL communicator aborted")

    group = tdist.Group(1, 2, broken, lambda: None)
    with pytest.raises(
        torpor.TorporError,
        match=r"group rank 1 of 2 \(torch\).*NCCL communicator aborted",
    ):
        tdist.sleep(pools[0], 1, group=group)
    short = tdist.Group(0, 2, lambda data: [data], lambda: None)
    with pytest.raises(torpor.InvalidState, match="returned 1 entries for 2 ranks"):
        tdist.wake_up(pools[0], group=short)
    assert pools[0].stats()["mapped_bytes"] > 0, "nothing slept"
    with pytest.raises(torpor.InvalidArgument, match="outside"):
        tdist.Group(2, 2, broken, lambda: None)


def test_python_protocol_rolls_back_a_failed_rank(dist, monkeypatch):
    """The PyTorch-embedding path (pool=None) runs the protocol in Python: one rank's failure
    fails every rank, and the ranks that slept wake back up."""
    from torpor import torch_pools

    state = {r: "awake" for r in range(N)}

    def fake_sleep(level, tags):
        r = dist.local.rank
        if r == 1:
            raise torpor.OutOfMemory("host store full")
        state[r] = "asleep"
        return {"operation": "sleep"}

    def fake_wake(tags):
        state[dist.local.rank] = "awake"
        return {"operation": "wake_up"}

    monkeypatch.setattr(torch_pools, "sleep", fake_sleep)
    monkeypatch.setattr(torch_pools, "wake_up", fake_wake)
    errors = on_ranks(dist, lambda r: tdist.sleep(None, 1, group=tdist.Group.from_torch()))
    for r in range(N):
        assert isinstance(errors[r], torpor.OutOfMemory), errors[r]
        assert "rank(s) [1] failed to sleep" in str(errors[r]) and "host store full" in str(errors[r])
    assert state == {r: "awake" for r in range(N)}


def test_python_protocol_rejects_a_mismatch_before_anything_sleeps(dist, monkeypatch):
    from torpor import torch_pools

    slept = []
    monkeypatch.setattr(torch_pools, "sleep", lambda level, tags: slept.append(dist.local.rank))
    errors = on_ranks(dist, lambda r: tdist.sleep(None, 1 + r, group=tdist.Group.from_torch()))
    for r in range(N):
        assert isinstance(errors[r], torpor.InvalidArgument) and "rank(s) [1]" in str(errors[r]), errors[r]
    assert slept == []
