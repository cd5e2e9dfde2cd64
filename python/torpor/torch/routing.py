"""Routing: the registry of torpor's torch.cuda.MemPool pools, and the one context that routes
a thread's allocations to one of them (``routed``), which use_pool and graph capture share.

One MemPool per (tag, class, device), allocating through a single CUDAPluggableAllocator over
libtorpor's torpor_torch_malloc/free; ``routed`` sets the C library's thread-local tag and class
for the thread that allocates. A tag may hold several classes (torch_memory_saver's regions with
and without a CPU backup share tags), each in a MemPool of its own, since PyTorch reuses a
pool's free blocks for anything.

Pool lifetime (pytorch#146431): a MemPool destroyed while tensors from it live makes PyTorch
free those tensors with cudaFree instead of the pool's allocator. torpor's MemPools (and the
allocator object) live for the whole process: kept here, plus one reference leaked on purpose,
so not even interpreter shutdown destroys one before its tensors.

Empty segments while awake: what a model frees while it loads stays mapped in free segments,
and engines size their KV cache from the device's free memory. So when the last use_pool()
block of a MemPool exits, its segments without a live block are given back to torpor
(``release_empty_segments``), as vLLM's allocator does. PyTorch still lists them in that
MemPool, so the MemPool is retired: the next use_pool() of its tag and class allocates in a new
one, and no block of a given-back segment is ever handed out again.

The registry also counts the blocks that route allocations (entries and exits, and those open
now): a sleep's re-mark (torpor.torch.remark) uses the count to know whether anything can have
been allocated in these MemPools since its last snapshot. The device pools' preserve globs live
here too, since every device pool gets them when it is first used, and so does the hand-over of
every device pool to the hook bus (``equip_device_pools``).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable

from .. import _lib
from ..pool import MemoryClass, Pool
from . import expandable
from .runtime import keep_forever


@dataclass
class TorchPool:
    """One torch.cuda.MemPool of torpor's and what happened to it."""

    mempool: object
    memory_class: MemoryClass  # of the blocks PyTorch allocates in it
    active: int = 0  # use_pool() blocks routing allocations to it now (every thread)
    retired: bool = False  # gave segments back to torpor: never routed to again
    released: set = field(default_factory=set)  # addresses of the segments given back


@dataclass
class Registry:
    lock: threading.RLock = field(default_factory=threading.RLock)
    allocator: object = None  # torch.cuda.memory.CUDAPluggableAllocator
    mempools: dict = field(default_factory=dict)  # (tag, class, device) -> [TorchPool], oldest first
    preserve: list = field(default_factory=list)  # globs every device pool gets
    graph_tags: set = field(default_factory=set)  # tags of graph pools (torpor.torch.graphs): never use_pool's
    routings: int = 0  # entries and exits of blocks that route allocations to torpor's MemPools
    routing_now: int = 0  # such blocks open now


registry = Registry()
# The hook bus (torpor.torch.hook_bus) equips each device pool with what runs around its sleeps
# and wakes; routing hands it every device pool it uses. One subscriber, set once when the bus is
# imported: what a sleep runs, and in which order, is the bus's code. Kept apart from the registry,
# since the C pools it equips live for the whole process.
_equip: Callable[[Pool], None] | None = None


def equip_device_pools(equip: Callable[[Pool], None]) -> None:
    """Let `equip(pool)` (idempotent) equip each device's torpor pool when a MemPool is made on it,
    and every device pool in use now (the hook bus calls this once)."""
    global _equip
    with registry.lock:
        _equip = equip
        pools = [Pool.torch(d) for d in devices()]
    for pool in pools:
        equip(pool)


def _device_pool(device: int) -> Pool:
    """The device's torpor pool, with the preserve globs and the bus's hooks (caller holds the lock)."""
    pool = Pool.torch(device)
    pool.set_preserve(registry.preserve)
    if _equip is not None:
        _equip(pool)
    return pool


def mempool(torch, tag: str, device: int, memory_class: MemoryClass) -> TorchPool:
    """The MemPool that allocations of (tag, class) on device go to: the newest one, unless it
    was retired (see 'Empty segments while awake'), then a new one."""
    with registry.lock:
        key = (tag, memory_class, device)
        generations = registry.mempools.setdefault(key, [])
        if not generations or generations[-1].retired:
            # The torpor pool first: a missing backend fails here with its reason, before
            # PyTorch sees the allocator; and the preserve globs apply to it from the start.
            _device_pool(device)
            if registry.allocator is None:
                registry.allocator = torch.cuda.memory.CUDAPluggableAllocator(
                    _lib.library_path(), "torpor_torch_malloc", "torpor_torch_free"
                )
                keep_forever(registry.allocator)
            made = torch.cuda.memory.MemPool(registry.allocator.allocator())
            keep_forever(made)
            generations.append(TorchPool(made, memory_class))
        return generations[-1]


def pools_of(tag: str, device: int) -> list[TorchPool]:
    """Every MemPool of `tag` on `device`, each class, retired ones included."""
    with registry.lock:
        return [p for (t, _, d), ps in registry.mempools.items() if t == tag and d == device for p in ps]


def every_mempool() -> list[tuple[tuple, TorchPool]]:
    """((tag, class, device), MemPool) of every MemPool made, oldest first per key."""
    with registry.lock:
        return [(key, p) for key, ps in registry.mempools.items() for p in ps]


def devices() -> list[int]:
    """The devices that have torpor MemPools."""
    with registry.lock:
        return sorted({device for _, _, device in registry.mempools})


def device_pools() -> dict[int, Pool]:
    """The torpor pool of every device PyTorch allocated in through torpor."""
    return {d: Pool.torch(d) for d in devices()}


def tag_at(device: int, address: int) -> str | None:
    """The tag of the use_pool MemPool whose segment on `device` holds `address` (None: none)."""
    for (tag, _cls, dev), pool in every_mempool():
        if dev != device:
            continue
        for seg in own_segments(pool, device):
            if seg["address"] <= address < seg["address"] + seg["total_size"]:
                return tag
    return None


def add_preserve(globs: list[str]) -> None:
    """Add preserve globs (kept once each) and give every device pool the whole list."""
    with registry.lock:
        for g in globs:
            if g not in registry.preserve:
                registry.preserve.append(g)
        for d in devices():
            Pool.torch(d).set_preserve(registry.preserve)


def own_segments(pool: TorchPool, device: int, snapshot: list[dict] | None = None) -> list[dict]:
    """The snapshot segments of one MemPool on one device that torpor still holds (filtered
    again by pool id in case a PyTorch version lists every pool's); from `snapshot` if given."""
    pool_id = tuple(pool.mempool.id)
    return [
        s
        for s in (pool.mempool.snapshot() if snapshot is None else snapshot)
        if s.get("device", device) == device
        and tuple(s.get("segment_pool_id", pool_id)) == pool_id
        and s["address"] not in pool.released
    ]


# -- graph tags ----------------------------------------------------------------------------


def is_graph_tag(tag: str) -> bool:
    with registry.lock:
        return tag in registry.graph_tags


def claim_graph_tag(tag: str, device: int) -> bool | None:
    """Make `tag` a graph pool's tag. None when use_pool already allocated in it on `device`
    (a graph pool needs a tag of its own); else whether the tag is new."""
    with registry.lock:
        if tag in registry.graph_tags:
            return False
        if pools_of(tag, device):
            return None
        registry.graph_tags.add(tag)
        return True


def forget_graph_tag(tag: str) -> None:
    with registry.lock:
        registry.graph_tags.discard(tag)


# -- routing ---------------------------------------------------------------------------------


@contextlib.contextmanager
def counted():
    """Around a block that routes allocations to torpor's MemPools: counted, so that a sleep
    knows whether anything may have been allocated in them since its last re-mark."""
    with registry.lock:
        registry.routings += 1
        registry.routing_now += 1
    try:
        yield
    finally:
        with registry.lock:
            registry.routings += 1
            registry.routing_now -= 1


def routing_count() -> tuple[int, int]:
    """(entries and exits so far, blocks open now) of the routing blocks."""
    with registry.lock:
        return registry.routings, registry.routing_now


@contextlib.contextmanager
def routed(torch, tag: str, memory_class: MemoryClass):
    """The calling thread allocates in torpor under (tag, class) inside: the C library's
    thread-local tag and class set (and restored after), the block counted, expandable segments
    off. use_pool adds the MemPool it allocates from; a graph capture names its pool itself."""
    lib = _lib.lib()
    previous_tag, previous_class = lib.torpor_current_tag(), lib.torpor_current_class()
    try:
        _lib.check(lib.torpor_set_current_tag(tag.encode()))
        _lib.check(lib.torpor_set_current_class(int(memory_class)))
        with counted(), expandable.segments_off(torch):
            yield
    finally:
        lib.torpor_set_current_tag(previous_tag)
        lib.torpor_set_current_class(previous_class)


# -- giving empty segments back --------------------------------------------------------------


def _is_empty(segment: dict) -> bool:
    return not segment.get("is_expandable") and all(b["state"] == "inactive" for b in segment.get("blocks", []))


def release_empty_segments(pool: TorchPool, device: int, tag: str) -> int:
    """Give the segments of `pool` that hold no live block back to torpor, and retire the pool
    when any went (see 'Empty segments while awake'). Caller holds registry.lock, and no
    use_pool block routes to the pool. Returns the bytes given back."""
    empty = [seg for seg in own_segments(pool, device) if _is_empty(seg)]
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
