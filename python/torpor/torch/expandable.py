"""Expandable segments off while torpor's pools allocate.

With expandable_segments:True (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF) PyTorch maps
segments itself instead of asking a pool's allocator (or refuses, depending on the version).
So every block that routes allocations to a torpor MemPool turns them off while any such block
is open, and back on after the last one exits. Nested and concurrent uses count. PyTorch parses
its settings as a whole, resetting every item the string leaves out, so both writes are the
user's whole settings string with only expandable_segments changed, and the exit writes it back
as it was (environment.with_alloc_flag).
"""

from __future__ import annotations

import contextlib
import threading

from .. import environment

_lock = threading.Lock()
_depth = 0  # blocks open now that turned expandable segments off (every thread)


def requested() -> bool:
    """Whether the environment asks PyTorch for expandable segments."""
    return environment.alloc_conf_true("expandable_segments")


def _set_allocator_settings(torch, settings: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(settings)


@contextlib.contextmanager
def segments_off(torch):
    """Inside: expandable segments off (when the environment turned them on)."""
    global _depth
    if not requested():
        yield
        return
    # The settings in force, expandable segments on (as requested() found them asked for).
    conf = environment.with_alloc_flag(environment.alloc_conf(), "expandable_segments", True)
    with _lock:
        if _depth == 0:
            _set_allocator_settings(torch, environment.with_alloc_flag(conf, "expandable_segments", False))
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _set_allocator_settings(torch, conf)
