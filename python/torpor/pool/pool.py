"""Pool: one device's torpor pool through the C API, without PyTorch.

A Pool either owns a pool it created (``Pool(device, backend=...)``; destroyed by close())
or wraps the pool PyTorch's pluggable allocator uses for a device (``Pool.torch(device)``;
never destroyed, PyTorch holds segments in it). Addresses are plain ints. Every failure
raises the typed exception of torpor's status (torpor.errors) with torpor's message.

Sleep hooks (``add_sleep_hook``, torpor_add_sleep_hook): Python callables run inside the pool's
sleep before anything moves (one that raises aborts it) and after every wake; the PyTorch
embedding re-marks its blocks in one. Tag hooks (``add_tag_hooks``, torpor_add_tag_hooks): per-tag
callables before a sleep unmaps the tag and after a wake maps it fully (vLLM's
register_tag_hooks). Levels are SleepLevel (torpor.values), checked where they
enter.

Exportable pools (``exportable=True``): memory with shareable handles, GPUDirect RDMA capable where
the device can; ``export_handles(tags, kind)`` hands out one handle per chunk for a KV transport
(torpor.exports says who owns the descriptors and what sleep and wake do to them).

Tag lists: ``None`` means every tag of the pool, a string one tag, a list those tags; an
empty list means no tag, so the call does nothing (vLLM's ``wake_up(tags=[])`` does the same).
"""

from __future__ import annotations

import ctypes
import enum
import json
from typing import Iterable, Union

from .. import _lib, exports
from ..errors import InvalidArgument, InvalidHandle, InvalidState, InvalidType, error_for
from . import callbacks
from .options import PoolOptions
from ..values import INT_MAX, SIZE_MAX, ULLONG_MAX, SleepLevel, address, choice, sleep_level, text, whole


class MemoryClass(enum.Enum):
    """What the bytes are. A member's value is the class's name; int(member) is the C API's
    value (torpor_class), and MemoryClass(int) the member of a C value, both as the loaded
    library defines them."""

    PARAMETER = "parameter"  # reloadable weights: offloaded at level 1, discarded at level 2
    STATE = "state"  # must survive bit-exact: always offloaded
    CACHE = "cache"  # recomputable (KV cache, free space): always discarded

    def __int__(self) -> int:
        return _lib.enum_value("memory_class", self.value)

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, int) and not isinstance(value, bool):
            for name, code in _lib.enum_values("memory_class").items():
                if code == value:
                    return cls(name)
        return None


ClassLike = Union[MemoryClass, int, str]
Tags = Union[None, str, Iterable[str]]


def to_memory_class(value: ClassLike) -> MemoryClass:
    """MemoryClass from a MemoryClass, its C value, or its name ("parameter", "state", "cache")."""
    key = value.lower() if isinstance(value, str) else value
    try:
        return MemoryClass(key)
    except ValueError:
        shown = f"'{value}'" if isinstance(value, str) else repr(value)
        *others, last = [m.value for m in MemoryClass]
        raise InvalidArgument(f"unknown memory class {shown} (expected {', '.join(others)} or {last})") from None


def _iterable(value, what: str):
    """iter(value), or InvalidArgument naming `what` (not the built-in TypeError)."""
    try:
        return iter(value)
    except TypeError:
        raise InvalidType(f"{what}: {type(value).__name__} {value!r} is not iterable") from None


def tag_list(tags: Tags) -> list[str] | None:
    """None (all tags) or a list of tags, from None, one string, or an iterable of strings."""
    if tags is None:
        return None
    if isinstance(tags, str):
        tags = [tags]
    out = []
    for t in _iterable(tags, "tags (None, a tag, or a list of tags)"):
        text(t, "tag")
        out.append(t)
    return out


_json_capacity: dict = {}  # C function's name -> the size its last document needed


def _json(fn, handle):
    """Call a (pool, buffer, capacity, needed) JSON function of the C API. The buffer starts at
    the size the function's last document needed, since a document that does not fit is
    computed again."""
    needed = ctypes.c_size_t(0)
    name = getattr(fn, "__name__", None)
    capacity = _json_capacity.get(name, 4096)
    while True:
        buf = ctypes.create_string_buffer(capacity)
        _lib.check(fn(handle, buf, capacity, ctypes.byref(needed)))
        if needed.value <= capacity:
            _json_capacity[name] = max(needed.value, 4096)
            return json.loads(buf.value.decode())
        capacity = needed.value


_marks_made = 0


def marks_generation() -> int:
    """How many times Pool.mark or Pool.mark_ranges changed classes in this process: the PyTorch
    embedding keeps its last re-mark of a pool only while this number stays what it was after
    it (a class set by anyone else makes the next sleep compute the classes again)."""
    return _marks_made


def _marked() -> None:
    global _marks_made
    _marks_made += 1


class Pool(_lib.Closing):
    """One device's torpor pool (see the module note)."""

    def __init__(self, device: int = 0, **options):
        """A new pool on `device` with `options`: the fields of torpor.pool.PoolOptions
        (backend, va_bytes, fill_on_wake, exportable, skip_unchanged, the host store's), each
        defaulting to the library's."""
        o = PoolOptions(**options).c_struct(device)
        handle = ctypes.c_void_p()
        _lib.check(_lib.lib().torpor_pool_create(ctypes.byref(o), ctypes.byref(handle)))
        self._handle: int | None = handle.value
        self._owned = True
        self.device = int(device)

    @classmethod
    def torch(cls, device: int = 0) -> "Pool":
        """The pool torpor_torch_malloc allocates in for `device`, created if needed (with the
        options of torpor.configure). Not owned: close() leaves it alive."""
        device = whole(device, "Pool.torch: device", 0, INT_MAX)
        handle = ctypes.c_void_p()
        _lib.check(_lib.lib().torpor_torch_pool(device, ctypes.byref(handle)))
        self = cls.__new__(cls)
        self._handle, self._owned, self.device = handle.value, False, device
        return self

    # -- lifetime ----------------------------------------------------------------------------

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise InvalidArgument(f"this torpor Pool (device {self.device}) was closed")
        return self._handle

    def close(self) -> None:
        """Destroy an owned pool (its memory goes back). Idempotent; a no-op for Pool.torch()."""
        if self._handle is not None and self._owned:
            handle, self._handle = self._handle, None
            _lib.check(_lib.lib().torpor_pool_destroy(handle))

    def __repr__(self) -> str:
        state = "closed" if self._handle is None else self.backend
        return f"<torpor.Pool device={self.device} {state}{'' if self._owned else ' (torch)'}>"

    # -- allocations -------------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """ "cuda" or "host"."""
        name = _lib.lib().torpor_pool_backend(self.handle)
        if not name:
            _lib.check(InvalidHandle.status)
        return name.decode()

    def alloc(
        self,
        nbytes: int,
        tag: str = "default",
        memory_class: ClassLike = MemoryClass.STATE,
        name: str | None = None,
    ) -> int:
        """Allocate `nbytes` in `tag` with one class for the whole allocation; its address."""
        size = whole(nbytes, "alloc: nbytes", 1, SIZE_MAX)
        tag_bytes = text(tag, "tag")
        name_bytes = text(name, "name", allow_empty=True) if name else None
        out = ctypes.c_void_p()
        cls = to_memory_class(memory_class)
        _lib.check(_lib.lib().torpor_alloc(self.handle, size, tag_bytes, int(cls), name_bytes, ctypes.byref(out)))
        return out.value

    def free(self, ptr: int) -> None:
        _lib.check(_lib.lib().torpor_free(self.handle, address(ptr, "free: ptr")))

    def mark(self, ptr: int, nbytes: int, memory_class: ClassLike, name: str | None = None) -> None:
        """Reclassify [ptr, ptr + nbytes), which must lie inside one allocation. name None or
        "" keeps the current name; names are what preserve globs match."""
        start = address(ptr, "mark: ptr")
        size = whole(nbytes, "mark: nbytes", 0, SIZE_MAX)
        name_bytes = text(name, "name", allow_empty=True) if name else None
        cls = to_memory_class(memory_class)
        _marked()  # before the call: a failed mark may have changed nothing, never too few counted
        _lib.check(_lib.lib().torpor_mark(self.handle, start, size, int(cls), name_bytes))

    def mark_ranges(self, ranges: Iterable[tuple]) -> None:
        """Reclassify many ranges in one call, in order (a later range wins where ranges
        overlap): (ptr, nbytes, memory_class) or (ptr, nbytes, memory_class, name) tuples. Every
        range is checked first; on a bad one nothing changes and the error names its
        index. ptr is an address and nbytes a size in [0, 2**64 - 1] (whole numbers, not bool or
        float); a name is a str without NUL."""
        ranges = list(_iterable(ranges, "mark_ranges: ranges (a list of (ptr, nbytes, class[, name]))"))
        n = len(ranges)
        if n == 0:
            return
        # Plain lists first, each C array built in one go: a sleep marks thousands of ranges.
        codes = {c: int(c) for c in MemoryClass}
        ptrs, sizes, classes, names = [], [], [], [None] * n
        any_name = False
        for i, r in enumerate(ranges):
            if not isinstance(r, (tuple, list)) or len(r) not in (3, 4):
                raise InvalidType(f"mark_ranges: range {i} {r!r} is not (ptr, nbytes, class[, name])")
            ptrs.append(address(r[0], f"mark_ranges: range {i}: ptr"))
            sizes.append(whole(r[1], f"mark_ranges: range {i}: nbytes", 0, SIZE_MAX))
            code = codes.get(r[2]) if isinstance(r[2], MemoryClass) else None
            classes.append(int(to_memory_class(r[2])) if code is None else code)
            if len(r) == 4 and r[3] is not None and r[3] != "":
                names[i] = text(r[3], f"mark_ranges: range {i}: name")
                any_name = True
        c_ptrs = (ctypes.c_void_p * n)(*ptrs)
        c_sizes = (ctypes.c_size_t * n)(*sizes)
        c_classes = (ctypes.c_int * n)(*classes)
        c_names = (ctypes.c_char_p * n)(*names) if any_name else None
        _marked()
        _lib.check(_lib.lib().torpor_mark_ranges(self.handle, n, c_ptrs, c_sizes, c_classes, c_names))

    def set_preserve(self, globs: Iterable[str]) -> None:
        """Parameters whose name matches one of these fnmatch globs survive level 2 (offloaded).
        One string is one glob (not its characters)."""
        globs = [globs] if isinstance(globs, str) else list(_iterable(globs, "set_preserve: globs"))
        for g in globs:
            text(g, "set_preserve: glob")
        arr, n = _lib.encode_list(globs)
        _lib.check(_lib.lib().torpor_set_preserve(self.handle, arr, n))

    # -- shareable handles --------------------------------------------------------------

    @property
    def exportable(self) -> bool:
        """Whether the pool was created exportable (torpor_pool_exportable)."""
        out = ctypes.c_int(0)
        _lib.check(_lib.lib().torpor_pool_exportable(self.handle, ctypes.byref(out)))
        return bool(out.value)

    def export_handles(self, tags: Tags = None, kind: str = "auto") -> exports.ExportedHandles:
        """The shareable handles of the chunks holding allocations of `tags` (None = every tag),
        one ExportedChunk per chunk in address order (torpor.exports: fields, who owns the
        descriptors, what sleep and wake do). kind: "auto" (fabric where this pool's memory has
        fabric handles, else "posix_fd"), "posix_fd" or "fabric". All or nothing. Raises
        InvalidState for a pool that is not exportable or a tag asleep (its memory was released:
        wake it first), InvalidArgument for an unknown tag, Unavailable for fabric handles the
        device has not (the message says why)."""
        tags = tag_list(tags)
        k = choice("handle_kind", kind, "handle kind")
        if tags == []:
            return exports.ExportedHandles()
        arr, n = _lib.encode_list(tags or [])
        return exports.export(self.handle, arr if tags else None, n, k)

    def find(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation containing ptr; InvalidArgument if none."""
        ptr = address(ptr, "find: ptr")
        base, size = ctypes.c_void_p(), ctypes.c_size_t()
        _lib.check(_lib.lib().torpor_find(self.handle, ptr, ctypes.byref(base), ctypes.byref(size)))
        return base.value, size.value

    def contains(self, ptr: int) -> bool:
        """Whether ptr lies inside an allocation of this pool."""
        status = _lib.lib().torpor_find(self.handle, address(ptr, "contains: ptr"), None, None)
        if status == InvalidArgument.status:  # not inside any allocation
            return False
        _lib.check(status)
        return True

    # -- bytes ----------------------------------------------------------------------------

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Synchronous copy between host memory and pool memory, any direction."""
        dst = whole(dst, "copy: dst", 0, SIZE_MAX)
        src = whole(src, "copy: src", 0, SIZE_MAX)
        size = whole(nbytes, "copy: nbytes", 0, SIZE_MAX)
        _lib.check(_lib.lib().torpor_copy(self.handle, dst, src, size))

    def write(self, ptr: int, data: bytes) -> None:
        """Copy host bytes (bytes, bytearray, memoryview, ...) into pool memory at ptr."""
        ptr = address(ptr, "write: ptr")
        try:
            data = bytes(memoryview(data))
        except TypeError:
            raise InvalidType(
                f"write: data must be bytes-like (bytes, bytearray, memoryview), not {type(data).__name__}"
            ) from None
        buf = ctypes.create_string_buffer(data, len(data))
        self.copy(ptr, ctypes.addressof(buf), len(data))

    def read(self, ptr: int, nbytes: int) -> bytes:
        """Copy nbytes of pool memory at ptr to the host."""
        ptr = address(ptr, "read: ptr")
        buf = ctypes.create_string_buffer(whole(nbytes, "read: nbytes", 0, SIZE_MAX))
        self.copy(ctypes.addressof(buf), ptr, nbytes)
        return buf.raw

    def read_host_copy(self, ptr: int, nbytes: int, dst: int) -> bool | None:
        """Copy the host copy of [ptr, ptr + nbytes) to host memory at `dst`
        (torpor_read_host_copy): True when the bytes are asleep (their backup), False when awake
        with a retained copy, None when awake without one. Raises the typed error otherwise
        (InvalidState: no host copy of sleeping bytes, as for bytes of class cache)."""
        ptr = whole(ptr, "read_host_copy: address", 0, SIZE_MAX)
        nbytes = whole(nbytes, "read_host_copy: nbytes", 0, SIZE_MAX)
        dst = whole(dst, "read_host_copy: dst", 0, SIZE_MAX)
        asleep = ctypes.c_int(0)
        status = _lib.lib().torpor_read_host_copy(self.handle, ptr, nbytes, dst, ctypes.byref(asleep))
        if status == _lib.status_ok():
            return bool(asleep.value)
        if status == InvalidState.status and not asleep.value:
            return None
        raise error_for(status, _lib.last_error())

    # -- sleep ----------------------------------------------------------------------------

    def sleep(self, level: int | SleepLevel = 1, tags: Tags = None) -> dict:
        """Release the physical memory of `tags` (None = all), keeping what `level` keeps
        (1: parameters and state; 2: state and preserved parameters). Returns the report. A
        sleep hook (add_sleep_hook) that raised aborts it: its exception is raised here.
        """
        level = sleep_level(level)
        tags = tag_list(tags)
        if tags == []:
            return {}
        arr, n = _lib.encode_list(tags or [])
        callbacks.check(_lib.lib().torpor_sleep(self.handle, int(level), arr if tags else None, n))
        return self.last_report()

    def set_fill_on_wake(self, fill: str) -> str:
        """What the wakes from now on write into discarded bytes (none, zero, poison: the pool
        option fill_on_wake, torpor_set_fill_on_wake). Returns the previous fill."""
        previous = ctypes.c_int(-1)
        _lib.check(
            _lib.lib().torpor_set_fill_on_wake(self.handle, choice("fill", fill, "fill"), ctypes.byref(previous))
        )
        return next(name for name, value in _lib.enum_values("fill").items() if value == previous.value)

    def add_sleep_hook(self, before_sleep=None, after_wake=None) -> int:
        """Run before_sleep(level: SleepLevel, tags: list[str]) inside every sleep of this pool
        at levels 1 and 2, before anything moves (an exception from it aborts the sleep with
        nothing changed; the sleep raises it), and after_wake(tags, ok: bool) after every wake
        (torpor_add_sleep_hook). Returns the hook's id for remove_sleep_hook."""
        return callbacks.add(self.handle, before_sleep, after_wake)

    def remove_sleep_hook(self, hook_id: int) -> None:
        callbacks.remove(self.handle, whole(hook_id, "remove_sleep_hook: hook_id", 0, ULLONG_MAX))

    def add_tag_hooks(self, tag: str, before_unmap=None, after_map=None) -> int:
        """Tag hooks (torpor_add_tag_hooks; vLLM's register_tag_hooks): before_unmap(tag) in
        every sleep of this pool that unmaps some of `tag`, before anything moves (an exception
        aborts the sleep with nothing moved; the sleep raises it); after_map(tag) once after
        every wake that leaves `tag` fully mapped (it must be idempotent), and after a failed
        sleep that left mapped a tag whose before_unmap ran. Returns the id for
        remove_tag_hooks."""
        return callbacks.add_tag(self.handle, tag, before_unmap, after_map)

    def remove_tag_hooks(self, hook_id: int) -> None:
        callbacks.remove_tag(self.handle, whole(hook_id, "remove_tag_hooks: hook_id", 0, ULLONG_MAX))

    def run_after_map_hooks(self) -> None:
        """after_map(tag) of every hooked tag that is fully mapped, as at the end of a wake
        (torpor_run_after_map_hooks): vLLM runs its after_map hooks after every wake-up, also one
        that selects nothing to map."""
        _lib.check(_lib.lib().torpor_run_after_map_hooks(self.handle))

    def wake_up(self, tags: Tags = None) -> dict:
        """Map memory again at the same addresses for `tags` (None = all) and restore what was
        kept. Returns the report. An empty list maps nothing, and still runs the after_map hooks
        of the tags that are fully mapped, as every wake does."""
        tags = tag_list(tags)
        if tags == []:
            self.run_after_map_hooks()
            return {}
        arr, n = _lib.encode_list(tags or [])
        _lib.check(_lib.lib().torpor_wake_up(self.handle, arr if tags else None, n))
        return self.last_report()

    def release_host_store(self) -> int:
        """Drop the host copies kept after wake (skip_unchanged) and give every unused host
        store block back, memory and disk (backups of sleeping tags stay). Returns the bytes
        released."""
        released = ctypes.c_size_t(0)
        _lib.check(_lib.lib().torpor_release_host_store(self.handle, ctypes.byref(released)))
        return released.value

    def prepare_host_store(self, nbytes: int = 0, wait: bool = False) -> int:
        """Start page-locking host memory in the background until the pinned store holds
        `nbytes` (0 = what a level-1 sleep of everything allocated now needs), so that the first
        sleep copies at full speed; call it while the model loads. wait: block until done.
        The bytes added."""
        added = ctypes.c_size_t(0)
        n = whole(nbytes, "prepare_host_store: nbytes (0 = what a level-1 sleep needs)", 0, SIZE_MAX)
        _lib.check(_lib.lib().torpor_prepare_host_store(self.handle, n, 1 if wait else 0, ctypes.byref(added)))
        return added.value

    def sleep_host_bytes(self, level: int | SleepLevel = 1, tags: Tags = None) -> int:
        """The host store bytes a sleep at `level` of `tags` (None = all) would hold with the
        classes marked now: what to prepare_host_store() before a first sleep."""
        level = sleep_level(level)
        tags = tag_list(tags)
        if tags == []:
            return 0
        arr, n = _lib.encode_list(tags or [])
        out = ctypes.c_size_t(0)
        _lib.check(
            _lib.lib().torpor_sleep_host_bytes(self.handle, int(level), arr if tags else None, n, ctypes.byref(out))
        )
        return out.value

    def stats(self) -> dict:
        """Pool statistics: mapped bytes, per tag and class (the C API's JSON document)."""
        return _json(_lib.lib().torpor_stats_json, self.handle)

    def last_report(self) -> dict:
        """What the last sleep or wake_up did: bytes moved and time per phase."""
        return _json(_lib.lib().torpor_last_report_json, self.handle)

    def tags(self) -> list[str]:
        """The pool's tags, sorted (the stats' tag names, without computing the statistics)."""
        return _json(_lib.lib().torpor_tags_json, self.handle)
