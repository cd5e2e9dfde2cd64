"""The PyTorch embedding: torpor allocates the segments of torch.cuda.MemPool pools, and the
sleep API engines call, with the names and defaults of vLLM's sleep mode.

    import torpor
    with torpor.use_pool("weights"):
        model = build_model()                       # parameters, buffers: in torpor
    torpor.register_parameters(model, preserve=["embed.*"])
    with torpor.use_pool("kv_cache"):
        kv_cache = allocate_kv_cache()              # class cache: never copied
    torpor.sleep(level=2)                           # the GPU memory goes back
    ...                                             # a trainer uses it
    torpor.wake_up(["weights"]); load_weights(model); torpor.wake_up(["kv_cache"])

Every tensor keeps its address through sleep and wake, so CUDA graphs captured before sleep
replay after it. Only parameters (registered) are reloaded; buffers and anything else
allocated in a weights pool are state and come back bit-exact.

Design: one torch.cuda.MemPool per (tag, device), allocating through a single
CUDAPluggableAllocator over libtorpor's torpor_torch_malloc/free; use_pool() sets the C
library's thread-local tag and class for the thread that allocates. PyTorch is imported
lazily, so `import torpor` works without it.

PyTorch's known pitfalls with pluggable allocators and pools, and what is done about each:

- Pool lifetime (pytorch#146431): a MemPool destroyed while tensors from it live makes
  PyTorch free those tensors with cudaFree instead of the pool's allocator. torpor's MemPools
  (and the allocator object) live for the whole process: kept here, plus one reference
  leaked on purpose, so not even interpreter shutdown destroys one before its tensors.
- empty_cache (pytorch#145168): torch.cuda.empty_cache() releases a private pool's cached
  segments only once the pool's use count drops to zero, never for a live pool, so free
  space stays in torpor's segments while awake. At sleep it costs nothing: every free block
  is reclassified as cache first (never copied) and its memory is released with the rest.
  When PyTorch does hand a segment back (out-of-memory retry, teardown), torpor_torch_free
  waits for the device before unmapping, since PyTorch relies on cudaFree's implicit sync.
  sleep() ends with torch.cuda.empty_cache(), as vLLM's does, so the default pool's cached
  memory goes back to the device too.
- Expandable segments: with expandable_segments:True (PYTORCH_CUDA_ALLOC_CONF or
  PYTORCH_ALLOC_CONF) PyTorch maps segments itself instead of asking a pool's allocator (or
  refuses, depending on the version). use_pool() turns them off while any torpor pool is in
  use and back on after; sleep() warns about any segment of a torpor MemPool that is not
  torpor's.

Sleep and wake act on every device that has torpor pools. The CUDA current device is
restored after each call (the driver calls make the pool's device current).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import threading
import warnings
import weakref
from dataclasses import dataclass, field

from . import _lib, _marks
from .errors import InvalidArgument, InvalidState, OutOfMemory, TorchUnavailable, error_for
from .pool import ClassLike, MemoryClass, Pool, Tags, pool_options, tag_list, to_memory_class
from .tags import KV_CACHE


@dataclass
class Registration:
    """What register_parameters marked."""

    parameters: int = 0
    nbytes: int = 0
    outside: list[str] = field(default_factory=list)  # parameters not in a torpor pool


@dataclass
class _State:
    lock: threading.RLock = field(default_factory=threading.RLock)
    allocator: object = None  # torch.cuda.memory.CUDAPluggableAllocator
    mempools: dict = field(default_factory=dict)  # (tag, device) -> torch.cuda.MemPool
    classes: dict = field(default_factory=dict)  # tag -> MemoryClass of its allocations
    modules: list = field(default_factory=list)  # (weakref to nn.Module, prefix)
    preserve: list = field(default_factory=list)  # globs
    expandable_off_depth: int = 0


_state = _State()


# -- PyTorch, lazily ------------------------------------------------------------------------


def _torch():
    try:
        import torch
    except ImportError as e:
        raise TorchUnavailable(
            f"this part of torpor needs PyTorch, which cannot be imported ({e}); " f"torpor.Pool works without it"
        ) from None
    return torch


def _cuda_torch():
    torch = _torch()
    if not torch.cuda.is_available():
        raise TorchUnavailable(
            "PyTorch sees no CUDA device (torch.cuda.is_available() is False); torpor's "
            "PyTorch pools need one. torpor.Pool works without it, on the host backend"
        )
    return torch


def _keep_forever(obj) -> None:
    """Leak one reference: see 'Pool lifetime' in the module note."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _device_index(torch, device) -> int:
    if device is None:
        return torch.cuda.current_device()
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if d.type != "cuda":
        raise InvalidArgument(f"device {device!r} is not a CUDA device")
    return torch.cuda.current_device() if d.index is None else d.index


@contextlib.contextmanager
def _keep_current_device(torch):
    previous = torch.cuda.current_device()
    try:
        yield
    finally:
        torch.cuda.set_device(previous)


def _expandable_segments_requested() -> bool:
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for item in os.environ.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return True
    return False


def _set_allocator_settings(torch, settings: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(settings)


@contextlib.contextmanager
def _expandable_segments_off(torch):
    """See 'Expandable segments' in the module note. Nested and concurrent uses count, so
    the setting comes back only when the last torpor pool context exits."""
    if not _expandable_segments_requested():
        yield
        return
    with _state.lock:
        if _state.expandable_off_depth == 0:
            _set_allocator_settings(torch, "expandable_segments:False")
        _state.expandable_off_depth += 1
    try:
        yield
    finally:
        with _state.lock:
            _state.expandable_off_depth -= 1
            if _state.expandable_off_depth == 0:
                _set_allocator_settings(torch, "expandable_segments:True")


# -- pools ---------------------------------------------------------------------------------


def configure(
    *,
    backend: str = "auto",
    fill_on_wake: str = "none",
    va_bytes: int = 0,
    skip_unchanged: bool = True,
    host_store_limit: int = 0,
    host_store_prepare: int = 0,
    spill_dir=None,
    spill_limit: int = 0,
) -> None:
    """Options of the pools PyTorch allocates in; call before the first allocation (later,
    only the same options are accepted). backend: auto (TORPOR_BACKEND, else cuda when
    usable, else host), cuda or host. fill_on_wake: none, zero, or poison (NaN bytes, so a
    forgotten weight reload is visible). va_bytes: address space per device (0 = twice its
    memory). Host memory (torpor.pool.pool_options says more): skip_unchanged (default True:
    host copies stay after wake so an unchanged re-sleep copies nothing, costing that host
    memory while awake; release_host_store() gives it back), host_store_limit (page-locked
    bytes at most), spill_dir and spill_limit (the disk tier beyond the limit),
    host_store_prepare (bytes to page-lock in the background when a pool is created)."""
    o = pool_options(
        0,
        backend,
        va_bytes,
        fill_on_wake,
        skip_unchanged=skip_unchanged,
        host_store_limit=host_store_limit,
        host_store_prepare=host_store_prepare,
        spill_dir=spill_dir,
        spill_limit=spill_limit,
    )
    _lib.check(_lib.lib().torpor_torch_configure(ctypes.byref(o)))


def _default_class(tag: str) -> MemoryClass:
    return MemoryClass.CACHE if tag == KV_CACHE else MemoryClass.STATE


def _mempool(torch, tag: str, device: int, memory_class: MemoryClass):
    with _state.lock:
        known = _state.classes.get(tag)
        if known is not None and known != memory_class:
            raise InvalidArgument(
                f"use_pool: tag '{tag}' already allocates class {known.name.lower()}; a tag has one class "
                f"(PyTorch reuses its free blocks for anything), so use another tag for "
                f"{memory_class.name.lower()} bytes"
            )
        key = (tag, device)
        pool = _state.mempools.get(key)
        if pool is None:
            # The torpor pool first: a missing backend fails here with its reason, before
            # PyTorch sees the allocator; and the preserve globs apply to it from the start.
            Pool.torch(device).set_preserve(_state.preserve)
            if _state.allocator is None:
                _state.allocator = torch.cuda.memory.CUDAPluggableAllocator(
                    _lib.library_path(), "torpor_torch_malloc", "torpor_torch_free"
                )
                _keep_forever(_state.allocator)
            pool = torch.cuda.memory.MemPool(_state.allocator.allocator())
            _keep_forever(pool)
            _state.mempools[key] = pool
        _state.classes[tag] = memory_class
        return pool


def _allocation_error(tag: str, device: int, status: int):
    message = f"PyTorch could not allocate in torpor pool '{tag}' on device {device}: {_lib.last_error()}"
    return error_for(status, message) if status != _lib.status_ok() else OutOfMemory(message)


@contextlib.contextmanager
def use_pool(tag: str = "default", memory_class: ClassLike | None = None, device=None):
    """Allocate the CUDA tensors this thread creates inside the block in torpor, in `tag`.

    memory_class: what the bytes are; default state, or cache for the tag "kv_cache" (as in
    vLLM, whose KV cache is discarded by every sleep level). Parameters inside a state tag are
    told apart by register_parameters(). device: the CUDA device (default: current); tensors
    created for other devices inside the block go to PyTorch's default pool. Yields the
    torch.cuda.MemPool. Entering a sleeping tag raises InvalidState; an allocation torpor
    refuses inside the block raises torpor's typed error (InvalidState when the tag was put to
    sleep meanwhile, OutOfMemory, ...), chained to PyTorch's out-of-memory error."""
    torch = _cuda_torch()
    if not isinstance(tag, str) or not tag:
        raise InvalidArgument(f"use_pool: tag {tag!r} is not a non-empty string")
    cls = _default_class(tag) if memory_class is None else to_memory_class(memory_class)
    dev = _device_index(torch, device)
    pool = _mempool(torch, tag, dev, cls)
    # PyTorch serves a request from a free block of the pool's cached segments without asking
    # torpor: in a sleeping tag that block is unmapped, and the first kernel touching it
    # faults. So refuse up front (a sleep inside the block is caught by torpor_torch_malloc).
    tag_stats = Pool.torch(dev).stats()["tags"].get(tag)
    if tag_stats is not None and tag_stats["asleep"]:
        raise InvalidState(
            f"use_pool: tag '{tag}' is asleep on device {dev} (level {tag_stats['level']}); "
            f"wake_up(['{tag}']) before allocating in it"
        )
    lib = _lib.lib()
    previous_tag, previous_class = lib.torpor_current_tag(), lib.torpor_current_class()
    _lib.check(lib.torpor_set_current_tag(tag.encode()))
    _lib.check(lib.torpor_set_current_class(int(cls)))
    failures = lib.torpor_torch_failures(None)
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    try:
        with _expandable_segments_off(torch), torch.cuda.memory.use_mem_pool(pool, dev):
            yield pool
    except oom as e:
        status = ctypes.c_int(0)
        if lib.torpor_torch_failures(ctypes.byref(status)) != failures:
            raise _allocation_error(tag, dev, status.value) from e
        raise
    finally:
        lib.torpor_set_current_tag(previous_tag)
        lib.torpor_set_current_class(previous_class)


def _devices() -> list[int]:
    with _state.lock:
        return sorted({device for _, device in _state.mempools})


def pools() -> dict[int, Pool]:
    """The torpor pool of every device PyTorch allocated in through use_pool()."""
    return {d: Pool.torch(d) for d in _devices()}


# -- parameters -----------------------------------------------------------------------------


def _span_bytes(t) -> int:
    """Bytes from a tensor's first element to past its last (exact for any strided view)."""
    if t.numel() == 0:
        return 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return extent * t.element_size()


def _parameter_spans(modules) -> dict[int, list[_marks.Span]]:
    """device -> named spans of the CUDA parameters of (module, prefix) pairs; the rest under
    device -1."""
    out: dict[int, list[_marks.Span]] = {}
    for module, prefix in modules:
        for name, p in module.named_parameters(prefix=prefix):
            device = p.device.index if p.is_cuda else -1
            out.setdefault(device, []).append(_marks.Span(name, p.data_ptr(), _span_bytes(p)))
    return out


def _live_modules() -> list:
    with _state.lock:
        alive = [(ref(), prefix) for ref, prefix in _state.modules]
        _state.modules = [(ref, prefix) for ref, prefix in _state.modules if ref() is not None]
    return [(m, prefix) for m, prefix in alive if m is not None]


def register_parameters(module, preserve=None, prefix: str = "") -> Registration:
    """Mark every parameter of `module` (named as named_parameters(prefix) names it) as class
    parameter: reloadable, so level 2 discards it unless its name matches a `preserve` glob
    (fnmatch, e.g. "embed.*"). Everything else a weights pool holds (buffers, tensors a module
    computed at load) stays state and survives every level bit-exact. The module is kept (by
    weak reference) and re-marked at every sleep, so parameters replaced later (e.g. by a
    weight loader assigning param.data) are followed. Globs add up over calls."""
    torch = _torch()
    if not isinstance(module, torch.nn.Module):
        raise InvalidArgument(f"register_parameters: {type(module).__name__} is not a torch.nn.Module")
    globs = [] if preserve is None else ([preserve] if isinstance(preserve, str) else list(preserve))
    for g in globs:
        if not isinstance(g, str) or not g:
            raise InvalidArgument(f"register_parameters: preserve glob {g!r} is not a non-empty string")
    with _state.lock:
        for g in globs:
            if g not in _state.preserve:
                _state.preserve.append(g)
        if not any(ref() is module and p == prefix for ref, p in _state.modules):
            _state.modules.append((weakref.ref(module), prefix))
        devices = sorted({device for _, device in _state.mempools})
    for d in devices:
        Pool.torch(d).set_preserve(_state.preserve)
    result = Registration()
    spans = _parameter_spans([(module, prefix)])
    for device, device_spans in spans.items():
        pool = Pool.torch(device) if device in devices else None
        marks = []
        for s in device_spans:
            if pool is None or s.nbytes == 0 or not pool.contains(s.address):
                result.outside.append(s.name)
                continue
            marks.append((s.address, s.nbytes, MemoryClass.PARAMETER, s.name))
            result.parameters += 1
            result.nbytes += s.nbytes
        if marks:
            pool.mark_ranges(marks)
    return result


def _refresh_classes(device: int, tags: list[str], spans: list[_marks.Span]) -> None:
    """Re-mark the segments of `tags` on `device` (see torpor/_marks.py)."""
    pool = Pool.torch(device)
    for tag in tags:
        with _state.lock:
            mempool = _state.mempools.get((tag, device))
            cls = _state.classes.get(tag)
        if mempool is None:
            continue  # a tag allocated through the C API directly, not by PyTorch
        # One pool's segments on this device (filtered again in case a PyTorch version lists
        # every pool's).
        segments = [
            s
            for s in mempool.snapshot()
            if s.get("device", device) == device and tuple(s.get("segment_pool_id", mempool.id)) == tuple(mempool.id)
        ]
        plan = _marks.plan(segments, cls, spans)
        if plan.foreign:
            warnings.warn(
                f"torpor: {len(plan.foreign)} segment(s) of torpor pool '{tag}' on device {device} were mapped by "
                f"PyTorch itself (expandable segments), not by torpor: sleep cannot release them. Set "
                f"expandable_segments:False in PYTORCH_CUDA_ALLOC_CONF, or allocate only inside torpor.use_pool",
                RuntimeWarning,
                stacklevel=3,
            )
        _marks.apply(pool, plan)


# -- sleep ----------------------------------------------------------------------------------


def _tags_by_device(tags: list[str] | None, operation: str) -> dict[int, list[str]]:
    devices = _devices()
    known = {d: Pool.torch(d).tags() for d in devices}
    if tags is None:
        return known
    everywhere = sorted({t for ts in known.values() for t in ts})
    for t in tags:
        if t not in everywhere:
            listed = ", ".join(f"'{k}'" for k in everywhere)
            raise InvalidArgument(f"{operation}: unknown tag '{t}' (known tags: {listed})")
    return {d: [t for t in tags if t in known[d]] for d in devices}


def sleep(level: int = 1, tags: Tags = None, collect: int | None = 1) -> dict[int, dict]:
    """Give the GPU memory of `tags` (None = all) back, on every device with torpor pools.

    level 1: parameters and state are offloaded to host memory, cache is discarded.
    level 2: parameters are discarded too (reload them after wake_up), except those matching
    a preserve glob; state is still offloaded. 0 does nothing. Idempotent; a level-1 sleeper
    asked for level 2 drops its parameter copies. Returns {device: report} (bytes and time
    per phase). On failure the devices already asleep stay asleep; calling again finishes.

    collect: the garbage-collector generation collected first (0..2, None = none), so that
    tensors only a reference cycle still holds are free space rather than copied state. The
    default, 1, collects young objects only, which costs little; a full collection (2) walks
    every object of the process, which in a large program costs more than the sleep itself:
    ask for it when long-lived cycles hold tensors."""
    if level not in (0, 1, 2):
        raise InvalidArgument(f"sleep: level {level!r} is not 0, 1 or 2")
    if collect is not None and (isinstance(collect, bool) or collect not in (0, 1, 2)):
        raise InvalidArgument(f"sleep: collect {collect!r} is not a generation 0..2 or None")
    tags = tag_list(tags)
    if tags == [] or not _devices():
        if tags:
            raise InvalidArgument(
                f"sleep: unknown tag '{tags[0]}' (no torpor pool exists yet; allocate inside "
                f"torpor.use_pool(tag) first)"
            )
        return {}
    torch = _cuda_torch()
    selected = _tags_by_device(tags, "sleep")
    if collect is not None:
        gc.collect(collect)  # tensors only a reference cycle still holds are free space, not state
    reports = {}
    with _keep_current_device(torch):
        if level > 0:
            spans = _parameter_spans(_live_modules())
            for device, device_tags in selected.items():
                _refresh_classes(device, device_tags, spans.get(device, []))
        for device, device_tags in selected.items():
            if device_tags:
                reports[device] = Pool.torch(device).sleep(level, device_tags)
    torch.cuda.empty_cache()
    return reports


def wake_up(tags: Tags = None) -> dict[int, dict]:
    """Map memory again, at the same addresses, for `tags` (None = all; vLLM's RL pattern is
    wake_up(["weights"]), load weights, then wake_up(["kv_cache"])). Returns {device: report}."""
    tags = tag_list(tags)
    if tags == [] or not _devices():
        if tags:
            raise InvalidArgument(f"wake_up: unknown tag '{tags[0]}' (no torpor pool exists yet)")
        return {}
    torch = _cuda_torch()
    selected = _tags_by_device(tags, "wake_up")
    reports = {}
    with _keep_current_device(torch):
        for device, device_tags in selected.items():
            if device_tags:
                reports[device] = Pool.torch(device).wake_up(device_tags)
    return reports


def release_host_store() -> dict[int, int]:
    """Give host memory back on every device: the host copies kept after wake (skip_unchanged)
    and every unused host store block, memory and disk (backups of sleeping tags stay).
    Returns {device: bytes released}."""
    return {d: Pool.torch(d).release_host_store() for d in _devices()}


def prepare_host_store(nbytes: int = 0, wait: bool = False) -> dict[int, int]:
    """Start page-locking host memory on every device in the background (nbytes each; 0 = what
    a level-1 sleep of everything allocated now needs), so that the first sleep copies at full
    speed: call it while or after the model loads. wait: block until done.
    Returns {device: bytes added}."""
    return {d: Pool.torch(d).prepare_host_store(nbytes, wait) for d in _devices()}


def stats(device: int | None = None) -> dict:
    """{device: stats} of every torpor pool PyTorch uses, or one device's stats."""
    devices = _devices()
    if device is None:
        return {d: Pool.torch(d).stats() for d in devices}
    if device not in devices:
        raise InvalidArgument(f"stats: PyTorch has no torpor pool on device {device} (devices: {devices})")
    return Pool.torch(device).stats()
