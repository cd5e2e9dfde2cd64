"""torpor: a sleep-mode-aware GPU memory pool allocator on CUDA virtual memory.

Two layers:

- torpor.Pool: one device's pool through the C API (ctypes), no PyTorch needed: alloc, free,
  mark, sleep, wake_up, stats, copy. Runs on the host backend anywhere.
- The PyTorch embedding (torpor.torch_pools, re-exported here): use_pool(tag),
  register_parameters(module, preserve), sleep(level=1, tags=None), wake_up(tags=None),
  stats(), release_host_store(), prepare_host_store();
  and CuMemAllocator, vLLM's interface. PyTorch is imported on first use only.

libtorpor.so is found through TORPOR_LIBRARY, then a copy bundled at install time, then the
repository's build directories, then the system path (see torpor._lib).
"""

from . import errors, tags
from ._lib import last_error, library_path
from .compat import CuMemAllocator
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
from .torch_pools import (
    Registration,
    configure,
    pools,
    prepare_host_store,
    register_parameters,
    release_host_store,
    sleep,
    stats,
    use_pool,
    wake_up,
)

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
    "errors",
    "last_error",
    "library_path",
    "pools",
    "prepare_host_store",
    "register_parameters",
    "release_host_store",
    "sleep",
    "stats",
    "tags",
    "use_pool",
    "wake_up",
]
