"""The pool tags torpor's clients share by convention (the names of vLLM's sleep mode): the C++
API's torpor/tags.hpp and torpor.h's TORPOR_TAG_*, for Python. To the pool a tag is any
non-empty string; what sleep does with the bytes follows their class, not their tag.
"""

WEIGHTS = "weights"  # parameters and what is computed at load; woken first, then reloaded
KV_CACHE = "kv_cache"  # KV cache and activations (class cache by default in use_pool); woken last
CUDA_GRAPH = "cuda_graph"  # memory that captured CUDA graphs own

__all__ = ["CUDA_GRAPH", "KV_CACHE", "WEIGHTS"]
