"""Hook mode "preload": libtorpor_preload.so, on LD_PRELOAD from the process's start, interposes
the CUDA runtime's cudaMalloc / cudaFree (torch_memory_saver's default hook mode, and what SGLang's
schedulers get from configure_subprocess). This strategy drives it through ctypes with
torch_memory_saver's entry points: region settings per thread, a MemPool per region kind (PyTorch
caches freed blocks per pool, so a block of a region's segment is never handed to an allocation
outside the region), pause / resume / retain / backups / the disk directory in the library.
TMS_INIT_ENABLE=1 makes the library capture every allocation from the start. The allocations are
cudaMalloc's, not PyTorch's, so keep_buffers (which tells parameters from buffers) is refused.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Optional

from .. import engine
from ..errors import InternalError, OutOfMemory, Unavailable
from . import library
from .regions import Regions


class PreloadHooks:
    """Hook mode "preload" (see the module note): the strategy TorchMemorySaver delegates to."""

    name = "preload"

    def __init__(self, regions: Regions):
        self._regions = regions
        self._lib = library.bind(library.preloaded())  # Unavailable when the process did not preload it

    def library(self) -> ctypes.CDLL:
        return self._lib

    def loaded_library(self) -> ctypes.CDLL:
        return self._lib

    def missing_library(self) -> str:
        return "loaded"

    # -- regions ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def region(self, tag: str, cpu: bool, disk: bool, backend: Optional[str]):
        torch = engine.cuda_torch()
        device = torch.cuda.current_device()
        resolved = (backend or self._lib.tms_get_cpu_backup_backend().decode()) if cpu else ""
        key = (tag, cpu, disk, resolved, device)
        r = self._regions
        with r.lock:
            pool = r.mem_pools.get(key)
            if pool is None:
                pool = r.mem_pools[key] = torch.cuda.memory.MemPool()
            r.tags.add(tag)
        with torch.cuda.memory.use_mem_pool(pool):
            with library.region_settings(self._lib, tag, cpu, disk, backend):
                yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool, stream, capture_error_mode: str, tag: str, cpu: bool, backend):
        # as torch_memory_saver's preload mode: the capture's private pool cudaMallocs its
        # segments inside the region, so they are the preload library's
        torch = engine.cuda_torch()
        with torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            with library.region_settings(self._lib, tag, cpu, False, backend):
                yield

    def keep_buffers(self, tag: str) -> None:
        raise Unavailable(
            "keep_buffers: in hook_mode 'preload' the allocations are cudaMalloc's, not PyTorch's, so torpor "
            "cannot tell parameters from buffers; use hook_mode 'torch' for SGLang's weights"
        )

    # -- pause and resume --------------------------------------------------------------------

    def pause(self, tag: Optional[str]) -> None:
        self._call("tms_pause", tag)

    def resume(self, tag: Optional[str]) -> None:
        self._call("tms_resume", tag)

    def _call(self, name: str, tag: Optional[str]) -> None:
        code = getattr(self._lib, name)(tag.encode() if tag else None)
        if code == 0:
            return
        cls = OutOfMemory if code == library.CUDA_ERROR_MEMORY_ALLOCATION else InternalError
        raise engine.runtime_error(
            cls(
                f"{name}({tag!r}) failed with CUDA error {code} (libtorpor_preload.so says why on stderr); calling it "
                f"again once the cause is gone completes it"
            )
        )

    # -- settings and backups ----------------------------------------------------------------

    def retain_cpu_backup(self) -> bool:
        return bool(self._lib.tms_get_retain_cpu_backup())

    def set_disk_backup_dir(self, path: str) -> None:
        # The library configures the pools' disk tier from torpor's default options; then the
        # same tier with this process's torpor.configure() options (the last configure before
        # the first allocation is the pools').
        self._lib.tms_set_disk_backup_dir(path.encode())
        self._regions.use_disk_dir(path)

    def cpu_backup(self, torch, x, nbytes: int, zero_copy: bool):
        """torch_memory_saver's get_cpu_backup over the library's slot (entrypoint.py)."""
        address = self._lib.tms_get_cpu_backup_pointer(x.data_ptr(), nbytes)
        if not address:
            return None
        raw = (ctypes.c_uint8 * nbytes).from_address(address)
        out = torch.frombuffer(raw, dtype=x.dtype).view(x.shape)
        return out if zero_copy else out.clone()


__all__ = ["PreloadHooks"]
