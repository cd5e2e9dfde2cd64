"""vllm.device_allocator: the sleep-mode allocator protocol and the platform's instance."""

from contextlib import AbstractContextManager
from typing import Protocol


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
