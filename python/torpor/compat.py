"""vLLM's CuMemAllocator interface over torpor, so a vLLM-style worker switches allocators by
changing one import:

    from torpor import CuMemAllocator   # instead of vllm.device_allocator.cumem
    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        model = load_model()
    allocator.sleep(offload_tags=("weights",) if level == 1 else ())
    allocator.wake_up(tags)

Semantics map onto torpor's levels: tags in offload_tags sleep at level 1 (parameters and
state offloaded), the others at level 2. One difference, on purpose: vLLM discards every byte
of a tag it does not offload; torpor still keeps state (buffers, flags, anything not marked
parameter or cache). Call torpor.register_parameters(model) after loading so level 2 can
discard the parameters themselves; without it a weights tag is all state and is offloaded.
"""

from __future__ import annotations

from . import torch_pools
from .pool import MemoryClass


class CuMemAllocator:
    """A process-wide singleton, as vLLM's (get_instance())."""

    instance: "CuMemAllocator | None" = None
    default_tag: str = "default"

    @staticmethod
    def get_instance() -> "CuMemAllocator":
        if CuMemAllocator.instance is None:
            CuMemAllocator.instance = CuMemAllocator()
        return CuMemAllocator.instance

    def use_memory_pool(self, tag: str | None = None):
        return torch_pools.use_pool(tag or self.default_tag)

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        if offload_tags is None:
            offload_tags = (self.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        known = sorted({t for s in torch_pools.stats().values() for t in s["tags"]})
        torch_pools.sleep(1, [t for t in known if t in offload_tags])
        torch_pools.sleep(2, [t for t in known if t not in offload_tags])

    def wake_up(self, tags: list[str] | None = None) -> None:
        torch_pools.wake_up(tags)

    def get_current_usage(self) -> int:
        """Bytes allocated in the pools (PyTorch's segments), asleep or not."""
        return sum(
            c["allocated_bytes"]
            for s in torch_pools.stats().values()
            for t in s["tags"].values()
            for c in t["classes"].values()
        )


__all__ = ["CuMemAllocator", "MemoryClass"]
