"""GPU: an exportable PyTorch pool for a KV transport, with real PyTorch on the cuda backend.

A KV cache is allocated inside torpor.use_pool("kv_cache", exportable=True); torpor.export_handles
hands out its chunks' descriptors. Oracles outside torpor: another process imports each descriptor
with the CUDA driver itself (ctypes on libcuda: cuMemImportFromShareableHandle, cuMemMap,
cuMemcpyDtoH) and reports a digest of the bytes it reads; cuPointerGetAttribute says whether the
memory is GPUDirect RDMA capable. Checked:

- the other process reads the tensor's bytes through the descriptor;
- the memory is GPUDirect RDMA capable exactly as the export says (where the device supports it);
- after sleep and wake, the mapping hooks (where a transport re-registers) hand out new
  descriptors, through which the other process reads what was written after the wake.

Skips (with the reason) without PyTorch or a CUDA device. The CUDA-typed gtests of the export
(ExportTest/cuda.*, ExportCudaTest.*) are the C++ side.
"""

import ctypes
import hashlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (these tests need torch with CUDA)")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no CUDA device", allow_module_level=True)

import torpor  # noqa: E402
from torpor import engine  # noqa: E402

KV_BYTES = 64 << 20

# In another process: import descriptor `fd` (inherited) of a `size`-byte chunk on `device` with the
# CUDA driver, map it, copy [offset, offset + n) to the host and print its sha256.
IMPORTER = r"""
import ctypes, hashlib, sys
fd, size, offset, n, device = (int(a) for a in sys.argv[1:6])
cu = ctypes.CDLL("libcuda.so.1")
def check(r, what):
    if r != 0:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(r, ctypes.byref(name))
        sys.exit(f"{what} returned {r} ({name.value})")
class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]
U64, SZ = ctypes.c_ulonglong, ctypes.c_size_t
check(cu.cuInit(0), "cuInit")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
check(cu.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
handle, va = U64(), U64()
check(cu.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), 1), "cuMemImportFromShareableHandle")
check(cu.cuMemAddressReserve(ctypes.byref(va), SZ(size), SZ(0), U64(0), U64(0)), "cuMemAddressReserve")
check(cu.cuMemMap(va, SZ(size), SZ(0), handle, U64(0)), "cuMemMap")
desc = AccessDesc(Location(1, dev.value), 3)  # CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_ACCESS_FLAGS_PROT_READWRITE
check(cu.cuMemSetAccess(va, SZ(size), ctypes.byref(desc), SZ(1)), "cuMemSetAccess")
buf = ctypes.create_string_buffer(n)
check(cu.cuMemcpyDtoH_v2(buf, U64(va.value + offset), SZ(n)), "cuMemcpyDtoH")
print(hashlib.sha256(buf.raw).hexdigest())
check(cu.cuMemUnmap(va, SZ(size)), "cuMemUnmap")
check(cu.cuMemRelease(handle), "cuMemRelease")
check(cu.cuMemAddressFree(va, SZ(size)), "cuMemAddressFree")
"""


def read_elsewhere(chunk, tensor) -> str:
    fd = chunk.fd
    address = tensor.data_ptr()
    args = [str(fd), str(chunk.nbytes), str(address - chunk.va), str(tensor.numel() * tensor.element_size())]
    out = subprocess.run(
        [sys.executable, "-c", IMPORTER, *args, str(tensor.device.index or 0)],
        pass_fds=(fd,),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip()


def digest(tensor) -> str:
    return hashlib.sha256(tensor.cpu().numpy().tobytes()).hexdigest()


def holding(chunks, tensor):
    (chunk,) = [c for c in chunks if c.va <= tensor.data_ptr() < c.va + c.nbytes]
    return chunk


@pytest.fixture(scope="module")
def kv():
    torpor.configure(backend="cuda", fill_on_wake="poison")
    with torpor.use_pool("kv_cache", exportable=True):
        t = torch.randint(0, 256, (KV_BYTES,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    yield t


def test_another_process_reads_the_kv_cache_through_the_exported_descriptor(kv):
    assert torpor.Pool.torch(kv.device.index or 0).exportable
    with torpor.export_handles("kv_cache", kind="posix_fd") as chunks:
        assert read_elsewhere(holding(chunks, kv), kv) == digest(kv)


def test_the_memory_is_gpu_direct_rdma_capable_as_the_export_says(kv):
    cu = ctypes.CDLL("libcuda.so.1")
    capable = ctypes.c_int(0)  # the driver writes a boolean: zeros around it read as its value
    # CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE = 15; PyTorch's context is current here.
    assert cu.cuPointerGetAttribute(ctypes.byref(capable), 15, ctypes.c_ulonglong(kv.data_ptr())) == 0
    with torpor.export_handles("kv_cache", kind="posix_fd") as chunks:
        assert holding(chunks, kv).gpu_direct_rdma == bool(
            capable.value
        ), "the export reports the flag the driver reports for the memory"


def test_after_sleep_and_wake_the_mapping_hooks_hand_out_descriptors_of_the_new_memory(kv):
    transport = {"chunks": torpor.export_handles("kv_cache", kind="posix_fd"), "events": []}

    def before_unmap(tag):
        transport["chunks"].close()
        transport["events"].append("deregister")

    def after_map(tag):
        if all(c.closed for c in transport["chunks"]):
            transport["chunks"] = engine.export_handles(tag, kind="posix_fd")
            transport["events"].append("register")

    hook = engine.hooks.add_mapping_hooks("kv_cache", before_unmap, after_map)
    try:
        address = kv.data_ptr()
        torpor.sleep(1)  # the KV cache is class cache: discarded
        torpor.wake_up()
        assert transport["events"] == ["deregister", "register"]
        assert kv.data_ptr() == address
        kv.copy_(torch.randint(0, 256, (KV_BYTES,), dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        assert read_elsewhere(holding(transport["chunks"], kv), kv) == digest(kv)
    finally:
        engine.hooks.remove_mapping_hooks(hook)
        transport["chunks"].close()
