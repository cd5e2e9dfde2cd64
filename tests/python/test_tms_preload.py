"""torpor.tms in hook_mode "preload" on the host backend: a child process starts with
libtorpor_preload.so on LD_PRELOAD (the way torpor.tms.configure_subprocess() starts SGLang's
schedulers) and a fake CUDA runtime after it (tests/preload/fake_cudart.cpp, what RTLD_NEXT finds
in place of libcudart), and calls cudaMalloc by name as PyTorch's caching allocator does. The
oracles: who holds an address (torpor's pool or the fake runtime), the bytes written before a
pause, torch_memory_saver's get_cpu_backup results (test/examples/cpu_backup.py at 4a43c97)."""

import json
import pathlib
import subprocess
import sys

import pytest


from torpor import engine, tms
from conftest import REPO, subprocess_env

CHILD = f"""
import ctypes, json, os, sys
sys.path.insert(0, {str(REPO / "tests" / "python")!r})
import fake_torch
sys.modules["torch"] = fake_torch
fake_torch.Tensor.dtype = "uint8"


class HostBytes(fake_torch.Tensor):
    def __init__(self, raw):
        self.raw = raw
        super().__init__(ctypes.addressof(raw), len(raw), None)
        self.device, self.is_cuda = fake_torch._Device("cpu", None), False

    def view(self, shape):
        return self

    def clone(self):
        return HostBytes((ctypes.c_uint8 * len(self.raw)).from_buffer_copy(self.raw))

    def tobytes(self):
        return bytes(self.raw)


fake_torch.frombuffer = lambda raw, dtype=None: HostBytes(raw)

import torpor
from torpor.tms import torch_memory_saver as saver

torpor.configure(backend="host", fill_on_wake="poison", va_bytes=1 << 30)
out = {{}}
if sys.argv[1] == "no_preload":
    try:
        saver.hook_mode = "preload"
    except torpor.Unavailable as e:
        out["refused"] = str(e)
    print(json.dumps(out))
    sys.exit(0)
saver.hook_mode = "preload"
rt = ctypes.CDLL(None)  # the global lookup, as libcudart's callers: the interposer's cudaMalloc first
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
rt.cudaFree.argtypes = [ctypes.c_void_p]
N = 4 << 20


def cuda_malloc(n):
    p = ctypes.c_void_p()
    assert rt.cudaMalloc(ctypes.byref(p), n) == 0
    return p.value


with saver.region(tag="weights", enable_cpu_backup=True):
    w = cuda_malloc(N)
    with saver.disable():
        d = cuda_malloc(N)
with saver.region(tag="kv_cache"):
    kv = cuda_malloc(N)
outside = cuda_malloc(N)
pool = torpor.Pool.torch(0)
out["held"] = [pool.contains(w), pool.contains(kv), pool.contains(d), pool.contains(outside)]
data, lost = os.urandom(N), bytes(range(200)) * (N // 200) + bytes(N % 200)
pool.write(w, data)
pool.write(kv, lost)
x = fake_torch.Tensor(w, N, 0, element_size=1)
out["before_pause"] = saver.get_cpu_backup(x) is None
saver.pause()
saver.pause()  # torch_memory_saver exits here; torpor does nothing
first = saver.get_cpu_backup(x, zero_copy=True)
out["backup_exact"] = first.tobytes() == data
saver.retain_cpu_backup = True
saver.resume()
again = saver.get_cpu_backup(x, zero_copy=True)
out["same_address"] = again.data_ptr() == first.data_ptr()
out["kept"] = pool.read(w, N) == data
out["discarded"] = pool.read(kv, N) == b"\\xff" * N
saver.retain_cpu_backup = False
saver.pause("weights")
saver.resume("weights")
out["none_after_plain_resume"] = saver.get_cpu_backup(x) is None
out["kept_again"] = pool.read(w, N) == data
cdll = saver._impl._binary_wrapper.cdll  # as TMS's examples reach it
out["impl"] = [saver._ensure_initialized() is None, cdll.tms_get_current_tag(), cdll.tms_get_interesting_region()]
with saver._impl._with_region_config(tag="cfg", enable_cpu_backup=True, cpu_backup_backend="mmap"):
    out["impl"] += [cdll.tms_get_current_tag(), cdll.tms_get_cpu_backup_backend(), cdll.tms_get_interesting_region()]
out["impl"] += [cdll.tms_get_current_tag(), ("weights", True, False, "pinned", 0) in saver._impl._mem_pools]
for p in (w, kv, d, outside):
    assert rt.cudaFree(p) == 0
out["freed"] = not pool.contains(w)
print(json.dumps(out, default=lambda b: b.decode()))
"""


def _libraries():
    build = pathlib.Path(engine.library_path()).resolve().parent.parent
    preload, fake = build / "preload" / tms.PRELOAD_NAME, build / "tests" / "libtorpor_fake_cudart.so"
    if not (preload.is_file() and fake.is_file()):
        pytest.skip(f"build the torpor_preload and torpor_preload_tests targets first (no {preload} or {fake})")
    return preload, fake


def run(mode, preload_env):
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode],
        env=subprocess_env(TORPOR_LOG="off", **preload_env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_preload_mode_routes_regions_to_torpor_and_the_rest_to_the_runtime():
    preload, fake = _libraries()
    r = run("preload", {"LD_PRELOAD": f"{preload}:{fake}", "TORPOR_LIBRARY": engine.library_path()})
    assert r["held"] == [True, True, False, False], "regions in torpor; disable() and outside: the runtime"
    assert r["before_pause"], "awake and never paused: no backup"
    assert r["backup_exact"] and r["same_address"], "zero_copy: the slot, same address after a retained resume"
    assert r["kept"] and r["discarded"] and r["kept_again"]
    assert r["none_after_plain_resume"] and r["freed"]
    assert r["impl"] == [
        True,
        "default",
        False,
        "cfg",
        "mmap",
        True,
        "default",
        True,
    ], "TMS's _impl, as its examples use it"


def test_control_hook_mode_preload_without_the_library_on_ld_preload_is_refused():
    r = run("no_preload", {"LD_PRELOAD": ""})
    assert "needs exactly one libtorpor_preload.so on LD_PRELOAD" in r["refused"]


def test_the_default_hook_mode_is_preload_where_the_library_is_preloaded_as_tms_default(monkeypatch):
    """torch_memory_saver defaults to hook_mode "preload" (entrypoint.py at 4a43c97) and SGLang never
    sets it: its schedulers start inside configure_subprocess. Without the library on LD_PRELOAD
    preload mode cannot work, so the default there is "torch"."""
    preload, _ = _libraries()
    monkeypatch.setenv("LD_PRELOAD", f"/other.so:{preload}")
    assert tms.TorchMemorySaver().hook_mode == "preload"
    monkeypatch.setenv("LD_PRELOAD", "/other.so")
    assert tms.TorchMemorySaver().hook_mode == "torch"
    monkeypatch.delenv("LD_PRELOAD")
    assert tms.TorchMemorySaver().hook_mode == "torch"


def test_configure_subprocess_puts_the_preload_library_first_on_ld_preload(monkeypatch):
    preload, _ = _libraries()
    monkeypatch.setenv("LD_PRELOAD", "/other.so")
    with tms.configure_subprocess():
        code = (
            "import os; print(os.environ['LD_PRELOAD']); import torch_memory_saver; print(torch_memory_saver.__name__)"
        )
        out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True)
    lines = out.stdout.split()
    assert lines[0] == f"{preload}:/other.so", out.stderr
    assert lines[1] == "torpor.tms", "the shim resolves import torch_memory_saver to torpor.tms"
    import os

    assert os.environ["LD_PRELOAD"] == "/other.so", "the previous value comes back"


# hook_mode "torch" (the process starts without LD_PRELOAD): torch_memory_saver's examples still
# reach its library through _impl._binary_wrapper.cdll (test/examples/cpu_backup.py
# run_backend_from_env and _assert_cpu_backup_released_on_allocation_free at 4a43c97). The fake
# runtime is loaded RTLD_GLOBAL first, as PyTorch's libcudart is there before torch_memory_saver.
TORCH_MODE_CHILD = f"""
import ctypes, gc, json, os, sys
sys.path.insert(0, {str(REPO / "tests" / "python")!r})
fake = ctypes.CDLL(sys.argv[2], mode=ctypes.RTLD_GLOBAL)
fake.fake_cudart_is_host_block.restype = ctypes.c_bool
fake.fake_cudart_is_host_block.argtypes = [ctypes.c_void_p]
import fake_torch
sys.modules["torch"] = fake_torch
fake_torch.Tensor.dtype = "uint8"


class HostBytes(fake_torch.Tensor):
    def __init__(self, raw):
        if not isinstance(raw, ctypes.Array):  # an mmap: a view of its bytes, as torch.frombuffer
            raw = (ctypes.c_uint8 * len(raw)).from_buffer(raw)
        self.raw = raw
        super().__init__(ctypes.addressof(raw), len(raw), None)
        self.device, self.is_cuda = fake_torch._Device("cpu", None), False

    def view(self, shape):
        return self

    def tobytes(self):
        return bytes(self.raw)


fake_torch.frombuffer = lambda raw, dtype=None: HostBytes(raw)

import torpor
from torpor.tms import torch_memory_saver as saver

torpor.configure(backend="host", fill_on_wake="poison", va_bytes=1 << 30)
out = {{"hook_mode": saver.hook_mode}}
saver._ensure_initialized()
cdll = saver._impl._binary_wrapper.cdll
flags_of = cdll.cudaHostGetFlags
flags_of.argtypes, flags_of.restype = [ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p], ctypes.c_int
cdll.cudaGetLastError.argtypes, cdll.cudaGetLastError.restype = [], ctypes.c_int


def host_allocated(pointer):
    status = flags_of(ctypes.byref(ctypes.c_uint()), ctypes.c_void_p(pointer))
    if status != 0:
        cdll.cudaGetLastError()
    return status == 0


out["backend"] = [cdll.tms_get_cpu_backup_backend().decode()]
N = 4 << 20
with saver.region(tag="retained_free", enable_cpu_backup=True):
    out["in_region"] = [cdll.tms_get_current_tag().decode(), cdll.tms_get_interesting_region(),
                        cdll.tms_get_enable_cpu_backup(), cdll.tms_get_cpu_backup_backend().decode()]
    tensor = fake_torch.empty(N, element_size=1)
out["after_region"] = [cdll.tms_get_current_tag().decode(), cdll.tms_get_interesting_region()]
out["backend"].append(cdll.tms_get_cpu_backup_backend().decode())
pool = torpor.Pool.torch(0)
data = os.urandom(N)
pool.write(tensor.data_ptr(), data)
saver.retain_cpu_backup = True
out["retain_mirrored"] = cdll.tms_get_retain_cpu_backup()
saver.pause("retained_free")
backup = saver.get_cpu_backup(tensor, zero_copy=True)
pointer = backup.data_ptr()
out["exact"] = backup.tobytes() == data
out["while_alive"] = [host_allocated(pointer), fake.fake_cudart_is_host_block(pointer)]
del backup
saver.resume("retained_free")
again = saver.get_cpu_backup(tensor, zero_copy=True)
out["same_pointer"] = again.data_ptr() == pointer
del again
key = ("retained_free", True, False, out["backend"][0], 0)
out["pool_key"] = key in saver._impl._mem_pools
mempool = saver._impl._mem_pools.pop(key)
with saver._impl._with_region_config(tag="retained_free", enable_cpu_backup=True, cpu_backup_backend="pinned"):
    out["config_tag"] = cdll.tms_get_current_tag().decode()
    tensor.free()
    del tensor, mempool
    gc.collect()
out["after_free"] = [host_allocated(pointer), fake.fake_cudart_is_host_block(pointer)]
saver.retain_cpu_backup = False
print(json.dumps(out))
"""


def run_torch_mode(fake, **env):
    out = subprocess.run(
        [sys.executable, "-c", TORCH_MODE_CHILD, "torch", str(fake)],
        env=subprocess_env(TORPOR_LOG="off", LD_PRELOAD="", TORPOR_LIBRARY=engine.library_path(), **env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torch_mode_has_tms_impl_whose_library_answers_from_the_python_sides_state(monkeypatch):
    _, fake = _libraries()
    monkeypatch.delenv("TMS_INIT_CPU_BACKUP_BACKEND", raising=False)
    r = run_torch_mode(fake)
    assert r["hook_mode"] == "torch"
    assert r["backend"] == ["pinned", "pinned"], "unset TMS_INIT_CPU_BACKUP_BACKEND: pinned"
    assert r["in_region"] == ["retained_free", True, True, "pinned"], "the region's settings, mirrored"
    assert r["after_region"] == ["default", False], "and the previous ones after it"
    assert r["retain_mirrored"] is True
    assert r["pool_key"] and r["config_tag"] == "retained_free", "TMS's _mem_pools key and _with_region_config"
    assert r["exact"] and r["same_pointer"], "the zero-copy slot: the pause's bytes, same address after resume"
    assert r["while_alive"] == [True, True], "page-locked (cudaHostGetFlags through _impl's library succeeds)"
    assert r["after_free"] == [False, False], "freeing the tensor gives its page-locked backup back"


def test_torch_mode_library_reads_tms_init_cpu_backup_backend_as_the_python_side(monkeypatch):
    _, fake = _libraries()
    monkeypatch.setenv("TMS_INIT_CPU_BACKUP_BACKEND", "mmap")
    r = run_torch_mode(fake)
    assert r["backend"] == ["mmap", "mmap"] and r["in_region"][3] == "mmap"
    assert tms.default_backup_backend() == "mmap", "the Python side's default, from the same variable"
    assert r["while_alive"] == [False, False], "an mmap backup is pageable: cudaHostGetFlags fails on it"
    assert r["exact"] and r["same_pointer"]
