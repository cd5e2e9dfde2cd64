"""The sleep-mode backend "torpor" for vLLM versions with pluggable sleep-mode backends
(``vllm.device_allocator.sleep_mode_backend``: SleepModeBackend, SleepModeBackendFactory).

torpor.vllm_plugin registers it (TORPOR_VLLM=1); vLLM imports this module only when the
backend is selected (``--sleep-mode-backend torpor``). It drives torpor.vllm.CuMemAllocator, the
allocator the plugin put under vLLM's name, with vLLM's level semantics: level 1 offloads the
"weights" tag and discards the rest, level 2 offloads nothing (with registered parameters, torpor
keeps every byte that is not a parameter; see torpor.vllm). Unlike vLLM's default backend of some
versions, it supports discard(tags) (vLLM's release of the KV cache between rollouts).

Both generations of vLLM's backend contract, as read from vLLM's public sources
(``vllm/device_allocator/sleep_mode_backend.py``, index id 55111445073 for the newest; the older
one at commit 0ffa2a2473a8d400321525f6cd44a50929066ef9, tests/python/stand_ins' v1 generation):

- ``suspend(level)`` (older) and ``suspend(level, tags=None)`` (newer): `tags` offloads exactly
  those tags and discards the rest (vLLM's CuMemTagBackend precedence: the call's tags, then the
  constructor's ``suspend_tags``, then the level's default); ``suspended_tags()``: the tags the
  last suspend put to sleep that are still asleep, None when running;
  ``supports_selective_offload()`` is True.
- ``resume(tags=None)``: wakes those tags (None: every sleeping tag). torpor's wake of a tag that
  is awake changes nothing, so no selective wake can corrupt live memory, and level-2 weights may
  be woken before the reload (their bytes are undefined until it, as at level 2 in vLLM).
- Capability flags under both names: ``preserves_communicators`` and
  ``preserves_graphs_with_communicators`` (older, commit 0ffa2a24), ``preserves_nccl``,
  ``preserves_graphs_with_nccl``, ``preserves_compiled_artifacts`` (newer; all True: torpor
  touches neither communicators nor the process, and every address stays), and
  ``supports_durable_storage`` (False: host copies live in this process).
- Backend options (``model_config.sleep_mode_backend_options``, passed to the constructor):
  ``suspend_tags``, ``poison_discarded_pages`` and ``release_host_memory`` (vLLM's variables of
  the same meaning, as torpor.vllm documents; the option wins over the variable),
  ``preserve`` (parameter-name globs kept through level 2, as ``--sleep-preserve-parameter-names``)
  and ``memory_margin_bytes`` (device memory a new segment must leave free). An unknown option is
  a TypeError naming the accepted ones; options of the pools themselves (fill_on_wake, the host
  store) are fixed before the model loads, so they are refused with the call that sets them.
"""

from __future__ import annotations

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

from . import engine
from .vllm import CuMemAllocator

# Pool options (torpor's one description of them) a backend cannot change once the model is loaded:
# the message says where to set them instead.
_POOL_OPTIONS = engine.PoolOptions.names()
_OPTIONS = ("suspend_tags", "poison_discarded_pages", "release_host_memory", "preserve", "memory_margin_bytes")


def _allocator() -> CuMemAllocator:
    import vllm.device_allocator.cumem as cumem

    if cumem.CuMemAllocator is not CuMemAllocator:
        raise RuntimeError(
            "sleep-mode backend 'torpor' needs TORPOR_VLLM=1 in every vLLM process: the torpor plugin then "
            "puts torpor's allocator under vllm.device_allocator.cumem.CuMemAllocator, where vLLM allocates "
            "the weights and the KV cache; without it they are in vLLM's own allocator"
        )
    return CuMemAllocator.get_instance()


def _tags(value, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    out = tuple(value)
    if not all(isinstance(t, str) and t for t in out):
        raise ValueError(f"sleep-mode backend 'torpor': {what} {value!r} is not a list of non-empty tag names")
    return out


class TorporSleepModeBackend(SleepModeBackend):
    """vLLM's SleepModeBackend over torpor's allocator (see the module note)."""

    def __init__(self, **options) -> None:
        super().__init__()
        unknown = sorted(set(options) - set(_OPTIONS))
        pool = [k for k in unknown if k in _POOL_OPTIONS]
        if pool:
            raise TypeError(
                f"sleep-mode backend 'torpor': {', '.join(pool)} is an option of torpor's pools, fixed when the first "
                "one is made: call torpor.configure(...) in the worker before the model loads"
            )
        if unknown:
            raise TypeError(
                f"sleep-mode backend 'torpor': unknown option(s) {', '.join(unknown)} (accepted: {', '.join(_OPTIONS)})"
            )
        self.suspend_tags = _tags(options.get("suspend_tags"), "suspend_tags")
        self._suspended: tuple[str, ...] | None = None
        allocator = _allocator()
        for name in ("poison_discarded_pages", "release_host_memory"):
            if options.get(name) is not None:
                setattr(allocator, name, bool(options[name]))
        if options.get("preserve"):
            engine.add_preserve(options["preserve"])
        if options.get("memory_margin_bytes") is not None:
            engine.set_memory_margin(options["memory_margin_bytes"])

    def suspend(self, level: int = 1, tags: tuple[str, ...] | None = None) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level {level!r}: the torpor backend sleeps at level 1 or 2")
        offload = _tags(tags, "tags")
        if offload is None:
            offload = self.suspend_tags
        if offload is None:
            offload = ("weights",) if level == 1 else ()
        allocator = _allocator()
        awake = {t for t, asleep in engine.tag_states().items() if not asleep}
        allocator.sleep(offload_tags=offload)  # raises before any bookkeeping: still RUNNING
        states = engine.tag_states()
        self._suspended = tuple(sorted(t for t in awake if states.get(t)))
        self._state = "SUSPENDED"

    def resume(self, tags: list[str] | None = None) -> None:
        allocator = _allocator()
        self._state = "RESUMING"
        try:
            allocator.wake_up(tags)
        except BaseException:
            self._state = "SUSPENDED"
            raise
        self._refresh()

    def discard(self, tags: tuple[str, ...]) -> None:
        _allocator().discard(tags)
        self._state = "SUSPENDED"

    def suspended_tags(self) -> tuple[str, ...] | None:
        self._refresh()
        return self._suspended

    def _refresh(self) -> None:
        states = engine.tag_states()
        if self._suspended is not None:
            self._suspended = tuple(t for t in self._suspended if states.get(t)) or None
        self._state = "SUSPENDED" if any(states.values()) else "RUNNING"

    @classmethod
    def is_supported(cls) -> bool:
        try:
            import torch

            return torch.cuda.is_available()
        except ImportError:
            return False

    @classmethod
    def supports_selective_offload(cls) -> bool:
        return True

    @classmethod
    def preserves_communicators(cls) -> bool:  # the older contract's name
        return True  # communicators' buffers are outside torpor's pools; nothing touches them

    @classmethod
    def preserves_graphs_with_communicators(cls) -> bool:  # the older contract's name
        return True

    @classmethod
    def preserves_nccl(cls) -> bool:
        return True

    @classmethod
    def preserves_graphs_with_nccl(cls) -> bool:
        return True  # NCCL is not rebuilt and every address stays: captured collectives replay

    @classmethod
    def preserves_compiled_artifacts(cls) -> bool:
        return True

    @classmethod
    def supports_durable_storage(cls) -> bool:
        return False


__all__ = ["TorporSleepModeBackend"]
