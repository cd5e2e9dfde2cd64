"""The public API of the PyTorch embedding: configure, use_pool, sleep, wake_up, stats,
export_handles and the host-store calls (re-exported as torpor.*), and what engine modes use
besides through torpor.engine: sleep with a class policy (``sleep_with_policy``), ``reconfigure``,
``fill_on_wake``, the memory margin and ``read_host_copy``. See torpor.torch's package note for
the design."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc

from .. import _lib
from ..errors import InvalidArgument, InvalidState, InvalidType, OutOfMemory, error_for
from ..exports import ExportedHandles
from ..pool import ClassLike, MemoryClass, Pool, PoolOptions, Tags, tag_list, to_memory_class
from ..tags import KV_CACHE
from ..values import INT_MAX, SIZE_MAX, SleepLevel, sleep_level, text, whole
from . import hook_bus, prepare, remark, routing
from .marks import segment_blocks
from .runtime import cuda_torch, device_index, keep_current_device


def configure(**options) -> None:
    """Options of the pools PyTorch allocates in: the fields of torpor.pool.PoolOptions
    (backend, fill_on_wake, va_bytes, exportable, skip_unchanged and the host store's; each
    defaulting to the library's). Call before the first allocation; later, only the same
    options are accepted. exportable: memory with shareable handles for KV transports
    (export_handles; use_pool(..., exportable=True) sets it for a pool not created yet)."""
    _apply(PoolOptions(**options))


def reconfigure(**changes) -> None:
    """configure() with the options of the last configure() from Python, `changes` changed
    (before the first allocation, as configure): a mode that sets only some options (torpor.tms's
    disk and pageable backups, use_pool's exportable) keeps the rest."""
    _apply(dataclasses.replace(_configured, **changes))


def _apply(options: PoolOptions) -> None:
    global _configured
    _lib.check(_lib.lib().torpor_torch_configure(ctypes.byref(options.c_struct(0))))
    _configured = options


# The options of the last configure() from Python (all the library's defaults before one).
_configured = PoolOptions()


def _default_class(tag: str) -> MemoryClass:
    return MemoryClass.CACHE if tag == KV_CACHE else MemoryClass.STATE


def _allocation_error(tag: str, device: int, status: int):
    message = f"PyTorch could not allocate in torpor pool '{tag}' on device {device}: {_lib.last_error()}"
    return error_for(status, message) if status != _lib.status_ok() else OutOfMemory(message)


def _refuse_a_sleeping_tag(tag: str, device: int) -> None:
    # PyTorch serves a request from a free block of the pool's cached segments without asking
    # torpor: in a sleeping tag that block is unmapped, and the first kernel touching it
    # faults. So refuse up front (a sleep inside the block is caught by torpor_torch_malloc).
    tag_stats = Pool.torch(device).stats()["tags"].get(tag)
    if tag_stats is not None and tag_stats["asleep"]:
        raise InvalidState(
            f"use_pool: tag '{tag}' is asleep on device {device} (level {tag_stats['level']}); "
            f"wake_up(['{tag}']) before allocating in it"
        )


def _ensure_exportable(device: int) -> None:
    """The device's torch pool exportable: created so when it does not exist yet (the torch pools'
    options as last configured, with exportable on), else it must have been created so."""
    if not _configured.c_struct().exportable:
        try:
            reconfigure(exportable=True)
        except InvalidState:
            pass  # pools exist already, with other options: the check below names the fix
    if not Pool.torch(device).exportable:
        raise InvalidState(
            f"use_pool(..., exportable=True): the torpor pool of device {device} behind PyTorch's allocator was "
            f"created without shareable handles (its first allocation came before any exportable request), and a "
            f"pool's memory cannot become exportable later. Call torpor.configure(exportable=True) (with your other "
            f"options) before the first allocation through torpor, or pass exportable=True to the first use_pool"
        )


@contextlib.contextmanager
def use_pool(tag: str = "default", memory_class: ClassLike | None = None, device=None, exportable: bool = False):
    """Allocate the CUDA tensors this thread creates inside the block in torpor, in `tag`.

    memory_class: what the bytes are; default state, or cache for the tag "kv_cache" (as in
    vLLM, whose KV cache is discarded by every sleep level). Parameters inside a state tag are
    told apart by register_parameters(). device: the CUDA device (default: current); tensors
    created for other devices inside the block go to PyTorch's default pool. Yields the
    torch.cuda.MemPool. Entering a sleeping tag raises InvalidState; an allocation torpor
    refuses inside the block raises torpor's typed error (InvalidState when the tag was put to
    sleep meanwhile, OutOfMemory, ...), chained to PyTorch's out-of-memory error.

    exportable: the memory must have shareable handles, for a KV transport (export_handles();
    GPUDirect RDMA capable where the device can). The device has one torpor pool for every tag,
    so this makes all of its memory exportable: the pool is created so when it does not exist
    yet (torpor.configure(exportable=True) implicitly, the other options kept); one created
    earlier without raises InvalidState naming the fix."""
    torch = cuda_torch()
    text(tag, "use_pool: tag")  # a str the C API carries whole: no NUL, no lone surrogate
    if not isinstance(exportable, bool):
        raise InvalidType(f"use_pool: exportable {exportable!r} is not True or False")
    if routing.is_graph_tag(tag):
        raise InvalidArgument(
            f"use_pool: tag '{tag}' is a CUDA graph pool (torpor.graph): its free blocks are the graphs' "
            f"intermediates, rewritten at every replay; allocate tensors in another tag"
        )
    cls = _default_class(tag) if memory_class is None else to_memory_class(memory_class)
    dev = device_index(torch, device)
    if exportable:
        _ensure_exportable(dev)
    _refuse_a_sleeping_tag(tag, dev)
    lib = _lib.lib()
    with routing.registry.lock:
        pool = routing.mempool(torch, tag, dev, cls)
        pool.active += 1
    completed = loaded = False
    try:
        failures = lib.torpor_torch_failures(None)
        oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
        try:
            with routing.routed(torch, tag, cls), torch.cuda.memory.use_mem_pool(pool.mempool, dev):
                yield pool.mempool
            completed = True
        except oom as e:
            status = ctypes.c_int(0)
            if lib.torpor_torch_failures(ctypes.byref(status)) != failures:
                raise _allocation_error(tag, dev, status.value) from e
            raise
    finally:
        with routing.registry.lock:
            pool.active -= 1
            if pool.active == 0 and not pool.retired:
                routing.release_empty_segments(pool, dev, tag)
                loaded = True
        if loaded and completed:
            prepare.after_load()  # the outermost block of the tag: what it loaded may sleep


def pools() -> dict[int, Pool]:
    """The torpor pool of every device PyTorch allocated in through use_pool()."""
    return routing.device_pools()


def export_handles(tags: Tags = None, device=None, kind: str = "auto") -> ExportedHandles:
    """The shareable handles of the memory PyTorch allocated in torpor under `tags` (None = every
    tag) on `device` (default: current), for a KV transport: Pool.export_handles on the pool
    behind those MemPools (torpor.exports: the fields, who owns the descriptors, and why a
    transport exports again in an after_map tag hook, since a wake maps new memory). The pool
    must be exportable (use_pool(..., exportable=True)); InvalidState otherwise, or for a
    sleeping tag."""
    torch = cuda_torch()
    dev = device_index(torch, device)
    if dev not in routing.devices():
        raise InvalidArgument(
            f"export_handles: PyTorch has no torpor pool on device {dev} (devices: {routing.devices()}); allocate "
            f"inside torpor.use_pool(tag, exportable=True) first"
        )
    return Pool.torch(dev).export_handles(tags, kind)


# -- sleep ----------------------------------------------------------------------------------


def _tags_by_device(tags: list[str] | None, operation: str) -> dict[int, list[str]]:
    devices = routing.devices()
    known = {d: Pool.torch(d).tags() for d in devices}
    if tags is None:
        return known
    everywhere = sorted({t for ts in known.values() for t in ts})
    for t in tags:
        if t not in everywhere:
            listed = ", ".join(f"'{k}'" for k in everywhere)
            raise InvalidArgument(f"{operation}: unknown tag '{t}' (known tags: {listed})")
    return {d: [t for t in tags if t in known[d]] for d in devices}


def _checked_collect(collect: int | None) -> None:
    if collect is not None and (isinstance(collect, bool) or collect not in (0, 1, 2)):
        raise InvalidArgument(f"sleep: collect {collect!r} is not a generation 0..2 or None")


def selected_devices(tags: Tags, operation: str) -> dict[int, list[str]] | None:
    """{device: its tags among `tags`} for a sleep or wake of the PyTorch pools; None when there
    is nothing to do (no tag asked for, or no pool yet and none named)."""
    tags = tag_list(tags)
    if tags == [] or not routing.devices():
        if tags:
            hint = "; allocate inside torpor.use_pool(tag) first" if operation == "sleep" else ""
            raise InvalidArgument(f"{operation}: unknown tag '{tags[0]}' (no torpor pool exists yet{hint})")
        return None
    return _tags_by_device(tags, operation)


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
    return sleep_with_policy(level, tags, remark.pool_class, collect=collect)


def sleep_with_policy(
    level: int | SleepLevel, tags: Tags, policy: remark.ClassPolicy | None = None, collect: int | None = 1
) -> dict[int, dict]:
    """sleep(), with the classes of allocated blocks decided by `policy`: (tag, the class its
    MemPool allocates, whether registered parameters lie in the tag's segments on the device) ->
    MemoryClass (None: each MemPool's own class). The policy applies inside each pool's sleep (the
    hook bus's re-mark), so its marks and the sleep are one step. Returns {device: report}."""
    level = sleep_level(level, "sleep: level")  # the level checked once, where it enters
    _checked_collect(collect)
    selected = selected_devices(tags, "sleep")
    if selected is None:
        return {}
    policy = remark.pool_class if policy is None else policy
    return each_device_sleep(selected, lambda d, t: Pool.torch(d).sleep(level, t), policy, collect)


def each_device_sleep(selected: dict, sleep_one, policy: remark.ClassPolicy = remark.pool_class, collect=1) -> dict:
    """sleep_one(device, tags) on every device of `selected` that has tags, as torpor.sleep
    sleeps: the garbage collected first, the re-mark inside each pool's sleep with `policy`
    (the hook bus), the current device kept, PyTorch's cached memory released after. Returns
    {device: report}."""
    torch = cuda_torch()
    if collect is not None:
        gc.collect(collect)  # tensors only a reference cycle still holds are free space, not state
    reports = {}
    with keep_current_device(torch), hook_bus.sleeping(policy):
        for device, device_tags in selected.items():
            if device_tags:
                reports[device] = sleep_one(device, device_tags)
    torch.cuda.empty_cache()
    return reports


def each_device_wake_up(selected: dict, wake_one) -> dict:
    """wake_one(device, tags) on every device of `selected` that has tags, the current device
    kept. Returns {device: report}."""
    torch = cuda_torch()
    reports = {}
    with keep_current_device(torch):
        for device, device_tags in selected.items():
            if device_tags:
                reports[device] = wake_one(device, device_tags)
    return reports


def wake_up(tags: Tags = None) -> dict[int, dict]:
    """Map memory again, at the same addresses, for `tags` (None = all; vLLM's RL pattern is
    wake_up(["weights"]), load weights, then wake_up(["kv_cache"])). Returns {device: report}.
    Every device pool runs its after_map tag hooks, also one this wake maps nothing of (an empty
    `tags`, or none of its tags named), as vLLM's allocator does after every wake-up."""
    selected = selected_devices(tags, "wake_up")
    reports = {} if selected is None else each_device_wake_up(selected, lambda d, t: Pool.torch(d).wake_up(t))
    for device in routing.devices():
        if device not in reports:
            Pool.torch(device).run_after_map_hooks()
    return reports


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


def tag_states() -> dict[str, bool]:
    """{tag: whether it is asleep (on any device)} of every tag of the pools PyTorch uses."""
    out: dict[str, bool] = {}
    for d in routing.devices():
        for tag, t in Pool.torch(d).stats()["tags"].items():
            out[tag] = out.get(tag, False) or t["asleep"]
    return out


def release_host_store() -> dict[int, int]:
    """Give host memory back on every device: the host copies kept after wake (skip_unchanged)
    and every unused host store block, memory and disk (backups of sleeping tags stay).
    Returns {device: bytes released}."""
    return {d: Pool.torch(d).release_host_store() for d in routing.devices()}


def prepare_host_store(nbytes: int = 0, wait: bool = False) -> dict[int, int]:
    """Start page-locking host memory on every device in the background (nbytes each; 0 = what
    a level-1 sleep of everything allocated now needs), so that the first sleep copies at full
    speed: call it while or after the model loads. wait: block until done.
    Returns {device: bytes added}."""
    return {d: Pool.torch(d).prepare_host_store(nbytes, wait) for d in routing.devices()}


def memory_margin() -> int:
    """Bytes of device memory a new segment must leave free (torpor_torch_memory_margin)."""
    return int(_lib.lib().torpor_torch_memory_margin())


def set_memory_margin(nbytes: int) -> None:
    """Refuse a new segment that would leave less than `nbytes` free (a checked size_t)."""
    n = whole(nbytes, "set_memory_margin: nbytes (the memory margin, 0 = no check)", 0, SIZE_MAX)
    _lib.check(_lib.lib().torpor_torch_set_memory_margin(n))


def read_host_copy(device: int, address: int, nbytes: int, dst: int) -> bool | None:
    """Pool.read_host_copy on the torpor pool of `device`: the host copy of [address, +nbytes)
    into host memory at `dst`; True asleep, False awake with a retained copy, None awake without."""
    device = whole(device, "read_host_copy: device", 0, INT_MAX)
    for what, value in (("address", address), ("nbytes", nbytes), ("dst", dst)):
        whole(value, f"read_host_copy: {what}", 0, SIZE_MAX)  # all checked before a pool is made
    return Pool.torch(device).read_host_copy(address, nbytes, dst)


def stats(device: int | None = None) -> dict:
    """{device: stats} of every torpor pool PyTorch uses, or one device's stats: the pool's
    statistics (torpor.Pool.stats: per tag the bytes mapped on the device, allocated in torpor
    (PyTorch's segments) and per class), plus, per tag, ``active_bytes``: the bytes of PyTorch's
    live blocks in those segments (what its tensors take; the rest of a segment is free space)."""
    devices = routing.devices()
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
            for p in routing.pools_of(tag, device)
            for seg in routing.own_segments(p, device)
            for _, size, state in segment_blocks(seg)
            if state != "inactive"
        )
    return st
