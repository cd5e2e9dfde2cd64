"""The re-mark: before a pool sleeps, every block of torpor's MemPools gets its class from
PyTorch's snapshot (torpor.torch.marks plans it), and the cache that lets an unchanged sleep skip
that work.

Computing the classes reads PyTorch's snapshot of every segment and every registered parameter,
which at thousands of tensors costs more than the engine's own unchanged sleep. So each
(device, tags, policy) keeps what its last re-mark was computed from (the MemPools and the
segments given back, the parameter and state spans, each MemPool's raw snapshot and its live
blocks) and how many marks others had made (torpor.pool.marks_generation() less the re-marks'
own). vLLM's sleep re-marks its offloaded and its discarded tags apart, so each keeps its own.
A sleep whose inputs and outside marks are the same skips the snapshots when nothing can have
been allocated or freed in its MemPools since:
- PyTorch's block counters of the device (allocations and frees, torch.cuda.memory_stats) have
  not moved, or
- no allocation was routed to a torpor MemPool since (torpor.torch.routing counts use_pool
  blocks and graph captures) and each MemPool's live blocks are still the ones of its last
  snapshot (PyTorch's checkPoolLiveAllocations, one C call per MemPool): then nothing was freed
  either. The engine's own work between sleeps (a forward pass, a checksum) allocates in
  PyTorch's default pool, which moves the counters but not this.
Otherwise it takes the snapshots, and skips the plan and its marks when they equal the last
ones. A parameter reassigned (p.data = ...) changes the spans; a new segment or MemPool changes
the snapshots or the MemPools; a mark by anyone else changes the count. Counters reset by
torch.cuda.reset_accumulated_memory_stats() are not trusted (allocated - freed no longer equals
current). A MemPool that use_pool yields is for allocating inside that block: routing to it
later by hand (torch.cuda.use_mem_pool) bypasses the count, and the next sleep may then miss
a tensor allocated where a freed one was.

State spans: bytes declared state whatever their pool's class (torpor.torch.graphs'
mark_state) reach the re-mark through ``add_state_source``: a module that declares state
registers a function here, so this module imports none of them.
"""

from __future__ import annotations

import bisect
import functools
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable

from ..pool import MemoryClass, Pool, marks_generation
from . import marks, parameters, routing
from .marks import Span
from .runtime import torch_module

# How a sleep classes the allocated blocks of a tag: (tag, the MemPool's class, whether registered
# parameters lie in the tag's segments on this device) -> class. An engine mode (torpor.engine)
# passes its own; by default a MemPool's blocks keep the class it allocates.
ClassPolicy = Callable[[str, MemoryClass, bool], MemoryClass]


def pool_class(tag: str, memory_class: MemoryClass, has_parameters: bool) -> MemoryClass:
    """The default policy: a MemPool's blocks keep the class it allocates."""
    return memory_class


def keep_everything(tag: str, memory_class: MemoryClass, has_parameters: bool) -> MemoryClass:
    """A policy: every allocated byte survives (parameters are offloaded at level 1 too)."""
    return MemoryClass.STATE


@dataclass
class Remark:
    """The last re-mark of one (device, tags, policy) (see the module note)."""

    inputs: tuple  # MemPools (identity, segments given back), parameter and state spans
    snapshots: list  # each MemPool's snapshot as PyTorch returned it, in the order of inputs' MemPools
    live: list  # per MemPool, the addresses of its allocated blocks in that snapshot
    outside_marks: int  # marks made by others than the re-marks, once this one was in place
    routings: int  # routing.routing_count()[0] before the snapshots
    counters: tuple | None  # PyTorch's block counters of the device before the snapshots (None: unusable)
    foreign: list  # (tag, segments PyTorch mapped itself): warned about at every sleep


@dataclass
class Cache:
    lock: threading.RLock = field(default_factory=threading.RLock)
    remarks: dict = field(default_factory=dict)  # (device, tags, policy) -> Remark
    remark_marks: int = 0  # marks the re-marks made (marks_generation() counts everyone's)
    state_sources: list = field(default_factory=list)  # () -> {device: [Span]}


cache = Cache()

# Re-marks kept at once: one per (device, tags, policy) a program sleeps with (vLLM's sleep uses
# two per device); each holds its MemPools' snapshots, so an unusual program that sleeps with
# ever new tag lists does not keep them all.
REMARKS_KEPT = 16


def add_state_source(source: Callable[[], dict]) -> None:
    """Register a function returning {device: [Span]} of bytes declared state."""
    with cache.lock:
        if source not in cache.state_sources:
            cache.state_sources.append(source)


def state_spans() -> dict[int, list[Span]]:
    """device -> every registered source's state spans."""
    with cache.lock:
        sources = list(cache.state_sources)
    out: dict[int, list[Span]] = {}
    for source in sources:
        for device, spans in source().items():
            out.setdefault(device, []).extend(spans)
    return out


def holds_parameters(segments: list[dict], spans: list[Span]) -> bool:
    """Whether any parameter span lies inside one of `segments`."""
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


def block_counters(torch, device: int) -> tuple | None:
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


def warn_foreign(tag: str, device: int, count: int, stacklevel: int = 5) -> None:
    warnings.warn(
        f"torpor: {count} segment(s) of torpor pool '{tag}' on device {device} were mapped "
        f"by PyTorch itself (expandable segments), not by torpor: sleep cannot release them. Set "
        f"expandable_segments:False in PYTORCH_CUDA_ALLOC_CONF, or allocate only inside torpor.use_pool",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


def _live_blocks(segments: list[dict]) -> set[int]:
    """Addresses of the allocated blocks of snapshot segments (what checkPoolLiveAllocations
    compares: a block freed while a stream still uses it is no longer allocated)."""
    return {
        address for seg in segments for address, _, state in marks.segment_blocks(seg) if state == "active_allocated"
    }


def _nothing_allocated_or_freed(torch, device: int, pools: list, last: Remark) -> bool:
    """Whether the MemPools of `pools` (tag, TorchPool) can have had no block allocated or
    freed since `last` was taken: nothing routed allocations to torpor's MemPools since, and
    each MemPool's live blocks are those of its last snapshot (one C call each)."""
    routings, routing_now = routing.routing_count()
    if routing_now or routings != last.routings:
        return False
    check = getattr(torch._C, "_cuda_checkPoolLiveAllocations", None)
    if check is None:
        return False
    try:
        return all(check(device, tuple(p.mempool.id), live) for (_, p), live in zip(pools, last.live))
    except (RuntimeError, TypeError, ValueError):
        return False  # an allocator without the check: the snapshots tell


def _apply_plans(device, tags, pools, own, spans, states, policy) -> list:
    """Plan and apply the classes of every MemPool of `tags`; returns the foreign segments."""
    pool = Pool.torch(device)
    foreign = []
    for tag in tags:
        mine = [(p, segments) for (t, p), segments in zip(pools, own) if t == tag]
        if not mine:
            continue  # a tag allocated through the C API directly, not by PyTorch
        has_parameters = policy is not pool_class and holds_parameters([s for _, ss in mine for s in ss], spans)
        for p, segments in mine:
            plan = marks.plan(segments, policy(tag, p.memory_class, has_parameters), spans, states)
            if plan.foreign:
                foreign.append((tag, len(plan.foreign)))
                warn_foreign(tag, device, len(plan.foreign), stacklevel=6)
            marks.apply(pool, plan)
    return foreign


def _keep(key, device: int, tags: list[str], remark: Remark) -> None:
    """Keep `remark` as the last of `key`; other keys' re-marks sharing a tag are stale now.
    Caller holds cache.lock."""
    for other in [k for k in cache.remarks if k[0] == device and k != key and set(k[1]) & set(tags)]:
        del cache.remarks[other]
    cache.remarks.pop(key, None)
    cache.remarks[key] = remark
    while len(cache.remarks) > REMARKS_KEPT:  # the least recently re-marked go first
        del cache.remarks[next(iter(cache.remarks))]


def _reuse(last: Remark, device: int) -> bool:
    for tag, count in last.foreign:
        warn_foreign(tag, device, count, stacklevel=6)
    return False


def refresh_classes(
    torch,
    device: int,
    tags: list[str],
    spans: list[Span],
    states: list[Span],
    policy: ClassPolicy = pool_class,
    counters: tuple | None = None,
) -> bool:
    """Re-mark the segments of `tags` on `device` (see torpor.torch.marks), unless nothing changed
    since the last re-mark (the module note); `counters`: block_counters of the device, read
    before this call. Returns whether marks were made."""
    with cache.lock:
        pools = [(tag, p) for tag in tags for p in routing.pools_of(tag, device)]
        routings = routing.routing_count()[0]
        key = (device, tuple(tags), policy)
        last = cache.remarks.get(key)
        outside_marks = marks_generation() - cache.remark_marks
    inputs = (tuple((id(p), len(p.released)) for _, p in pools), spans, states)
    same = last is not None and last.outside_marks == outside_marks and last.inputs == inputs
    if same and (
        (counters is not None and last.counters == counters) or _nothing_allocated_or_freed(torch, device, pools, last)
    ):
        last.counters = counters
        return _reuse(last, device)
    snapshots = [p.mempool.snapshot() for _, p in pools]
    own = [routing.own_segments(p, device, snap) for (_, p), snap in zip(pools, snapshots)]
    live = [_live_blocks(segments) for segments in own]
    if same and last.snapshots == snapshots:
        last.counters, last.live, last.routings = counters, live, routings
        return _reuse(last, device)
    with cache.lock:
        before = marks_generation()
        foreign = _apply_plans(device, tags, pools, own, spans, states, policy)
        cache.remark_marks += marks_generation() - before
        _keep(key, device, tags, Remark(inputs, snapshots, live, outside_marks, routings, counters, foreign))
    return True


def remark_now(device: int, tags: list[str], policy: ClassPolicy = pool_class) -> None:
    """The re-mark that a sleep of `tags` on `device` with `policy` makes first (torpor.torch's
    hook bus runs it inside every sleep of a device pool), now: torpor.torch.prepare sizes the host
    store from the classes it leaves."""
    if not any(routing.pools_of(t, device) for t in tags):
        return  # tags of the C API alone (or a registry reset by a test): nothing of PyTorch's
    torch = torch_module()
    spans = parameters.registered_spans().get(device, [])
    states = state_spans().get(device, [])
    counters = block_counters(torch, device)
    refresh_classes(torch, device, tags, spans, states, policy, counters)
