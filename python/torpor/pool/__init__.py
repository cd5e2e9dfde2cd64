"""torpor.Pool and what it is made of, over the C API (ctypes), without PyTorch:

- pool: Pool (one device's pool: alloc, free, mark, sleep, wake_up, hooks, stats, copies),
  MemoryClass (the library's classes) and the tag lists the calls take;
- options: PoolOptions, the one description of the pool options (torpor_pool_options), each
  row's check and C conversion;
- callbacks: Python callables as the C API's sleep hooks and tag hooks (the trampolines, and the
  exception a hook raised, kept for the thread that slept).
"""

from .options import LIBRARY_DEFAULT, CPoolOptions, PoolOptions
from .pool import ClassLike, MemoryClass, Pool, Tags, marks_generation, tag_list, to_memory_class

__all__ = [
    "LIBRARY_DEFAULT",
    "ClassLike",
    "CPoolOptions",
    "MemoryClass",
    "Pool",
    "PoolOptions",
    "Tags",
    "marks_generation",
    "tag_list",
    "to_memory_class",
]
