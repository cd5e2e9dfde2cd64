"""Hook mode "torch": torch_memory_saver's regions through PyTorch's pluggable allocator, in
process, over torpor.engine (the default where libtorpor_preload.so is not preloaded).

- A region is a torpor.use_pool block of its tag, class cache without a backup (discarded on
  pause, undefined after resume) and state with one (copied to host memory, restored bit-exact);
  both kinds may share a tag (a MemPool of each class).
- A pause is a level-1 sleep of the regions' tags, each with its MemPool's class; a tag given to
  keep_buffers sleeps at level 2 with the policy that keeps every byte but the registered
  parameters. A resume wakes them, and without retain_cpu_backup gives the host copies back
  (torpor.release_host_store), as torch_memory_saver frees them.
- cuda_graph: torpor.graph into the tag's graph tag, "T.graph" (a graph pool needs a tag of its
  own); pause and resume of T act on it too, when it holds graphs.
- get_cpu_backup reads torpor's host copy (torpor_read_host_copy). zero_copy hands out a stable
  slot (``HostBackup``) that each pause refills, as torch_memory_saver's backup slot.
- The tms library, when built, is loaded with ctypes only (it interposes nothing here) and the
  regions mirror their settings into it, so its tms_get_* answer what this side does.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import weakref
from typing import Optional

from .. import engine
from ..errors import InvalidArgument, InvalidState, LibraryNotFound
from ..pool import MemoryClass
from . import library
from .regions import Regions, default_backup_backend

logger = logging.getLogger(__name__)


def graph_tag(tag: str) -> str:
    """The torpor tag holding the CUDA graphs that cuda_graph() captured under tms tag `tag`."""
    return f"{tag}.graph"


def _parameters_only(tag: str, memory_class: MemoryClass, has_parameters: bool) -> MemoryClass:
    """keep_buffers' policy (a level-2 sleep): in a tag holding registered parameters every other
    byte is state (offloaded, restored in place); a tag without them keeps its regions' class."""
    return MemoryClass.STATE if has_parameters else memory_class


class HostBackup:
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


class TorchHooks:
    """Hook mode "torch" (see the module note): the strategy TorchMemorySaver delegates to."""

    name = "torch"

    def __init__(self, regions: Regions):
        self._regions = regions
        self._backends: dict[str, str] = {}  # tag -> backend of its last region with a backup
        self.host_backups: dict[tuple[int, int, int], HostBackup] = {}  # zero-copy slots
        self._buffers_kept: set[str] = set()  # tags whose pause discards parameters only (keep_buffers)
        self._lib: Optional[ctypes.CDLL] = None  # the tms library, loaded with ctypes
        self._lib_missing: Optional[str] = None  # why there is none

    # -- the tms library -------------------------------------------------------------------

    def library(self) -> Optional[ctypes.CDLL]:
        """The tms library, loaded with ctypes on first use (RTLD_LOCAL, so its cudaMalloc
        interposes nothing), whose thread settings the regions here mirror, as
        torch_memory_saver's torch-mode library holds them. None when it is not built."""
        r = self._regions
        with r.lock:
            if self._lib is None and self._lib_missing is None:
                try:
                    self._lib = library.bind(library.preload_library_path())
                    self._lib.tms_set_retain_cpu_backup(r.retain_cpu_backup)
                except (LibraryNotFound, OSError, AttributeError) as e:
                    self._lib_missing = str(e)
                    logger.debug("torpor.tms: no tms library in hook_mode 'torch': %s", e)
            return self._lib

    def loaded_library(self) -> Optional[ctypes.CDLL]:
        """The tms library if loaded already (settings are mirrored into it only then)."""
        return self._lib

    def missing_library(self) -> str:
        """Why library() is None."""
        return self._lib_missing or "not loaded"

    # -- regions ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def region(self, tag: str, cpu: bool, disk: bool, backend: Optional[str]):
        r = self._regions
        r.apply_store(disk=disk)
        cls = MemoryClass.STATE if (cpu or disk) else MemoryClass.CACHE
        resolved = (backend or default_backup_backend()) if cpu else ""
        with r.lock:
            r.tags.add(tag)
            if cpu:
                self._backends[tag] = resolved
        engine.intend_sleep("torch_memory_saver", self._planned, 1)
        lib = self.library()
        settings = (
            library.region_settings(lib, tag, cpu, disk, backend) if lib is not None else contextlib.nullcontext()
        )
        with engine.use_pool(tag, memory_class=cls) as mempool, settings:
            device = engine.cuda_torch().cuda.current_device()
            with r.lock:  # torch_memory_saver's _mem_pools key (entrypoint.py at 4a43c97)
                r.mem_pools[(tag, cpu, disk, resolved, device)] = mempool
            yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool, stream, capture_error_mode: str, tag: str, cpu: bool, backend):
        self._regions.apply_store(disk=False)
        cls = MemoryClass.STATE if cpu else MemoryClass.CACHE
        with engine.graphs.graph(cuda_graph, pool, stream, capture_error_mode, tag=graph_tag(tag), memory_class=cls):
            with self._regions.lock:
                self._regions.tags.add(tag)
            yield

    def keep_buffers(self, tag: str) -> None:
        with self._regions.lock:
            self._buffers_kept.add(tag)

    # -- pause and resume --------------------------------------------------------------------

    def _selected(self, tag: Optional[str], asleep: bool) -> list[str]:
        """The tags a pause (asleep=False) or resume (asleep=True) acts on: `tag`, or every
        region's, and the graph tag of each that holds graphs (not a user's tag that is only named
        like one), among the tags torpor knows that are awake, or asleep."""
        with self._regions.lock:
            wanted = set(self._regions.tags) if tag is None else {tag}
        wanted |= {graph_tag(t) for t in wanted if engine.graphs.is_graph_tag(graph_tag(t))}
        return sorted(t for t, sleeping in engine.tag_states().items() if t in wanted and sleeping == asleep)

    def _planned(self, level: int, tags: list[str]) -> list:
        """What pause() does, whatever the level: one level-1 sleep of the regions' tags, each
        with its region's class (torpor.engine's preparation of the host store)."""
        return [(1, self._selected(None, asleep=False), engine.pool_class)]

    def pause(self, tag: Optional[str]) -> None:
        tags = self._selected(tag, asleep=False)
        with self._regions.lock:
            kept = [t for t in tags if t in self._buffers_kept]
        with engine.as_runtime_errors():
            engine.sleep(1, [t for t in tags if t not in kept])
            if kept:
                engine.sleep(2, kept, _parameters_only)
            if tags:
                self._refill_host_backups()

    def resume(self, tag: Optional[str]) -> None:
        tags = self._selected(tag, asleep=True)
        with engine.as_runtime_errors():
            engine.wake_up(tags)
            if tags and not self._regions.retain_cpu_backup:
                # torpor keeps host copies after wake to skip unchanged bytes at the next pause;
                # torch_memory_saver frees them unless retained (csrc/core.cpp, resume, at 4a43c97).
                engine.release_host_store()
                self._refill_host_backups()

    def _refill_host_backups(self) -> None:
        """After a pause or a resume: every zero-copy backup holds the pool's host copy again (a
        pause wrote new bytes into torch_memory_saver's slot), or is dropped where the pool holds
        none any more (a resume without retain_cpu_backup frees the slot; so does freeing x)."""
        with self._regions.lock:
            backups = list(self.host_backups.items())
        for key, backup in backups:
            try:
                kept = backup.refill() is not None
            except (InvalidState, InvalidArgument):
                kept = False  # discarded, or no longer an allocation of the pool
            if not kept:
                self._drop_backup(key, backup)

    # -- settings and backups ----------------------------------------------------------------

    def retain_cpu_backup(self) -> bool:
        return self._regions.retain_cpu_backup

    def set_disk_backup_dir(self, path: str) -> None:
        self._regions.use_disk_dir(path)

    def cpu_backup(self, torch, x, nbytes: int, zero_copy: bool):
        """get_cpu_backup of a CUDA tensor of `nbytes` > 0 bytes (see the module note)."""
        r = self._regions
        key = (x.device.index, x.data_ptr(), nbytes)
        with r.lock:
            backup = self.host_backups.get(key) if zero_copy else None
        fresh = backup is None and zero_copy
        if fresh:
            tag = engine.tag_at(x.device.index, x.data_ptr())
            with r.lock:
                kind = self._backends.get(tag) or default_backup_backend()
            backup = HostBackup(torch, x, kind, self.library())
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
            with r.lock:
                self.host_backups[key] = backup
            # torch_memory_saver frees the slot with its allocation; what this layer sees of that
            # is the tensor going (the segment itself is PyTorch's to keep cached)
            weakref.finalize(x, self._drop_backup, key, backup)
        return out

    def _drop_backup(self, key, backup: Optional[HostBackup] = None) -> None:
        """Forget the zero-copy slot of `key` and give its memory back (only `backup`'s, if given:
        a slot made since for the same key is not this one)."""
        with self._regions.lock:
            held = self.host_backups.get(key)
            if held is None or (backup is not None and held is not backup):
                return
            del self.host_backups[key]
        held.release()


__all__ = ["HostBackup", "TorchHooks", "graph_tag"]
