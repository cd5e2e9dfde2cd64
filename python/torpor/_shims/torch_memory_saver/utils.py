"""torch_memory_saver.utils' helpers that its tests import (is_xpu, change_env; utils.py at
fzyzcjy/torch_memory_saver 4a43c97)."""

import functools

from torpor import environment


@functools.lru_cache(maxsize=1)
def is_xpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def change_env(key: str, value: str):
    """`key` set to `value` inside, its previous value (or absence) after."""
    return environment.replaced(key, value)
