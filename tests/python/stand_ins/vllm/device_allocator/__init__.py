"""vllm.device_allocator: the sleep-mode allocator protocol and the platform's instance.

Generation mrv2 adds what the newest vLLM defines here, read (not copied) from
``vllm/device_allocator/__init__.py`` as stored in the code index: ``DEFERRABLE_TAGS`` and
``register_tag_hooks`` with the two runners of the hooks (index id 71436949636: before_unmap of
each tag in `tags` that still has mapped allocations; after_map of every hooked tag with nothing
asleep, on every wake), and the graph-pool routing of Model Runner V2 (index id 71337998459:
``use_cudagraph_pool(pool, vllm_config)`` enters ``CuMemAllocator.get_instance()
.use_cudagraph_pool(pool)`` when sleep mode is on; ``is_capturing_into_cumem_pool()`` compares
``allocator.current_tag`` with ``CuMemAllocator.cudagraph_tag``). torpor's plugin replaces
register_tag_hooks; the runners stay vLLM's, for vLLM's own allocator."""

import contextlib
from contextlib import AbstractContextManager
from typing import Protocol

from vllm import GENERATION


class MemAllocator(Protocol):
    def use_memory_pool(self, tag=None) -> AbstractContextManager:
        ...

    def sleep(self, offload_tags=None) -> None:
        ...

    def discard(self, tags) -> None:
        ...

    def wake_up(self, tags=None) -> None:
        ...

    def get_current_usage(self) -> int:
        ...


def get_mem_allocator_instance() -> MemAllocator:
    from vllm.device_allocator.cumem import CuMemAllocator

    return CuMemAllocator.get_instance()


if GENERATION == "mrv2":
    DEFERRABLE_TAGS = ("weights", "kv_cache")
    _tag_hooks = {}

    def register_tag_hooks(tag, before_unmap, after_map):
        hooks = (before_unmap, after_map)
        _tag_hooks.setdefault(tag, []).append(hooks)
        return lambda: _tag_hooks[tag].remove(hooks)

    def run_before_unmap_hooks(allocations, tags=None):
        mapped = {d.tag for d in allocations if not d.is_asleep and (tags is None or d.tag in tags)}
        for tag in mapped & _tag_hooks.keys():
            for before_unmap, _ in _tag_hooks[tag]:
                before_unmap()

    def run_after_map_hooks(allocations):
        asleep = {d.tag for d in allocations if d.is_asleep}
        for tag in _tag_hooks.keys() - asleep:
            for _, after_map in _tag_hooks[tag]:
                after_map()

    def use_cudagraph_pool(pool, vllm_config):
        if vllm_config.model_config.enable_sleep_mode:
            from vllm.device_allocator.cumem import CuMemAllocator

            return CuMemAllocator.get_instance().use_cudagraph_pool(pool)
        return contextlib.nullcontext(pool)

    def is_capturing_into_cumem_pool():
        from vllm.device_allocator.cumem import CuMemAllocator

        allocator = CuMemAllocator.instance
        return allocator is not None and allocator.current_tag == CuMemAllocator.cudagraph_tag
