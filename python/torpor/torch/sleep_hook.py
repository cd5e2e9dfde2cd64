"""The re-mark inside the pool's sleep. torpor.torch adds a sleep hook (torpor_add_sleep_hook)
to the torpor pool of every device it makes a MemPool on; before that pool's sleep moves
anything, the hook re-marks the sleeping tags from PyTorch's snapshot (torpor.torch.remark),
with the class policy of the sleep in progress on this thread (``with_policy``; by default a
MemPool's blocks keep its class). So every sleep of those pools classes PyTorch's blocks
first: torpor.sleep, an engine mode's (torpor.engine), and torpor.distributed's collective
sleep, which runs in libtorpor. A re-mark that raises aborts the sleep with nothing moved.
"""

from __future__ import annotations

import contextlib
import threading

from ..pool import Pool
from . import parameters, remark, routing
from .runtime import torch_module

_lock = threading.Lock()
_hooked: set = set()  # handles of the device pools that have the hook (C pools live for the process)
_local = threading.local()  # .policy: the ClassPolicy of the sleep this thread is in


@contextlib.contextmanager
def with_policy(policy: remark.ClassPolicy):
    """Inside: the sleeps this thread makes re-mark with `policy`."""
    previous = getattr(_local, "policy", remark.pool_class)
    _local.policy = policy
    try:
        yield
    finally:
        _local.policy = previous


def remark_now(device: int, tags: list[str], policy: remark.ClassPolicy) -> None:
    """The re-mark that a sleep of `tags` on `device` with `policy` makes first, now
    (torpor.torch.prepare sizes the host store from the classes it leaves)."""
    if not any(routing.pools_of(t, device) for t in tags):
        return  # tags of the C API alone (or a registry reset by a test): nothing of PyTorch's
    torch = torch_module()
    spans = parameters.registered_spans().get(device, [])
    states = remark.state_spans().get(device, [])
    counters = remark.block_counters(torch, device)
    remark.refresh_classes(torch, device, tags, spans, states, policy, counters)


def _remark(device: int):
    def before_sleep(level, tags: list[str]) -> None:
        remark_now(device, tags, getattr(_local, "policy", remark.pool_class))

    return before_sleep


def install(pool: Pool) -> None:
    """Give `pool` (a device's torpor pool) the re-mark hook, once."""
    with _lock:
        if pool.handle in _hooked:
            return
        pool.add_sleep_hook(_remark(pool.device))
        _hooked.add(pool.handle)


routing.on_new_mempool(install)
