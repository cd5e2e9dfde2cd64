"""torch_memory_saver mode: the ``torch_memory_saver`` singleton's API over torpor, for SGLang and
the RL frameworks built on it (they pause "weights", "kv_cache" and "cuda_graph").

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
  CUDA runtime's cudaMalloc / cudaFree; this module then drives it through ctypes with
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
  ``import torch_memory_saver`` to this module too (the shim directory goes first on PYTHONPATH)
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
import logging
import mmap
import os
import pathlib
import sys
import threading
import weakref
from typing import Optional

from . import engine, environment
from .engine import as_runtime_errors
from .errors import InternalError, InvalidArgument, InvalidState, LibraryNotFound, OutOfMemory, Unavailable
from .pool import MemoryClass
from .values import text

logger = logging.getLogger(__name__)

_TAG_DEFAULT = "default"
_CPU_BACKUP_BACKENDS = ("mmap", "pinned")
_HOOK_MODES = ("preload", "torch")
SHIM_DIR = pathlib.Path(__file__).resolve().parent / "_shims"

_DISK_DIR_DEFAULT = "/tmp"  # torch_memory_saver's, without TMS_DISK_BACKUP_DIR (csrc/disk_backend.cpp)
# A host-store limit below the store's 2 MiB block puts every backup beyond it: in pageable memory,
# or with a spill directory on disk (torpor/pool.hpp, PoolOptions::host_store_limit).
_EVERY_BACKUP_BEYOND_THE_LIMIT = 1
PRELOAD_NAME = "libtorpor_preload.so"
_CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation, what tms_pause / tms_resume return for OOM


def preload_library_path() -> str:
    """libtorpor_preload.so of the libtorpor.so torpor loaded: beside it (an installed tree), or
    in the build tree's preload/ beside its allocator/. LibraryNotFound when neither exists."""
    lib = pathlib.Path(engine.library_path()).resolve()
    candidates = [lib.parent / PRELOAD_NAME, lib.parent.parent / "preload" / PRELOAD_NAME]
    for c in candidates:
        if c.is_file():
            return str(c)
    raise LibraryNotFound(
        f"{PRELOAD_NAME} (torch_memory_saver's preload mode) is not beside {lib}: looked in "
        f"{', '.join(str(c.parent) for c in candidates)}; build the torpor_preload target"
    )


def _preload_entries() -> list[str]:
    """The libtorpor_preload.so entries of this process's LD_PRELOAD."""
    value = environment.text("LD_PRELOAD")
    return [p for p in value.replace(" ", ":").split(":") if pathlib.Path(p).name.startswith("libtorpor_preload")]


def _default_hook_mode() -> str:
    """torch_memory_saver's default, "preload" (_TorchMemorySaverImpl.__init__ in
    torch_memory_saver/entrypoint.py at 4a43c97), where this process has the preload library, as
    SGLang's scheduler processes do (python/sglang/srt/utils/torch_memory_saver_adapter.py at
    1373e4f sets hook_mode only on XPU, and calls configure_subprocess); "torch" elsewhere, where
    preload mode could not work."""
    return "preload" if len(_preload_entries()) == 1 else "torch"


def _preloaded() -> str:
    """The libtorpor_preload.so on this process's LD_PRELOAD (exactly one, as torch_memory_saver
    asserts of its own, hooks/mode_preload.py at 4a43c97)."""
    value = environment.text("LD_PRELOAD")
    found = _preload_entries()
    if len(found) != 1:
        raise Unavailable(
            f"hook_mode='preload' needs exactly one {PRELOAD_NAME} on LD_PRELOAD when the process starts "
            f"(LD_PRELOAD={value!r}): start it inside torpor.tms.configure_subprocess(), or with "
            f"LD_PRELOAD=$(python3 -m torpor.tms --preload-path)"
        )
    return found[0]


def _bind_preload(path: str) -> ctypes.CDLL:
    """The preloaded library through ctypes, with torch_memory_saver's prototypes
    (binary_wrapper.py at 4a43c97)."""
    cdll = ctypes.CDLL(path)
    c_bool, c_char_p = ctypes.c_bool, ctypes.c_char_p
    for name, args, res in (
        ("tms_set_current_tag", [c_char_p], None),
        ("tms_get_current_tag", [], c_char_p),
        ("tms_set_interesting_region", [c_bool], None),
        ("tms_get_interesting_region", [], c_bool),
        ("tms_set_enable_cpu_backup", [c_bool], None),
        ("tms_get_enable_cpu_backup", [], c_bool),
        ("tms_set_cpu_backup_backend", [c_char_p], None),
        ("tms_get_cpu_backup_backend", [], c_char_p),
        ("tms_set_enable_disk_backup", [c_bool], None),
        ("tms_get_enable_disk_backup", [], c_bool),
        ("tms_set_disk_backup_dir", [c_char_p], None),
        ("tms_pause", [c_char_p], ctypes.c_int),
        ("tms_resume", [c_char_p], ctypes.c_int),
        ("set_memory_margin_bytes", [ctypes.c_uint64], None),
        ("tms_set_retain_cpu_backup", [c_bool], None),
        ("tms_get_retain_cpu_backup", [], c_bool),
        ("tms_get_cpu_backup_pointer", [ctypes.c_void_p, ctypes.c_uint64], ctypes.c_void_p),
        ("torpor_preload_host_alloc", [ctypes.c_uint64, c_char_p], ctypes.c_void_p),
        ("torpor_preload_host_free", [ctypes.c_void_p], c_bool),
        ("torpor_preload_host_pinned", [ctypes.c_void_p], c_bool),
    ):
        fn = getattr(cdll, name)
        fn.argtypes, fn.restype = args, res
    return cdll


def graph_tag(tag: str) -> str:
    """The torpor tag holding the CUDA graphs that cuda_graph() captured under tms tag `tag`."""
    return f"{tag}.graph"


def _check_backup_backend(enable_cpu_backup: bool, cpu_backup_backend: Optional[str]) -> None:
    if cpu_backup_backend is None:
        return
    if not enable_cpu_backup:
        raise InvalidArgument("cpu_backup_backend requires enable_cpu_backup=True")
    if cpu_backup_backend not in _CPU_BACKUP_BACKENDS:
        raise InvalidArgument(
            f"cpu_backup_backend {cpu_backup_backend!r} is not one of {', '.join(_CPU_BACKUP_BACKENDS)}"
        )


def _parameters_only(tag: str, memory_class: MemoryClass, has_parameters: bool) -> MemoryClass:
    """keep_buffers' policy (a level-2 sleep): in a tag holding registered parameters every other
    byte is state (offloaded, restored in place); a tag without them keeps its regions' class."""
    return MemoryClass.STATE if has_parameters else memory_class


def default_backup_backend() -> str:
    """TMS_INIT_CPU_BACKUP_BACKEND, or "pinned" (torch_memory_saver's cpu_backup_kind_from_str: an
    unset or empty value is pinned, anything but mmap or pinned an error)."""
    value = environment.text("TMS_INIT_CPU_BACKUP_BACKEND")
    if not value:
        return "pinned"
    if value not in _CPU_BACKUP_BACKENDS:
        raise InvalidArgument(
            f"TMS_INIT_CPU_BACKUP_BACKEND={value!r} is not one of {', '.join(_CPU_BACKUP_BACKENDS)}: "
            f"set it to one of them, or unset it for pinned"
        )
    return value


def _store_request(disk_dir: Optional[str]) -> Optional[tuple[int, Optional[str]]]:
    """The host-store options (host_store_limit, spill_dir) the torch_memory_saver settings ask of
    torpor's pools, or None for torpor's own (every backup page-locked)."""
    if disk_dir is not None:
        return (_EVERY_BACKUP_BEYOND_THE_LIMIT, disk_dir)
    if default_backup_backend() == "mmap":
        return (_EVERY_BACKUP_BEYOND_THE_LIMIT, None)
    return None


class _HostBackup:
    """The host memory behind get_cpu_backup(x, zero_copy=True): torch_memory_saver hands out a
    view of its backup slot, whose address stays across a retained resume and is refilled by the
    next pause. torpor's host store moves and reuses its blocks, so the C API only copies out of
    it (torpor_read_host_copy); this buffer is the stable slot, of the region's backend kind:
    page-locked ("pinned") or anonymous pageable memory ("mmap", given back to the system when
    the buffer is dropped at a resume without retain_cpu_backup).

    Page-locked slots come from the tms library (torpor_preload_host_alloc: cudaMallocHost of the
    loaded runtime) and go back with cudaFreeHost when the slot is dropped, as torch_memory_saver's
    do when their allocation is freed (test/examples/cpu_backup.py checks cudaHostGetFlags fails
    then, at 4a43c97); PyTorch's pin_memory would keep the block registered in its host cache.
    Without the library or a runtime that page-locks, PyTorch's pinned memory. release() is
    idempotent; a view of a page-locked slot still held after it dangles, as torch_memory_saver's
    does (an mmap slot lives on until its last view goes)."""

    def __init__(self, torch, x, kind: str, lib: Optional[ctypes.CDLL]):
        self.kind = kind
        self.device = x.device.index
        self.address = x.data_ptr()
        self.nbytes = x.numel() * x.element_size()
        self._lib, self._host, self._map = None, None, None
        if kind == "pinned":
            host = lib.torpor_preload_host_alloc(self.nbytes, b"pinned") if lib is not None else None
            if host and lib.torpor_preload_host_pinned(host):
                self._lib, self._host = lib, host
                raw = (ctypes.c_uint8 * self.nbytes).from_address(host)
                self.tensor = torch.frombuffer(raw, dtype=x.dtype).view(x.shape)
            else:
                if host:
                    lib.torpor_preload_host_free(host)  # pageable: no better than PyTorch's pinned memory
                self.tensor = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
        else:
            self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.tensor = torch.frombuffer(self._map, dtype=x.dtype).view(x.shape)

    def refill(self) -> Optional[bool]:
        """Copy the pool's host copy in; engine.read_host_copy's answer (None: no copy)."""
        return engine.read_host_copy(self.device, self.address, self.nbytes, self.tensor.data_ptr())

    def release(self) -> None:
        """Give the slot's memory back now (not at the next garbage collection)."""
        self.tensor = None
        if self._host is not None:
            host, self._host = self._host, None
            self._lib.torpor_preload_host_free(host)
        # an mmap goes with its last reference: a view handed out may still hold it (PyTorch's
        # frombuffer keeps the object, not an export, so closing it here could leave that dangling)
        self._map = None


class TorchMemorySaver:
    """torch_memory_saver's TorchMemorySaver over torpor (see the module note). Instances share
    torpor's pools: pause() of one pauses the regions of all (the process has one allocator).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._tags: set[str] = set()  # every tag a region or a cuda_graph created
        self._retain_cpu_backup = environment.enabled("TMS_RETAIN_CPU_BACKUP")
        self._hook_mode = "torch"
        self._disk_dir: Optional[str] = environment.text("TMS_DISK_BACKUP_DIR") or None
        self._store_applied: Optional[tuple] = None  # the host-store options put on the pools
        self._backends: dict[str, str] = {}  # tag -> backend of its last region with a backup
        self._host_backups: dict[tuple[int, int, int], _HostBackup] = {}
        self._cdll: Optional[ctypes.CDLL] = None  # the preload library, in hook_mode "preload"
        self._torch_lib: Optional[ctypes.CDLL] = None  # the same library, not preloaded, in "torch"
        self._torch_lib_missing: Optional[str] = None  # why hook_mode "torch" has no library
        self._buffers_kept: set[str] = set()  # tags whose pause discards parameters only (keep_buffers)
        self._mem_pools: dict = {}  # preload mode: (tag, cpu, disk, backend, device) -> MemPool
        if _default_hook_mode() == "preload":
            self.hook_mode = "preload"  # binds the preloaded library, as setting it does

    # -- regions ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def region(
        self,
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: Optional[str] = None,
    ):
        _check_backup_backend(enable_cpu_backup, cpu_backup_backend)
        if enable_cpu_backup and enable_disk_backup:
            raise InvalidArgument("enable_cpu_backup and enable_disk_backup are mutually exclusive")
        text(tag, "region: tag")
        if self._cdll is not None:
            with self._preload_region(tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
                yield
            return
        self._apply_store(disk=enable_disk_backup)
        cls = MemoryClass.STATE if (enable_cpu_backup or enable_disk_backup) else MemoryClass.CACHE
        resolved = (cpu_backup_backend or default_backup_backend()) if enable_cpu_backup else ""
        with self._lock:
            self._tags.add(tag)
            if enable_cpu_backup:
                self._backends[tag] = resolved
        engine.intend_sleep("torch_memory_saver", self._planned, 1)
        lib = self._library()
        settings = (
            self._region_config(tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend, lib)
            if lib is not None
            else contextlib.nullcontext()
        )
        with engine.use_pool(tag, memory_class=cls) as mempool, settings:
            device = engine.cuda_torch().cuda.current_device()
            with self._lock:  # torch_memory_saver's _mem_pools key (entrypoint.py at 4a43c97)
                self._mem_pools[(tag, enable_cpu_backup, enable_disk_backup, resolved, device)] = mempool
            yield

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph,
        pool=None,
        stream=None,
        capture_error_mode: str = "global",
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        cpu_backup_backend: Optional[str] = None,
    ):
        """torch.cuda.graph with the graph's memory pauseable under `tag` (see the module note)."""
        _check_backup_backend(enable_cpu_backup, cpu_backup_backend)
        text(tag, "cuda_graph: tag")
        if self._cdll is not None:
            # as torch_memory_saver's preload mode: the capture's private pool cudaMallocs its
            # segments inside the region, so they are the preload library's
            torch = engine.cuda_torch()
            with torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
                with self._region_config(tag, enable_cpu_backup, False, cpu_backup_backend):
                    yield
            return
        self._apply_store(disk=False)
        cls = MemoryClass.STATE if enable_cpu_backup else MemoryClass.CACHE
        with engine.graphs.graph(
            cuda_graph,
            pool,
            stream,
            capture_error_mode,
            tag=graph_tag(tag),
            memory_class=cls,
        ):
            with self._lock:
                self._tags.add(tag)
            yield

    @contextlib.contextmanager
    def disable(self):
        """PyTorch's own memory for what is created inside, even within a region (a MemPool of
        PyTorch's default allocator, dropped at exit: its memory goes back once those tensors die).
        """
        torch = engine.cuda_torch()
        cdll = self._cdll if self._cdll is not None else self._torch_lib
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
        region without a CPU backup. torpor.sglang.register_model calls it for SGLang's weights."""
        text(tag, "keep_buffers: tag")
        if self._cdll is not None:
            raise Unavailable(
                "keep_buffers: in hook_mode 'preload' the allocations are cudaMalloc's, not PyTorch's, so torpor "
                "cannot tell parameters from buffers; use hook_mode 'torch' for SGLang's weights"
            )
        with self._lock:
            self._buffers_kept.add(tag)

    # -- preload mode ------------------------------------------------------------------------

    def _library(self) -> Optional[ctypes.CDLL]:
        """The tms library behind _impl: the preloaded one in hook_mode "preload"; in "torch" the
        same file loaded with ctypes (RTLD_LOCAL, so its cudaMalloc interposes nothing), whose
        thread settings the regions here mirror, as torch_memory_saver's torch-mode library holds
        them. None when it is not built (self._torch_lib_missing says why)."""
        if self._cdll is not None:
            return self._cdll
        with self._lock:
            if self._torch_lib is None and self._torch_lib_missing is None:
                try:
                    self._torch_lib = _bind_preload(preload_library_path())
                    self._torch_lib.tms_set_retain_cpu_backup(self._retain_cpu_backup)
                except (LibraryNotFound, OSError, AttributeError) as e:
                    self._torch_lib_missing = str(e)
                    logger.debug("torpor.tms: no tms library in hook_mode 'torch': %s", e)
            return self._torch_lib

    @contextlib.contextmanager
    def _region_config(self, tag: str, cpu: bool, disk: bool, backend: Optional[str], cdll=None):
        """The tms library's thread settings for the block, the previous ones after
        (torch_memory_saver's _with_region_config)."""
        cdll = cdll if cdll is not None else self._library()
        saved = (
            cdll.tms_get_current_tag(),
            cdll.tms_get_interesting_region(),
            cdll.tms_get_enable_cpu_backup(),
            cdll.tms_get_cpu_backup_backend(),
            cdll.tms_get_enable_disk_backup(),
        )

        def put(tag_b, interesting, cpu_b, backend_b, disk_b):
            cdll.tms_set_current_tag(tag_b)
            cdll.tms_set_interesting_region(interesting)
            cdll.tms_set_enable_cpu_backup(cpu_b)
            if backend_b is not None:
                cdll.tms_set_cpu_backup_backend(backend_b)
            cdll.tms_set_enable_disk_backup(disk_b)

        put(tag.encode(), True, cpu, backend.encode() if backend else None, disk)
        try:
            yield
        finally:
            put(*saved)

    @contextlib.contextmanager
    def _preload_region(self, tag: str, cpu: bool, disk: bool, backend: Optional[str]):
        # A MemPool per region kind, as torch_memory_saver's: PyTorch caches freed blocks per pool,
        # so a block of a region's segment is never handed to an allocation outside the region.
        torch = engine.cuda_torch()
        device = torch.cuda.current_device()
        resolved = (backend or self._cdll.tms_get_cpu_backup_backend().decode()) if cpu else ""
        key = (tag, cpu, disk, resolved, device)
        with self._lock:
            pool = self._mem_pools.get(key)
            if pool is None:
                pool = self._mem_pools[key] = torch.cuda.memory.MemPool()
            self._tags.add(tag)
        with torch.cuda.memory.use_mem_pool(pool):
            with self._region_config(tag, cpu, disk, backend):
                yield

    # torch_memory_saver's own examples (test/examples/nested_region.py, cpu_backup.py at 4a43c97)
    # reach into its implementation: _ensure_initialized(), _impl._binary_wrapper.cdll (the C
    # library), _impl._mem_pools and _impl._with_region_config. In preload mode the same exist
    # here, over libtorpor_preload.so, so those examples run unmodified.

    def _ensure_initialized(self) -> None:
        """torch_memory_saver initialises lazily; torpor.tms is ready from the start."""

    @property
    def _impl(self):
        lib = self._library()
        if lib is None:
            raise AttributeError(
                f"torpor.tms has torch_memory_saver's _impl (its C library) only with {PRELOAD_NAME} built: "
                f"{self._torch_lib_missing}"
            )
        return _PreloadImpl(self, lib)

    def _preload_call(self, name: str, tag: Optional[str]) -> None:
        code = getattr(self._cdll, name)(tag.encode() if tag else None)
        if code == 0:
            return
        cls = OutOfMemory if code == _CUDA_ERROR_MEMORY_ALLOCATION else InternalError
        raise engine.runtime_error(
            cls(
                f"{name}({tag!r}) failed with CUDA error {code} (libtorpor_preload.so says why on stderr); calling it "
                f"again once the cause is gone completes it"
            )
        )

    # -- pause and resume --------------------------------------------------------------------

    def _selected(self, tag: Optional[str], operation: str, asleep: bool) -> list[str]:
        """The tags a pause (asleep=False) or resume (asleep=True) acts on: `tag`, or every
        region's, and the graph tag of each that holds graphs (not a user's tag that is only named
        like one), among the tags torpor knows that are awake, or asleep."""
        if tag is not None:
            text(tag, f"{operation}: tag (None means every tag)")
        with self._lock:
            wanted = set(self._tags) if tag is None else {tag}
        wanted |= {graph_tag(t) for t in wanted if engine.graphs.is_graph_tag(graph_tag(t))}
        return sorted(t for t, sleeping in engine.tag_states().items() if t in wanted and sleeping == asleep)

    def _planned(self, level: int, tags: list[str]) -> list:
        """What pause() does, whatever the level: one level-1 sleep of the regions' tags, each
        with its region's class (torpor.engine's preparation of the host store)."""
        return [(1, self._selected(None, "pause", asleep=False), engine.pool_class)]

    def pause(self, tag: Optional[str] = None) -> None:
        """Release the memory of `tag` (None: every region's tag): backed-up bytes go to host
        memory, the rest is discarded. Pausing a paused tag does nothing."""
        if self._cdll is not None:
            if tag is not None:
                text(tag, "pause: tag (None means every tag)")
            return self._preload_call("tms_pause", tag)
        tags = self._selected(tag, "pause", asleep=False)
        with self._lock:
            kept = [t for t in tags if t in self._buffers_kept]
        with as_runtime_errors():
            engine.sleep(1, [t for t in tags if t not in kept])
            if kept:
                engine.sleep(2, kept, _parameters_only)
            if tags:
                self._refill_host_backups()

    def resume(self, tag: Optional[str] = None) -> None:
        """Map the memory of `tag` (None: every region's tag) again at the same addresses and
        restore the backed-up bytes. Resuming an awake tag does nothing."""
        if self._cdll is not None:
            if tag is not None:
                text(tag, "resume: tag (None means every tag)")
            return self._preload_call("tms_resume", tag)
        tags = self._selected(tag, "resume", asleep=True)
        with as_runtime_errors():
            engine.wake_up(tags)
            if tags and not self._retain_cpu_backup:
                self._drop_host_copies()

    def _drop_host_copies(self) -> None:
        # torpor keeps host copies after wake to skip unchanged bytes at the next pause;
        # torch_memory_saver frees them unless retained (csrc/core.cpp, resume, at 4a43c97).
        engine.release_host_store()
        self._refill_host_backups()

    def _refill_host_backups(self) -> None:
        """After a pause or a resume: every zero-copy backup holds the pool's host copy again (a
        pause wrote new bytes into torch_memory_saver's slot), or is dropped where the pool holds
        none any more (a resume without retain_cpu_backup frees the slot; so does freeing x)."""
        with self._lock:
            backups = list(self._host_backups.items())
        for key, backup in backups:
            try:
                kept = backup.refill() is not None
            except (InvalidState, InvalidArgument):
                kept = False  # discarded, or no longer an allocation of the pool
            if not kept:
                self._drop_backup(key, backup)

    def _apply_store(self, disk: bool) -> None:
        """Put the host-store options that the backup settings ask for on torpor's pools, once,
        before their first allocation: a disk directory (TMS_DISK_BACKUP_DIR, set_disk_backup_dir,
        or /tmp for a region with enable_disk_backup) makes the pools' disk tier hold every backup;
        TMS_INIT_CPU_BACKUP_BACKEND=mmap makes every backup pageable."""
        with self._lock:
            disk_dir = self._disk_dir
            if disk and disk_dir is None:
                disk_dir = _DISK_DIR_DEFAULT
            wanted = _store_request(disk_dir)
            if wanted is None or wanted == self._store_applied:
                return
            try:
                # torch_memory_saver writes a file per disk-backed allocation (csrc/disk_backend.cpp)
                engine.reconfigure(
                    host_store_limit=wanted[0], spill_dir=wanted[1], spill_file_per_allocation=wanted[1] is not None
                )
            except InvalidState as e:
                raise Unavailable(
                    f"torpor.tms: {self._store_reason(wanted)} needs torpor's pools configured for it, and they "
                    f"already hold memory ({e}); torpor's host store is per pool: set it before the first "
                    f"CUDA allocation in a region (set TMS_DISK_BACKUP_DIR / TMS_INIT_CPU_BACKUP_BACKEND in the "
                    f"environment, or call set_disk_backup_dir first)"
                ) from None
            self._store_applied, self._disk_dir = wanted, disk_dir  # only once the pools took it

    @staticmethod
    def _store_reason(wanted: tuple) -> str:
        if wanted[1] is not None:
            return f"disk backup into {wanted[1]!r}"
        return "cpu_backup_backend mmap (TMS_INIT_CPU_BACKUP_BACKEND)"

    # -- settings ----------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self) -> str:
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, value: str) -> None:
        """ "torch" (regions through PyTorch's pluggable allocator, in process) or "preload"
        (libtorpor_preload.so on LD_PRELOAD interposes cudaMalloc: see the module note). Before
        the first region: the two keep their memory apart."""
        if value not in _HOOK_MODES:
            raise InvalidArgument(f"hook_mode {value!r} is not one of {', '.join(_HOOK_MODES)}")
        if value == self._hook_mode:
            return
        with self._lock:
            if self._tags:
                raise InvalidState(
                    f"hook_mode: regions of hook_mode {self._hook_mode!r} exist already "
                    f"({', '.join(sorted(self._tags))}); set hook_mode before the first region"
                )
        self._cdll = _bind_preload(_preloaded()) if value == "preload" else None
        self._hook_mode = value

    @property
    def retain_cpu_backup(self) -> bool:
        if self._cdll is not None:
            return bool(self._cdll.tms_get_retain_cpu_backup())
        return self._retain_cpu_backup

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        lib = self._cdll if self._cdll is not None else self._torch_lib
        if lib is not None:
            lib.tms_set_retain_cpu_backup(bool(value))
        self._retain_cpu_backup = bool(value)

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
        if self._cdll is not None:
            # The library configures the pools' disk tier from torpor's default options; then the
            # same tier with this process's torpor.configure() options (the last configure before
            # the first allocation is the pools').
            self._cdll.tms_set_disk_backup_dir(path.encode())
        with self._lock:
            previous, self._disk_dir = self._disk_dir, path
        try:
            self._apply_store(disk=True)
        except Exception:
            with self._lock:
                self._disk_dir = previous
            raise

    # -- backups -----------------------------------------------------------------------------

    def get_cpu_backup(self, x, zero_copy: bool = False):
        """A CPU tensor with the host copy of x's bytes, or None (see the module note)."""
        torch = engine.cuda_torch()
        if not isinstance(x, torch.Tensor) or not x.is_cuda:
            raise InvalidArgument(f"get_cpu_backup: {type(x).__name__} is not a CUDA tensor")
        if not x.is_contiguous():
            raise InvalidArgument(
                f"get_cpu_backup: the tensor is not contiguous (shape {tuple(x.shape)}, " f"stride {x.stride()})"
            )
        nbytes = x.numel() * x.element_size()
        if nbytes == 0:
            return torch.empty(x.shape, dtype=x.dtype, device="cpu")
        if self._cdll is not None:
            return self._preload_backup(torch, x, nbytes, zero_copy)
        key = (x.device.index, x.data_ptr(), nbytes)
        with self._lock:
            backup = self._host_backups.get(key) if zero_copy else None
        fresh = backup is None and zero_copy
        if fresh:
            tag = engine.tag_at(x.device.index, x.data_ptr())
            with self._lock:
                kind = self._backends.get(tag) or default_backup_backend()
            backup = _HostBackup(torch, x, kind, self._library())
        out = backup.tensor if zero_copy else torch.empty(x.shape, dtype=x.dtype, device="cpu")
        try:
            copied = engine.read_host_copy(x.device.index, x.data_ptr(), nbytes, out.data_ptr())
        except InvalidState as e:
            raise InvalidState(f"{e} (was the tensor created in a region without enable_cpu_backup=True?)") from None
        if copied is None:  # awake without a retained copy: torch_memory_saver's slot was freed
            self._drop_backup(key)
            if fresh:
                backup.release()
            return None
        if fresh:
            with self._lock:
                self._host_backups[key] = backup
            # torch_memory_saver frees the slot with its allocation; what this layer sees of that
            # is the tensor going (the segment itself is PyTorch's to keep cached)
            weakref.finalize(x, self._drop_backup, key, backup)
        return out

    def _drop_backup(self, key, backup: Optional[_HostBackup] = None) -> None:
        """Forget the zero-copy slot of `key` and give its memory back (only `backup`'s, if given:
        a slot made since for the same key is not this one)."""
        with self._lock:
            held = self._host_backups.get(key)
            if held is None or (backup is not None and held is not backup):
                return
            del self._host_backups[key]
        held.release()

    def _preload_backup(self, torch, x, nbytes: int, zero_copy: bool):
        """torch_memory_saver's get_cpu_backup over the preload library's slot (entrypoint.py)."""
        address = self._cdll.tms_get_cpu_backup_pointer(x.data_ptr(), nbytes)
        if not address:
            return None
        raw = (ctypes.c_uint8 * nbytes).from_address(address)
        out = torch.frombuffer(raw, dtype=x.dtype).view(x.shape)
        return out if zero_copy else out.clone()


class _PreloadImpl:
    """What torch_memory_saver's examples use of its _TorchMemorySaverImpl (entrypoint.py), in
    either hook mode: the library (whose exports include the runtime's cudaHostGetFlags and
    cudaGetLastError, as TMS's library links the runtime), the MemPools by region kind, the
    region settings."""

    def __init__(self, saver: TorchMemorySaver, lib: ctypes.CDLL):
        self._saver = saver
        self._binary_wrapper = type("BinaryWrapper", (), {"cdll": lib})()
        self._mem_pools = saver._mem_pools  # same keys: (tag, cpu, disk, backend or "", device)

    def _with_region_config(self, tag, enable_cpu_backup, cpu_backup_backend=None, enable_disk_backup=False):
        return self._saver._region_config(tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend)


@contextlib.contextmanager
def configure_subprocess():
    """Child processes started inside resolve ``import torch_memory_saver`` to torpor.tms and, as
    torch_memory_saver's configure_subprocess does for its own binary, start with
    libtorpor_preload.so first on LD_PRELOAD (hook_mode "preload", its default and SGLang's).
    Without the preload library (not built) the children get only the shim, and a warning says so."""
    with environment.prepended_path("PYTHONPATH", shim_path()):
        try:
            preload = preload_library_path()
        except LibraryNotFound as e:
            logger.warning("torpor.tms.configure_subprocess: %s; children can use hook_mode='torch' only", e)
            yield
            return
        with environment.prepended_path("LD_PRELOAD", preload, separator=":"):
            yield


def shim_path() -> str:
    """A directory whose ``torch_memory_saver`` package is torpor.tms: put it first on PYTHONPATH."""
    return str(SHIM_DIR)


def install() -> None:
    """Make ``import torch_memory_saver`` (and ``torch_memory_saver.entrypoint``) resolve to this
    module in this process. Call before the engine imports torch_memory_saver."""
    module = sys.modules[__name__]
    sys.modules["torch_memory_saver"] = module
    sys.modules["torch_memory_saver.entrypoint"] = module


# The global singleton, as torch_memory_saver's.
torch_memory_saver = TorchMemorySaver()

__all__ = [
    "TorchMemorySaver",
    "configure_subprocess",
    "install",
    "preload_library_path",
    "shim_path",
    "torch_memory_saver",
]


def _main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python3 -m torpor.tms", description="torpor's torch_memory_saver mode")
    ap.add_argument(
        "--shim-path",
        action="store_true",
        help="print the directory to put first on PYTHONPATH",
    )
    ap.add_argument(
        "--preload-path",
        action="store_true",
        help=f"print the path of {PRELOAD_NAME} to put on LD_PRELOAD (hook_mode 'preload')",
    )
    args = ap.parse_args(argv)
    if args.shim_path:
        print(shim_path())
        return 0
    if args.preload_path:
        print(preload_library_path())
        return 0
    ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
