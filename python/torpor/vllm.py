"""vLLM mode: vLLM's sleep-mode allocator (``vllm.device_allocator.cumem.CuMemAllocator``, the
MemAllocator protocol of ``vllm.device_allocator``) over torpor, with vLLM's semantics.

    from torpor.vllm import CuMemAllocator     # or torpor.CuMemAllocator; the plugin
                                               # (torpor.vllm_plugin) puts it under vLLM's name
    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        model = load_model()
    torpor.register_parameters(model)          # optional: torpor's upgrade, below
    with allocator.use_memory_pool(tag="kv_cache"):
        kv_cache = allocate_kv_cache()
    allocator.sleep(offload_tags=("weights",) if level == 1 else ())
    allocator.wake_up(["weights"]); reload_weights(); allocator.wake_up(["kv_cache"])

What each call does, as vLLM's CuMemAllocator (the versions README's vLLM section names):

- ``sleep(offload_tags)``: every byte of every allocation whose tag is in offload_tags is kept
  (copied to host memory), and so is every byte of the tags vLLM keeps at every level ("runtime",
  "cudagraph"); the tags vLLM declares discardable ("weights", "kv_cache", "default",
  "workspace") lose every byte unless listed. A tag vLLM does not declare discardable
  (VLLM_TAG_FATES does not name it) is kept, and named once in the log: torpor never discards
  bytes the engine did not declare discardable. None means ("default",), a string one tag. Tags
  already asleep keep the fate they fell asleep with.
- ``discard(tags)``: the awake allocations of those tags are discarded, nothing copied.
- ``wake_up(tags)``: None wakes every tag. A list wakes those tags, and every sleeping tag other
  than "weights" and "kv_cache" (vLLM: selective wake may defer only those two). Tags that were
  never used are ignored. Discarded bytes come back undefined.
- ``use_memory_pool(tag)``: tensors created inside live in torpor under `tag` (None: "default").
  When the block exits, segments PyTorch left empty are unmapped (vLLM frees them the same way);
  ``reuse_memory_pool(tag)`` re-enters a tag used before (ValueError otherwise).
- ``get_current_usage()``: bytes of the segments in the pools, asleep or not.
- ``is_asleep(tags=None)``: whether any of those tags (None: any tag) is asleep.
- Errors are torpor's typed errors with torpor's message, re-raised as RuntimeError subclasses
  (torpor.engine.runtime_error): a wake that runs out of device memory raises an error that is a
  RuntimeError, a torpor.OutOfMemory and a MemoryError at once.

torpor's upgrade, with ``torpor.register_parameters(model)`` (the plugin calls it after vLLM
loads the model): a tag that holds registered parameters and is not offloaded discards only the
parameters; its buffers and every other byte that is not a parameter come back bit-exact, so
vLLM's level-2 buffer stash (``Worker._sleep_saved_buffers``) has nothing to add, and a level-2
sleep copies no parameter to host memory. Tags without registered parameters (the KV cache) are
discarded in full, as in vLLM.

Every address is the same after wake (as in vLLM), so CUDA graphs replay. This mode uses torpor
through torpor.engine only (the seam every engine mode is written against), and reads vLLM's
variables through torpor.environment.

Model Runner V2's graph pool (vLLM's CUDA graphs captured into the sleep pool). Read, not copied,
from vLLM's public sources as stored in the code index (find_string/read_file ids; the index
gives no commit for these files): the call sites in ``vllm/device_allocator/__init__.py``
(index ids 66925547905 and 71337998459: ``CuMemAllocator.get_instance().use_cudagraph_pool(pool)``,
``CuMemAllocator.instance.release_cudagraph_pool(pool)``, ``is_capturing_into_cumem_pool()``:
``allocator.current_tag == CuMemAllocator.cudagraph_tag``), the newer graph-pool routing module
(ids 71025779603, 71346200736, 71284111856: ``use_cudagraph_pool()`` with no argument, used as
``with ... as graph_pool`` and followed by ``set_graph_pool_id(graph_pool)``;
``release_cudagraph_pool()``), vLLM's test ``test_cudagraph_pool_sleep`` in
``tests/basic_correctness/test_cumem.py`` (id 70104731465: the tag is ``"cudagraph"``, the graph
pool is backed up at both sleep levels and woken by any wake) and its NCCL policy test (id
71291901243: ``NCCL_GRAPH_REGISTER`` defaults to 0 with the cuMem graph pool). The defining
``vllm/device_allocator/cumem.py`` revision is not in the index (its stored versions,
e.g. commit 010c211270c004db49f91933849804821d153e4d, predate the graph pool).

- ``cudagraph_tag`` ("cudagraph", vLLM's), ``current_tag``: the tag allocations go to now: the
  cudagraph tag inside ``use_cudagraph_pool`` (what vLLM's custom all-reduce asks), the tag of
  the innermost ``use_memory_pool`` block, else "default".
- ``use_cudagraph_pool(pool=None)``: a context manager yielding torpor's graph pool id (tag
  "cudagraph", class state) to capture into. Either call form works: the argument (vLLM's own
  graph_pool_handle()) is accepted and not used, since every capture the thread begins inside
  goes to torpor's pool whatever pool it names (torpor.engine.graphs.capture_into). So graphs live in
  torpor: every sleep (levels 1 and 2, as vLLM) keeps their allocated blocks (static outputs,
  constants a replay never writes) in host memory and gives every byte of device memory back;
  any wake maps them back at the same addresses, and the same graphs replay. Entering it sets
  NCCL_GRAPH_REGISTER=0 when unset (one log line; a warning when the user set another value):
  NCCL's registrations would pin the graph memory through sleep and go stale after wake.
- ``register_tag_hooks(tag, before_unmap, after_map)`` (module level, as vLLM's in
  ``vllm/device_allocator/__init__.py``, index id 71436949636): KV connectors (NIXL) re-register
  transport memory there. torpor calls them where vLLM's allocator does: ``before_unmap()`` in
  every sleep and discard that unmaps some of the tag (not for a tag already asleep), before
  anything moves, and an exception from it aborts that sleep with nothing moved; ``after_map()``
  once after every wake that leaves the tag fully mapped, tags that never slept included (vLLM:
  "idempotent"). torpor adds: a sleep that fails after before_unmap ran calls after_map for each
  tag it left mapped. One difference: a ``wake_up`` that selects no sleeping tag wakes nothing
  and calls no hook (vLLM's runs them anyway; they are idempotent, so nothing is lost).
- vLLM's options, read at each wake as vLLM reads them (or set as attributes, which the
  sleep-mode backend's options do): ``VLLM_POISON_DISCARDED_PAGES`` (``poison_discarded_pages``):
  the wake fills discarded bytes with 0xFF (torpor.engine.fill_on_wake), kept bytes untouched;
  ``VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY`` (``release_host_memory``): after the wake, torpor's host
  copies of awake tags and its unused host store go back (torpor.engine.release_host_store; a
  tag still asleep keeps its backup), where by default they stay so that an unchanged re-sleep
  copies nothing.
- ``exportable`` (torpor's; False by default): the pools are created with shareable handles,
  GPUDirect RDMA capable where the device can (torpor.use_pool(..., exportable=True)), so a KV
  transport can register the KV cache with a NIC or share it across processes and nodes. The
  plugin sets it before the worker's first allocation when vLLM has a KV connector
  (torpor.vllm_plugin, step 6). ``export_handles(tags, kind)``: the handles of those tags' memory
  (torpor.exports), for a transport that takes them from torpor; a transport re-exports in its
  ``after_map`` tag hook, since every wake maps new memory at the same addresses.
- ``release_cudagraph_pool(pool=None)``: once the graphs are destroyed, their pool's memory goes
  back to torpor and the next capture starts in a new, empty pool; a RuntimeError (InvalidState)
  while a graph captured into it is alive or the tag is asleep.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable, Iterable

from . import engine, environment
from .engine import as_runtime_errors, keep_everything, runtime_error
from .errors import InvalidArgument, InvalidType
from .pool import MemoryClass
from .tags import KV_CACHE, WEIGHTS

logger = logging.getLogger(__name__)

# vLLM's DEFERRABLE_TAGS: a selective wake leaves only these asleep.
DEFERRABLE_TAGS: tuple[str, ...] = (WEIGHTS, KV_CACHE)

# What vLLM's sleep does with each tag it allocates into, the one table this mode follows.
# "listed": offloaded when the sleep's offload_tags names the tag, else discarded (vLLM declares
# the bytes discardable); "always": offloaded at every level, whatever offload_tags says. Read from
# vLLM's public sources (code index ids; the index gives no commit for them):
# - weights, kv_cache: the worker's sleep through CuMemBackend.suspend, offload_tags ("weights",)
#   at level 1 and () at level 2 (vllm/device_allocator/sleep_mode_backend.py, id 66905327771);
# - default: CuMemAllocator.default_tag, offloaded by sleep() with no argument (cumem.py, commit
#   9ac9658813add86b01198b8204d02e245daddb2a; test_basic_cumem);
# - workspace: the WorkspaceManager's scratch, "Discarded, not copied" at level 1 (test_cumem.py's
#   test_workspace_scratch_discarded_on_sleep, id 70104731465; vllm/v1/worker/workspace.py, commit
#   4f5923a7b50cbafa0f93a7ec70125ee74619dd38);
# - runtime: "Runtime state is offloaded at both levels and restored by the first selective wake"
#   (test_cumem.py's test_runtime_state_survives_sleep, id 70104731465);
# - cudagraph: Model Runner V2's graph pool, backed up at both levels (test_cudagraph_pool_sleep,
#   same file).
# A tag this table does not name was not declared discardable by vLLM: it is offloaded at every
# level, like "always", and named once in the log (a newer vLLM may have added it). An engine that
# allocates into discardable tags of its own declares them here ("listed") before its first sleep.
VLLM_TAG_FATES: dict[str, str] = {
    WEIGHTS: "listed",
    KV_CACHE: "listed",
    "default": "listed",
    "workspace": "listed",
    "runtime": "always",
    "cudagraph": "always",
}

_unknown_lock = threading.Lock()
_unknown_logged: set[str] = set()


def kept_by_vllm(tag: str, offload: tuple[str, ...]) -> bool:
    """Whether vLLM's sleep with these offload_tags keeps `tag`'s bytes (VLLM_TAG_FATES); a tag
    the table does not know is kept, and named once in the log."""
    fate = VLLM_TAG_FATES.get(tag)
    if fate == "listed":
        return tag in offload
    if fate is None and tag not in offload:
        _log_unknown(tag)
    return True


def _log_unknown(tag: str) -> None:
    with _unknown_lock:
        if tag in _unknown_logged:
            return
        _unknown_logged.add(tag)
    logger.warning(
        "torpor: vLLM tag %r is not one vLLM declares discardable (torpor.vllm.VLLM_TAG_FATES): its bytes are "
        "offloaded to host memory at every sleep level instead of discarded",
        tag,
    )


def _tag_tuple(tags, what: str) -> tuple[str, ...]:
    if isinstance(tags, str):
        tags = (tags,)
    out = tuple(tags)
    for t in out:
        if not isinstance(t, str) or not t:
            raise runtime_error(InvalidArgument(f"{what}: tag {t!r} is not a non-empty string"))
    return out


def _check_pool(pool, what: str) -> None:
    """vLLM passes its own graph pool handle (two ints) or nothing."""
    if pool is None:
        return
    try:
        first, second = pool
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (first, second))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise runtime_error(
            InvalidArgument(f"{what}: pool {pool!r} is not a CUDA graph pool handle (two ints); pass one or none")
        )


def _discard(tag: str, memory_class: MemoryClass, has_parameters: bool) -> MemoryClass:
    """Discarded tags: everything goes (vLLM), except in a tag holding registered parameters,
    whose other bytes are state and stay (torpor's upgrade; the parameters go at level 2)."""
    return MemoryClass.STATE if has_parameters else MemoryClass.CACHE


def register_tag_hooks(tag: str, before_unmap: Callable[[], None], after_map: Callable[[], None]) -> Callable[[], None]:
    """vLLM's ``vllm.device_allocator.register_tag_hooks`` over torpor's hook bus
    (torpor.engine.hooks.add_mapping_hooks, the C pool's tag hooks): `before_unmap()` right before a
    sleep or discard unmaps allocations of `tag`, the idempotent `after_map()` after every wake
    that leaves all of them mapped. Returns the function that unregisters them (a second call
    raises KeyError). The plugin puts it under vLLM's name (see the module note)."""
    for what, fn in (("before_unmap", before_unmap), ("after_map", after_map)):
        if not callable(fn):
            raise runtime_error(InvalidType(f"register_tag_hooks: {what} must be callable, not {type(fn).__name__}"))
    with as_runtime_errors():
        hook_id = engine.hooks.add_mapping_hooks(tag, lambda _tag: before_unmap(), lambda _tag: after_map())
    return lambda: engine.hooks.remove_mapping_hooks(hook_id)


class CuMemAllocator:
    """A process-wide singleton, as vLLM's (get_instance()); see the module note."""

    instance: "CuMemAllocator | None" = None
    default_tag: str = "default"
    cudagraph_tag: str = "cudagraph"  # vLLM's: the tag of Model Runner V2's graph pool

    @staticmethod
    def get_instance() -> "CuMemAllocator":
        if CuMemAllocator.instance is None:
            CuMemAllocator.instance = CuMemAllocator()
        return CuMemAllocator.instance

    def __init__(self):
        # vLLM's options; None reads vLLM's variable at each wake (the sleep-mode backend's
        # options set them): VLLM_POISON_DISCARDED_PAGES, VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY.
        self.poison_discarded_pages: bool | None = None
        self.release_host_memory: bool | None = None
        self.last_reports: dict[str, dict] = {}  # what the last sleep, discard or wake_up did, per step
        self.exportable = False  # pools with shareable handles (see the module note)
        self._pool_tags: list[str] = []  # tags of the use_memory_pool blocks open now, innermost last

    # -- pools -------------------------------------------------------------------------------

    @property
    def current_tag(self) -> str:
        """The tag allocations go to now (see the module note)."""
        if engine.graphs.capturing_into() == self.cudagraph_tag:
            return self.cudagraph_tag
        return self._pool_tags[-1] if self._pool_tags else self.default_tag

    @contextlib.contextmanager
    def _tagged(self, tag: str):
        engine.intend_sleep("vllm", self._planned, 1)  # LLM.sleep()'s default level
        with engine.use_pool(tag, exportable=self.exportable):
            self._pool_tags.append(tag)
            try:
                yield
            finally:
                self._pool_tags.pop()

    def use_memory_pool(self, tag: str | None = None):
        tag = self.default_tag if tag is None else tag
        return self._tagged(_tag_tuple(tag, "use_memory_pool")[0])

    def reuse_memory_pool(self, tag: str):
        """Re-enter the pool of a tag used before; ValueError for one never used."""
        if tag not in engine.tag_states():
            raise runtime_error(InvalidArgument(f"Memory pool for tag '{tag}' does not exist."))
        return self._tagged(tag)

    @contextlib.contextmanager
    def use_cudagraph_pool(self, pool: tuple[int, int] | None = None):
        """Capture CUDA graphs into torpor's graph pool; yields its id (see the module note)."""
        _check_pool(pool, "use_cudagraph_pool")
        with contextlib.ExitStack() as scope:
            with as_runtime_errors():
                graph_pool = scope.enter_context(engine.graphs.capture_into(self.cudagraph_tag, MemoryClass.STATE))
            yield graph_pool

    def release_cudagraph_pool(self, pool: tuple[int, int] | None = None) -> int:
        """Give the graph pool's memory back once its graphs are destroyed; returns the bytes."""
        _check_pool(pool, "release_cudagraph_pool")
        with as_runtime_errors():
            return engine.graphs.release_graph_pool(self.cudagraph_tag)

    def export_handles(self, tags: Iterable[str] | str | None = KV_CACHE, kind: str = "auto", device=None):
        """The shareable handles of the memory of `tags` (default the KV cache; None: every tag) on
        `device` (default: current): torpor.export_handles, for an exportable allocator."""
        with as_runtime_errors():
            return engine.export_handles(tags, device, kind)

    def get_current_usage(self) -> int:
        """Bytes of the segments PyTorch holds in torpor, asleep or not (vLLM: the handles' sizes)."""
        return sum(t["allocated_bytes"] for st in engine.stats().values() for t in st["tags"].values())

    def is_asleep(self, tags: Iterable[str] | str | None = None) -> bool:
        states = engine.tag_states()
        wanted = states if tags is None else _tag_tuple(tags, "is_asleep")
        return any(states.get(t, False) for t in wanted)

    # -- sleep -------------------------------------------------------------------------------

    def _steps(self, offload: tuple[str, ...], tags: list[str]) -> list:
        """The two sleeps of vLLM's sleep(offload): what it keeps (VLLM_TAG_FATES), then the rest."""
        kept = [t for t in tags if kept_by_vllm(t, offload)]
        return [
            (1, kept, keep_everything),
            (2, [t for t in tags if t not in kept], _discard),
        ]

    def _planned(self, level: int, tags: list[str]) -> list:
        """vLLM's worker sleep at `level`: offload_tags=("weights",) at 1, () at 2 (torpor.engine's
        preparation of the host store)."""
        return self._steps((WEIGHTS,) if level == 1 else (), tags)

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        offload = (self.default_tag,) if offload_tags is None else _tag_tuple(offload_tags, "sleep")
        awake = [t for t, asleep in sorted(engine.tag_states().items()) if not asleep]
        (_, kept, _), (_, gone, _) = self._steps(offload, awake)
        with as_runtime_errors():
            self.last_reports = {
                "offload": engine.sleep(1, kept, keep_everything),
                "discard": engine.sleep(2, gone, _discard),
            }

    def discard(self, tags: tuple[str, ...] | str) -> None:
        wanted = set(_tag_tuple(tags, "discard"))
        awake = [t for t, asleep in sorted(engine.tag_states().items()) if not asleep and t in wanted]
        with as_runtime_errors():
            self.last_reports = {"discard": engine.sleep(2, awake, _discard)}

    def wake_up(self, tags: list[str] | None = None) -> None:
        states = engine.tag_states()
        if tags is None:
            selected = [t for t, asleep in sorted(states.items()) if asleep]
        else:
            wanted = set(_tag_tuple(tags, "wake_up"))
            selected = [
                t for t, asleep in sorted(states.items()) if asleep and (t in wanted or t not in DEFERRABLE_TAGS)
            ]
        poison = self._option(self.poison_discarded_pages, "VLLM_POISON_DISCARDED_PAGES")
        with as_runtime_errors():
            with engine.fill_on_wake("poison") if poison else contextlib.nullcontext():
                self.last_reports = {"wake_up": engine.wake_up(selected)}
            if self._option(self.release_host_memory, "VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY"):
                self.last_reports["host_released"] = engine.release_host_store()

    @staticmethod
    def _option(value: bool | None, variable: str) -> bool:
        """A vLLM option: the attribute when set (a backend option), else vLLM's variable, read at
        each call as vLLM reads it."""
        return environment.enabled(variable) if value is None else bool(value)


__all__ = ["DEFERRABLE_TAGS", "VLLM_TAG_FATES", "CuMemAllocator", "kept_by_vllm", "register_tag_hooks"]
