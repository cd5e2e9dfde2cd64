"""The seam for engine modes: what a mode that gives an engine its own sleep-mode API
(torpor.vllm: vLLM's CuMemAllocator; torpor.tms: torch_memory_saver's API) uses of torpor, and
all it uses. A new mode (SGLang's, an RL framework's) is one module written against this one; it
touches neither torpor.torch nor the C library.

    from torpor import engine

    with engine.use_pool("weights"):               # route a tag (and a class) to torpor
        model = load_model()
    engine.register_parameters(model)              # parameters: discardable at level 2
    engine.add_tag_hooks("kv_cache", before_sleep=drop_views, after_wake=rebuild_views)
    with engine.as_runtime_errors():               # the engine catches RuntimeError
        engine.sleep(1, ["weights"], policy=engine.keep_everything)
        engine.sleep(2, ["kv_cache"])
        engine.wake_up(None)

The interface:

- ``sleep(level, tags, policy=None, collect=1)``: the PyTorch pools' sleep, with a class policy:
  ``policy(tag, memory_class, has_parameters) -> MemoryClass`` decides the class of the
  allocated blocks of each sleeping tag (``memory_class``: the class its MemPool allocates;
  ``has_parameters``: whether registered parameters lie in the tag's segments on the device).
  None keeps each MemPool's class. The policy applies inside the pool's sleep (the re-mark is a
  sleep hook), so its marks and the sleep are one step. ``fill_on_wake(fill)``: a block whose
  wakes fill discarded bytes with `fill` on every device pool. ``wake_up(tags)``, ``tag_states()``,
  ``stats()``, ``release_host_store()`` as torpor's; ``reconfigure(**changes)``: torpor.configure
  with the options last configured, `changes` changed (the fields of ``PoolOptions``; before the
  first allocation).
- ``use_pool(tag, memory_class, exportable=False)``: allocations of the block in torpor under that
  tag and class (exportable: the device's pool has shareable handles, torpor.use_pool's);
  ``export_handles(tags, device, kind)``: the handles of that memory for a KV transport
  (torpor.exports; a transport re-exports in an after_map mapping hook, since wake maps new memory);
  ``graph(...)``: a CUDA graph capture in a torpor graph pool (torpor.graph); ``graph_pool``,
  ``capture_into(tag, memory_class)`` (every capture of the block in that graph pool),
  ``capturing_into()``, ``release_graph_pool(tag)``, ``nccl_graph_register_off()``: as in
  torpor.torch.graphs.
- ``register_parameters(module, preserve)``: as torpor.register_parameters; ``add_preserve(globs)``:
  its preserve globs without a module. ``tag_at(device, address)``: the tag of the use_pool
  segment holding an address.
- ``add_tag_hooks(tag, before_sleep=None, after_wake=None) -> id``: ``before_sleep(tag, level)``
  runs inside every sleep of `tag` (levels 1 and 2), after the re-mark and before anything moves:
  an exception aborts that device's sleep with nothing moved, and the sleep raises it.
  ``after_wake(tag, ok)`` runs after every wake of `tag`. ``remove_tag_hooks(id)``.
- ``add_mapping_hooks(tag, before_unmap=None, after_map=None) -> id``: the C pool's tag hooks
  (torpor_add_tag_hooks, one hook bus for C, C++ and Python) on every device pool, for state that
  lives exactly as long as the tag's mapping (vLLM's register_tag_hooks maps onto it):
  ``before_unmap(tag)`` in every sleep or discard that unmaps some of `tag`, before anything
  moves and before the sleep hooks above (an exception aborts the sleep, nothing moved);
  ``after_map(tag)`` after every wake, once per device pool, when `tag` is fully mapped there
  (idempotent: it runs for tags that never slept too), and after a failed sleep for each tag whose
  before_unmap ran and that it left mapped. ``remove_mapping_hooks(id)``.
- ``intend_sleep(mode, plan, default_level)``: the mode's sleep, declared so that the host store
  is page-locked in the background once the model is loaded (torpor.torch.prepare; with
  TORPOR_PREPARE_SLEEP): ``plan(level, tags) -> [(level, tags, policy), ...]`` are the sleeps the
  mode's own sleep at `level` makes on a device pool holding `tags`. ``prepare_for_sleep()`` runs
  that preparation now (it also runs by itself when a tag's outermost use_pool block exits and
  after register_parameters). The first sleep then finds the store pinned (stats' host_store_*).
- ``runtime_error(e)``, ``as_runtime_errors()``: torpor's typed errors as RuntimeError subclasses
  too (vLLM and its tests catch RuntimeError), with torpor's message.
- ``cuda_torch()``, ``memory_margin()`` / ``set_memory_margin(n)``, ``read_host_copy(...)``: what
  torch_memory_saver's API needs of PyTorch and of the C library.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
from typing import Callable

from . import _lib
from .errors import InvalidState, InvalidType, TorporError, error_for
from .options import PoolOptions
from .pool import ClassLike, MemoryClass, Pool, Tags
from .torch import api, graphs, parameters, prepare, routing
from .torch.remark import ClassPolicy, pool_class
from .torch.runtime import cuda_torch
from .values import INT_MAX, SIZE_MAX, whole

# -- sleep and wake ------------------------------------------------------------------------------


def keep_everything(tag: str, memory_class: MemoryClass, has_parameters: bool) -> MemoryClass:
    """A policy: every allocated byte survives (parameters are offloaded at level 1 too)."""
    return MemoryClass.STATE


def sleep(level: int, tags: Tags, policy: ClassPolicy | None = None, collect: int | None = 1) -> dict[int, dict]:
    """torpor.sleep with the classes of allocated blocks decided by `policy` (None: each
    MemPool's own class). Returns {device: report}."""
    return api.sleep_with_policy(level, tags, pool_class if policy is None else policy, collect=collect)


@contextlib.contextmanager
def fill_on_wake(fill: str):
    """Inside: the wakes of every device pool write `fill` (none, zero, poison) into discarded
    bytes (Pool.set_fill_on_wake); each pool's own fill comes back after."""
    previous = []
    try:
        for pool in routing.device_pools().values():
            previous.append((pool, pool.set_fill_on_wake(fill)))
        yield
    finally:
        for pool, old in previous:
            pool.set_fill_on_wake(old)


wake_up = api.wake_up
tag_states = api.tag_states
is_graph_tag = routing.is_graph_tag  # whether a torpor tag holds CUDA graph pools (torpor.graph)
stats = api.stats
release_host_store = api.release_host_store
reconfigure = api.reconfigure  # the torch pools' options as last configured, some changed


# -- routing and parameters ------------------------------------------------------------------


def use_pool(tag: str, memory_class: ClassLike | None = None, device=None, exportable: bool = False):
    """torpor.use_pool: the block's allocations in torpor under `tag` and `memory_class`, in an
    exportable pool when `exportable` (see torpor.use_pool)."""
    return api.use_pool(tag, memory_class=memory_class, device=device, exportable=exportable)


export_handles = api.export_handles  # the shareable handles of a tag's memory (torpor.export_handles)


graph = graphs.graph
graph_pool = graphs.graph_pool
capture_into = graphs.capture_into
capturing_into = graphs.capturing_into
release_graph_pool = graphs.release_graph_pool
nccl_graph_register_off = graphs.nccl_graph_register_off
register_parameters = parameters.register_parameters


def add_preserve(globs) -> None:
    """Parameter-name globs (fnmatch) kept through level 2 on every device pool, as
    register_parameters(preserve=...) adds them, without a module."""
    globs = [globs] if isinstance(globs, str) else list(globs)
    for g in globs:
        if not isinstance(g, str) or not g:
            raise InvalidType(f"add_preserve: glob {g!r} is not a non-empty string")
    routing.add_preserve(globs)


def tag_at(device: int, address: int) -> str | None:
    """The tag of the use_pool MemPool whose segment on `device` holds `address` (None: none)."""
    for (tag, _cls, dev), pool in routing.every_mempool():
        if dev != device:
            continue
        for seg in routing.own_segments(pool, device):
            if seg["address"] <= address < seg["address"] + seg["total_size"]:
                return tag
    return None


# -- the host store before the first sleep ----------------------------------------------------


def intend_sleep(mode: str, plan: prepare.Plan, default_level: int) -> None:
    """Declare the mode's sleep (see the module note); the last mode to declare wins."""
    prepare.intend(mode, plan, default_level)


def prepare_for_sleep() -> dict[int, int]:
    """Start page-locking what the declared sleep needs, on every device. {device: bytes added}."""
    return prepare.after_load()


# -- tag hooks -------------------------------------------------------------------------------


_hooks_lock = threading.Lock()
_tag_hooks: dict = {}  # id -> (tag, before_sleep, after_wake)
_hook_ids = itertools.count(1)
_hooked_pools: set = set()  # handles of the device pools with the dispatcher (live for the process)


def add_tag_hooks(
    tag: str,
    before_sleep: Callable[[str, int], None] | None = None,
    after_wake: Callable[[str, bool], None] | None = None,
) -> int:
    """Callbacks around every sleep and wake of `tag` on any device (see the module note)."""
    if not isinstance(tag, str) or not tag:
        raise InvalidType(f"add_tag_hooks: tag {tag!r} is not a non-empty string")
    if before_sleep is None and after_wake is None:
        raise InvalidType("add_tag_hooks: give before_sleep, after_wake or both")
    for what, hook in (("before_sleep", before_sleep), ("after_wake", after_wake)):
        if hook is not None and not callable(hook):
            raise InvalidType(f"add_tag_hooks: {what} must be callable or None, not {type(hook).__name__}")
    with _hooks_lock:
        hook_id = next(_hook_ids)
        _tag_hooks[hook_id] = (tag, before_sleep, after_wake)
    for pool in routing.device_pools().values():
        _install(pool)
    return hook_id


def remove_tag_hooks(hook_id: int) -> None:
    with _hooks_lock:
        if _tag_hooks.pop(hook_id, None) is None:
            raise KeyError(f"remove_tag_hooks: {hook_id} is not a tag hook (removed twice?)")


def _hooks_of(tags: list[str], which: int) -> list:
    with _hooks_lock:
        return [(tag, hook[which]) for tag in tags for hook in _tag_hooks.values() if hook[0] == tag and hook[which]]


def _before_sleep(level, tags: list[str]) -> None:
    for tag, fn in _hooks_of(tags, 1):
        fn(tag, int(level))


def _after_wake(tags: list[str], ok: bool) -> None:
    for tag, fn in _hooks_of(tags, 2):
        fn(tag, ok)


def _install(pool: Pool) -> None:
    """The dispatcher of the tag hooks on a device pool, once (after torpor.torch's re-mark)."""
    with _hooks_lock:
        if pool.handle in _hooked_pools:
            return
        pool.add_sleep_hook(_before_sleep, _after_wake)
        _hooked_pools.add(pool.handle)


routing.on_new_mempool(_install)


# -- mapping hooks: the pool's tag hooks on every device ---------------------------------------


_mapping_hooks: dict = {}  # id -> [tag, before_unmap, after_map, {pool handle: (pool, C hook id)}]


def add_mapping_hooks(
    tag: str,
    before_unmap: Callable[[str], None] | None = None,
    after_map: Callable[[str], None] | None = None,
) -> int:
    """The C pool's tag hooks (Pool.add_tag_hooks, torpor_add_tag_hooks) on every device pool
    PyTorch uses, now and later (see the module note)."""
    if not isinstance(tag, str) or not tag:
        raise InvalidType(f"add_mapping_hooks: tag {tag!r} is not a non-empty string")
    if before_unmap is None and after_map is None:
        raise InvalidType("add_mapping_hooks: give before_unmap, after_map or both")
    for what, hook in (("before_unmap", before_unmap), ("after_map", after_map)):
        if hook is not None and not callable(hook):
            raise InvalidType(f"add_mapping_hooks: {what} must be callable or None, not {type(hook).__name__}")
    with _hooks_lock:
        hook_id = next(_hook_ids)
        _mapping_hooks[hook_id] = [tag, before_unmap, after_map, {}]
    for pool in routing.device_pools().values():
        _install_mapping(pool)
    return hook_id


def remove_mapping_hooks(hook_id: int) -> None:
    with _hooks_lock:
        entry = _mapping_hooks.pop(hook_id, None)
    if entry is None:
        raise KeyError(f"remove_mapping_hooks: {hook_id} is not a mapping hook (removed twice?)")
    for pool, c_id in entry[3].values():
        pool.remove_tag_hooks(c_id)


def _install_mapping(pool: Pool) -> None:
    """Every registered mapping hook on `pool`, once each."""
    with _hooks_lock:
        for entry in _mapping_hooks.values():
            if pool.handle not in entry[3]:
                entry[3][pool.handle] = (pool, pool.add_tag_hooks(entry[0], entry[1], entry[2]))


routing.on_new_mempool(_install_mapping)


# -- errors engines catch --------------------------------------------------------------------

_runtime_classes: dict[type, type] = {}


def runtime_error_class(cls: type[TorporError]) -> type[TorporError]:
    """A class deriving from `cls` and RuntimeError (`cls` itself when it already is one)."""
    if issubclass(cls, RuntimeError):
        return cls
    made = _runtime_classes.get(cls)
    if made is None:
        made = type(
            cls.__name__,
            (cls, RuntimeError),
            {
                "__module__": __name__,
                "__qualname__": f"RuntimeError[{cls.__qualname__}]",
                "__doc__": f"{cls.__name__}, also a RuntimeError (vLLM's allocator raises those).",
            },
        )
        _runtime_classes[cls] = made
    return made


def runtime_error(e: TorporError) -> TorporError:
    """`e` as an instance of runtime_error_class(type(e)), same message and status."""
    cls = runtime_error_class(type(e))
    if cls is type(e):
        return e
    out = cls(e.message)
    out.status = e.status
    return out


@contextlib.contextmanager
def as_runtime_errors():
    """Inside: a TorporError leaves as runtime_error(e), with its traceback."""
    try:
        yield
    except TorporError as e:
        raise runtime_error(e).with_traceback(e.__traceback__) from None


# -- what torch_memory_saver's API needs of the C library --------------------------------------


def library_path() -> str:
    """The path of the libtorpor.so this process loaded (torpor._lib's search)."""
    return _lib.library_path()


def memory_margin() -> int:
    """Bytes of device memory a new segment must leave free (torpor_torch_memory_margin)."""
    return int(_lib.lib().torpor_torch_memory_margin())


def set_memory_margin(nbytes: int) -> None:
    """Refuse a new segment that would leave less than `nbytes` free (a checked size_t)."""
    n = whole(nbytes, "set_memory_margin: nbytes (the memory margin, 0 = no check)", 0, SIZE_MAX)
    _lib.check(_lib.lib().torpor_torch_set_memory_margin(n))


def read_host_copy(device: int, address: int, nbytes: int, dst: int) -> bool | None:
    """Copy the host copy of [address, +nbytes) of `device`'s torch pool to host memory at
    `dst`: True when the bytes are asleep (their backup), False when awake with a retained copy,
    None when awake without one. Raises the typed error otherwise (InvalidState: no host copy
    of sleeping bytes, as for a tensor in a region without a backup)."""
    device = whole(device, "read_host_copy: device", 0, INT_MAX)
    address = whole(address, "read_host_copy: address", 0, SIZE_MAX)
    nbytes = whole(nbytes, "read_host_copy: nbytes", 0, SIZE_MAX)
    dst = whole(dst, "read_host_copy: dst", 0, SIZE_MAX)
    asleep = ctypes.c_int(0)
    status = _lib.lib().torpor_read_host_copy(Pool.torch(device).handle, address, nbytes, dst, ctypes.byref(asleep))
    if status == _lib.status_ok():
        return bool(asleep.value)
    if status == InvalidState.status and not asleep.value:
        return None
    raise error_for(status, _lib.last_error())


__all__ = [
    "ClassPolicy",
    "PoolOptions",
    "add_mapping_hooks",
    "add_preserve",
    "add_tag_hooks",
    "as_runtime_errors",
    "capture_into",
    "capturing_into",
    "reconfigure",
    "cuda_torch",
    "export_handles",
    "fill_on_wake",
    "graph",
    "graph_pool",
    "intend_sleep",
    "keep_everything",
    "library_path",
    "memory_margin",
    "nccl_graph_register_off",
    "pool_class",
    "prepare_for_sleep",
    "read_host_copy",
    "register_parameters",
    "release_graph_pool",
    "release_host_store",
    "remove_mapping_hooks",
    "remove_tag_hooks",
    "runtime_error",
    "runtime_error_class",
    "set_memory_margin",
    "sleep",
    "stats",
    "tag_at",
    "tag_states",
    "use_pool",
    "wake_up",
]
