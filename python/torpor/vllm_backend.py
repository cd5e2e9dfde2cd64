"""The sleep-mode backend "torpor" for vLLM versions with pluggable sleep-mode backends
(``vllm.device_allocator.sleep_mode_backend``: SleepModeBackend, SleepModeBackendFactory).

torpor.vllm_plugin registers it (TORPOR_VLLM=1); vLLM imports this module only when the
backend is selected (``--sleep-mode-backend torpor``). It drives torpor.vllm.CuMemAllocator, the
allocator the plugin put under vLLM's name, with vLLM's level semantics: level 1 offloads the
"weights" tag and discards the rest, level 2 offloads nothing (with registered parameters, torpor
keeps every byte that is not a parameter; see torpor.vllm). Unlike vLLM's default backend of some
versions, it supports discard(tags) (vLLM's release of the KV cache between rollouts).
"""

from __future__ import annotations

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

from .vllm import CuMemAllocator


def _allocator() -> CuMemAllocator:
    import vllm.device_allocator.cumem as cumem

    if cumem.CuMemAllocator is not CuMemAllocator:
        raise RuntimeError(
            "sleep-mode backend 'torpor' needs TORPOR_VLLM=1 in every vLLM process: the torpor plugin then "
            "puts torpor's allocator under vllm.device_allocator.cumem.CuMemAllocator, where vLLM allocates "
            "the weights and the KV cache; without it they are in vLLM's own allocator"
        )
    return CuMemAllocator.get_instance()


class TorporSleepModeBackend(SleepModeBackend):
    """vLLM's SleepModeBackend over torpor's allocator."""

    def suspend(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level {level!r}: the torpor backend sleeps at level 1 or 2")
        allocator = _allocator()
        self._state = "SUSPENDED"
        allocator.sleep(offload_tags=("weights",) if level == 1 else ())

    def resume(self, tags: list[str] | None = None) -> None:
        allocator = _allocator()
        self._state = "RESUMING"
        allocator.wake_up(tags)
        self._state = "SUSPENDED" if allocator.is_asleep() else "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        _allocator().discard(tags)
        self._state = "SUSPENDED"

    @classmethod
    def is_supported(cls) -> bool:
        try:
            import torch

            return torch.cuda.is_available()
        except ImportError:
            return False

    @classmethod
    def preserves_communicators(cls) -> bool:
        return True  # communicators' buffers are outside torpor's pools; nothing touches them


__all__ = ["TorporSleepModeBackend"]
