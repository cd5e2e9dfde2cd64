"""torch_memory_saver's API over torpor: TorchMemorySaver, whose singleton torpor.tms.torch_memory_saver
is, for SGLang and the RL frameworks built on it (they pause "weights", "kv_cache" and
"cuda_graph"). This module is the API and its checks; what a call does is the strategy of the
hook mode in force (torpor.tms.torch_mode, torpor.tms.preload_mode), over the state their
regions share (torpor.tms.regions).

    from torpor.tms import torch_memory_saver       # or, once torpor.tms.install() ran (or with
                                                    # torpor.tms.shim_path() on PYTHONPATH):
                                                    # from torch_memory_saver import torch_memory_saver
    with torch_memory_saver.region(tag="kv_cache"):
        kv = torch.empty(n, device="cuda")           # discarded on pause
    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        w = torch.empty(n, device="cuda")            # kept on pause (host copy)
    torch_memory_saver.pause("kv_cache"); torch_memory_saver.pause()      # one tag, then all
    torch_memory_saver.resume()

Semantics, as torch_memory_saver's (the source read is in /work/main/.anchors/torch_memory_saver,
torch_memory_saver/entrypoint.py and csrc/core.cpp):

- Tags are non-empty str without NUL (a C string would end there) or lone surrogates:
  anything else is torpor.InvalidArgument, in every call that takes a tag.
- ``region(tag="default", enable_cpu_backup=False)``: CUDA tensors created inside live in torpor
  under `tag`. Without a backup their bytes are discarded on pause (class cache) and come back
  undefined; with one they are copied to host memory and restored bit-exact (class state). Both
  kinds may share a tag. Regions nest; the innermost wins.
- ``pause(tag=None)`` / ``resume(tag=None)``: one tag, or every tag a region created. Every address
  stays the same, so CUDA graphs captured over these tensors replay after resume.
- ``disable()``: tensors created inside go to PyTorch's own memory even inside a region, and that
  memory goes back to the device when they are freed after the block.
- ``retain_cpu_backup`` (default False, or TMS_RETAIN_CPU_BACKUP=1): keep the host copies after
  resume. A resume without it gives them back (torpor.release_host_store: the whole pool's).
- ``memory_margin_bytes = n``: refuse a new segment (PyTorch's out-of-memory error) when it would
  leave less than n bytes of the device free (torpor_torch_set_memory_margin), as
  torch_memory_saver's malloc checks margin + allocation size against cudaMemGetInfo's free bytes.
- ``get_cpu_backup(x, zero_copy=False)``: a CPU tensor (x's dtype and shape) with the host copy of
  x's bytes: while paused, its backup; after resume, the copy when the resume retained it, None
  after a resume without retain_cpu_backup (torch_memory_saver returns its slot whenever it exists,
  csrc/core.cpp get_cpu_backup_pointer at 4a43c97). ``zero_copy=True`` returns a view of one host
  buffer per tensor that keeps its address across retained resumes and is refilled by every pause
  (torch_memory_saver's slot): torpor's own host store moves its blocks, so that buffer is a copy
  of the store, made only for zero-copy callers, and dropped (its memory freed) when the pool no
  longer holds a copy (a resume without retain) or the tensor x is freed. A "pinned" buffer is
  page-locked with the runtime's cudaMallocHost through the tms library and freed with
  cudaFreeHost when dropped (PyTorch's pin_memory would keep it registered in its host cache),
  so cudaHostGetFlags fails on it once x is gone, as torch_memory_saver's examples check; without
  that library or a runtime, PyTorch's pinned memory.
- ``cpu_backup_backend`` ("pinned" or "mmap"; default TMS_INIT_CPU_BACKUP_BACKEND, else pinned):
  the kind of memory of the zero-copy buffer of the tensors of that region's tag (page-locked, or
  anonymous pageable memory given back to the system when the buffer is dropped; regions of one
  tag share torpor's MemPool, so the tag's last backup region decides). torpor's own
  backups live in its host store, whose tier is per pool: page-locked by default;
  TMS_INIT_CPU_BACKUP_BACKEND=mmap makes it pageable (host_store_limit below one block) before
  the first allocation. Either way a resume without retain gives the store's memory back.
- ``set_disk_backup_dir(path)`` (or TMS_DISK_BACKUP_DIR; /tmp when neither, as torch_memory_saver)
  and ``region(enable_disk_backup=True)``: the pools' disk tier in that directory, a file per
  allocation as torch_memory_saver's (spill_file_per_allocation; given back with the copies at a
  resume without retain), configured before the first allocation in a region;
  a disk region's bytes are kept bit-exact (class state). torpor's tier is per pool, so once a
  disk directory is set every backup of the process goes there, those of enable_cpu_backup regions
  too (still restored bit-exact, and get_cpu_backup reads them back from the file, where
  torch_memory_saver returns None for a disk-backed tensor). Setting it after the pools hold
  memory is torpor.Unavailable, saying so.
- ``cuda_graph(cuda_graph, pool=None, stream=None, capture_error_mode="global", tag="default",
  enable_cpu_backup=False)``: torch.cuda.graph with the graph's memory in torpor (torpor.graph):
  ``pause(tag)`` releases it with the tag's regions, ``resume(tag)`` maps it back at the same
  addresses and the graph replays without re-capture. A graph pool is rewritten by every replay,
  so it cannot share a torpor tag with tensors: the graphs of tms tag T live in torpor tag
  "T.graph" (what torpor.stats() shows); pause and resume of T act on both. Only on a "T.graph"
  that holds graphs, though: a region tag of the user's that happens to be named "T.graph" is a
  tag of its own, which pause("T") leaves alone (and a region cannot enter a tag holding graphs,
  nor a graph capture a tag holding tensors: either is InvalidArgument). Without a backup the
  graph's memory is discarded on pause (its intermediates are rewritten by the next replay; mark
  static inputs and outputs with torpor.mark_state to keep them); with enable_cpu_backup=True all
  of it is kept. `pool` must be a torpor graph pool (another such graph's pool()).
- ``hook_mode``: "preload" by default when libtorpor_preload.so is on this process's LD_PRELOAD
  (torch_memory_saver's default, and what SGLang's schedulers get from configure_subprocess), else
  "torch" (torch_memory_saver would fail there): regions through PyTorch's pluggable allocator, in
  process. "preload": libtorpor_preload.so, which must be on
  LD_PRELOAD when the process starts (torpor.Unavailable otherwise, saying how), interposes the
  CUDA runtime's cudaMalloc / cudaFree; torpor.tms.preload_mode then drives it through ctypes with
  torch_memory_saver's entry points (region settings per thread, a MemPool per region kind,
  pause / resume / retain / backups / disk directory in the library; TMS_INIT_ENABLE=1 captures
  every allocation from the start; README says what it cannot capture). Set it before the first
  region. keep_buffers (torpor.sglang) needs "torch". In both modes ``_impl._binary_wrapper.cdll``
  is that library (in "torch" loaded with ctypes, not preloaded, so it interposes nothing; the
  regions here mirror their settings into it, so tms_get_* answer what the Python side does),
  ``_impl._mem_pools`` holds the regions' MemPools under torch_memory_saver's keys and
  ``_impl._with_region_config`` sets the library's thread settings; the library exports the CUDA
  runtime's cudaHostGetFlags and cudaGetLastError as forwarders to the runtime the process loaded,
  as torch_memory_saver's library, which links the runtime, resolves them.
- ``configure_subprocess()``: a context in which child processes started from here resolve
  ``import torch_memory_saver`` to torpor.tms too (the shim directory goes first on PYTHONPATH)
  and start with libtorpor_preload.so first on LD_PRELOAD, as torch_memory_saver's own.

torch_memory_saver's variables, read through torpor.environment with its values (1, true, TRUE,
yes, YES mean on): TMS_RETAIN_CPU_BACKUP, TMS_INIT_CPU_BACKUP_BACKEND, TMS_DISK_BACKUP_DIR here;
TMS_INIT_ENABLE, TMS_INIT_ENABLE_CPU_BACKUP, TMS_INIT_ENABLE_DISK_BACKUP by the preload library
(they describe allocations outside region(), which only it sees).

Where torch_memory_saver exits the process, torpor raises or is idempotent, by design:

- pausing a paused tag, resuming an awake one: no-op (torch_memory_saver: exit(1));
- pause or resume of a tag no region created: no-op (as torch_memory_saver);
- entering a region of a paused tag: torpor.InvalidState (torch_memory_saver allocates, and the
  next resume of the tag exits the process);
- get_cpu_backup of a tensor torpor does not hold: torpor.InvalidArgument (exit(1)); of a paused
  tensor without a backup: torpor.InvalidState (an abort there);
- a failed pause or resume raises torpor's typed error, also a RuntimeError
  (torpor.engine.runtime_error); calling it again once the cause is gone completes it.

Making ``import torch_memory_saver`` resolve here (opt-in): ``torpor.tms.install()`` in the process,
or ``PYTHONPATH=$(python3 -m torpor.tms --shim-path):$PYTHONPATH`` for it and its children.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Optional

from .. import engine
from ..errors import InvalidArgument, InvalidState
from ..values import text
from . import library
from .preload_mode import PreloadHooks
from .regions import TAG_DEFAULT, Regions, check_backup_backend
from .torch_mode import TorchHooks

_HOOK_MODES = ("preload", "torch")


class TorchMemorySaver:
    """torch_memory_saver's TorchMemorySaver over torpor (see the module note). Instances share
    torpor's pools: pause() of one pauses the regions of all (the process has one allocator).
    """

    def __init__(self):
        self._regions = Regions()
        self._torch = TorchHooks(self._regions)  # kept across hook_mode changes, as its settings
        self._mode: TorchHooks | PreloadHooks = self._torch
        if library.default_hook_mode() == "preload":
            self.hook_mode = "preload"  # binds the preloaded library, as setting it does

    # -- regions ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def region(
        self,
        tag: str = TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: Optional[str] = None,
    ):
        check_backup_backend(enable_cpu_backup, cpu_backup_backend)
        if enable_cpu_backup and enable_disk_backup:
            raise InvalidArgument("enable_cpu_backup and enable_disk_backup are mutually exclusive")
        text(tag, "region: tag")
        with self._mode.region(tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
            yield

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph,
        pool=None,
        stream=None,
        capture_error_mode: str = "global",
        tag: str = TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        cpu_backup_backend: Optional[str] = None,
    ):
        """torch.cuda.graph with the graph's memory pauseable under `tag` (see the module note)."""
        check_backup_backend(enable_cpu_backup, cpu_backup_backend)
        text(tag, "cuda_graph: tag")
        with self._mode.cuda_graph(
            cuda_graph, pool, stream, capture_error_mode, tag, enable_cpu_backup, cpu_backup_backend
        ):
            yield

    @contextlib.contextmanager
    def disable(self):
        """PyTorch's own memory for what is created inside, even within a region (a MemPool of
        PyTorch's default allocator, dropped at exit: its memory goes back once those tensors die).
        """
        torch = engine.cuda_torch()
        cdll = self._mode.loaded_library()
        was = cdll.tms_get_interesting_region() if cdll is not None else False
        if cdll is not None:
            cdll.tms_set_interesting_region(False)
        pool = torch.cuda.memory.MemPool()
        try:
            with torch.cuda.memory.use_mem_pool(pool):
                yield
        finally:
            del pool
            if cdll is not None:
                cdll.tms_set_interesting_region(was)

    def keep_buffers(self, tag: str = "weights") -> None:
        """Opt-in, torpor's upgrade of torch_memory_saver's policy: from now on a pause of `tag`
        discards only the registered parameters (engine.register_parameters) of its regions and
        keeps every other byte (buffers, tensors computed at load) bit-exact in place, even in a
        region without a CPU backup. torpor.sglang.register_model calls it for SGLang's weights.
        Hook mode "torch" only."""
        text(tag, "keep_buffers: tag")
        self._mode.keep_buffers(tag)

    # -- pause and resume --------------------------------------------------------------------

    def pause(self, tag: Optional[str] = None) -> None:
        """Release the memory of `tag` (None: every region's tag): backed-up bytes go to host
        memory, the rest is discarded. Pausing a paused tag does nothing."""
        if tag is not None:
            text(tag, "pause: tag (None means every tag)")
        self._mode.pause(tag)

    def resume(self, tag: Optional[str] = None) -> None:
        """Map the memory of `tag` (None: every region's tag) again at the same addresses and
        restore the backed-up bytes. Resuming an awake tag does nothing."""
        if tag is not None:
            text(tag, "resume: tag (None means every tag)")
        self._mode.resume(tag)

    # -- settings ----------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self) -> str:
        return self._mode.name

    @hook_mode.setter
    def hook_mode(self, value: str) -> None:
        """ "torch" (regions through PyTorch's pluggable allocator, in process) or "preload"
        (libtorpor_preload.so on LD_PRELOAD interposes cudaMalloc: see the module note). Before
        the first region: the two keep their memory apart."""
        if value not in _HOOK_MODES:
            raise InvalidArgument(f"hook_mode {value!r} is not one of {', '.join(_HOOK_MODES)}")
        if value == self._mode.name:
            return
        with self._regions.lock:
            if self._regions.tags:
                raise InvalidState(
                    f"hook_mode: regions of hook_mode {self._mode.name!r} exist already "
                    f"({', '.join(sorted(self._regions.tags))}); set hook_mode before the first region"
                )
        self._mode = PreloadHooks(self._regions) if value == "preload" else self._torch

    @property
    def retain_cpu_backup(self) -> bool:
        return self._mode.retain_cpu_backup()

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        lib = self._mode.loaded_library()
        if lib is not None:
            lib.tms_set_retain_cpu_backup(bool(value))
        self._regions.retain_cpu_backup = bool(value)

    @property
    def memory_margin_bytes(self) -> int:
        return engine.memory_margin()

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgument(f"memory_margin_bytes {value!r} is not a whole number of bytes >= 0")
        if value > ctypes.c_size_t(-1).value:
            raise InvalidArgument(f"memory_margin_bytes {value} does not fit in a size_t")
        engine.set_memory_margin(value)

    def set_disk_backup_dir(self, path: str) -> None:
        """The process-wide directory of disk backups (created if missing, as torch_memory_saver's):
        torpor's disk tier there, a file per allocation, for every backup of the pools. Before the first
        allocation in a region (torpor.Unavailable after: the pools' host store is fixed)."""
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidArgument(f"set_disk_backup_dir: {path!r} is not a path")
        path = os.fspath(path)
        if not path or "\0" in path:
            raise InvalidArgument(f"set_disk_backup_dir: {path!r} is not a directory name")
        os.makedirs(path, exist_ok=True)
        self._mode.set_disk_backup_dir(path)

    # -- backups -----------------------------------------------------------------------------

    def get_cpu_backup(self, x, zero_copy: bool = False):
        """A CPU tensor with the host copy of x's bytes, or None (see the module note)."""
        torch = engine.cuda_torch()
        if not isinstance(x, torch.Tensor) or not x.is_cuda:
            raise InvalidArgument(f"get_cpu_backup: {type(x).__name__} is not a CUDA tensor")
        if not x.is_contiguous():
            raise InvalidArgument(
                f"get_cpu_backup: the tensor is not contiguous (shape {tuple(x.shape)}, stride {x.stride()})"
            )
        nbytes = x.numel() * x.element_size()
        if nbytes == 0:
            return torch.empty(x.shape, dtype=x.dtype, device="cpu")
        return self._mode.cpu_backup(torch, x, nbytes, zero_copy)

    # -- what torch_memory_saver's own examples reach -----------------------------------------
    # (test/examples/nested_region.py, cpu_backup.py at 4a43c97): _ensure_initialized(),
    # _impl._binary_wrapper.cdll (the C library), _impl._mem_pools and _impl._with_region_config.
    # The same exist here, in either hook mode, over libtorpor_preload.so, so those examples run
    # unmodified.

    def _ensure_initialized(self) -> None:
        """torch_memory_saver initialises lazily; torpor.tms is ready from the start."""

    @property
    def _impl(self) -> "Impl":
        lib = self._mode.library()
        if lib is None:
            raise AttributeError(
                f"torpor.tms has torch_memory_saver's _impl (its C library) only with {library.PRELOAD_NAME} built: "
                f"{self._mode.missing_library()}"
            )
        return Impl(self._regions, lib)


class Impl:
    """What torch_memory_saver's examples use of its _TorchMemorySaverImpl (entrypoint.py), in
    either hook mode: the library (whose exports include the runtime's cudaHostGetFlags and
    cudaGetLastError, as TMS's library links the runtime), the MemPools by region kind, the
    region settings."""

    def __init__(self, regions: Regions, lib: ctypes.CDLL):
        self._lib = lib
        self._binary_wrapper = type("BinaryWrapper", (), {"cdll": lib})()
        self._mem_pools = regions.mem_pools  # same keys: (tag, cpu, disk, backend or "", device)

    def _with_region_config(self, tag, enable_cpu_backup, cpu_backup_backend=None, enable_disk_backup=False):
        return library.region_settings(self._lib, tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend)


# The global singleton, as torch_memory_saver's.
torch_memory_saver = TorchMemorySaver()

__all__ = ["TorchMemorySaver", "torch_memory_saver"]
