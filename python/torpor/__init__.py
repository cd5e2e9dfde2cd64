"""torpor: a sleep-mode-aware GPU memory pool allocator on CUDA virtual memory.

Two layers:

- torpor.Pool: one device's pool through the C API (ctypes), no PyTorch needed: alloc, free,
  mark, sleep, wake_up, stats, copy. Runs on the host backend anywhere.
- The PyTorch embedding (the package torpor.torch, re-exported here): use_pool(tag),
  register_parameters(module, preserve), sleep(level=1, tags=None), wake_up(tags=None),
  stats(), release_host_store(), prepare_host_store(). PyTorch is imported on first use only.
  use_pool(tag, exportable=True) gives memory with shareable handles, and export_handles(tags)
  hands them to a KV transport (torpor.exports: ExportedChunk, who owns the descriptors).
  CUDA graphs in torpor (torpor.torch.graphs, re-exported here): graph(cuda_graph, tag=...) for
  torch.cuda.graph, graph_pool(tag) for torch.cuda.graph(..., pool=...), mark_state(tensor);
  their memory is released at sleep and the same graphs replay after wake.

Engines that have a sleep-mode API of their own keep it, each a mode written against one seam,
torpor.engine (sleep and wake with a class policy, routing a tag, registering parameters, tag
hooks), so a new mode touches neither torpor.torch nor the C library:

- torpor.vllm: vLLM's allocator (CuMemAllocator, also here) with vLLM's semantics;
  torpor.vllm_plugin is the vLLM plugin that puts it in every vLLM process (TORPOR_VLLM=1).
- torpor.distributed: collective sleep / wake over the engine's own torch.distributed group
  (Group.from_torch(), sleep(pool, level, group=...), wake_up(pool, group=...)).
- torpor.tms: torch_memory_saver's API (the torch_memory_saver singleton) for SGLang and the
  RL frameworks on it.

libtorpor.so is found through TORPOR_LIBRARY, then a copy bundled at install time, then the
repository's build directories, then the system path (see torpor._lib). The environment
variables the package reads are one table, torpor.environment.
"""

from . import _lib, distributed, errors, tags, tms, vllm
from ._lib import cmake_dir, last_error, library_path, library_version
from .errors import (
    DriverError,
    InternalError,
    InvalidArgument,
    InvalidHandle,
    InvalidState,
    InvalidType,
    LibraryNotFound,
    OutOfMemory,
    Timeout,
    TorchUnavailable,
    TorporError,
    Unavailable,
)
from .exports import ExportedChunk, ExportedHandles
from .pool import MemoryClass, Pool
from .torch import (
    GraphPool,
    Registration,
    configure,
    export_handles,
    graph,
    graph_memory,
    graph_pool,
    graph_pools,
    mark_state,
    memory_nodes,
    pools,
    prepare_host_store,
    register_parameters,
    release_host_store,
    sleep,
    stats,
    use_pool,
    wake_up,
)
from .vllm import CuMemAllocator

__version__ = _lib.package_version()  # the package's version (VERSION), not an API name

__all__ = [
    "CuMemAllocator",
    "DriverError",
    "ExportedChunk",
    "ExportedHandles",
    "GraphPool",
    "InternalError",
    "InvalidArgument",
    "InvalidHandle",
    "InvalidState",
    "InvalidType",
    "LibraryNotFound",
    "MemoryClass",
    "OutOfMemory",
    "Pool",
    "Registration",
    "Timeout",
    "TorchUnavailable",
    "TorporError",
    "Unavailable",
    "cmake_dir",
    "configure",
    "distributed",
    "errors",
    "export_handles",
    "graph",
    "graph_memory",
    "graph_pool",
    "graph_pools",
    "last_error",
    "library_path",
    "library_version",
    "mark_state",
    "memory_nodes",
    "pools",
    "prepare_host_store",
    "register_parameters",
    "release_host_store",
    "sleep",
    "stats",
    "tags",
    "tms",
    "use_pool",
    "vllm",
    "wake_up",
]
