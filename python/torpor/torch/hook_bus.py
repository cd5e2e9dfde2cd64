"""The hook bus: everything that runs around the sleeps and wakes of the device pools (the torpor
pools PyTorch allocates in), installed on each pool in one place, in an order written here.

When routing makes the first MemPool on a device, the bus equips that device's pool (once):

- ONE C sleep hook (torpor_add_sleep_hook). Inside every sleep of the pool, before anything moves,
  it runs, in this order:
  1. the re-mark of the sleeping tags' PyTorch blocks (torpor.torch.remark.remark_now), with the
     class policy of the sleep in progress, which the caller hands over as a value
     (``sleeping(policy)``; outside one, each MemPool's own class: remark.pool_class);
  2. the tag hooks' ``before_sleep(tag, level)`` of the sleeping tags (``add_tag_hooks``), which
     so see the classes the sleep will act on.
  An exception from either aborts the sleep with nothing moved, and the sleep raises it. After
  every wake of the pool it runs the tag hooks' ``after_wake(tag, ok)``.
- the mapping hooks (``add_mapping_hooks``): the C pool's own tag hooks (torpor_add_tag_hooks),
  ``before_unmap(tag)`` before anything moves and before the sleep hook above (the pool calls
  them first), ``after_map(tag)`` once the wake left the tag fully mapped (after_map's rules:
  Pool.add_tag_hooks). A mapping hook added later is added to every equipped pool.

Every sleep of those pools goes through this, whoever asks for it: torpor.sleep, an engine
mode's sleep with its policy (torpor.engine), torpor.distributed's collective sleep in libtorpor.
The C pools live for the whole process, and so does what the bus put on them.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Callable

from ..errors import InvalidType
from ..pool import Pool
from . import remark, routing

_lock = threading.Lock()
_equipped: set = set()  # handles of the device pools with the bus's hooks
_local = threading.local()  # .policy: the ClassPolicy of the sleep this thread is in
_ids = itertools.count(1)  # one count for tag hooks and mapping hooks
_tag_hooks: dict = {}  # id -> (tag, before_sleep, after_wake)
_mapping_hooks: dict = {}  # id -> [tag, before_unmap, after_map, {pool handle: (pool, C hook id)}]


@contextlib.contextmanager
def sleeping(policy: remark.ClassPolicy):
    """Inside: the sleeps this thread makes re-mark with `policy`."""
    previous = getattr(_local, "policy", remark.pool_class)
    _local.policy = policy
    try:
        yield
    finally:
        _local.policy = previous


# -- equipping a device pool -------------------------------------------------------------------


def equip(pool: Pool) -> None:
    """Give a device pool the bus's sleep hook and every mapping hook, once each (idempotent)."""
    with _lock:
        if pool.handle not in _equipped:
            pool.add_sleep_hook(_before_sleep_of(pool.device), _after_wake)
            _equipped.add(pool.handle)
        for entry in _mapping_hooks.values():
            if pool.handle not in entry[3]:
                entry[3][pool.handle] = (pool, pool.add_tag_hooks(entry[0], entry[1], entry[2]))


def _before_sleep_of(device: int):
    def before_sleep(level, tags: list[str]) -> None:
        remark.remark_now(device, tags, getattr(_local, "policy", remark.pool_class))
        for tag, hook in _hooks_of(tags, 1):
            hook(tag, int(level))

    return before_sleep


def _after_wake(tags: list[str], ok: bool) -> None:
    for tag, hook in _hooks_of(tags, 2):
        hook(tag, ok)


def _hooks_of(tags: list[str], which: int) -> list:
    with _lock:
        return [(tag, hook[which]) for tag in tags for hook in _tag_hooks.values() if hook[0] == tag and hook[which]]


routing.equip_device_pools(equip)


# -- tag hooks ---------------------------------------------------------------------------------


def _checked(what: str, tag, hooks: dict) -> None:
    if not isinstance(tag, str) or not tag:
        raise InvalidType(f"{what}: tag {tag!r} is not a non-empty string")
    if all(hook is None for hook in hooks.values()):
        first, second = hooks
        raise InvalidType(f"{what}: give {first}, {second} or both")
    for name, hook in hooks.items():
        if hook is not None and not callable(hook):
            raise InvalidType(f"{what}: {name} must be callable or None, not {type(hook).__name__}")


def add_tag_hooks(
    tag: str,
    before_sleep: Callable[[str, int], None] | None = None,
    after_wake: Callable[[str, bool], None] | None = None,
) -> int:
    """Callbacks around every sleep and wake of `tag` on any device: ``before_sleep(tag, level)``
    inside every sleep of the tag (levels 1 and 2), after the re-mark and before anything moves
    (an exception aborts that device's sleep with nothing moved, and the sleep raises it);
    ``after_wake(tag, ok)`` after every wake of the tag. Returns the id for remove_tag_hooks."""
    _checked("add_tag_hooks", tag, {"before_sleep": before_sleep, "after_wake": after_wake})
    with _lock:
        hook_id = next(_ids)
        _tag_hooks[hook_id] = (tag, before_sleep, after_wake)
    for pool in routing.device_pools().values():
        equip(pool)
    return hook_id


def remove_tag_hooks(hook_id: int) -> None:
    with _lock:
        if _tag_hooks.pop(hook_id, None) is None:
            raise KeyError(f"remove_tag_hooks: {hook_id} is not a tag hook (removed twice?)")


# -- mapping hooks: the C pool's tag hooks on every device pool --------------------------------


def add_mapping_hooks(
    tag: str,
    before_unmap: Callable[[str], None] | None = None,
    after_map: Callable[[str], None] | None = None,
) -> int:
    """The C pool's tag hooks (Pool.add_tag_hooks, torpor_add_tag_hooks) on every device pool
    PyTorch uses, now and later, for state that lives exactly as long as the tag's mapping:
    ``before_unmap(tag)`` in every sleep or discard that unmaps some of `tag`, before anything
    moves (an exception aborts the sleep, nothing moved); ``after_map(tag)`` after every wake,
    once per device pool, when `tag` is fully mapped there (idempotent: it runs for tags that
    never slept too), and after a failed sleep for each tag whose before_unmap ran and that it
    left mapped. Returns the id for remove_mapping_hooks."""
    _checked("add_mapping_hooks", tag, {"before_unmap": before_unmap, "after_map": after_map})
    with _lock:
        hook_id = next(_ids)
        _mapping_hooks[hook_id] = [tag, before_unmap, after_map, {}]
    for pool in routing.device_pools().values():
        equip(pool)
    return hook_id


def remove_mapping_hooks(hook_id: int) -> None:
    with _lock:
        entry = _mapping_hooks.pop(hook_id, None)
    if entry is None:
        raise KeyError(f"remove_mapping_hooks: {hook_id} is not a mapping hook (removed twice?)")
    for pool, c_id in entry[3].values():
        pool.remove_tag_hooks(c_id)


__all__ = [
    "add_mapping_hooks",
    "add_tag_hooks",
    "equip",
    "remove_mapping_hooks",
    "remove_tag_hooks",
    "sleeping",
]
