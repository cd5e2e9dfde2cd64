"""The seam for engine modes: what a mode that gives an engine its own sleep-mode API
(torpor.vllm: vLLM's CuMemAllocator; torpor.tms: torch_memory_saver's API; torpor.sglang) uses of
torpor, and all it uses. A new mode (an RL framework's) is one module written against this one;
it touches neither torpor.torch nor the C library. This module only names the contract: each
name is defined where its concept lives (torpor.torch, torpor.errors, torpor.pool).

    from torpor import engine

    with engine.use_pool("weights"):               # route a tag (and a class) to torpor
        model = load_model()
    engine.register_parameters(model)              # parameters: discardable at level 2
    engine.hooks.add_tag_hooks("kv_cache", before_sleep=drop_views, after_wake=rebuild_views)
    with engine.as_runtime_errors():               # the engine catches RuntimeError
        engine.sleep(1, ["weights"], policy=engine.keep_everything)
        engine.sleep(2, ["kv_cache"])
        engine.wake_up(None)

Sleep and wake (the PyTorch pools of every device):

- ``sleep(level, tags, policy=None, collect=1) -> {device: report}``: torpor.sleep with a class
  policy, ``ClassPolicy``: ``policy(tag, memory_class, has_parameters) -> MemoryClass`` decides
  the class of the allocated blocks of each sleeping tag (``memory_class``: the class its MemPool
  allocates; ``has_parameters``: whether registered parameters lie in the tag's segments on the
  device). None is ``pool_class`` (each MemPool's class); ``keep_everything`` keeps every byte.
  The policy applies inside the pool's sleep (the hook bus's re-mark), so its marks and the sleep
  are one step.
- ``wake_up(tags)``, ``tag_states()``, ``stats()``, ``release_host_store()``: as torpor's.
  ``fill_on_wake(fill)``: a block whose wakes fill discarded bytes with `fill` on every pool.

Memory:

- ``use_pool(tag, memory_class=None, device=None, exportable=False)``: allocations of the block in
  torpor under that tag and class (torpor.use_pool); ``export_handles(tags, device, kind)``: the
  handles of that memory for a KV transport (torpor.exports; a transport re-exports in an
  after_map mapping hook, since a wake maps new memory).
- ``reconfigure(**changes)``: torpor.configure with the options last configured, `changes`
  changed (the fields of ``PoolOptions``, the one description of the pool options; before the
  first allocation).
- ``graphs``: CUDA graphs in torpor's graph pools (torpor.torch.graphs): ``graph(...)`` (a capture,
  torpor.graph), ``capture_into(tag, memory_class)`` (every capture of the block in that graph
  pool), ``capturing_into()``, ``release_graph_pool(tag)``, ``is_graph_tag(tag)``,
  ``nccl_graph_register_off()``.
- ``register_parameters(module, preserve)``: as torpor.register_parameters; ``add_preserve(globs)``:
  its preserve globs without a module. ``tag_at(device, address)``: the tag of the use_pool
  segment holding an address.

Hooks: ``hooks`` is the hook bus (torpor.torch.hook_bus), which equips every device pool with one
sleep hook that runs the re-mark, then the tag hooks, and with the mapping hooks:

- ``hooks.add_tag_hooks(tag, before_sleep=None, after_wake=None) -> id``: ``before_sleep(tag,
  level)`` inside every sleep of `tag` (levels 1 and 2), after the re-mark and before anything
  moves (an exception aborts that device's sleep with nothing moved, and the sleep raises it);
  ``after_wake(tag, ok)`` after every wake of `tag`. ``hooks.remove_tag_hooks(id)``.
- ``hooks.add_mapping_hooks(tag, before_unmap=None, after_map=None) -> id``: the C pool's tag
  hooks (torpor_add_tag_hooks, one hook bus for C, C++ and Python) on every device pool, for state
  that lives exactly as long as the tag's mapping (vLLM's register_tag_hooks maps onto it):
  ``before_unmap(tag)`` before anything moves and before the sleep hook; ``after_map(tag)`` after
  every wake that leaves `tag` fully mapped (idempotent). ``hooks.remove_mapping_hooks(id)``.

The host store before the first sleep: ``intend_sleep(mode, plan, default_level)`` declares the
mode's sleep so that the host store is page-locked in the background once the model is loaded
(torpor.torch.prepare; TORPOR_PREPARE_SLEEP): ``plan(level, tags) -> [(level, tags, policy),
...]`` are the sleeps the mode's own sleep at `level` makes on a device pool holding `tags`.
``prepare_for_sleep()`` runs that preparation now (it also runs when a tag's outermost use_pool
block exits and after register_parameters).

Errors: ``runtime_error(e)``, ``as_runtime_errors()``: torpor's typed errors as RuntimeError
subclasses too (vLLM and its tests catch RuntimeError), with torpor's message (torpor.errors).

What torch_memory_saver's API needs of PyTorch and of the C library: ``cuda_torch()`` (PyTorch,
when it sees a device), ``library_path()``, ``memory_margin()`` / ``set_memory_margin(n)``
(device memory a new segment must leave free), ``read_host_copy(device, address, nbytes, dst)``
(the host copy of a tensor's bytes).
"""

from __future__ import annotations

from ._lib import library_path
from .errors import as_runtime_errors, runtime_error
from .pool import PoolOptions
from .torch import graphs
from .torch import hook_bus as hooks
from .torch.api import (
    export_handles,
    fill_on_wake,
    memory_margin,
    read_host_copy,
    reconfigure,
    release_host_store,
    set_memory_margin,
)
from .torch.api import sleep_with_policy as sleep
from .torch.api import stats, tag_states, use_pool, wake_up
from .torch.parameters import add_preserve, register_parameters
from .torch.prepare import after_load as prepare_for_sleep
from .torch.prepare import intend as intend_sleep
from .torch.remark import ClassPolicy, keep_everything, pool_class
from .torch.routing import tag_at
from .torch.runtime import cuda_torch

__all__ = [
    "ClassPolicy",
    "PoolOptions",
    "add_preserve",
    "as_runtime_errors",
    "cuda_torch",
    "export_handles",
    "fill_on_wake",
    "graphs",
    "hooks",
    "intend_sleep",
    "keep_everything",
    "library_path",
    "memory_margin",
    "pool_class",
    "prepare_for_sleep",
    "read_host_copy",
    "reconfigure",
    "register_parameters",
    "release_host_store",
    "runtime_error",
    "set_memory_margin",
    "sleep",
    "stats",
    "tag_at",
    "tag_states",
    "use_pool",
    "wake_up",
]
