"""Errors: every C status becomes its typed exception carrying torpor's message; bad input
changes nothing."""

import ctypes
import subprocess
import sys

import pytest

import torpor
from conftest import MiB, pattern, subprocess_env


def test_each_status_class_is_also_the_builtin_a_caller_expects():
    # The codes themselves are checked against torpor.h in test_constants.py.
    from torpor.errors import error_for

    expected = {
        torpor.InvalidArgument: ValueError,
        torpor.InvalidState: RuntimeError,
        torpor.OutOfMemory: MemoryError,
        torpor.DriverError: RuntimeError,
        torpor.Timeout: TimeoutError,
        torpor.InvalidHandle: ValueError,
        torpor.InternalError: RuntimeError,
        torpor.Unavailable: RuntimeError,
    }
    torpor._lib.lib()
    for cls, builtin in expected.items():
        err = error_for(cls.status, "message")
        assert type(err) is cls and isinstance(err, torpor.TorporError) and isinstance(err, builtin)
        assert str(err) == "message"


def _gpu_present():
    # Asked of the CUDA driver itself, not of a torpor pool: ctest forces pools to the host
    # backend (TORPOR_BACKEND=host), so a default pool says nothing about the machine.
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return False
    return count.value > 0


def test_the_cuda_backend_without_a_gpu_is_unavailable():
    if _gpu_present():
        pytest.skip("a GPU is present; this checks the GPU-less path")
    with pytest.raises(torpor.Unavailable, match="cuda backend was requested"):
        torpor.Pool(backend="cuda")


def test_allocating_into_a_sleeping_tag_is_invalid_state(pool):
    pool.alloc(MiB, "weights", "state")
    pool.sleep(1, "weights")
    with pytest.raises(torpor.InvalidState, match=r"tag 'weights' is asleep .*wake_up"):
        pool.alloc(MiB, "weights", "state")
    pool.wake_up()
    pool.alloc(MiB, "weights", "state")


def test_unknown_tag_names_the_known_tags(pool):
    pool.alloc(MiB, "weights", "state")
    with pytest.raises(torpor.InvalidArgument, match=r"unknown tag 'kv' \(known tags: 'weights'\)"):
        pool.wake_up(["kv"])
    with pytest.raises(torpor.InvalidArgument, match="unknown tag 'kv'"):
        pool.sleep(2, ["weights", "kv"])
    assert not pool.stats()["tags"]["weights"]["asleep"], "a rejected sleep changes nothing"


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda p: p.sleep(3), r"sleep level 3 is out of range \(accepted: 0 to 2\)"),
        (lambda p: p.alloc(MiB, "weights", "weights"), "unknown memory class 'weights'"),
        (lambda p: p.alloc(MiB, "weights", 7), "unknown memory class 7"),
        (lambda p: p.alloc(MiB, ""), "tag '' is not a non-empty string"),
        (lambda p: p.alloc(0), r"nbytes 0 is out of range \(accepted: 1 to"),
        (lambda p: p.free(0x1000), "not allocated by this pool"),
        (lambda p: p.find(0x1000), "not inside any allocation"),
        (lambda p: p.set_preserve([""]), "glob '' is not a non-empty string"),
        (lambda p: p.sleep(1, [3]), "tag 3 is not a non-empty string"),
    ],
)
def test_bad_arguments_are_invalid_argument(pool, call, match):
    with pytest.raises(torpor.InvalidArgument, match=match):
        call(pool)


def test_double_free_and_mark_past_the_end(pool):
    a = pool.alloc(MiB, "weights", "state")
    with pytest.raises(torpor.InvalidArgument, match="runs past the end"):
        pool.mark(a + MiB - 16, 32, "parameter", "x")
    pool.free(a)
    with pytest.raises(torpor.InvalidArgument, match="double free"):
        pool.free(a)


def test_bad_options_are_refused_before_anything_is_created():
    with pytest.raises(torpor.InvalidArgument, match="unknown backend 'gpu' .*auto, host, cuda"):
        torpor.Pool(0, backend="gpu")
    with pytest.raises(torpor.InvalidArgument, match="unknown fill_on_wake 'nan'"):
        torpor.Pool(0, backend="host", fill_on_wake="nan")
    with pytest.raises(torpor.InvalidArgument, match="device 99 does not exist"):
        torpor.Pool(99, backend="host")


def test_exhausting_the_address_space_is_out_of_memory(pool):
    with pytest.raises(torpor.InvalidArgument, match="exceed the pool's whole VA reservation"):
        pool.alloc(2 << 30, "weights", "state")  # can never succeed
    pool.alloc(600 * MiB, "weights", "state")
    with pytest.raises(torpor.OutOfMemory) as info:
        pool.alloc(600 * MiB, "weights", "state")  # could, once memory is freed
    assert isinstance(info.value, MemoryError)
    a = pool.alloc(MiB, "weights", "state")
    pool.write(a, pattern(MiB))
    assert pool.read(a, MiB) == pattern(MiB), "the pool still works"


def test_missing_library_is_reported_with_where_to_point():
    code = (
        "import torpor\n"
        "try:\n    torpor.Pool(0, backend='host')\n"
        "except torpor.LibraryNotFound as e:\n    print('LNF', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(TORPOR_LIBRARY="/nonexistent/libtorpor.so"),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("LNF TORPOR_LIBRARY=/nonexistent/libtorpor.so could not be loaded"), out


def test_import_does_not_need_torch_and_torch_calls_say_so():
    # torch made unimportable, whether or not it is installed here.
    code = (
        "import sys\nsys.modules['torch'] = None\n"
        "import torpor\n"
        "assert torpor.Pool(0, backend='host', va_bytes=1 << 30).backend == 'host'\n"
        "for call in (lambda: torpor.use_pool('weights').__enter__(),\n"
        "             lambda: torpor.register_parameters(object())):\n"
        "    try:\n        call()\n    except torpor.TorchUnavailable as e:\n        print('TU', e)\n"
        "print(torpor.sleep(), torpor.wake_up(), torpor.stats())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    needs_torch = [line.startswith("TU this part of torpor needs PyTorch") for line in lines[:2]]
    assert len(lines) == 3 and all(needs_torch), out.stdout
    assert lines[2] == "{} {} {}", "no pools yet: sleep and wake do nothing"


def test_lazy_import_keeps_torch_out_of_sys_modules():
    code = "import sys, torpor\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
