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
- ``retain_cpu_backup`` (default False): keep the host copies after resume. While True,
  ``get_cpu_backup`` shows the copy of the last pause after resume too.
- ``memory_margin_bytes = n``: refuse a new segment (PyTorch's out-of-memory error) when it would
  leave less than n bytes of the device free (torpor_torch_set_memory_margin).
- ``get_cpu_backup(x, zero_copy=False)``: a CPU tensor (x's dtype and shape) with the host copy of
  x's bytes: while paused, its backup; after resume, None unless retain_cpu_backup is set.
  torpor always returns a copy: zero_copy is accepted and gives a copy too, since torpor's host
  store reuses its memory for the next pause.
- ``set_disk_backup_dir(path)`` and ``region(enable_disk_backup=True)``: torch_memory_saver chooses
  disk per region; torpor's disk tier is per pool: the backups beyond the pool's page-locked
  limit go to files (``torpor.configure(host_store_limit=..., spill_dir=...)`` before the first
  allocation, then regions with ``enable_cpu_backup=True``). Both raise torpor.Unavailable saying
  so, rather than keep the bytes somewhere the caller did not ask for.
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
- ``hook_mode`` ("preload" or "torch"): accepted and remembered; torpor always works in process,
  through PyTorch's pluggable allocator, so both behave as "torch": only tensors created inside
  ``region()`` are pauseable (torch_memory_saver's preload mode with TMS_INIT_ENABLE=1 also
  captures allocations outside regions; torpor does not).
- ``configure_subprocess()``: a context in which child processes started from here resolve
  ``import torch_memory_saver`` to this module too (the shim directory goes first on PYTHONPATH).

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
import pathlib
import sys
import threading
from typing import Optional

from . import engine, environment
from .engine import as_runtime_errors
from .errors import InvalidArgument, InvalidState, Unavailable
from .pool import MemoryClass
from .values import text

logger = logging.getLogger(__name__)

_TAG_DEFAULT = "default"
_CPU_BACKUP_BACKENDS = ("mmap", "pinned")
_HOOK_MODES = ("preload", "torch")
SHIM_DIR = pathlib.Path(__file__).resolve().parent / "_shims"

DISK_TIER_MISSING = (
    "torch_memory_saver's per-region disk backup has no torpor equivalent: torpor's disk tier is per pool "
    "(backups beyond the page-locked limit go to files): call torpor.configure(host_store_limit=..., "
    "spill_dir=...) before the first allocation and use region(enable_cpu_backup=True)"
)


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
            f"cpu_backup_backend {cpu_backup_backend!r} is not one of {', '.join(_CPU_BACKUP_BACKENDS)} "
            f"(torpor keeps every backup in its own host store either way)"
        )


class TorchMemorySaver:
    """torch_memory_saver's TorchMemorySaver over torpor (see the module note). Instances share
    torpor's pools: pause() of one pauses the regions of all (the process has one allocator).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._tags: set[str] = set()  # every tag a region or a cuda_graph created
        self._retain_cpu_backup = False
        self._hook_mode = "torch"

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
        if enable_disk_backup:
            raise Unavailable(DISK_TIER_MISSING)
        text(tag, "region: tag")
        cls = MemoryClass.STATE if enable_cpu_backup else MemoryClass.CACHE
        with self._lock:
            self._tags.add(tag)
        engine.intend_sleep("torch_memory_saver", self._planned, 1)
        with engine.use_pool(tag, memory_class=cls):
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
        cls = MemoryClass.STATE if enable_cpu_backup else MemoryClass.CACHE
        with engine.graph(
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
        pool = torch.cuda.memory.MemPool()
        try:
            with torch.cuda.memory.use_mem_pool(pool):
                yield
        finally:
            del pool

    # -- pause and resume --------------------------------------------------------------------

    def _selected(self, tag: Optional[str], operation: str, asleep: bool) -> list[str]:
        """The tags a pause (asleep=False) or resume (asleep=True) acts on: `tag`, or every
        region's, and the graph tag of each that holds graphs (not a user's tag that is only named
        like one), among the tags torpor knows that are awake, or asleep."""
        if tag is not None:
            text(tag, f"{operation}: tag (None means every tag)")
        with self._lock:
            wanted = set(self._tags) if tag is None else {tag}
        wanted |= {graph_tag(t) for t in wanted if engine.is_graph_tag(graph_tag(t))}
        return sorted(t for t, sleeping in engine.tag_states().items() if t in wanted and sleeping == asleep)

    def _planned(self, level: int, tags: list[str]) -> list:
        """What pause() does, whatever the level: one level-1 sleep of the regions' tags, each
        with its region's class (torpor.engine's preparation of the host store)."""
        return [(1, self._selected(None, "pause", asleep=False), engine.pool_class)]

    def pause(self, tag: Optional[str] = None) -> None:
        """Release the memory of `tag` (None: every region's tag): backed-up bytes go to host
        memory, the rest is discarded. Pausing a paused tag does nothing."""
        with as_runtime_errors():
            engine.sleep(1, self._selected(tag, "pause", asleep=False))

    def resume(self, tag: Optional[str] = None) -> None:
        """Map the memory of `tag` (None: every region's tag) again at the same addresses and
        restore the backed-up bytes. Resuming an awake tag does nothing."""
        tags = self._selected(tag, "resume", asleep=True)
        with as_runtime_errors():
            engine.wake_up(tags)
            if tags and not self._retain_cpu_backup:
                self._drop_host_copies()

    def _drop_host_copies(self) -> None:
        # torpor keeps host copies after wake to skip unchanged bytes at the next pause;
        # torch_memory_saver frees them unless retained.
        engine.release_host_store()

    # -- settings ----------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self) -> str:
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, value: str) -> None:
        if value not in _HOOK_MODES:
            raise InvalidArgument(f"hook_mode {value!r} is not one of {', '.join(_HOOK_MODES)}")
        if value == "preload" and environment.enabled("TMS_INIT_ENABLE"):
            logger.warning(
                "torpor.tms: TMS_INIT_ENABLE=1 asks torch_memory_saver's preload mode to capture every "
                "allocation; torpor captures only those made inside region()"
            )
        self._hook_mode = value

    @property
    def retain_cpu_backup(self) -> bool:
        return self._retain_cpu_backup

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
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
        raise Unavailable(DISK_TIER_MISSING)

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
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu")
        nbytes = x.numel() * x.element_size()
        if nbytes == 0:
            return out
        try:
            asleep = engine.read_host_copy(x.device.index, x.data_ptr(), nbytes, out.data_ptr())
        except InvalidState as e:
            raise InvalidState(f"{e} (was the tensor created in a region without enable_cpu_backup=True?)") from None
        if asleep is None:
            return None  # awake without a retained copy
        return out if (asleep or self._retain_cpu_backup) else None


def configure_subprocess():
    """Child processes started inside resolve ``import torch_memory_saver`` to torpor.tms."""
    return environment.prepended_path("PYTHONPATH", shim_path())


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
    args = ap.parse_args(argv)
    if args.shim_path:
        print(shim_path())
        return 0
    ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
