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

Design: one torch.cuda.MemPool per (tag, class, device), allocating through a single
CUDAPluggableAllocator over libtorpor's torpor_torch_malloc/free; use_pool() sets the C
library's thread-local tag and class for the thread that allocates. A tag may hold several
classes (torch_memory_saver's regions with and without a CPU backup share tags), each in a
MemPool of its own, since PyTorch reuses a pool's free blocks for anything. PyTorch is
imported lazily, so `import torpor` works without it.

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
- Empty segments while awake: what a model frees while it loads (online quantization builds
  weights in a wide type, then keeps narrow copies) stays mapped in free segments, and engines
  size their KV cache from the device's free memory. So when the last use_pool() block of a
  MemPool exits, its segments without a live block are given back to torpor (unmapped), as
  vLLM's allocator does. PyTorch still lists them in that MemPool, so the MemPool is retired:
  the next use_pool() of its tag and class allocates in a new one, and no block of a given-back
  segment is ever handed out again (a retired MemPool's free blocks inside segments still in
  use are not reused either).
- Expandable segments: with expandable_segments:True (PYTORCH_CUDA_ALLOC_CONF or
  PYTORCH_ALLOC_CONF) PyTorch maps segments itself instead of asking a pool's allocator (or
  refuses, depending on the version). use_pool() turns them off while any torpor pool is in
  use and back on after; sleep() warns about any segment of a torpor MemPool that is not
  torpor's.

The last re-mark: computing the classes reads PyTorch's snapshot of every segment and every
registered parameter, which at thousands of tensors costs more than the engine's own unchanged
sleep. So each (device, tags, policy) keeps what its last re-mark was computed from (the MemPools
and the segments given back, the parameter and state spans, each MemPool's raw snapshot and its
live blocks) and how many marks others had made (torpor.pool.marks_generation() less the
re-marks' own). vLLM's sleep re-marks its offloaded and its discarded tags apart, so each keeps
its own. A sleep whose inputs and outside marks are the same skips the snapshots when nothing
can have been allocated or freed in its MemPools since:
- PyTorch's block counters of the device (allocations and frees, torch.cuda.memory_stats) have
  not moved, or
- no allocation was routed to a torpor MemPool since (use_pool blocks and graph captures into
  torpor's pools count their entries and exits) and each MemPool's live blocks are still the
  ones of its last snapshot (PyTorch's checkPoolLiveAllocations, one C call per MemPool): then
  nothing was freed either. The engine's own work between sleeps (a forward pass, a checksum)
  allocates in PyTorch's default pool, which moves the counters but not this.
Otherwise it takes the snapshots, and skips the plan and its marks when they equal the last
ones. A parameter reassigned (p.data = ...) changes the spans; a new segment or MemPool changes
the snapshots or the MemPools; a mark by anyone else changes the count. Counters reset by
torch.cuda.reset_accumulated_memory_stats() are not trusted (allocated - freed no longer equals
current). A MemPool that use_pool yields is for allocating inside that block: routing to it
later by hand (torch.cuda.use_mem_pool) bypasses the count, and the next sleep may then miss
a tensor allocated where a freed one was.

Sleep and wake act on every device that has torpor pools. The CUDA current device is
restored after each call (the driver calls make the pool's device current).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import gc
import os
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable

from . import _lib, _marks
from .errors import InvalidArgument, InvalidState, OutOfMemory, TorchUnavailable, error_for
from .pool import ClassLike, MemoryClass, Pool, Tags, marks_generation, pool_options, tag_list, to_memory_class
from .tags import KV_CACHE


@dataclass
class Registration:
    """What register_parameters marked."""

    parameters: int = 0
    nbytes: int = 0
    outside: list[str] = field(default_factory=list)  # parameters not in a torpor pool


@dataclass
class _TorchPool:
    """One torch.cuda.MemPool of torpor's and what happened to it."""

    mempool: object
    memory_class: MemoryClass  # of the blocks PyTorch allocates in it
    active: int = 0  # use_pool() blocks routing allocations to it now (every thread)
    retired: bool = False  # gave segments back to torpor: never routed to again
    released: set = field(default_factory=set)  # addresses of the segments given back


@dataclass
class _Remark:
    """The last re-mark of one (device, tags, policy) (see 'The last re-mark' in the module note)."""

    inputs: tuple  # MemPools (identity, segments given back), parameter and state spans
    snapshots: list  # each MemPool's snapshot as PyTorch returned it, in the order of inputs' MemPools
    live: list  # per MemPool, the addresses of its allocated blocks in that snapshot
    outside_marks: int  # marks made by others than the re-marks, once this one was in place
    routings: int  # _state.routings before the snapshots
    counters: tuple | None  # PyTorch's block counters of the device before the snapshots (None: unusable)
    foreign: list  # (tag, segments PyTorch mapped itself): warned about at every sleep


@dataclass
class _State:
    lock: threading.RLock = field(default_factory=threading.RLock)
    allocator: object = None  # torch.cuda.memory.CUDAPluggableAllocator
    mempools: dict = field(default_factory=dict)  # (tag, class, device) -> [_TorchPool], oldest first
    modules: list = field(default_factory=list)  # (weakref to nn.Module, prefix)
    preserve: list = field(default_factory=list)  # globs
    graph_tags: set = field(default_factory=set)  # tags of graph pools (graphs.py): never use_pool's
    expandable_off_depth: int = 0
    remarks: dict = field(default_factory=dict)  # (device, tags, policy) -> _Remark
    spans: dict = field(default_factory=dict)  # (id(module), prefix) -> _ModuleSpans of a registered module
    remark_marks: int = 0  # marks the re-marks made (marks_generation() counts everyone's)
    routings: int = 0  # entries and exits of blocks that route allocations to torpor's MemPools
    routing_now: int = 0  # such blocks open now


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


@contextlib.contextmanager
def _routing():
    """Around a block that routes allocations to torpor's MemPools (use_pool, a graph capture):
    counted, so that a sleep knows whether anything may have been allocated in them since its
    last re-mark (see 'The last re-mark' in the module note)."""
    with _state.lock:
        _state.routings += 1
        _state.routing_now += 1
    try:
        yield
    finally:
        with _state.lock:
            _state.routings += 1
            _state.routing_now -= 1


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


def _mempool(torch, tag: str, device: int, memory_class: MemoryClass) -> _TorchPool:
    """The MemPool that allocations of (tag, class) on device go to: the newest one, unless it
    was retired (see 'Empty segments while awake'), then a new one."""
    with _state.lock:
        key = (tag, memory_class, device)
        generations = _state.mempools.setdefault(key, [])
        if not generations or generations[-1].retired:
            # The torpor pool first: a missing backend fails here with its reason, before
            # PyTorch sees the allocator; and the preserve globs apply to it from the start.
            Pool.torch(device).set_preserve(_state.preserve)
            if _state.allocator is None:
                _state.allocator = torch.cuda.memory.CUDAPluggableAllocator(
                    _lib.library_path(), "torpor_torch_malloc", "torpor_torch_free"
                )
                _keep_forever(_state.allocator)
            mempool = torch.cuda.memory.MemPool(_state.allocator.allocator())
            _keep_forever(mempool)
            generations.append(_TorchPool(mempool, memory_class))
        return generations[-1]


def _pools_of(tag: str, device: int) -> list[_TorchPool]:
    """Every MemPool of `tag` on `device`, each class, retired ones included."""
    with _state.lock:
        return [p for (t, _, d), ps in _state.mempools.items() if t == tag and d == device for p in ps]


def _own_segments(pool: _TorchPool, device: int, snapshot: list[dict] | None = None) -> list[dict]:
    """The snapshot segments of one MemPool on one device that torpor still holds (filtered
    again by pool id in case a PyTorch version lists every pool's); from `snapshot` if given."""
    mempool = pool.mempool
    pool_id = tuple(mempool.id)
    return [
        s
        for s in (mempool.snapshot() if snapshot is None else snapshot)
        if s.get("device", device) == device
        and tuple(s.get("segment_pool_id", pool_id)) == pool_id
        and s["address"] not in pool.released
    ]


def _is_empty(segment: dict) -> bool:
    return not segment.get("is_expandable") and all(b["state"] == "inactive" for b in segment.get("blocks", []))


def _release_empty_segments(pool: _TorchPool, device: int, tag: str) -> int:
    """Give the segments of `pool` that hold no live block back to torpor, and retire the pool
    when any went (see 'Empty segments while awake'). Caller holds _state.lock, and no use_pool
    block routes to the pool. Returns the bytes given back."""
    empty = [seg for seg in _own_segments(pool, device) if _is_empty(seg)]
    if not empty or Pool.torch(device).stats()["tags"].get(tag, {}).get("asleep"):
        return 0  # a sleeping tag keeps its segments until it wakes and a block exits again
    lib = _lib.lib()
    released = 0
    for seg in empty:
        failures = lib.torpor_torch_failures(None)
        lib.torpor_torch_free(seg["address"], seg["total_size"], device, None)
        if lib.torpor_torch_failures(None) != failures:
            warnings.warn(
                f"torpor: an empty segment of pool '{tag}' on device {device} could not be given back: "
                f"{_lib.last_error()}",
                RuntimeWarning,
                stacklevel=4,
            )
            continue
        pool.released.add(seg["address"])
        released += seg["total_size"]
    if released:
        pool.retired = True
    return released


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
    with _state.lock:
        if tag in _state.graph_tags:
            raise InvalidArgument(
                f"use_pool: tag '{tag}' is a CUDA graph pool (torpor.graph): its free blocks are the graphs' "
                f"intermediates, rewritten at every replay; allocate tensors in another tag"
            )
    cls = _default_class(tag) if memory_class is None else to_memory_class(memory_class)
    dev = _device_index(torch, device)
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
    with _state.lock:
        pool = _mempool(torch, tag, dev, cls)
        pool.active += 1
    previous_tag, previous_class = lib.torpor_current_tag(), lib.torpor_current_class()
    try:
        _lib.check(lib.torpor_set_current_tag(tag.encode()))
        _lib.check(lib.torpor_set_current_class(int(cls)))
        failures = lib.torpor_torch_failures(None)
        oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
        try:
            with _routing(), _expandable_segments_off(torch), torch.cuda.memory.use_mem_pool(pool.mempool, dev):
                yield pool.mempool
        except oom as e:
            status = ctypes.c_int(0)
            if lib.torpor_torch_failures(ctypes.byref(status)) != failures:
                raise _allocation_error(tag, dev, status.value) from e
            raise
    finally:
        lib.torpor_set_current_tag(previous_tag)
        lib.torpor_set_current_class(previous_class)
        with _state.lock:
            pool.active -= 1
            if pool.active == 0 and not pool.retired:
                _release_empty_segments(pool, dev, tag)


def _devices() -> list[int]:
    with _state.lock:
        return sorted({device for _, _, device in _state.mempools})


def pools() -> dict[int, Pool]:
    """The torpor pool of every device PyTorch allocated in through use_pool()."""
    return {d: Pool.torch(d) for d in _devices()}


# -- parameters -----------------------------------------------------------------------------


def _span_bytes(t) -> int:
    """Bytes from a tensor's first element to past its last (exact for any strided view)."""
    if t.is_contiguous():
        return t.nbytes  # the same extent, without walking shape and strides in Python
    if t.numel() == 0:
        return 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return extent * t.element_size()


@dataclass
class _ModuleSpans:
    """One registered module's parameter spans as the last sleep computed them, and what they
    were computed from (see _module_spans)."""

    signature: tuple  # per submodule: (name, its parameters' names, their identities)
    first: list | None  # positions of each parameter's first occurrence among every listed one (None: all)
    pointers: list  # data_ptr() of each parameter
    sizes: list  # nbytes of each parameter
    spans: dict  # device -> [Span]


def _submodule_parameters(module, prefix: str) -> tuple[tuple, list]:
    """(signature, every value of every submodule's parameter dict, in named_modules order)."""
    signature, values = [], []
    for module_prefix, m in module.named_modules(prefix=prefix):
        d = m._parameters
        signature.append((module_prefix, tuple(d), tuple(map(id, d.values()))))
        values.extend(d.values())
    return tuple(signature), values


def _computed_spans(signature: tuple, values: list) -> _ModuleSpans:
    """The spans of the parameters in `values`, named as named_parameters names them (each
    parameter once, under its first name)."""
    seen, first, names = set(), [], []
    at = 0
    for module_prefix, keys, _ in signature:
        dot = module_prefix + "." if module_prefix else ""
        for name in keys:
            p = values[at]
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                first.append(at)
                names.append(dot + name)
            at += 1
    params = [values[i] for i in first]
    out: dict[int, list[_marks.Span]] = {}
    pointers, sizes = [], []
    for name, p in zip(names, params):
        device = p.get_device() if p.is_cuda else -1
        address, nbytes = p.data_ptr(), p.nbytes
        pointers.append(address)
        sizes.append(nbytes)
        extent = nbytes if p.is_contiguous() else _span_bytes(p)
        out.setdefault(device, []).append(_marks.Span(name, address, extent))
    return _ModuleSpans(signature, None if len(first) == len(values) else first, pointers, sizes, out)


def _module_spans(module, prefix: str) -> dict[int, list[_marks.Span]]:
    """device -> spans of the parameters of one registered module. Every sleep asks for them,
    and at thousands of parameters computing them costs more than everything else a sleep does
    in Python; so the last result is kept and used again when every submodule lists the same
    parameter objects under the same names, and each of them still has the data pointer and
    byte size it had (a weight loader's p.data = t, a module's .to(), a parameter replaced or
    deleted all change one of these). A parameter that changes its strides in place without
    changing its address or size keeps its last extent."""
    signature, values = _submodule_parameters(module, prefix)
    key = (id(module), prefix)
    last = _state.spans.get(key)
    if last is not None and last.signature == signature:
        params = values if last.first is None else [values[i] for i in last.first]
        if [p.data_ptr() for p in params] == last.pointers and [p.nbytes for p in params] == last.sizes:
            return last.spans
    computed = _computed_spans(signature, values)
    _state.spans[key] = computed
    return computed.spans


def _parameter_spans(modules) -> dict[int, list[_marks.Span]]:
    """device -> named spans of the CUDA parameters of (module, prefix) pairs; the rest under
    device -1. The lists may be the ones a module's last result holds: not to be changed."""
    results = [_module_spans(module, prefix) for module, prefix in modules]
    if len(results) == 1:
        return results[0]
    out: dict[int, list[_marks.Span]] = {}
    for spans in results:
        for device, device_spans in spans.items():
            out.setdefault(device, []).extend(device_spans)
    return out


def _live_modules() -> list:
    """(module, prefix) of every registered module still alive; the others' kept spans go."""
    with _state.lock:
        alive = [(ref(), prefix) for ref, prefix in _state.modules]
        _state.modules = [(ref, prefix) for ref, prefix in _state.modules if ref() is not None]
        live = [(m, prefix) for m, prefix in alive if m is not None]
        keys = {(id(m), prefix) for m, prefix in live}
        for key in [k for k in _state.spans if k not in keys]:
            del _state.spans[key]
    return live


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
        devices = sorted({device for _, _, device in _state.mempools})
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


# How a sleep classes the allocated blocks of a tag: (tag, the MemPool's class, whether registered
# parameters lie in the tag's segments on this device) -> class. The vLLM mode (torpor/vllm.py)
# passes its own; by default a MemPool's blocks keep the class it allocates.
ClassPolicy = Callable[[str, MemoryClass, bool], MemoryClass]


def _pool_class(tag: str, memory_class: MemoryClass, has_parameters: bool) -> MemoryClass:
    return memory_class


def _holds_parameters(segments: list[dict], spans: list[_marks.Span]) -> bool:
    ranges = sorted((s["address"], s["address"] + s["total_size"]) for s in segments if not s.get("is_expandable"))
    starts = [lo for lo, _ in ranges]
    for p in spans:
        i = bisect.bisect_right(starts, p.address) - 1
        if p.nbytes > 0 and i >= 0 and p.address + p.nbytes <= ranges[i][1]:
            return True
    return False


def _stat(stats: dict, name: str, kind: str) -> int:
    """One counter of torch._C._cuda_memoryStats's nested dict (name.all.kind)."""
    return stats[name]["all"][kind]


def _block_counters(torch, device: int) -> tuple | None:
    """PyTorch's cumulative block counters of `device`: allocations and frees, of allocated and
    of active blocks (a block freed while a stream still used it turns inactive later). None
    when they cannot be read, or were reset since the allocator started (allocated - freed no
    longer equals current), so that equal counters mean nothing was allocated or freed."""
    try:
        raw = getattr(torch._C, "_cuda_memoryStats", None)
        if raw is not None:
            stats = raw(device)
            get = functools.partial(_stat, stats)
        else:
            flat = torch.cuda.memory_stats(device)
            get = lambda name, kind: flat[f"{name}.all.{kind}"]  # noqa: E731
        counters = []
        for name in ("allocation", "active"):
            allocated, freed, current = get(name, "allocated"), get(name, "freed"), get(name, "current")
            if allocated - freed != current:
                return None
            counters += [allocated, freed]
        return tuple(counters)
    except (AttributeError, KeyError, TypeError, RuntimeError):
        return None


def _warn_foreign(tag: str, device: int, count: int) -> None:
    warnings.warn(
        f"torpor: {count} segment(s) of torpor pool '{tag}' on device {device} were mapped "
        f"by PyTorch itself (expandable segments), not by torpor: sleep cannot release them. Set "
        f"expandable_segments:False in PYTORCH_CUDA_ALLOC_CONF, or allocate only inside torpor.use_pool",
        RuntimeWarning,
        stacklevel=5,
    )


# Re-marks kept at once: one per (device, tags, policy) a program sleeps with (vLLM's sleep uses
# two per device); each holds its MemPools' snapshots, so an unusual program that sleeps with
# ever new tag lists does not keep them all.
_REMARKS_KEPT = 16


def _live_blocks(segments: list[dict]) -> set[int]:
    """Addresses of the allocated blocks of snapshot segments (what checkPoolLiveAllocations
    compares: a block freed while a stream still uses it is no longer allocated)."""
    return {
        address for seg in segments for address, _, state in _marks.segment_blocks(seg) if state == "active_allocated"
    }


def _nothing_allocated_or_freed(torch, device: int, pools: list, last: _Remark) -> bool:
    """Whether the MemPools of `pools` (tag, _TorchPool) can have had no block allocated or
    freed since `last` was taken: nothing routed allocations to torpor's MemPools since, and
    each MemPool's live blocks are those of its last snapshot (one C call each)."""
    with _state.lock:
        if _state.routing_now or _state.routings != last.routings:
            return False
    check = getattr(torch._C, "_cuda_checkPoolLiveAllocations", None)
    if check is None:
        return False
    try:
        return all(check(device, tuple(p.mempool.id), live) for (_, p), live in zip(pools, last.live))
    except (RuntimeError, TypeError, ValueError):
        return False  # an allocator without the check: the snapshots tell


def _refresh_classes(
    device: int,
    tags: list[str],
    spans: list[_marks.Span],
    states: list[_marks.Span],
    policy: ClassPolicy = _pool_class,
    counters: tuple | None = None,
) -> bool:
    """Re-mark the segments of `tags` on `device` (see torpor/_marks.py), unless nothing changed
    since the last re-mark ('The last re-mark' in the module note); `counters`: _block_counters
    of the device, read before this call. Returns whether marks were made."""
    torch = _torch()
    with _state.lock:
        pools = [(tag, p) for tag in tags for p in _pools_of(tag, device)]
        routings = _state.routings
        key = (device, tuple(tags), policy)
        last = _state.remarks.get(key)
        outside_marks = marks_generation() - _state.remark_marks
    inputs = (tuple((id(p), len(p.released)) for _, p in pools), spans, states)
    same = last is not None and last.outside_marks == outside_marks and last.inputs == inputs
    if same and (
        (counters is not None and last.counters == counters) or _nothing_allocated_or_freed(torch, device, pools, last)
    ):
        last.counters = counters
        for tag, count in last.foreign:
            _warn_foreign(tag, device, count)
        return False
    snapshots = [p.mempool.snapshot() for _, p in pools]
    own = [_own_segments(p, device, snap) for (_, p), snap in zip(pools, snapshots)]
    live = [_live_blocks(segments) for segments in own]
    if same and last.snapshots == snapshots:
        last.counters, last.live, last.routings = counters, live, routings
        for tag, count in last.foreign:
            _warn_foreign(tag, device, count)
        return False
    pool = Pool.torch(device)
    foreign = []
    with _state.lock:
        before = marks_generation()
        for tag in tags:
            mine = [(p, segments) for (t, p), segments in zip(pools, own) if t == tag]
            if not mine:
                continue  # a tag allocated through the C API directly, not by PyTorch
            has_parameters = policy is not _pool_class and _holds_parameters([s for _, ss in mine for s in ss], spans)
            for p, segments in mine:
                plan = _marks.plan(segments, policy(tag, p.memory_class, has_parameters), spans, states)
                if plan.foreign:
                    foreign.append((tag, len(plan.foreign)))
                    _warn_foreign(tag, device, len(plan.foreign))
                _marks.apply(pool, plan)
        _state.remark_marks += marks_generation() - before
        # These marks changed the classes of these tags' segments: another key's re-mark that
        # shares a tag is stale now (keys of other tags keep theirs).
        for other in [k for k in _state.remarks if k[0] == device and k != key and set(k[1]) & set(tags)]:
            del _state.remarks[other]
        _state.remarks.pop(key, None)
        _state.remarks[key] = _Remark(inputs, snapshots, live, outside_marks, routings, counters, foreign)
        while len(_state.remarks) > _REMARKS_KEPT:  # the least recently re-marked go first
            del _state.remarks[next(iter(_state.remarks))]
    return True


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
    return _sleep(level, tags, collect=collect)


def _sleep(level: int, tags: Tags, policy: ClassPolicy = _pool_class, collect: int | None = 1) -> dict[int, dict]:
    """sleep(), with the classes of allocated blocks decided by `policy`."""
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
            from .graphs import state_spans  # graphs imports this module

            states = state_spans()
            for device, device_tags in selected.items():
                counters = _block_counters(torch, device)
                _refresh_classes(device, device_tags, spans.get(device, []), states.get(device, []), policy, counters)
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


def tag_states() -> dict[str, bool]:
    """{tag: whether it is asleep (on any device)} of every tag of the pools PyTorch uses."""
    out: dict[str, bool] = {}
    for d in _devices():
        for tag, t in Pool.torch(d).stats()["tags"].items():
            out[tag] = out.get(tag, False) or t["asleep"]
    return out


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
    """{device: stats} of every torpor pool PyTorch uses, or one device's stats: the pool's
    statistics (torpor.Pool.stats: per tag the bytes mapped on the device, allocated in torpor
    (PyTorch's segments) and per class), plus, per tag, ``active_bytes``: the bytes of PyTorch's
    live blocks in those segments (what its tensors take; the rest of a segment is free space)."""
    devices = _devices()
    if device is None:
        return {d: _device_stats(d) for d in devices}
    if device not in devices:
        raise InvalidArgument(f"stats: PyTorch has no torpor pool on device {device} (devices: {devices})")
    return _device_stats(device)


def _device_stats(device: int) -> dict:
    st = Pool.torch(device).stats()
    for tag, t in st["tags"].items():
        t["active_bytes"] = sum(
            size
            for p in _pools_of(tag, device)
            for seg in _own_segments(p, device)
            for _, size, state in _marks.segment_blocks(seg)
            if state != "inactive"
        )
    return st
