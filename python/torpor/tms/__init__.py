"""torch_memory_saver mode: the ``torch_memory_saver`` singleton's API over torpor, for SGLang and
the RL frameworks built on it (they pause "weights", "kv_cache" and "cuda_graph").

    from torpor.tms import torch_memory_saver       # or, once torpor.tms.install() ran (or with
                                                    # torpor.tms.shim_path() on PYTHONPATH):
                                                    # from torch_memory_saver import torch_memory_saver
    with torch_memory_saver.region(tag="kv_cache"):
        kv = torch.empty(n, device="cuda")           # discarded on pause
    torch_memory_saver.pause(); torch_memory_saver.resume()

The package, each module depending only on those above it:

- library: libtorpor_preload.so, torch_memory_saver's C entry points over torpor (where it is,
  whether this process preloaded it, its prototypes, its per-thread region settings);
- regions: what the regions share in either hook mode (tags, MemPools, retain_cpu_backup, the
  host-store settings their backups ask of torpor's pools);
- torch_mode, preload_mode: one strategy per hook mode ("torch": PyTorch's pluggable allocator
  over torpor.engine; "preload": the library on LD_PRELOAD interposing cudaMalloc);
- saver: the public API, TorchMemorySaver and its singleton, with torch_memory_saver's semantics
  (its module note says them), delegating to the hook mode in force;
- shim: ``import torch_memory_saver`` resolving here (install, shim_path, configure_subprocess).

``python3 -m torpor.tms --shim-path`` prints the shim directory, ``--preload-path`` the library.
"""

from .library import PRELOAD_NAME, preload_library_path
from .regions import default_backup_backend
from .saver import TorchMemorySaver, torch_memory_saver
from .shim import SHIM_DIR, configure_subprocess, install, shim_path
from .torch_mode import graph_tag

__all__ = [
    "PRELOAD_NAME",
    "SHIM_DIR",
    "TorchMemorySaver",
    "configure_subprocess",
    "default_backup_backend",
    "graph_tag",
    "install",
    "preload_library_path",
    "shim_path",
    "torch_memory_saver",
]
