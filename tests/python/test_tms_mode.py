"""torch_memory_saver mode (torpor.tms) in CI: torch_memory_saver's API and semantics against
fake_torch, device memory from torpor's host backend. The oracle is torch_memory_saver's own
behaviour (torch_memory_saver/entrypoint.py, csrc/core.cpp, its README and test/examples), with
the documented differences where it exits the process. Discarded bytes come back poisoned (0xFF).
torch_memory_saver's examples run against this mode with real PyTorch in test_engines_gpu.py."""

import ctypes
import itertools
import os
import subprocess
import sys

import pytest

import fake_torch
import torpor
from torpor import tms
from torpor.torch import graphs
from conftest import (
    MiB,
    POISON,
    REPO,
    TORCH_POOL_OPTIONS,
    pattern,
    subprocess_env,
    fresh_torch_layer,
)


class HostTensor(fake_torch.Tensor):
    """A CPU tensor with real bytes (what get_cpu_backup returns)."""

    def __init__(self, shape, dtype):
        n = 1
        for s in shape:
            n *= s
        self._buf = ctypes.create_string_buffer(max(1, n * 4))
        super().__init__(ctypes.addressof(self._buf), n * 4, None, shape)
        self.device, self.is_cuda, self.dtype = (
            fake_torch._Device("cpu", None),
            False,
            dtype,
        )

    def tobytes(self):
        return self._buf.raw[: self._nbytes]


class HostView(fake_torch.Tensor):
    """A CPU tensor over memory someone else owns (torch.frombuffer's result), its owner kept."""

    def __init__(self, owner, shape, dtype):
        n = len(owner)
        self._owner = owner
        super().__init__(ctypes.addressof(ctypes.c_char.from_buffer(owner)), n, None, shape)
        self.device, self.is_cuda, self.dtype = fake_torch._Device("cpu", None), False, dtype

    def view(self, shape):
        self.shape = shape
        return self

    def tobytes(self):
        return ctypes.string_at(self.data_ptr(), self._nbytes)


class NativeAllocator:
    """PyTorch's own allocator, for MemPool() without one: addresses torpor does not hold."""

    _next = itertools.count(1)

    def malloc(self, size, device, stream):
        return 0x6000_0000_0000 + next(self._next) * (1 << 34)


@pytest.fixture
def torch(monkeypatch):
    torpor.configure(**TORCH_POOL_OPTIONS)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    fresh_torch_layer(monkeypatch)
    monkeypatch.setattr(fake_torch.Tensor, "dtype", "float32", raising=False)
    monkeypatch.setattr(fake_torch.Tensor, "is_contiguous", lambda self: True, raising=False)
    monkeypatch.setattr(
        fake_torch.cuda.memory,
        "MemPool",
        lambda allocator=None: fake_torch.MemPool(allocator or NativeAllocator()),
    )
    empty = fake_torch.empty

    host_memory = []  # the kind of every host buffer made: "pinned" or "pageable"

    def empty_anywhere(*args, device=None, dtype=None, pin_memory=False, **kwargs):
        if device == "cpu":
            host_memory.append("pinned" if pin_memory else "pageable")
            return HostTensor(args[0], dtype)
        return empty(*args, **kwargs)

    def frombuffer(buffer, dtype=None):
        host_memory.append("mmap")
        return HostView(buffer, (len(buffer),), dtype)

    monkeypatch.setattr(fake_torch, "empty", empty_anywhere)
    monkeypatch.setattr(fake_torch, "frombuffer", frombuffer, raising=False)
    monkeypatch.setattr(fake_torch, "host_memory", host_memory, raising=False)
    saver = tms.TorchMemorySaver()
    yield fake_torch, saver
    torpor.wake_up()
    torpor._lib.lib().torpor_torch_set_memory_margin(0)


def write(t, seed):
    data = pattern(t._nbytes, seed)
    torpor.Pool.torch(0).write(t.data_ptr(), data)
    return data


def read(t):
    return torpor.Pool.torch(0).read(t.data_ptr(), t._nbytes)


def test_pause_discards_regions_without_backup_and_keeps_those_with_one(torch):
    torch, saver = torch
    with saver.region():  # the default tag, no backup
        lost = torch.empty(MiB)
    with saver.region(enable_cpu_backup=True):  # the same tag, with one
        kept = torch.empty(MiB)
    with saver.region(tag="kv_cache"):
        kv = torch.empty(2 * MiB)
    data = {"lost": write(lost, 1), "kept": write(kept, 2), "kv": write(kv, 3)}
    addresses = (lost.data_ptr(), kept.data_ptr(), kv.data_ptr())
    saver.pause()
    assert all(torpor.torch.tag_states()[t] for t in ("default", "kv_cache"))
    saver.resume()
    assert (lost.data_ptr(), kept.data_ptr(), kv.data_ptr()) == addresses
    assert read(kept) == data["kept"]
    assert read(lost) == POISON * MiB and read(kv) == POISON * (2 * MiB)


def test_pause_and_resume_one_tag(torch):
    torch, saver = torch
    with saver.region(tag="weights", enable_cpu_backup=True):
        w = torch.empty(MiB)
    with saver.region(tag="kv_cache"):
        torch.empty(MiB)
    data = write(w, 4)
    saver.pause("kv_cache")
    assert torpor.torch.tag_states()["kv_cache"] and not torpor.torch.tag_states()["weights"]
    saver.pause("weights")
    saver.resume("weights")
    assert not torpor.torch.tag_states()["weights"] and torpor.torch.tag_states()["kv_cache"]
    assert read(w) == data
    saver.resume("kv_cache")


def test_pause_all_touches_only_the_regions_tags(torch):
    torch, saver = torch
    with torpor.use_pool("tms.not_a_region"):
        torch.empty(MiB)
    with saver.region(tag="tms.region"):
        torch.empty(MiB)
    saver.pause()
    states = torpor.torch.tag_states()
    assert states["tms.region"] and not states["tms.not_a_region"]
    saver.resume()


def test_where_torch_memory_saver_exits_torpor_is_idempotent_or_raises(torch):
    torch, saver = torch
    with saver.region(tag="tms.twice", enable_cpu_backup=True):
        t = torch.empty(MiB)
    data = write(t, 5)
    saver.resume("tms.twice")  # resuming an active allocation: torch_memory_saver exits
    saver.pause("tms.twice")
    saver.pause("tms.twice")  # pausing a paused one: torch_memory_saver exits
    saver.pause("never_created")  # nothing to pause
    with pytest.raises(torpor.InvalidState, match="tag 'tms.twice' is asleep"):
        with saver.region(tag="tms.twice"):
            pass
    saver.resume("tms.twice")
    saver.resume("tms.twice")
    assert read(t) == data


def test_get_cpu_backup_follows_torch_memory_savers_rules(torch):
    torch, saver = torch
    with saver.region(tag="tms.backup", enable_cpu_backup=True):
        x = torch.empty(64 << 10)
    with saver.region(tag="tms.nobackup"):
        y = torch.empty(64 << 10)
    data = write(x, 6)
    write(y, 7)
    assert saver.get_cpu_backup(x) is None, "awake and never paused: no backup"
    saver.pause()
    backup = saver.get_cpu_backup(x)
    assert backup.shape == x.shape and backup.dtype == x.dtype and not backup.is_cuda
    assert backup.tobytes() == data
    assert saver.get_cpu_backup(x, zero_copy=True).tobytes() == data
    with pytest.raises(torpor.InvalidState, match="without enable_cpu_backup"):
        saver.get_cpu_backup(y)
    saver.resume()
    assert saver.get_cpu_backup(x) is None, "without retain_cpu_backup, no backup after resume"
    saver.retain_cpu_backup = True
    assert saver.retain_cpu_backup is True
    assert saver.get_cpu_backup(x) is None, "the copy went at the last resume: retaining now cannot bring it back"
    saver.pause("tms.backup")
    saver.resume("tms.backup")
    assert saver.get_cpu_backup(x).tobytes() == data, "retained: the copy of the last pause"
    write(x, 8)
    assert saver.get_cpu_backup(x).tobytes() == data, "still the last pause's bytes"
    saver.pause("tms.backup")
    assert saver.get_cpu_backup(x).tobytes() == pattern(64 << 10, 8)
    saver.resume("tms.backup")
    outside = torch.empty(MiB)  # PyTorch's own memory: not torpor's
    with pytest.raises(torpor.InvalidArgument, match="not inside an allocation"):
        saver.get_cpu_backup(outside)


@pytest.mark.parametrize("backend", ["mmap", "pinned"])
def test_zero_copy_backup_keeps_its_address_across_retained_resumes_as_tms_example(torch, backend):
    """torch_memory_saver's test/examples/cpu_backup.py (4a43c97), the per-device loop: one host
    slot per tensor whose address survives a retained resume and whose bytes each pause renews;
    a resume without retain frees it (None)."""
    torch, saver = torch
    with saver.region(tag="tms.zc", enable_cpu_backup=True, cpu_backup_backend=backend):
        x = torch.empty(64 << 10)
    with saver.region(tag="tms.zc.other", enable_cpu_backup=True):
        other = torch.empty(64 << 10)
    first_bytes = write(x, 21)
    other_bytes = write(other, 22)
    made = len(torch.host_memory)
    saver.pause("tms.zc")
    first = saver.get_cpu_backup(x, zero_copy=True)
    assert torch.host_memory[made:] == [backend], "the slot is of the region's backend"
    first_ptr = first.data_ptr()
    assert first.tobytes() == first_bytes and read(other) == other_bytes
    saver.retain_cpu_backup = True
    saver.resume("tms.zc")
    after = saver.get_cpu_backup(x, zero_copy=True)
    assert after.data_ptr() == first_ptr and after.tobytes() == first_bytes
    assert read(x) == first_bytes
    saver.retain_cpu_backup = False  # no resume since: the retained slot is still there
    assert saver.get_cpu_backup(x, zero_copy=True).data_ptr() == first_ptr
    second_bytes = write(x, 23)
    saver.pause("tms.zc")
    assert first.tobytes() == second_bytes, "a pause renews the slot a held view shows"
    second = saver.get_cpu_backup(x, zero_copy=True)
    assert second.data_ptr() == first_ptr and second.tobytes() == second_bytes
    copy = saver.get_cpu_backup(x)
    assert copy.data_ptr() != first_ptr and copy.tobytes() == second_bytes, "zero_copy=False: a copy"
    assert len(torch.host_memory) == made + 2, "one slot, and the one copy just asked for"
    saver.resume("tms.zc")  # retain is off: the slot goes
    assert read(x) == second_bytes
    assert saver.get_cpu_backup(x) is None and saver.get_cpu_backup(x, zero_copy=True) is None
    assert all(k[1] != x.data_ptr() for k in saver._mode.host_backups), "the slot's memory was dropped"


def test_disable_allocates_outside_torpor_even_inside_a_region(torch):
    torch, saver = torch
    with saver.region(tag="tms.disable"):
        inside = torch.empty(MiB)
        with saver.disable():
            outside = torch.empty(MiB)
        again = torch.empty(MiB)
    pool = torpor.Pool.torch(0)
    assert pool.contains(inside.data_ptr()) and pool.contains(again.data_ptr())
    assert not pool.contains(outside.data_ptr())


def test_memory_margin_refuses_segments_that_would_eat_it(torch):
    torch, saver = torch
    saver.memory_margin_bytes = 64 << 40  # more than the emulated device has
    assert saver.memory_margin_bytes == 64 << 40
    with pytest.raises(torpor.OutOfMemory, match="refused by the memory margin") as info:
        with saver.region(tag="tms.margin"):
            torch.empty(4 * MiB)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    saver.memory_margin_bytes = 0
    with saver.region(tag="tms.margin"):
        torch.empty(4 * MiB)
    for bad in (-1, 1.5, True):
        with pytest.raises(torpor.InvalidArgument, match="memory_margin_bytes"):
            saver.memory_margin_bytes = bad
    with pytest.raises(torpor.InvalidArgument, match="TORPOR_TORCH_MEMORY_MARGIN_MAX"):
        saver.memory_margin_bytes = 1 << 60


def test_settings_and_what_is_not_here(torch, tmp_path):
    torch, saver = torch
    assert saver.enabled and saver.retain_cpu_backup is False
    saver.hook_mode = "torch"
    with pytest.raises(torpor.Unavailable, match="libtorpor_preload.so on LD_PRELOAD"):
        saver.hook_mode = "preload"  # this process did not start with it (test_tms_preload does)
    assert saver.hook_mode == "torch"
    with pytest.raises(torpor.InvalidArgument, match="hook_mode 'ld_preload'"):
        saver.hook_mode = "ld_preload"
    # The pools hold memory already (earlier tests): their host store cannot get a disk tier now.
    with pytest.raises(torpor.Unavailable, match="already hold memory.*before the first CUDA allocation"):
        saver.set_disk_backup_dir(str(tmp_path / "disk"))
    assert (tmp_path / "disk").is_dir() and saver._regions.disk_dir is None, "created, as TMS does; not kept"
    with pytest.raises(torpor.Unavailable, match="disk backup into '/tmp'"):
        with saver.region(enable_disk_backup=True):
            pass
    with pytest.raises(ValueError, match="cpu_backup_backend requires enable_cpu_backup"):
        with saver.region(cpu_backup_backend="mmap"):
            pass
    with pytest.raises(ValueError, match="mutually exclusive"):
        with saver.region(enable_cpu_backup=True, enable_disk_backup=True):
            pass
    with saver.region(enable_cpu_backup=True, cpu_backup_backend="mmap"):
        pass
    assert isinstance(tms.torch_memory_saver, tms.TorchMemorySaver)


def test_a_failed_resume_is_a_runtime_error_and_can_be_repeated():
    code = f"""
import sys
sys.path.insert(0, {str(REPO / "tests" / "python")!r})
import fake_torch
sys.modules["torch"] = fake_torch
import torpor
from torpor.tms import torch_memory_saver as saver

torpor.configure(backend="host", va_bytes=1 << 30)
with saver.region(tag="weights", enable_cpu_backup=True):
    x = fake_torch.empty(40 << 20)
saver.pause()
other = torpor.Pool(0, backend="host")
y = other.alloc(40 << 20, "trainer")
try:
    saver.resume()
except RuntimeError as e:
    assert isinstance(e, torpor.OutOfMemory)
    print("raised:", e)
other.free(y)
saver.resume()
print("resumed")
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(TORPOR_HOST_DEVICE_MEMORY="64M", TORPOR_LOG="off"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "raised: torpor_wake_up:" in out.stdout and out.stdout.rstrip().endswith("resumed")


def test_get_cpu_backup_and_read_host_copy_of_sub_ranges_read_the_disk_tier_at_unaligned_offsets(
    tmp_path,
):
    """Backups on disk (host_store_limit=1 and a spill_dir): get_cpu_backup of tensors that
    PyTorch packs at 512-byte steps inside one segment, and engine.read_host_copy of sub-ranges
    from 4097 consecutive start offsets, read the spill file off its 4 KiB direct-I/O alignment
    (the aligned window is read and the bytes moved into place; spill_store.cpp). The oracle is
    the bytes written. In a child: the torch pool's options are fixed once per process."""
    code = f"""
import ctypes, sys
sys.path.insert(0, {str(REPO / "tests" / "python")!r})
import fake_torch
sys.modules["torch"] = fake_torch
import torpor
from conftest import pattern
from torpor import engine, tms

torpor.configure(backend="host", va_bytes=1 << 30, fill_on_wake="poison", host_store_limit=1,
                 spill_dir={str(tmp_path)!r})


class HostTensor(fake_torch.Tensor):
    def __init__(self, shape, dtype):
        n = 1
        for s in shape:
            n *= s
        self._buf = ctypes.create_string_buffer(max(1, n * 4))
        super().__init__(ctypes.addressof(self._buf), n * 4, None, shape)
        self.device, self.is_cuda, self.dtype = fake_torch._Device("cpu", None), False, dtype


empty = fake_torch.empty
fake_torch.empty = lambda *a, device=None, dtype=None, **k: (
    HostTensor(a[0], dtype) if device == "cpu" else empty(*a, **k)
)
fake_torch.Tensor.dtype = "float32"
saver = tms.TorchMemorySaver()
pool = torpor.Pool.torch(0)
with saver.region(tag="tms.disk", enable_cpu_backup=True):
    tensors = [fake_torch.empty(n) for n in (1000, 3000, 4100, 5000, 12, 9000)]
data = []
for i, t in enumerate(tensors):
    data.append(pattern(t._nbytes, 40 + i))
    pool.write(t.data_ptr(), data[-1])
offsets = [t.data_ptr() % 4096 for t in tensors]
assert any(o != 0 for o in offsets), offsets
saver.pause()
assert pool.stats()["spill_used_bytes"] > 0, "the backups are on disk"
for i, t in enumerate(tensors):
    got = saver.get_cpu_backup(t)
    assert got is not None and got._buf.raw[: t._nbytes] == data[i], f"tensor {{i}} at offset {{offsets[i]}}"
big, big_data = tensors[-1], data[-1]
buf = ctypes.create_string_buffer(9000)
for k in range(4097):
    n = 9000 - k if k % 3 == 0 else 1 + k % 97
    assert engine.read_host_copy(0, big.data_ptr() + k, n, ctypes.addressof(buf)) is True
    assert buf.raw[:n] == big_data[k : k + n], f"from offset {{k}}, {{n}} bytes"
saver.resume()
for i, t in enumerate(tensors):
    assert pool.read(t.data_ptr(), t._nbytes) == data[i]
print("ok", offsets)
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(TORPOR_LOG="error"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("ok"), out.stdout


def test_import_torch_memory_saver_resolves_to_torpor_only_when_asked():
    code = (
        "import sys\n"
        "try:\n"
        "    import torch_memory_saver\n"
        "except ImportError:\n"
        "    print('absent')\n"
        "else:\n"
        "    import torpor.tms\n"
        "    assert torch_memory_saver is torpor.tms, torch_memory_saver\n"
        "    assert torch_memory_saver.torch_memory_saver is torpor.tms.torch_memory_saver\n"
        "    from torch_memory_saver.entrypoint import TorchMemorySaver\n"
        "    assert TorchMemorySaver is torpor.tms.TorchMemorySaver\n"
        "    print('torpor')\n"
    )

    def run(env, *argv):
        out = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    env = subprocess_env()
    assert run(env, "-c", code) == "absent"
    shim = run(env, "-m", "torpor.tms", "--shim-path")
    assert os.path.isdir(os.path.join(shim, "torch_memory_saver"))
    assert (
        run(
            subprocess_env(PYTHONPATH=os.pathsep.join([shim, env["PYTHONPATH"]])),
            "-c",
            code,
        )
        == "torpor"
    )
    assert run(env, "-c", "import torpor.tms\ntorpor.tms.install()\n" + code) == "torpor"
    # configure_subprocess: children started inside resolve it too.
    parent = (
        "import subprocess, sys, torpor.tms\n"
        "with torpor.tms.configure_subprocess():\n"
        f"    subprocess.run([sys.executable, '-c', {code!r}], check=True)\n"
        f"subprocess.run([sys.executable, '-c', {code!r}], check=True)\n"
    )
    assert run(env, "-c", parent).split() == ["torpor", "absent"]


def test_cuda_graph_memory_pauses_with_its_tag_and_the_graph_replays_after_resume(torch, monkeypatch):
    torch, saver = torch
    monkeypatch.setattr(graphs, "_registry", graphs._Registry(graphs.threading.RLock(), {}, {}, []))
    monkeypatch.setattr(fake_torch.graph, "default_capture_stream", None)
    with saver.region(tag="weights", enable_cpu_backup=True):
        w = torch.empty(MiB)
    with saver.region(tag="kv_cache"):
        x = torch.empty(MiB)
    w_data = write(w, 5)
    g = torch.cuda.CUDAGraph()
    with saver.cuda_graph(g, tag="cuda_graph"):
        out = torch.empty(MiB)
        pool = torpor.Pool.torch(0)
        torch.launch(lambda: pool.write(out.data_ptr(), bytes(a ^ b for a, b in zip(read(x), read(w)))))

    def replay_and_check(seed):
        x_data = write(x, seed)
        g.replay()
        assert read(out) == bytes(a ^ b for a, b in zip(x_data, w_data)), f"replay with input {seed}"

    replay_and_check(6)
    graph_tag = tms.graph_tag("cuda_graph")
    assert torpor.Pool.torch(0).stats()["tags"][graph_tag]["mapped_bytes"] >= MiB
    saver.pause("cuda_graph")
    states = torpor.torch.tag_states()
    assert states[graph_tag] and not states["weights"] and not states["kv_cache"], "only the graph's tag paused"
    assert torpor.Pool.torch(0).stats()["tags"][graph_tag]["mapped_bytes"] == 0, "the graph's memory went back"
    saver.pause()
    saver.resume()
    assert not any(torpor.torch.tag_states().values())
    assert read(out) == POISON * MiB, "without a backup the graph's memory is discarded"
    assert read(w) == w_data
    replay_and_check(7)  # the same graph object, no re-capture
    assert len([c for c in torch.CUDAGraph.captures if c[0] is g]) == 1
    with saver.region(tag="cuda_graph"):  # a region may use the graphs' tms tag
        torch.empty(MiB)
    with pytest.raises(ValueError, match="not a non-empty string"):
        with saver.cuda_graph(torch.cuda.CUDAGraph(), tag=""):
            pass


@pytest.mark.parametrize("tag", ["m\0x", "m\0", "m\ud800"])
def test_tags_the_c_api_would_cut_are_refused_everywhere(torch, tag):
    # A NUL ended the C string: the region allocated in tag "m", and pause("m\0x") paused nothing.
    torch, saver = torch
    for enter in (
        lambda: saver.region(tag=tag),
        lambda: saver.cuda_graph(torch.cuda.CUDAGraph(), tag=tag),
    ):
        with pytest.raises(torpor.InvalidArgument, match="tag"):
            with enter():
                pass
    for call in (saver.pause, saver.resume, torpor.graph_pool):
        with pytest.raises(torpor.InvalidArgument, match="tag"):
            call(tag)
    with pytest.raises(torpor.InvalidArgument, match="use_pool: tag"):
        with torpor.use_pool(tag):
            pass
    assert "m" not in torpor.torch.tag_states(), "nothing was allocated under the cut name"


def test_pause_of_a_tag_leaves_a_user_tag_named_like_its_graph_tag(torch):
    torch, saver = torch
    with saver.region(tag="m", enable_cpu_backup=True):
        m = torch.empty(MiB)
    with saver.region(tag=tms.graph_tag("m"), enable_cpu_backup=True):  # the user's own tag "m.graph"
        user = torch.empty(MiB)
    data = write(user, 9)
    write(m, 8)
    saver.pause("m")
    states = torpor.torch.tag_states()
    assert states["m"] and not states["m.graph"], "pause('m') paused only tag m"
    assert read(user) == data
    saver.resume("m")
    saver.pause("m.graph")
    states = torpor.torch.tag_states()
    assert states["m.graph"] and not states["m"], "pause('m.graph') paused only the user's tag"
    saver.resume()
    assert read(user) == data


def test_pause_of_a_tag_still_pauses_the_graphs_captured_under_it(torch, monkeypatch):
    torch, saver = torch
    monkeypatch.setattr(graphs, "_registry", graphs._Registry(graphs.threading.RLock(), {}, {}, []))
    monkeypatch.setattr(fake_torch.graph, "default_capture_stream", None)
    with saver.region(tag="g"):
        torch.empty(MiB)
    with saver.cuda_graph(torch.cuda.CUDAGraph(), tag="g"):
        torch.empty(MiB)
    saver.pause("g")
    states = torpor.torch.tag_states()
    assert states["g"] and states[tms.graph_tag("g")]
    saver.resume("g")
    assert not any(torpor.torch.tag_states().values())
