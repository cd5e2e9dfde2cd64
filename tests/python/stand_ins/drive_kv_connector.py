"""Drives the stand-in vLLM worker (generation mrv2) with a KV connector configured, as vLLM's
engine would, in a process of its own, and prints what a KV transport saw as JSON
(tests/python/test_vllm_plugin.py asserts on it).

    STAND_IN_VLLM_GENERATION=mrv2 python3 drive_kv_connector.py --kv-connector NixlConnector --no-sleep-mode

The transport here takes torpor's handles: it registers the KV cache after the worker allocated it
(as NIXL's register_kv_caches does), through vLLM's register_tag_hooks closes its handles before
every unmap and exports new ones after every map. Another process maps each descriptor with mmap
(no torpor there) and reports what it reads, so "the handle reaches the KV cache's bytes" is judged
outside torpor. PyTorch is fake_torch and torpor's pools use the host backend, discarded bytes
poisoned (0xFF)."""

import argparse
import ctypes
import hashlib
import json
import pathlib
import subprocess
import sys
import types

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # fake_torch
import fake_torch  # noqa: E402

sys.modules["torch"] = fake_torch

import torpor  # noqa: E402

# Reads [offset, offset + n) of the memory behind descriptor `fd` (inherited) with mmap.
READER = """
import hashlib, mmap, sys
fd, size, offset, n = (int(a) for a in sys.argv[1:5])
with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
    print(hashlib.sha256(m[offset:offset + n]).hexdigest())
"""


def read_elsewhere(chunk, address, n):
    """sha256 of n bytes at `address` as another process reads them through the chunk's descriptor."""
    fd = chunk.fd
    out = subprocess.run(
        [sys.executable, "-c", READER, str(fd), str(chunk.nbytes), str(address - chunk.va), str(n)],
        pass_fds=(fd,),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return out.stdout.strip()


def digest(data):
    return hashlib.sha256(data).hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-connector", default="", help="kv_transfer_config.kv_connector ('' for none)")
    ap.add_argument("--no-sleep-mode", action="store_true", help="the cumem allocator without sleep mode")
    args = ap.parse_args()
    torpor.configure(backend="host", fill_on_wake="poison", va_bytes=1 << 30)

    from vllm.v1.worker.gpu_model_runner import pattern, write
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    sleep_mode = not args.no_sleep_mode
    config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(
            enable_sleep_mode=sleep_mode,
            enable_cumem_allocator=True,  # --enable-cumem-allocator, or sleep mode's doing
            sleep_mode_backend="cumem",
            sleep_mode_backend_options={},
            sleep_preserve_parameter_names=[],
        ),
        kv_transfer_config=(
            types.SimpleNamespace(kv_connector=args.kv_connector, kv_role="kv_both") if args.kv_connector else None
        ),
        parallel_config=types.SimpleNamespace(worker_cls="vllm.v1.worker.gpu_worker.Worker"),
    )
    out = {}
    wrapper = WorkerWrapperBase()
    wrapper.init_worker([{"vllm_config": config}])
    worker = wrapper.worker
    worker.init_device()
    worker.load_model()
    worker.initialize_from_config(None)
    kv = worker.model_runner.kv_cache
    pool = torpor.Pool.torch(0)
    out["kv_in_torpor"] = pool.contains(kv.data_ptr())
    out["exportable"] = pool.exportable

    from vllm.device_allocator import register_tag_hooks
    from vllm.device_allocator.cumem import CuMemAllocator

    allocator = CuMemAllocator.get_instance()

    class Transport:
        def __init__(self):
            self.handles, self.events = None, []

        def register(self):
            self.handles = allocator.export_handles("kv_cache", kind="posix_fd")
            self.events.append("register")

        def before_unmap(self):
            self.handles.close()
            self.events.append("deregister")

        def after_map(self):
            if self.handles is None or all(c.closed for c in self.handles):
                self.register()

        def chunk_of(self, address):
            return next(c for c in self.handles if c.va <= address < c.va + c.nbytes)

    transport = Transport()
    try:
        transport.register()
    except RuntimeError as e:  # torpor's errors are RuntimeErrors in the vLLM mode
        out["export_error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(out))
        return
    register_tag_hooks("kv_cache", transport.before_unmap, transport.after_map)

    def read(t):
        return ctypes.string_at(t.data_ptr(), t._nbytes)

    data = pattern(kv._nbytes, 21)
    write(kv, data)
    chunk = transport.chunk_of(kv.data_ptr())
    out["chunks"] = len(transport.handles)
    out["kinds"] = sorted({c.kind for c in transport.handles})
    out["gpu_direct_rdma"] = all(c.gpu_direct_rdma for c in transport.handles)
    out["read_elsewhere_matches"] = read_elsewhere(chunk, kv.data_ptr(), kv._nbytes) == digest(data)

    if sleep_mode:
        va = chunk.va
        worker.sleep(level=1)  # the KV cache is discarded
        out["closed_before_unmap"] = all(c.closed for c in transport.handles) and transport.events[-1] == "deregister"
        worker.wake_up()
        out["events"] = transport.events
        out["kv_poisoned_after_wake"] = read(kv) == b"\xff" * kv._nbytes
        data = pattern(kv._nbytes, 22)  # the engine writes its KV cache again
        write(kv, data)
        chunk = transport.chunk_of(kv.data_ptr())
        out["same_address_after_wake"] = chunk.va == va
        out["read_elsewhere_after_wake_matches"] = read_elsewhere(chunk, kv.data_ptr(), kv._nbytes) == digest(data)
    transport.handles.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
