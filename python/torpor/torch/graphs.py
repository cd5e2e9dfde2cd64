"""CUDA graphs whose memory lives in torpor: released at sleep, replayed after wake as they are.

    import torpor
    graph = torch.cuda.CUDAGraph()
    with torpor.graph(graph):                      # instead of torch.cuda.graph(graph)
        static_out = model(static_in)
    torpor.sleep(2)                                # the graph's memory goes back too
    torpor.wake_up(["weights"]); load_weights(model); torpor.wake_up()
    graph.replay()                                 # same graph object, no re-capture

or, where an engine calls torch.cuda.graph itself, only its pool argument changes:

    with torch.cuda.graph(graph, pool=torpor.graph_pool("cuda_graph")):
        ...

What PyTorch does with a capture's memory, and what torpor does with it:

- A capture allocates from a private pool (PyTorch's MemPool id passed as `pool`). Here that
  pool is a torch.cuda.MemPool backed by torpor's pluggable allocator (torpor.torch.routing
  makes it, one per (tag, device)), so every segment the capture asks for is a torpor allocation in the
  graph's tag. Nothing else allocates from it: use_pool() refuses a graph tag, and a graph tag
  refuses a use_pool tag, since an eager tensor in a block the graph writes at every replay
  would be overwritten.
- After capture, the tensors the caller still holds (static outputs) stay allocated blocks;
  the intermediates were freed during capture, but their blocks stay cached in the private
  pool and are handed out again only to captures into the same pool: every replay writes
  them. PyTorch never releases a live graph's segments (empty_cache skips pools in use).
- So a graph pool's bytes are class cache by default: a replay recomputes every intermediate
  and every output before reading it. At every sleep the embedding re-marks each block from
  PyTorch's snapshot (torpor.torch.marks): free blocks cache, allocated blocks the tag's class.
  Exactly the bytes whose contents outlive a replay are state, and only because someone says
  so: mark_state(tensor) for a static input allocated inside the capture or an output read
  after a sleep, or memory_class="state" for a pool whose graphs keep data between replays
  (its allocated blocks are then state; free blocks stay cache in any pool, as a graph writes
  a block it allocated before reading it).
- Level 1 and level 2 both release a graph pool's memory (cache is discarded, state
  offloaded). Every address stays, so after wake the same graph object replays as captured.
- PyTorch caches per-stream objects in the pool a capture allocates them from: the cuBLAS
  workspace of (handle, capture stream) is allocated inside the first capture on that stream
  and reused by every later call on it. torpor.graph therefore captures on a stream of its own
  per (tag, device) unless given one, so that workspace sleeps with the graphs that use it.
  With torch.cuda.graph's shared default capture stream, a graph captured outside torpor
  after one captured in torpor would use that workspace while the torpor tag sleeps.
- torch.cuda.graph(pool=graph_pool(tag)) works because graph_pool() wraps
  torch.cuda.CUDAGraph.capture_begin / capture_end once (PyTorch has no other hook between a
  capture and its pool): for a torpor graph pool they set the capturing thread's torpor tag
  and class and turn off expandable segments for the capture; any other capture is passed
  through untouched.
- capture_into(tag) (what torpor.vllm's use_cudagraph_pool rests on): inside it, every capture
  the thread begins goes to torpor's graph pool of `tag`, whatever pool the engine names (its
  own graph_pool_handle(), or none). release_graph_pool(tag) gives that pool's memory back once
  its graphs are destroyed; the next capture starts in a new, empty pool (a new id).
- NCCL graph registration (NCCL_GRAPH_REGISTER, on by default in NCCL) registers the buffers a
  captured collective uses: the registration holds the memory's handles, so a sleep cannot give
  it back, and after wake remaps the pool it points at the old mapping (hangs, wrong results;
  vLLM forbids it for its sleep pool). nccl_graph_register_off() sets NCCL_GRAPH_REGISTER=0 when
  unset (one log line) and warns once when the user set another value; capture_into calls it.
- No CUDA graph memory node: torpor cannot release memory that CUDA's own graph allocator
  owns (a library calling cudaMallocAsync during capture adds MEM_ALLOC/MEM_FREE nodes). When
  the graph was made with keep_graph=True, torpor.graph counts its memory nodes after capture
  (torpor_graph_memory_nodes, the library's one walk of a graph) and raises if there is one;
  graph_memory() reports the device's graph-allocator bytes (torpor_graph_memory), which stay 0
  while every graph keeps its memory in torpor.

Capture allocations happen on the capturing thread (PyTorch calls the pool's allocator
there, in relaxed capture mode), which is why the thread-local tag is enough.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
import weakref
from dataclasses import dataclass, field

from .. import _lib, environment
from ..errors import InvalidArgument, InvalidState
from ..pool import ClassLike, MemoryClass, Pool, to_memory_class
from ..tags import CUDA_GRAPH
from ..values import INT_MAX, address, text, whole
from . import remark, routing
from .marks import Span
from .runtime import cuda_torch, device_index, span_bytes, torch_module


@dataclass(frozen=True)
class GraphPool:
    """One torpor graph pool: its tag, device, class and PyTorch pool id."""

    tag: str
    device: int
    memory_class: MemoryClass
    id: tuple


@dataclass
class _Registry:
    lock: threading.RLock
    pools: dict  # PyTorch pool id -> GraphPool
    streams: dict  # (tag, device) -> torch.cuda.Stream
    state: list  # (weakref to a tensor, name) declared state by mark_state
    hooked: bool = False
    graphs: list = field(default_factory=list)  # (weakref to a CUDAGraph, pool id) of torpor captures


_registry = _Registry(threading.RLock(), {}, {}, [])
_capturing = threading.local()  # .depth: torpor.graph captures underway on this thread
_redirect = threading.local()  # .target: (tag, class) every capture of this thread goes to (capture_into)
_log = logging.getLogger(__name__)
_nccl = {"warned": False}


def _pool_id(pool) -> tuple | None:
    """A PyTorch pool handle as a tuple of two ints, or None when it is not one."""
    try:
        first, second = pool
        return (int(first), int(second))
    except (TypeError, ValueError):
        return None


def _graph_pool_entry(torch, tag: str, device: int, memory_class: MemoryClass) -> GraphPool:
    text(tag, "graph_pool: tag")  # a str the C API carries whole: no NUL, no lone surrogate
    with _registry.lock:
        for entry in _registry.pools.values():
            if (entry.tag, entry.device) == (tag, device):
                if entry.memory_class != memory_class:
                    raise InvalidArgument(
                        f"graph_pool: tag '{tag}' is a graph pool of class {entry.memory_class.value}, not "
                        f"{memory_class.value}; use another tag for {memory_class.value} graphs"
                    )
                return entry
        new_tag = routing.claim_graph_tag(tag, device)
        if new_tag is None:
            raise InvalidArgument(
                f"graph_pool: tag '{tag}' already holds tensors allocated in torpor.use_pool('{tag}'); a "
                f"graph pool is written by every replay, so it needs a tag of its own (e.g. "
                f"'{CUDA_GRAPH}')"
            )
        try:
            # MemPool binds to the current device at construction.
            with torch.cuda.device(device):
                mempool = routing.mempool(torch, tag, device, memory_class).mempool
        except BaseException:
            if new_tag:
                routing.forget_graph_tag(tag)
            raise
        entry = GraphPool(tag, device, memory_class, tuple(mempool.id))
        _registry.pools[entry.id] = entry
    return entry


def graph_pool(tag: str = CUDA_GRAPH, memory_class: ClassLike = MemoryClass.CACHE, device=None) -> tuple:
    """The PyTorch pool id of torpor's graph pool for `tag` on `device` (default: current),
    created on first use: pass it as torch.cuda.graph(..., pool=...) or
    CUDAGraph.capture_begin(pool=...). Graphs captured into it keep all their memory in torpor,
    released by every sleep of `tag`. memory_class: cache (default: replays recompute every
    byte) or state (every allocated block of the pool survives sleep bit-exact). Several graphs
    may share one pool, as with PyTorch's pools: replay them in capture order."""
    torch = cuda_torch()
    return _graph_pool(torch, tag, to_memory_class(memory_class), device_index(torch, device)).id


def _graph_pool(torch, tag: str, cls: MemoryClass, device: int) -> GraphPool:
    if cls == MemoryClass.PARAMETER:
        raise InvalidArgument("graph_pool: memory_class must be cache or state (a graph pool holds no parameters)")
    entry = _graph_pool_entry(torch, tag, device, cls)
    _install_capture_hook(torch)
    return entry


def graph_pools() -> list[GraphPool]:
    """Every torpor graph pool made so far."""
    with _registry.lock:
        return list(_registry.pools.values())


def is_graph_pool(pool) -> bool:
    """Whether `pool` (a PyTorch pool id) is one of torpor's graph pools."""
    key = _pool_id(pool)
    with _registry.lock:
        return key is not None and key in _registry.pools


# -- capture -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _capture_scope(torch, entry: GraphPool):
    """The capturing thread allocates in the graph's tag and class, expandable segments off."""
    current = torch.cuda.current_device()
    if current != entry.device:
        raise InvalidArgument(
            f"graph: the torpor graph pool of tag '{entry.tag}' belongs to device {entry.device}, but the capture "
            f"runs on device {current} (PyTorch would give it a pool outside torpor); use "
            f"graph_pool('{entry.tag}', device={current}) or make device {entry.device} current"
        )
    with routing.routed(torch, entry.tag, entry.memory_class):
        yield


def _install_capture_hook(torch) -> None:
    """Wrap CUDAGraph.capture_begin / capture_end (see the module note). Idempotent."""
    with _registry.lock:
        cls = getattr(torch.cuda, "CUDAGraph", None)
        if _registry.hooked or cls is None or getattr(cls, "_torpor_hooked", False):
            _registry.hooked = True
            return
        begin, end = cls.capture_begin, cls.capture_end
        scopes: dict = {}  # id(graph) -> the open capture scope of a torpor graph pool

        @functools.wraps(begin)
        def capture_begin(self, *args, **kwargs):
            pool = kwargs.get("pool", args[0] if args else None)
            key = _pool_id(pool) if pool is not None else None
            with _registry.lock:
                entry = _registry.pools.get(key) if key is not None else None
            target = getattr(_redirect, "target", None)
            if entry is None and target is not None:  # inside capture_into: torpor's pool instead
                entry = _graph_pool(torch, target[0], target[1], torch.cuda.current_device())
                if "pool" in kwargs or not args:
                    kwargs["pool"] = entry.id
                else:
                    args = (entry.id,) + args[1:]
            if entry is not None:
                with _registry.lock:
                    _registry.graphs.append((weakref.ref(self), entry.id))
            if entry is None or getattr(_capturing, "depth", 0) > 0:  # not torpor's, or torpor.graph's own
                return begin(self, *args, **kwargs)
            scope = contextlib.ExitStack()
            scope.enter_context(_capture_scope(torch, entry))
            try:
                result = begin(self, *args, **kwargs)
            except BaseException:
                scope.close()
                raise
            scopes[id(self)] = scope
            return result

        @functools.wraps(end)
        def capture_end(self, *args, **kwargs):
            scope = scopes.pop(id(self), None)
            try:
                return end(self, *args, **kwargs)
            finally:
                if scope is not None:
                    scope.close()

        cls.capture_begin, cls.capture_end = capture_begin, capture_end
        cls._torpor_hooked = True
        _registry.hooked = True


def _capture_stream(torch, tag: str, device: int):
    with _registry.lock:
        stream = _registry.streams.get((tag, device))
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            _registry.streams[(tag, device)] = stream
        return stream


@contextlib.contextmanager
def graph(
    cuda_graph,
    pool=None,
    stream=None,
    capture_error_mode: str = "global",
    *,
    tag: str | None = None,
    memory_class: ClassLike | None = None,
):
    """torch.cuda.graph with the capture's memory in torpor (a drop-in: same arguments, plus
    the tag and class of the graph pool). Captures on the current device into
    graph_pool(tag) (default tag "cuda_graph", class cache), or into `pool` when it is a torpor
    graph pool (another torpor graph's pool() or a graph_pool id; its tag then applies).
    stream: default one capture stream per (tag, device) (see the module note). After capture,
    a graph made with keep_graph=True is checked for CUDA graph memory nodes (InvalidState if
    it has any: that memory would stay resident while asleep). Yields nothing, as
    torch.cuda.graph does."""
    torch = cuda_torch()
    dev = torch.cuda.current_device()
    cls = None if memory_class is None else to_memory_class(memory_class)
    if pool is not None:
        key = _pool_id(pool)
        with _registry.lock:
            entry = _registry.pools.get(key) if key is not None else None
        if entry is None:
            raise InvalidArgument(
                f"graph: pool {pool!r} is not a torpor graph pool (its memory would stay outside torpor); pass a "
                f"torpor.graph_pool(tag) id, a pool() of a graph captured by torpor.graph, or none"
            )
        if tag is not None and tag != entry.tag:
            raise InvalidArgument(f"graph: pool {pool!r} is the graph pool of tag '{entry.tag}', not '{tag}'")
        if cls is not None and cls != entry.memory_class:
            raise InvalidArgument(f"graph: pool {pool!r} is of class {entry.memory_class.value}, not {cls.value}")
    else:
        entry = _graph_pool(torch, CUDA_GRAPH if tag is None else tag, MemoryClass.CACHE if cls is None else cls, dev)
    tag_stats = Pool.torch(dev).stats()["tags"].get(entry.tag)
    if tag_stats is not None and tag_stats["asleep"]:
        raise InvalidState(
            f"graph: tag '{entry.tag}' is asleep on device {dev} (level {tag_stats['level']}); "
            f"wake_up(['{entry.tag}']) before capturing into it"
        )
    capture_stream = _capture_stream(torch, entry.tag, dev) if stream is None else stream
    _capturing.depth = getattr(_capturing, "depth", 0) + 1
    try:
        with _capture_scope(torch, entry):
            with torch.cuda.graph(
                cuda_graph, pool=entry.id, stream=capture_stream, capture_error_mode=capture_error_mode
            ):
                yield
    finally:
        _capturing.depth -= 1
    nodes = memory_nodes(cuda_graph)
    if nodes:
        raise InvalidState(
            f"graph: the captured graph has {nodes} CUDA graph memory node(s) (cudaMallocAsync/cudaFreeAsync during "
            f"capture): that memory belongs to CUDA's graph allocator, outside torpor, and stays resident while "
            f"asleep; give the library a workspace from a torpor pool instead"
        )


@contextlib.contextmanager
def capture_into(tag: str = CUDA_GRAPH, memory_class: ClassLike = MemoryClass.CACHE):
    """Inside, every CUDA graph capture this thread begins (CUDAGraph.capture_begin, hence
    torch.cuda.graph too) allocates from torpor's graph pool of `tag` on the capturing device,
    whatever pool it names: none, or an engine's own graph_pool_handle() (a capture naming a
    torpor graph pool keeps that one). Yields the pool id on the current device, to pass as
    `pool` where the engine takes one. Sets NCCL_GRAPH_REGISTER=0 when unset
    (nccl_graph_register_off). Nests; the previous target comes back at exit."""
    torch = cuda_torch()
    entry = _graph_pool(torch, tag, to_memory_class(memory_class), torch.cuda.current_device())
    nccl_graph_register_off()
    previous = getattr(_redirect, "target", None)
    _redirect.target = (entry.tag, entry.memory_class)
    try:
        yield entry.id
    finally:
        _redirect.target = previous


def capturing_into() -> str | None:
    """The tag capture_into routes this thread's captures to, or None outside it."""
    target = getattr(_redirect, "target", None)
    return None if target is None else target[0]


def release_graph_pool(tag: str = CUDA_GRAPH, device=None) -> int:
    """Give back the memory of torpor's graph pool of `tag` on `device` (default: current) once
    its graphs are destroyed, so that the next capture into `tag` starts from an empty pool (a
    new MemPool, a new id). Segments still holding a live tensor (an output kept after its
    graph) stay. Returns the bytes given back (0 when there is no such pool). InvalidState, with
    nothing released, while a CUDA graph captured into the pool is alive or the tag is asleep."""
    torch = cuda_torch()
    dev = device_index(torch, device)
    with _registry.lock:
        entry = next((e for e in _registry.pools.values() if (e.tag, e.device) == (tag, dev)), None)
        if entry is None:
            return 0
        _registry.graphs = [(ref, pid) for ref, pid in _registry.graphs if ref() is not None]
        alive = sum(1 for _, pid in _registry.graphs if pid == entry.id)
        if alive:
            raise InvalidState(
                f"release_graph_pool: {alive} CUDA graph(s) captured into the graph pool of tag '{tag}' on device "
                f"{dev} are still alive and replay from its memory; drop every reference to them first"
            )
        tag_stats = Pool.torch(dev).stats()["tags"].get(tag)
        if tag_stats is not None and tag_stats["asleep"]:
            raise InvalidState(
                f"release_graph_pool: tag '{tag}' is asleep on device {dev}; wake_up(['{tag}']) before releasing it"
            )
        with routing.registry.lock:
            mine = [p for p in routing.pools_of(tag, dev) if tuple(p.mempool.id) == entry.id]
            released = sum(routing.release_empty_segments(p, dev, tag) for p in mine)
            if any(p.retired for p in mine):
                del _registry.pools[entry.id]  # the next graph_pool(tag) makes a new MemPool
        return released


def nccl_graph_register_off() -> str:
    """Keep NCCL from registering torpor's graph memory (see the module note): sets
    NCCL_GRAPH_REGISTER=0 when unset, with one log line; warns once when the user set another
    value (it is theirs; NCCL reads it at communicator creation). Returns the value in force."""
    if environment.set_default("NCCL_GRAPH_REGISTER", "0"):
        _log.info(
            "torpor: set NCCL_GRAPH_REGISTER=0: NCCL graph registration would pin torpor's graph memory through "
            "sleep and go stale after wake"
        )
        return "0"
    value = environment.text("NCCL_GRAPH_REGISTER")
    if value.strip() != "0" and not _nccl["warned"]:
        _nccl["warned"] = True
        _log.warning(
            "torpor: NCCL_GRAPH_REGISTER=%s: NCCL registrations of graph buffers pin torpor's memory through sleep "
            "and go stale after wake (hangs, wrong results); unset it or set it to 0",
            value,
        )
    return value


# -- state -------------------------------------------------------------------------------------


def _span_of(t) -> tuple[int, int]:
    return t.data_ptr(), span_bytes(t)


def mark_state(*tensors, name: str | None = None) -> None:
    """Declare tensors state: their bytes survive every sleep level bit-exact, whatever their
    pool's class, for as long as each tensor lives (held by weak reference; the span follows
    the tensor if its storage is replaced). For a torpor graph pool: a static input allocated
    inside the capture, an output read after a sleep, anything a graph keeps between replays.
    Every tensor must be a CUDA tensor inside a torpor pool (InvalidArgument otherwise)."""
    torch_module()
    checked = []
    for t in tensors:
        if not getattr(t, "is_cuda", False):
            raise InvalidArgument(f"mark_state: {type(t).__name__} is not a CUDA tensor")
        address, nbytes = _span_of(t)
        device = t.device.index
        pool = routing.device_pools().get(device)
        if pool is None or nbytes == 0 or not pool.contains(address) or not pool.contains(address + nbytes - 1):
            raise InvalidArgument(
                f"mark_state: the tensor at {address:#x} ({nbytes} bytes, device {device}) is not inside a torpor "
                f"pool; only memory torpor holds can be kept through sleep"
            )
        checked.append((t, device, address, nbytes, pool))
    with _registry.lock:
        for t, device, address, nbytes, pool in checked:
            _registry.state.append((weakref.ref(t), name))
            pool.mark(address, nbytes, MemoryClass.STATE, name)


def state_spans() -> dict[int, list[Span]]:
    """device -> spans of the live tensors declared by mark_state (dead ones are forgotten)."""
    out: dict[int, list[Span]] = {}
    with _registry.lock:
        alive = []
        for ref, name in _registry.state:
            t = ref()
            if t is None:
                continue
            alive.append((ref, name))
            address, nbytes = _span_of(t)
            if nbytes:
                out.setdefault(t.device.index, []).append(Span(name or "state", address, nbytes))
        _registry.state = alive
    return out


remark.add_state_source(state_spans)  # the re-mark keeps these bytes state at every sleep


# -- CUDA graph memory, through the library ---------------------------------------------------


def memory_nodes(cuda_graph) -> int | None:
    """CUDA graph memory nodes (MEM_ALLOC / MEM_FREE, child graphs included) of a captured
    graph (torpor_graph_memory_nodes), or None when its cudaGraph_t is not kept (PyTorch keeps
    it only for CUDAGraph(keep_graph=True)) or the object is not a real PyTorch graph.
    Unavailable without a usable GPU."""
    raw = getattr(cuda_graph, "raw_cuda_graph", None)
    if raw is None:
        return None
    try:
        handle = int(raw())
    except Exception:  # keep_graph=False: PyTorch destroyed the graph after instantiating it
        return None
    if not handle:
        return None
    count = ctypes.c_size_t(0)
    _lib.check(_lib.lib().torpor_graph_memory_nodes(address(handle, "memory_nodes: graph"), ctypes.byref(count)))
    return count.value


def graph_memory(device: int | None = None) -> dict:
    """Bytes CUDA's own graph allocator holds on `device` (memory nodes of every graph in the
    process; default: current device): {"used": ..., "reserved": ...} (torpor_graph_memory). 0
    while every graph keeps its memory in torpor pools. Unavailable without a usable GPU."""
    torch = cuda_torch()
    dev = device_index(torch, device)
    used, reserved = ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)
    _lib.check(
        _lib.lib().torpor_graph_memory(
            whole(dev, "graph_memory: device", 0, INT_MAX), ctypes.byref(used), ctypes.byref(reserved)
        )
    )
    return {"used": used.value, "reserved": reserved.value}


is_graph_tag = routing.is_graph_tag  # whether a torpor tag holds graph pools (use_pool refuses it)

__all__ = [
    "GraphPool",
    "capture_into",
    "capturing_into",
    "graph",
    "graph_memory",
    "graph_pool",
    "graph_pools",
    "is_graph_pool",
    "is_graph_tag",
    "mark_state",
    "memory_nodes",
    "nccl_graph_register_off",
    "release_graph_pool",
    "state_spans",
]
