"""torpor's vLLM plugin: with TORPOR_VLLM=1, every vLLM process uses torpor for sleep mode.

The package declares ``register`` as a ``vllm.general_plugins`` entry point (pyproject.toml).
vLLM calls every general plugin in every process it starts (``vllm.plugins.load_general_plugins``;
VLLM_PLUGINS, when set, must list "torpor"), and a worker does it in
``WorkerWrapperBase.init_worker`` before it imports its worker class. With TORPOR_VLLM unset (or
0, false, no, off) the plugin does nothing. Set, it:

1. puts torpor's allocator (torpor.vllm.CuMemAllocator) in place of
   ``vllm.device_allocator.cumem.CuMemAllocator``. Every vLLM generation asks that module for it:
   the oldest workers import the name when their module loads (which happens after the plugin
   ran; a worker module imported earlier gets its binding replaced too), later ones import it
   inside sleep(), wake_up() and the memory-pool context, the newest through
   ``vllm.device_allocator.get_mem_allocator_instance()``. So the pools vLLM loads weights and
   the KV cache into are torpor's, and so are sleep, wake_up and discard.
2. where vLLM has pluggable sleep-mode backends (``vllm.device_allocator.sleep_mode_backend``),
   registers the backend "torpor" (``--sleep-mode-backend torpor``; torpor.vllm_backend). vLLM's
   default backend, "cumem", drives the same allocator, so either gives torpor's sleep.
3. makes the worker register the model's parameters after every call that loads or replaces
   them (torpor.register_parameters; ``Worker.load_model``, ``reload_weights``,
   ``update_weights`` and ``finish_weight_update`` of vllm.v1.worker.gpu_worker and
   vllm.worker.worker, patched when those modules load): a level-2 sleep then discards only the
   parameters and keeps every other byte, instead of discarding everything. The weight-transfer
   engine's layerwise reload re-creates parameter tensors between start_weight_update and
   finish_weight_update (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``, read in
   a weight-transfer engine's start/finish, index id 70126702537; the four-call protocol, index id
   54636350917), and a reload may build a new model object, so registering once at load would
   leave new parameters counted as state (kept, copied) and old ranges as parameters. vLLM's
   ``sleep_preserve_parameter_names`` (``--sleep-preserve-parameter-names``: globs over
   ``model.named_parameters()`` kept through level 2) becomes register_parameters' preserve; a
   glob that matches no parameter raises ValueError from the call, as vLLM refuses it (its
   documentation, index id 69070261150: "Each pattern must match model.named_parameters()").
4. sets NCCL_GRAPH_REGISTER=0 when unset (torpor.engine.graphs.nccl_graph_register_off; a warning when the
   user set another value): vLLM points NCCL's graph allocations at the sleep pool, and NCCL reads
   the variable when a communicator is created, before any graph is captured; its registrations
   would pin torpor's memory through sleep and go stale after wake.

5. puts torpor.vllm.register_tag_hooks under ``vllm.device_allocator.register_tag_hooks`` (where
   vLLM has it; also in vllm modules already loaded that imported the name), so the hooks KV
   connectors register run around torpor's unmaps and maps (vLLM's own allocator, which would
   call them, is no longer the one that unmaps).
6. makes the pools exportable when vLLM has a KV connector (``vllm_config.kv_transfer_config``
   with a ``kv_connector``), before the worker's first allocation (``Worker.load_model``,
   ``initialize_from_config``, ``initialize_cache``): torpor.vllm.CuMemAllocator's ``exportable``,
   so the KV cache (and, the device pool being one, everything else torpor holds) has shareable
   handles and is GPUDirect RDMA capable where the device can, with or without sleep mode. vLLM
   does the equivalent with its own allocator: the worker routes the weights and the KV cache
   through CuMemAllocator whenever ``model_config.enable_cumem_allocator`` is on, not only with
   sleep mode (``_maybe_get_memory_pool_context`` in vllm/v1/worker/gpu_worker.py, code index id
   66475387063; ``--enable-cumem-allocator``, vllm-project/vllm#33648, "important when using Nixl
   for PD isolation in the GB series"), its cumem allocator requests fabric handles where a
   probe allocation says it may (#33540), and vllm-project/vllm#43134 turns the cumem allocator on
   for the KV cache by default when a KV connector is present. A connector reaches the handles
   through vLLM's register_tag_hooks (step 5: re-register in ``after_map``, since every wake maps
   new memory) and torpor.vllm.CuMemAllocator.export_handles, or registers the addresses itself.

README's vLLM section says which vLLM versions each route was written against. Everything here is
safe to run twice in a process (vLLM may load plugins more than once).
"""

from __future__ import annotations

import fnmatch
import functools
import importlib
import importlib.abc
import importlib.util
import logging
import sys
import threading

from . import environment

logger = logging.getLogger(__name__)

ENV = "TORPOR_VLLM"
BACKEND_NAME = "torpor"
CUMEM_MODULE = "vllm.device_allocator.cumem"
ALLOCATOR_PACKAGE = "vllm.device_allocator"
BACKEND_MODULE = "vllm.device_allocator.sleep_mode_backend"
# Worker modules whose Worker methods get the parameter registration (v1, then v0), and the
# methods: every call after which the model's parameter tensors may be new.
WORKER_MODULES = ("vllm.v1.worker.gpu_worker", "vllm.worker.worker")
WORKER_METHODS = ("load_model", "reload_weights", "update_weights", "finish_weight_update")
# Worker methods that may make the first allocation in torpor's pools (the weights, the KV cache of
# the V1 worker, the oldest one's): the pools' exportability is decided before them (step 6).
ALLOCATING_METHODS = ("load_model", "initialize_from_config", "initialize_cache")

_lock = threading.Lock()
_installed = False


def enabled() -> bool:
    return environment.enabled(ENV)


def register() -> None:
    """The ``vllm.general_plugins`` entry point."""
    if not enabled():
        logger.debug("torpor: %s is not set; vLLM keeps its own sleep-mode allocator", ENV)
        return
    install()


def install() -> None:
    """Steps 1 to 6 of the module note (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        substitute_allocator()
        register_backend()
        _patch_when_imported(WORKER_MODULES, _wrap_worker)
        nccl_graph_register_off()
        substitute_tag_hooks()
        _installed = True
    logger.info("torpor: vLLM's sleep mode uses torpor (%s=1)", ENV)


def nccl_graph_register_off() -> str:
    """Step 4: before vLLM creates its communicators. Returns the value in force."""
    from . import engine

    return engine.graphs.nccl_graph_register_off()


def substitute_allocator() -> None:
    """Step 1: torpor's CuMemAllocator under vLLM's name, and in worker modules already loaded."""
    from .vllm import CuMemAllocator

    cumem = importlib.import_module(CUMEM_MODULE)
    original = getattr(cumem, "CuMemAllocator", None)
    cumem.CuMemAllocator = CuMemAllocator
    for name in WORKER_MODULES:
        module = sys.modules.get(name)
        if module is not None and original is not None and getattr(module, "CuMemAllocator", None) is original:
            module.CuMemAllocator = CuMemAllocator


def substitute_tag_hooks() -> bool:
    """Step 5. Returns whether this vLLM has register_tag_hooks."""
    from .vllm import register_tag_hooks

    allocators = importlib.import_module(ALLOCATOR_PACKAGE)
    original = getattr(allocators, "register_tag_hooks", None)
    if original is None or original is register_tag_hooks:
        return original is not None
    allocators.register_tag_hooks = register_tag_hooks
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.") and getattr(module, "register_tag_hooks", None) is original:
            module.register_tag_hooks = register_tag_hooks
    return True


def register_backend() -> bool:
    """Step 2, where vLLM has SleepModeBackendFactory. Returns whether it registered."""
    try:
        backends = importlib.import_module(BACKEND_MODULE)
    except ImportError:
        return False  # an older vLLM: its worker calls the allocator directly
    factory = getattr(backends, "SleepModeBackendFactory", None)
    if factory is None:
        return False
    registry = getattr(factory, "_registry", {})
    if BACKEND_NAME not in registry:
        factory.register_backend(BACKEND_NAME, "torpor.vllm_backend", "TorporSleepModeBackend")
    return True


def preserve_globs(model_config, model) -> list[str]:
    """vLLM's sleep_preserve_parameter_names, each checked against model.named_parameters()."""
    globs = getattr(model_config, "sleep_preserve_parameter_names", None) or []
    globs = [globs] if isinstance(globs, str) else list(globs)
    names = [name for name, _ in model.named_parameters()]
    for g in globs:
        if not isinstance(g, str) or not g:
            raise ValueError(f"sleep_preserve_parameter_names: {g!r} is not a non-empty glob")
    unmatched = [g for g in globs if not any(fnmatch.fnmatchcase(n, g) for n in names)]
    if unmatched:
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise ValueError(
            f"sleep_preserve_parameter_names: {', '.join(repr(g) for g in unmatched)} match(es) no parameter of the "
            f"model (globs are matched against model.named_parameters() names: {shown or 'none'})"
        )
    return globs


def register_model(worker) -> None:
    """Step 3 for one worker: register its model's parameters (and a draft model's) when sleep
    mode put them in torpor. Never fails the call it follows, except for a preserve glob that
    matches no parameter (vLLM refuses those): any other problem is logged."""
    config = getattr(getattr(worker, "vllm_config", None), "model_config", None)
    if config is not None and not getattr(config, "enable_sleep_mode", False):
        return
    try:
        models = [("", worker.get_model())]
        draft = getattr(worker, "get_draft_model", None)
        if callable(draft) and draft() is not None:
            models.append(("draft", draft()))
    except Exception as e:
        logger.warning("torpor: could not find the worker's model (level 2 discards all): %s", e)
        return
    preserve = preserve_globs(config, models[0][1]) if config is not None else []
    try:
        import torpor

        for prefix, model in models:
            reg = torpor.register_parameters(model, preserve=preserve if not prefix else None, prefix=prefix)
            logger.info(
                "torpor: registered %d parameters (%d bytes)%s; %d outside torpor's pools",
                reg.parameters,
                reg.nbytes,
                f" of the {prefix} model" if prefix else "",
                len(reg.outside),
            )
    except Exception as e:  # a failed registration only costs torpor's upgrade, never the call
        logger.warning("torpor: could not register the model's parameters (level 2 discards all): %s", e)


def kv_connector(vllm_config) -> str | None:
    """The KV connector vLLM is configured with (``kv_transfer_config.kv_connector``), or None."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    name = getattr(transfer, "kv_connector", None) if transfer is not None else None
    return name or None


def prepare_pools(worker) -> bool:
    """Step 6 for one worker, before it allocates: torpor's pools exportable when vLLM has a KV
    connector. Returns whether they are to be exportable."""
    connector = kv_connector(getattr(worker, "vllm_config", None))
    if connector is None:
        return False
    from .vllm import CuMemAllocator

    allocator = CuMemAllocator.get_instance()
    if not allocator.exportable:
        allocator.exportable = True
        logger.info(
            "torpor: vLLM has a KV connector (%s): torpor's pools are exportable (shareable handles, GPUDirect RDMA "
            "capable where the device can)",
            connector,
        )
    return True


def _wrap_worker(module) -> None:
    worker = getattr(module, "Worker", None)
    for name in dict.fromkeys(ALLOCATING_METHODS + WORKER_METHODS):
        method = getattr(worker, name, None)
        if method is None or getattr(method, "_torpor_wrapped", False):
            continue
        setattr(worker, name, _wrapped(method, name in ALLOCATING_METHODS, name in WORKER_METHODS))


def _wrapped(method, prepare: bool, register: bool):
    """`method` with step 6 before it (prepare) and step 3 after it (register)."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        if prepare:
            prepare_pools(self)
        result = method(self, *args, **kwargs)
        if register:
            register_model(self)
        return result

    wrapped._torpor_wrapped = True
    return wrapped


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs patch(module) right after one of `names` is executed by its own loader."""

    def __init__(self, names, patch):
        self.names, self.patch = set(names), patch
        self._finding = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names or getattr(self._finding, "active", False):
            return None
        self._finding.active = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader, patch = spec.loader, self.patch

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                patch(module)

        spec.loader = _Loader()
        return spec


def _patch_when_imported(names, patch) -> None:
    """patch(module) for each of `names`: now for those already imported, at import for the rest."""
    for name in names:
        if name in sys.modules:
            patch(sys.modules[name])
    pending = [n for n in names if n not in sys.modules]
    if pending:
        sys.meta_path.insert(0, _PatchOnImport(pending, patch))


__all__ = [
    "BACKEND_NAME",
    "ENV",
    "enabled",
    "install",
    "kv_connector",
    "prepare_pools",
    "preserve_globs",
    "register",
    "register_model",
]
