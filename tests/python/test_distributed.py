"""torpor.distributed over a stand-in torch.distributed: two ranks as threads of this process,
each with its own host-backend pool, exchanging through all_gather_object and barrier as the
real module does. The oracle for restored bytes is conftest.pattern, per rank."""

import pathlib
import subprocess
import sys
import threading
import types

import pytest

import torpor
from conftest import MiB, pattern, subprocess_env
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
    with pytest.raises(torpor.InvalidArgument, match=r"rank .*2 is out of range"):
        tdist.Group(2, 2, broken, lambda: None)


# The PyTorch embedding's path (pool=None) needs a torch pool per rank: rank r's on device r. Those
# pools live as long as the process (and torpor.configure then lists device 1 among the pools),
# so its tests (distributed_torch_ranks.py) run in a child pytest of their own.
@pytest.mark.parametrize(
    "name",
    [
        "test_the_pytorch_pools_sleep_collectively_in_libtorpor",
        "test_python_protocol_rolls_back_a_failed_rank",
        "test_python_protocol_rejects_a_mismatch_before_anything_sleeps",
    ],
)
def test_the_pytorch_pools_path_in_a_process_of_its_own(name):
    here = pathlib.Path(__file__).resolve().parent
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"distributed_torch_ranks.py::{name}"],
        cwd=here,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "1 passed" in out.stdout, out.stdout[-2000:]
