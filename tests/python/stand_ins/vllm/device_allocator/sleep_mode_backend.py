"""vllm.device_allocator.sleep_mode_backend: pluggable sleep-mode backends chosen by name
(model_config.sleep_mode_backend, default "cumem"); third parties register from a general plugin.

Two contract generations (STAND_IN_VLLM_GENERATION, see vllm/__init__.py); absent in "v0", as in
vLLM before pluggable backends:

- "v1", the first contract (the file at commit 0ffa2a2473a8d400321525f6cd44a50929066ef9):
  ``suspend(level)``, ``resume(tags)``, capabilities ``preserves_communicators`` and
  ``preserves_graphs_with_communicators``, the factory builds ``backend_cls()`` without options;
  ``discard(tags)`` as the v1 worker of the stand-ins calls it.
- "mrv2", the newest contract, read (not copied) from the file as stored in the code index
  (index id 55111445073): ``suspend(level, tags=None)``, ``suspended_tags()``,
  ``supports_selective_offload()``, the capability flags ``preserves_nccl``,
  ``preserves_graphs_with_nccl``, ``preserves_compiled_artifacts``, ``supports_durable_storage``,
  and ``create_backend`` passing ``model_config.sleep_mode_backend_options`` to the constructor."""

import importlib
from abc import ABC, abstractmethod

from vllm import GENERATION

if GENERATION == "v0":
    raise ImportError("No module named 'vllm.device_allocator.sleep_mode_backend'")


class SleepModeBackend(ABC):
    def __init__(self):
        self._state = "RUNNING"

    @abstractmethod
    def suspend(self, level=1, tags=None):
        ...

    @abstractmethod
    def resume(self, tags=None):
        ...

    def state(self):
        return self._state

    def discard(self, tags):
        raise RuntimeError(f"Sleep-mode backend {type(self).__name__!r} does not support selective discard.")

    @classmethod
    def is_supported(cls):
        return True

    if GENERATION == "v1":

        @classmethod
        def preserves_communicators(cls):
            return False

        @classmethod
        def preserves_graphs_with_communicators(cls):
            return False

    else:

        def suspended_tags(self):
            return None

        @classmethod
        def preserves_nccl(cls):
            return False

        @classmethod
        def preserves_graphs_with_nccl(cls):
            return False

        @classmethod
        def preserves_compiled_artifacts(cls):
            return False

        @classmethod
        def supports_durable_storage(cls):
            return False

        @classmethod
        def supports_selective_offload(cls):
            return False


class CuMemBackend(SleepModeBackend):
    def suspend(self, level=1, tags=None):
        from vllm.device_allocator import get_mem_allocator_instance

        self._state = "SUSPENDED"
        get_mem_allocator_instance().sleep(offload_tags=("weights",) if level == 1 else tuple())

    def resume(self, tags=None):
        from vllm.device_allocator import get_mem_allocator_instance

        self._state = "RESUMING"
        get_mem_allocator_instance().wake_up(tags)
        self._state = "RUNNING"

    def discard(self, tags):
        from vllm.device_allocator import get_mem_allocator_instance

        get_mem_allocator_instance().discard(tags)
        self._state = "SUSPENDED"


class SleepModeBackendFactory:
    _registry = {}

    @classmethod
    def register_backend(cls, name, module_path, class_name):
        if name in cls._registry:
            raise ValueError(f"Sleep-mode backend '{name}' is already registered.")

        def loader():
            return getattr(importlib.import_module(module_path), class_name)

        cls._registry[name] = loader

    @classmethod
    def get_backend_class(cls, name):
        if name not in cls._registry:
            available = ", ".join(sorted(cls._registry)) or "<none>"
            raise ValueError(f"Unsupported sleep-mode backend '{name}'. Registered backends: {available}.")
        return cls._registry[name]()

    @classmethod
    def create_backend(cls, model_config):
        backend_cls = cls.get_backend_class(model_config.sleep_mode_backend)
        if not backend_cls.is_supported():
            raise ValueError(
                f"Sleep-mode backend '{model_config.sleep_mode_backend}' is not supported on this platform."
            )
        if GENERATION == "v1":
            return backend_cls()
        options = getattr(model_config, "sleep_mode_backend_options", {}) or {}
        return backend_cls(**options)


SleepModeBackendFactory.register_backend("cumem", "vllm.device_allocator.sleep_mode_backend", "CuMemBackend")
