"""torpor: a sleep-mode-aware GPU memory pool allocator on CUDA virtual memory.

Two layers:

- torpor.Pool: one device's pool through the C API (ctypes), no PyTorch needed: alloc, free,
  mark, sleep, wake_up, stats, copy. Runs on the host backend anywhere.
- The PyTorch embedding (torpor.torch_pools, re-exported here): use_pool(tag),
  register_parameters(module, preserve), sleep(level=1, tags=None), wake_up(tags=None),
  stats(). PyTorch is imported on first use only.

Engines that have a sleep-mode API of their own keep it:

- torpor.vllm: vLLM's allocator (CuMemAllocator, also here) with vLLM's semantics;
  torpor.vllm_plugin is the vLLM plugin that puts it in every vLLM process (TORPOR_VLLM=1).
- torpor.distributed: collective sleep / wake over the engine's own torch.distributed group
  (Group.from_torch(), sleep(pool, level, group=...), wake_up(pool, group=...)).
- torpor.tms: torch_memory_saver's API (the torch_memory_saver singleton) for SGLang and the
  RL frameworks on it.

libtorpor.so is found through TORPOR_LIBRARY, then a copy bundled at install time, then the
repository's build directories, then the system path (see torpor._lib).
"""

from . import distributed, errors, tags, tms, vllm
from ._lib import last_error, library_path
from .errors import (
    DriverError,
    InternalError,
    InvalidArgument,
    InvalidHandle,
    InvalidState,
    LibraryNotFound,
    OutOfMemory,
    Timeout,
    TorchUnavailable,
    TorporError,
    Unavailable,
)
from .pool import MemoryClass, Pool
from .torch_pools import Registration, configure, pools, register_parameters, sleep, stats, use_pool, wake_up
from .vllm import CuMemAllocator

__version__ = "0.1.0"

__all__ = [
    "CuMemAllocator",
    "DriverError",
    "InternalError",
    "InvalidArgument",
    "InvalidHandle",
    "InvalidState",
    "LibraryNotFound",
    "MemoryClass",
    "OutOfMemory",
    "Pool",
    "Registration",
    "Timeout",
    "TorchUnavailable",
    "TorporError",
    "Unavailable",
    "configure",
    "distributed",
    "errors",
    "last_error",
    "library_path",
    "pools",
    "register_parameters",
    "sleep",
    "stats",
    "tags",
    "tms",
    "use_pool",
    "vllm",
    "wake_up",
]
