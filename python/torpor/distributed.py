"""Collective sleep and wake over a process group the engine already has.

A tensor-parallel engine must never end with some ranks asleep and others awake. This module
puts one torpor pool per rank to sleep (or wakes it) as one collective over the engine's own
``torch.distributed`` process group, so no second rendezvous is needed::

    import torch.distributed as dist
    import torpor
    from torpor import distributed as tdist

    dist.init_process_group("nccl")                 # the engine's own group
    group = tdist.Group.from_torch()                # or Group.from_torch(tp_group)
    pool = torpor.Pool.torch(torch.cuda.current_device())
    tdist.sleep(pool, level=1, group=group)         # every rank, same arguments
    tdist.wake_up(pool, group=group)

Semantics (allocator/include/torpor/collective_sleep.hpp):

- Every rank first agrees on the request (level and tags; order and duplicates ignored). A
  rank that asks for something else makes every rank raise ``InvalidArgument`` naming it, and
  no rank sleeps.
- If any rank fails to sleep, every rank wakes back up what it put to sleep, and every rank
  raises the failed rank's error type naming each failed rank and its message.
- If any rank fails to wake, the ranks that woke stay awake and every rank raises, naming the
  ranks still asleep; calling ``wake_up`` again on every rank once the cause is gone finishes.

``sleep``/``wake_up`` take a ``torpor.Pool``, or None for the PyTorch embedding's pools (what
``torpor.sleep``/``torpor.wake_up`` act on). Either way the collective runs in libtorpor
(torpor_collective_sleep): for the PyTorch pools, once per device pool of this rank, and the
re-mark of PyTorch's blocks runs inside each pool's sleep as its sleep hook, so a rank whose
re-mark fails is a rank that failed to sleep, named on every rank, and every rank rolls back.

``Group.from_torch`` gathers bytes with ``all_gather_object`` on the given group (default: the
world group) and synchronises with ``barrier``. File descriptors (symmetric memory) cannot
travel that way: the first exchange that needs them creates a Unix socket group on this node,
whose address rank 0 sends over the torch group (one node only).
"""

from __future__ import annotations

import ctypes
from typing import Callable, Sequence

from . import _lib
from .errors import InvalidArgument, InvalidType
from .pool import Pool, Tags, tag_list
from .pool.callbacks import take_failure
from .torch import api
from .values import SleepLevel, sleep_level, whole

# torpor.h (torpor_group_create_callbacks): rank in [0, size), size in [1, 65536], timeout_ms in
# [0, 86400000] (0 = TORPOR_GROUP_TIMEOUT_MS or 60 s).
GROUP_SIZE_MAX = 65536
GROUP_TIMEOUT_MS_MAX = 86400000

_ALL_GATHER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_BARRIER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class _Callbacks(ctypes.Structure):
    _fields_ = [
        ("all_gather", _ALL_GATHER),
        ("barrier", _BARRIER),
        ("user", ctypes.c_void_p),
    ]


class Group(_lib.Closing):
    """A torpor group over an embedder's collectives (kind "torch" in libtorpor).

    ``all_gather(data: bytes) -> list[bytes]`` must return every rank's bytes, indexed by
    rank; ``barrier()`` waits for every rank. Both are called on the thread that called torpor.
    An exception in either becomes a ``TorporError`` naming the group and the rank; a reply of
    the wrong length an ``InvalidState``. Close the group (or use it as a context manager) after
    a final barrier.

    rank and size are whole numbers (not bool or float): size in [1, 65536], rank in [0, size).
    timeout_ms, in [0, 86400000] (24 h), bounds the waits of the fd group (0: the environment's
    TORPOR_GROUP_TIMEOUT_MS, else 60 s). Anything else is InvalidArgument, before a group exists."""

    def __init__(
        self,
        rank: int,
        size: int,
        all_gather: Callable[[bytes], Sequence[bytes]],
        barrier: Callable[[], None],
        *,
        timeout_ms: int = 0,
    ):
        self._handle: int | None = None  # until the C group exists: close() and __del__ do nothing
        size = whole(size, "Group: size (the number of ranks)", 1, GROUP_SIZE_MAX)
        rank = whole(rank, f"Group: rank (of a group of {size})", 0, size - 1)
        timeout = whole(timeout_ms, "Group: timeout_ms (0 = the default)", 0, GROUP_TIMEOUT_MS_MAX)
        for what, fn in (("all_gather", all_gather), ("barrier", barrier)):
            if not callable(fn):
                raise InvalidType(f"Group: {what} must be callable, not {type(fn).__name__}")
        self.rank, self.size = rank, size
        self._all_gather, self._barrier = all_gather, barrier
        # The C callbacks must stay alive as long as the group: they are attributes.
        self._c_all_gather = _ALL_GATHER(self._gather_trampoline)
        self._c_barrier = _BARRIER(self._barrier_trampoline)
        callbacks = _Callbacks(self._c_all_gather, self._c_barrier, None)
        handle = ctypes.c_void_p()
        _lib.check(
            _lib.lib().torpor_group_create_callbacks(
                self.rank,
                self.size,
                ctypes.byref(callbacks),
                timeout,
                ctypes.byref(handle),
            )
        )
        self._handle = handle.value

    @classmethod
    def from_torch(cls, process_group=None, *, timeout_ms: int = 0) -> "Group":
        """A group over a ``torch.distributed`` process group (None: the default group), which
        must be initialised. Bytes travel with ``all_gather_object``, so any backend works.
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            raise InvalidArgument(
                "Group.from_torch: torch.distributed is not initialised (call init_process_group first)"
            )
        rank = dist.get_rank(process_group)
        size = dist.get_world_size(process_group)

        def all_gather(data: bytes) -> list[bytes]:
            out = [None] * size
            dist.all_gather_object(out, data, group=process_group)
            return out

        def barrier() -> None:
            dist.barrier(group=process_group)

        return cls(rank, size, all_gather, barrier, timeout_ms=timeout_ms)

    # -- the C callbacks -----------------------------------------------------------------

    def _gather_trampoline(self, _user, mine, nbytes, out) -> int:
        lib = _lib.lib()
        try:
            parts = self._all_gather(ctypes.string_at(mine, nbytes) if nbytes else b"")
            for part in parts:
                if not isinstance(part, (bytes, bytearray)):
                    raise TypeError(f"all_gather returned a {type(part).__name__}, not bytes")
                buf = bytes(part)
                if lib.torpor_gather_append(out, buf, len(buf)) != _lib.status_ok():
                    raise InvalidArgument(_lib.last_error())
            return 0
        except BaseException as e:  # noqa: B036 - nothing may cross the C boundary
            lib.torpor_gather_fail(out, f"{type(e).__name__}: {e}".encode(errors="replace"))
            return 1

    def _barrier_trampoline(self, _user) -> int:
        try:
            self._barrier()
            return 0
        except BaseException:  # noqa: B036 - nothing may cross the C boundary
            return 1

    # -- lifetime ------------------------------------------------------------------------

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise InvalidArgument(f"this torpor Group (rank {self.rank} of {self.size}) was closed")
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            _lib.check(_lib.lib().torpor_group_destroy(handle))

    def __repr__(self) -> str:
        return f"torpor.distributed.Group(rank={self.rank}, size={self.size})"


def _request_tags(tags: Tags) -> list[str] | None:
    tags = tag_list(tags)
    if tags == []:
        raise InvalidArgument("an empty tag list asks for nothing; pass None for every tag")
    return tags


def _group_or_default(group: Group | None) -> Group:
    if group is None:
        return Group.from_torch()
    if not isinstance(group, Group):
        raise InvalidArgument(f"group must be a torpor.distributed.Group, not {type(group).__name__}")
    return group


def _collective(call, g: Group, pool: Pool, *args) -> dict:
    """One C collective on `pool`; a sleep hook's exception on this rank is already in the
    collective's message (the C layer sent it to every rank), so it is not raised apart."""
    status = call(pool.handle, g.handle, *args)
    take_failure()
    _lib.check(status)
    return pool.last_report()


def _device_tags(tags: list[str] | None, device_tags: list[str]):
    """The C list for one device's collective: None asks every rank for every tag (the ranks
    agree on None, whatever tags each has), a list for the tags named."""
    return _lib.encode_list(device_tags) if tags is not None else (None, 0)


def _torch_pools_sleep(g: Group, level: SleepLevel, tags: list[str] | None) -> dict:
    """The PyTorch embedding's pools: the C collective sleep on each device's pool in turn (their
    sleep hooks re-mark PyTorch's blocks first), as torpor.sleep sleeps them. {device: report}."""
    selected = api.selected_devices(tags, "sleep")
    if selected is None:
        return {}
    call = _lib.lib().torpor_collective_sleep

    def sleep_one(device: int, device_tags: list[str]) -> dict:
        return _collective(call, g, Pool.torch(device), int(level), *_device_tags(tags, device_tags))

    return api.each_device_sleep(selected, sleep_one)


def _torch_pools_wake_up(g: Group, tags: list[str] | None) -> dict:
    selected = api.selected_devices(tags, "wake_up")
    if selected is None:
        return {}
    call = _lib.lib().torpor_collective_wake_up

    def wake_one(device: int, device_tags: list[str]) -> dict:
        return _collective(call, g, Pool.torch(device), *_device_tags(tags, device_tags))

    return api.each_device_wake_up(selected, wake_one)


def sleep(pool=None, level: int = 1, tags: Tags = None, *, group: Group | None = None) -> dict:
    """Collective sleep: every rank of `group` (None: Group.from_torch() of the default
    group) calls it with the same level and tags. `pool` is a torpor.Pool (returns this rank's
    report), or None for the PyTorch embedding's pools: the collective runs on each device's
    pool this rank has, in device order, so every rank must have as many (returns {device:
    report}). level: a SleepLevel or its value (torpor.values.sleep_level: not bool or float);
    anything else is InvalidArgument on this rank before any collective runs."""
    level = sleep_level(level, "sleep: level")
    tags = _request_tags(tags)
    if pool is not None and not isinstance(pool, Pool):
        raise InvalidArgument(f"sleep: pool must be a torpor.Pool or None, not {type(pool).__name__}")
    g = _group_or_default(group)
    if pool is None:
        return _torch_pools_sleep(g, level, tags)
    arr, n = _lib.encode_list(tags or [])
    return _collective(_lib.lib().torpor_collective_sleep, g, pool, int(level), arr if tags else None, n)


def wake_up(pool=None, tags: Tags = None, *, group: Group | None = None) -> dict:
    """Collective wake: every rank of `group` with the same tags (see the module note for a
    rank that fails). `pool` as for sleep()."""
    tags = _request_tags(tags)
    if pool is not None and not isinstance(pool, Pool):
        raise InvalidArgument(f"wake_up: pool must be a torpor.Pool or None, not {type(pool).__name__}")
    g = _group_or_default(group)
    if pool is None:
        return _torch_pools_wake_up(g, tags)
    arr, n = _lib.encode_list(tags or [])
    return _collective(_lib.lib().torpor_collective_wake_up, g, pool, arr if tags else None, n)


__all__ = ["Group", "sleep", "wake_up"]
