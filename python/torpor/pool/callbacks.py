"""Python callables as the C API's sleep hooks (torpor_add_sleep_hook), for Pool.add_sleep_hook,
and as its tag hooks (torpor_add_tag_hooks), for Pool.add_tag_hooks.

A before-sleep hook that raises refuses the sleep: the trampoline returns the exception's status
(a TorporError's own, else TORPOR_ERROR_INTERNAL) with its text as the message, so the C side
aborts the sleep with nothing moved (and a collective sleep names this rank's failure on every
rank). The exception itself is kept for the thread that called the sleep, which raises it
(``check``): a direct caller sees the hook's own error type and message. A before_unmap tag
hook refuses the same way. An after-wake or after_map hook has no way back into the wake: its
exception is logged (logger torpor) and dropped.
"""

from __future__ import annotations

import ctypes
import logging
import threading

from .. import _lib
from ..errors import InternalError, InvalidType, TorporError
from ..values import SleepLevel

_lock = threading.Lock()
_alive: dict = {}  # (pool handle, hook id) -> the ctypes callbacks (kept alive while registered)
logger = logging.getLogger("torpor")
_failure = threading.local()  # .error: the exception a hook raised in this thread's last sleep


def _tags(tags, count: int) -> list[str]:
    return [tags[i].decode() for i in range(count)]


def _status_of(e: BaseException) -> int:
    if isinstance(e, TorporError) and e.status is not None:
        return e.status
    return InternalError.status if InternalError.status is not None else 1


def _refusal(e: BaseException, message, capacity) -> int:
    """Keep `e` for the sleeping thread, write its text for the C side; its status."""
    _failure.error = e
    text = (str(e) if isinstance(e, TorporError) else f"{type(e).__name__}: {e}").encode(errors="replace")
    ctypes.memmove(message, text[: capacity - 1] + b"\0", min(len(text), capacity - 1) + 1)
    return _status_of(e)


def _before(fn):
    def trampoline(_user, _pool, level, tags, count, message, capacity) -> int:
        try:
            fn(SleepLevel(level), _tags(tags, count))
            return _lib.status_ok()
        except BaseException as e:  # noqa: B036 - nothing may cross the C boundary
            return _refusal(e, message, capacity)

    return _lib.BEFORE_SLEEP_HOOK(trampoline) if fn is not None else _lib.BEFORE_SLEEP_HOOK()


def _after(fn):
    def trampoline(_user, _pool, tags, count, ok) -> None:
        try:
            fn(_tags(tags, count), bool(ok))
        except BaseException:  # noqa: B036 - nothing may cross the C boundary; a wake has no way back
            pass

    return _lib.AFTER_WAKE_HOOK(trampoline) if fn is not None else _lib.AFTER_WAKE_HOOK()


def add(handle: int, before_sleep, after_wake) -> int:
    if before_sleep is None and after_wake is None:
        raise InvalidType("add_sleep_hook: give before_sleep, after_wake or both")
    for what, fn in (("before_sleep", before_sleep), ("after_wake", after_wake)):
        if fn is not None and not callable(fn):
            raise InvalidType(f"add_sleep_hook: {what} must be callable or None, not {type(fn).__name__}")
    callbacks = (_before(before_sleep), _after(after_wake))
    hook_id = ctypes.c_ulonglong(0)
    _lib.check(_lib.lib().torpor_add_sleep_hook(handle, callbacks[0], callbacks[1], None, ctypes.byref(hook_id)))
    with _lock:
        _alive[(handle, hook_id.value)] = callbacks
    return hook_id.value


def remove(handle: int, hook_id: int) -> None:
    # The callbacks stay alive: a sleep on another thread may be calling this hook right now
    # (the C side starts no new call once this returns).
    _lib.check(_lib.lib().torpor_remove_sleep_hook(handle, hook_id))


def add_tag(handle: int, tag: str, before_unmap, after_map) -> int:
    """torpor_add_tag_hooks with Python callables: before_unmap(tag), after_map(tag)."""
    if not isinstance(tag, str) or not tag:
        raise InvalidType(f"add_tag_hooks: tag {tag!r} is not a non-empty string")
    if before_unmap is None and after_map is None:
        raise InvalidType("add_tag_hooks: give before_unmap, after_map or both")
    for what, fn in (("before_unmap", before_unmap), ("after_map", after_map)):
        if fn is not None and not callable(fn):
            raise InvalidType(f"add_tag_hooks: {what} must be callable or None, not {type(fn).__name__}")

    def before(_user, _pool, name, message, capacity) -> int:
        try:
            before_unmap(name.decode())
            return _lib.status_ok()
        except BaseException as e:  # noqa: B036 - nothing may cross the C boundary
            return _refusal(e, message, capacity)

    def after(_user, _pool, name) -> None:
        try:
            after_map(name.decode())
        except BaseException as e:  # noqa: B036 - a wake has no way back
            logger.error(
                "torpor: after_map hook of tag %r failed: %s: %s",
                name.decode(),
                type(e).__name__,
                e,
            )

    callbacks = (
        _lib.BEFORE_UNMAP_HOOK(before) if before_unmap is not None else _lib.BEFORE_UNMAP_HOOK(),
        _lib.AFTER_MAP_HOOK(after) if after_map is not None else _lib.AFTER_MAP_HOOK(),
    )
    hook_id = ctypes.c_ulonglong(0)
    status = _lib.lib().torpor_add_tag_hooks(
        handle, tag.encode(), callbacks[0], callbacks[1], None, ctypes.byref(hook_id)
    )
    _lib.check(status)
    with _lock:
        _alive[(handle, "tag", hook_id.value)] = callbacks
    return hook_id.value


def remove_tag(handle: int, hook_id: int) -> None:
    # As remove(): the callbacks stay alive for a call already running on another thread.
    _lib.check(_lib.lib().torpor_remove_tag_hooks(handle, hook_id))


def take_failure() -> BaseException | None:
    """The exception a hook raised in this thread since the last call, once."""
    error = getattr(_failure, "error", None)
    _failure.error = None
    return error


def check(status: int) -> None:
    """_lib.check for a call that runs the sleep hooks: a hook's own exception first."""
    failure = take_failure()
    if status != _lib.status_ok() and failure is not None:
        raise failure
    _lib.check(status)
