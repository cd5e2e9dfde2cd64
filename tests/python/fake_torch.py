"""A stand-in for the part of PyTorch that torpor's embedding touches, for CI (no torch, no
GPU). It models the behaviour of PyTorch's caching allocator (c10/cuda/CUDACachingAllocator.cpp)
that torpor's PyTorch layer meets:

- CUDAPluggableAllocator(path, alloc_name, free_name) loads the two entry points from the
  library and calls them for whole segments, on the allocating thread, under the allocator's
  lock (one per process here: PyTorch's is per device);
- segments and blocks as PyTorch carves them: requests rounded to 512 bytes; requests up to
  1 MiB from 2 MiB "small" segments, larger ones from "large" segments (20 MiB below 10 MiB,
  else the request rounded up to 2 MiB); the smallest free block of the same pool, kind and
  stream that fits is used (lowest address among equals), and split when the rest is at least
  512 bytes (small) or more than 1 MiB (large); a freed block merges with its free neighbours;
- blocks belong to the stream they were allocated on (each thread's current stream): a freed
  block is reused only by that stream;
- MemPool(allocator) + use_mem_pool(pool, device) route the calling thread's allocations (only
  that thread's) to the pool; a pool counts its users (the MemPool object, a CUDA graph
  captured into it) and caches freed blocks while it has one (pytorch#145168); once its
  MemPool is destroyed and nothing else uses it, empty_cache() (and the MemPool's destructor)
  release its wholly free segments through the pool allocator's free (pytorch#133327; the
  destructor's releasePool + emptyCache(id) as in MemPool.cpp, restated from torch_npu's copy,
  index id 56604946828);
- when a segment allocation fails: the wholly free segments of released pools go back and the
  allocation is retried once, then OutOfMemoryError;
- MemPool.snapshot() lists segments with their blocks and states, in address order;
- the current device and the current stream are the calling thread's;
- Module.named_parameters(prefix) yields tensors with data_ptr/shape/stride/element_size;
- CUDA graphs: cuda.graph(g, pool, stream, capture_error_mode) captures on a stream
  (capture_begin(pool) / capture_end, as torch.cuda.graph calls them); while a stream
  captures, its allocations come from the private pool of that id (a MemPool's, or a new one
  outside every torpor pool, like cudaMalloc) and launch(fn) records fn instead of running it;
  replay() runs the recorded work; blocks freed during capture stay cached in that pool.

What it still simplifies (tests that depend on it say so and name their GPU twin): a CUDA graph
is a list of Python closures, not captured kernels (test_graphs.py; test_graphs_gpu.py runs the
real ones); a freed block is reusable at once (no record_stream, no events pending on other
streams); no expandable segments, no max_split_size, no garbage-collection threshold; the
default pool (outside every MemPool) hands out made-up addresses and holds no segments.

Device memory is torpor's host backend, so tensor bytes are real and readable.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import types

SEGMENT = 2 << 20  # a small segment (kSmallBuffer), and the rounding of large ones (kRoundLarge)
ALIGN = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: requests up to this size are small
LARGE_BUFFER = 20 << 20  # kLargeBuffer: the segment of a request between 1 MiB and 10 MiB
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc

_ids = itertools.count(1)
_lock = threading.RLock()  # the allocator's mutex: malloc, free, empty_cache and snapshots take it
_thread = threading.local()  # .device, .streams {device: Stream}, .active {device: pool id}
_pools_by_id: dict[tuple, "_PrivatePool"] = {}  # every pool the allocator knows, by id
settings_calls: list[str] = []


class _Current:
    """`current["device"]`: the calling thread's current device (cudaSetDevice is per thread);
    `current["set_device_calls"]`: every thread's set_device calls, for tests."""

    calls = 0

    def __getitem__(self, key):
        if key == "device":
            return getattr(_thread, "device", 0)
        if key == "set_device_calls":
            return _Current.calls
        raise KeyError(key)

    def __setitem__(self, key, value):
        if key == "device":
            _thread.device = value
        elif key == "set_device_calls":
            _Current.calls = value
        else:
            raise KeyError(key)


current = _Current()


class OutOfMemoryError(RuntimeError):
    pass


class _Device:
    def __init__(self, type_, index):
        self.type, self.index = type_, index


def device(spec, index=None):
    if isinstance(spec, _Device):
        return spec
    type_, _, idx = str(spec).partition(":")
    return _Device(type_, index if index is not None else (int(idx) if idx else None))


class Tensor:
    def __init__(self, address, nbytes, dev=0, shape=None, element_size=4, block=None):
        self._address, self._nbytes, self._block = address, nbytes, block
        self.device = _Device("cuda", dev)
        self.is_cuda = True
        self.shape = tuple(shape) if shape is not None else (nbytes // element_size,)
        self._element_size = element_size

    def data_ptr(self):
        return self._address

    def get_device(self):
        return self.device.index if self.is_cuda else -1

    def is_contiguous(self):
        return True  # stride() is always the contiguous one

    @property
    def nbytes(self):
        return self.numel() * self._element_size

    def numel(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    def element_size(self):
        return self._element_size

    def stride(self):
        out, acc = [], 1
        for s in reversed(self.shape):
            out.append(acc)
            acc *= s
        return tuple(reversed(out))

    def free(self):
        """What PyTorch does when the last reference goes: the block returns to its pool and
        merges with its free neighbours."""
        if self._block is not None:
            _free_block(self._block)
            self._block = None


# PyTorch's cumulative block counters (torch._C._cuda_memoryStats(device)[name]["all"]), for the
# whole fake (one device is enough for the tests): every block allocation and free moves them.
_counters = {name: {"allocated": 0, "freed": 0} for name in ("allocation", "active")}


def _count(name, kind):
    _counters[name][kind] += 1


def _memory_stats(device):
    out = {}
    for name, c in _counters.items():
        current = c["allocated"] - c["freed"] + c.get("base", 0)
        out[name] = {"all": {"allocated": c["allocated"], "freed": c["freed"], "current": current, "peak": 0}}
    return out


def reset_accumulated_memory_stats(device=None):
    """As PyTorch: allocated and freed go back to 0, current stays."""
    for name, c in _counters.items():
        c["base"] = c["allocated"] - c["freed"] + c.get("base", 0)
        c["allocated"] = c["freed"] = 0


class CPUTensor(Tensor):
    def __init__(self, nbytes):
        super().__init__(0x1000, nbytes)
        self.device, self.is_cuda = _Device("cpu", None), False


class _Pluggable:
    def __init__(self, path, alloc_name, free_name):
        lib = ctypes.CDLL(path)
        self.malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
            ctypes.cast(getattr(lib, alloc_name), ctypes.c_void_p).value
        )
        self.free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
            ctypes.cast(getattr(lib, free_name), ctypes.c_void_p).value
        )

    def allocator(self):
        return self


class _NativeAllocator:
    """cudaMalloc / cudaFree for a pool without an allocator: addresses no torpor pool contains."""

    freed: list = []  # (address, size) of every segment given back, for tests

    def malloc(self, nbytes, dev, stream):
        return 0x6000_0000_0000 + next(_ids) * (1 << 32)

    def free(self, ptr, nbytes, dev, stream):
        _NativeAllocator.freed.append((ptr, nbytes))


class _PrivatePool:
    """The allocator's side of a private pool (PyTorch's PrivatePool): its segments and its use
    count. It outlives the MemPool object: a pool still used by a graph, or holding live blocks,
    stays until empty_cache finds it unused and empty."""

    def __init__(self, pool_id, allocator, device):
        self.id, self.allocator, self.device = pool_id, allocator, device
        self.segments = []
        self.use_count = 0

    def allocate(self, nbytes, dev):
        """(address, block) of a new block of `nbytes` on the calling thread's stream."""
        size = _round_size(nbytes)
        small = size <= SMALL_SIZE
        stream = id(_current_stream(dev))
        with _lock:
            block = self._best_fit(size, small, stream, dev)
            if block is None:
                block = self._new_segment(size, small, stream, dev)
            rest = block["size"] - size
            if rest >= ALIGN if small else rest > SMALL_SIZE:
                seg = block["segment"]
                i = seg["blocks"].index(block)
                seg["blocks"].insert(
                    i + 1, {"address": block["address"] + size, "size": rest, "state": "inactive", "segment": seg}
                )
                block["size"] = size
            block["state"] = "active_allocated"
            _count("allocation", "allocated")
            _count("active", "allocated")
            return block["address"], block

    def _best_fit(self, size, small, stream, dev):
        fits = [
            b
            for seg in self.segments
            if seg["device"] == dev and seg["stream"] == stream and (seg["segment_type"] == "small") == small
            for b in seg["blocks"]
            if b["state"] == "inactive" and b["size"] >= size
        ]
        return min(fits, key=lambda b: (b["size"], b["address"])) if fits else None

    def _new_segment(self, size, small, stream, dev):
        if small:
            seg_bytes = SEGMENT
        elif size < MIN_LARGE_ALLOC:
            seg_bytes = LARGE_BUFFER
        else:
            seg_bytes = -(-size // SEGMENT) * SEGMENT
        ptr = self.allocator.malloc(seg_bytes, dev, None)
        if not ptr:
            # PyTorch gives back the cached segments of released pools and retries once.
            _release_unused(None)
            ptr = self.allocator.malloc(seg_bytes, dev, None)
        if not ptr:
            raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} bytes")
        seg = {
            "device": dev,
            "address": ptr,
            "total_size": seg_bytes,
            "stream": stream,
            "segment_type": "small" if small else "large",
            "is_expandable": False,
            "segment_pool_id": self.id,
            "blocks": [],
        }
        seg["blocks"].append({"address": ptr, "size": seg_bytes, "state": "inactive", "segment": seg})
        self.segments.append(seg)
        return seg["blocks"][0]

    def release_free_segments(self):
        """Give every segment without an allocated block back through the allocator's free."""
        with _lock:
            keep = []
            for seg in self.segments:
                if len(seg["blocks"]) == 1 and seg["blocks"][0]["state"] == "inactive":
                    self.allocator.free(seg["address"], seg["total_size"], seg["device"], None)
                    seg["blocks"][0]["state"] = "released"  # a stale Tensor's block: never reused
                else:
                    keep.append(seg)
            self.segments = keep

    def snapshot(self):
        with _lock:
            return [
                {
                    **{k: v for k, v in s.items() if k != "blocks"},
                    "blocks": [{k: v for k, v in b.items() if k != "segment"} for b in s["blocks"]],
                }
                for s in sorted(self.segments, key=lambda s: s["address"])
            ]


def _round_size(nbytes):
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


def _free_block(block):
    """A block back to its segment's free blocks, merged with free neighbours (free_block and
    try_merge_blocks)."""
    with _lock:
        if block["state"] != "active_allocated":
            return
        block["state"] = "inactive"
        _count("allocation", "freed")
        _count("active", "freed")
        blocks = block["segment"]["blocks"]
        i = blocks.index(block)
        if i + 1 < len(blocks) and blocks[i + 1]["state"] == "inactive":
            block["size"] += blocks.pop(i + 1)["size"]
        if i > 0 and blocks[i - 1]["state"] == "inactive":
            blocks[i - 1]["size"] += blocks.pop(i)["size"]


def _incref(pool_id, allocator=None, device=None):
    """createOrIncrefPool: the private pool of `pool_id`, made when missing, one more user."""
    with _lock:
        pool = _pools_by_id.get(pool_id)
        if pool is None:
            pool = _pools_by_id[pool_id] = _PrivatePool(
                pool_id, allocator if allocator is not None else _NativeAllocator(), device
            )
        pool.use_count += 1
        return pool


def _release_pool(pool_id):
    """releasePool: one user fewer."""
    with _lock:
        pool = _pools_by_id.get(pool_id)
        if pool is not None and pool.use_count > 0:
            pool.use_count -= 1


def _release_unused(pool_id):
    """emptyCache's part for private pools: every pool nothing uses (or only `pool_id`'s, when
    given) gives its wholly free segments back; a pool left with no segment is forgotten."""
    with _lock:
        for pid, pool in list(_pools_by_id.items()):
            if pool.use_count == 0 and (pool_id is None or pid == pool_id):
                pool.release_free_segments()
                if not pool.segments:
                    del _pools_by_id[pid]


def empty_cache():
    """torch.cuda.empty_cache: the cached segments of pools nothing uses any more go back. A live
    MemPool's stay (pytorch#145168), and so do segments holding a live block."""
    _release_unused(None)


class MemPool:
    """torch.cuda.MemPool: a private pool, one of its users while this object lives; destroying it
    releases the pool and empties its cache (MemPool.cpp's destructor)."""

    def __init__(self, allocator=None, pool_id=None):
        self.allocator = allocator if allocator is not None else _NativeAllocator()
        self.id = pool_id if pool_id is not None else (0, next(_ids))
        self.device = current["device"]
        self.extra_segments = []  # what a test wants snapshot() to list besides (e.g. expandable)
        self._pool = _incref(self.id, self.allocator, self.device)

    @property
    def segments(self):
        return self._pool.segments

    def use_count(self):
        return self._pool.use_count

    def allocate(self, nbytes, dev):
        return self._pool.allocate(nbytes, dev)

    def snapshot(self):
        return self._pool.snapshot() + self.extra_segments

    def __del__(self):
        try:
            _release_pool(self.id)
            _release_unused(self.id)
        except Exception:  # noqa: BLE001 - a destructor at interpreter exit must not raise
            pass


def _active_pools():
    if not hasattr(_thread, "active"):
        _thread.active = {}
    return _thread.active


@contextlib.contextmanager
def use_mem_pool(pool, device=None):
    """The calling thread's allocations on `device` go to `pool` inside (only this thread's:
    _cuda_beginAllocateCurrentThreadToPool), the pool one more user meanwhile."""
    dev = current["device"] if device is None else device
    active = _active_pools()
    previous = active.get(dev)
    _incref(pool.id)
    active[dev] = pool.id
    try:
        yield
    finally:
        if previous is None:
            del active[dev]
        else:
            active[dev] = previous
        _release_pool(pool.id)


def empty(nbytes, shape=None, element_size=4):
    """A CUDA tensor on the current device: in the pool of the capture underway on the current
    stream, else in this thread's active pool, or (outside any pool) at a made-up address that
    no torpor pool contains, like PyTorch's default pool."""
    dev = current["device"]
    capture = _current_stream(dev).capture
    pool_id = capture.pool_id if capture is not None else _active_pools().get(dev)
    if pool_id is None:
        with _lock:
            _count("allocation", "allocated")  # PyTorch's counters are the device's, every pool's
            _count("active", "allocated")
        return Tensor(0x7000_0000_0000 + next(_ids) * SEGMENT, nbytes, dev, shape, element_size)
    address, block = _pools_by_id[pool_id].allocate(nbytes, dev)
    return Tensor(address, nbytes, dev, shape, element_size, block)


class Module:
    """Parameters and submodules by name (a Module among the keyword arguments is a submodule),
    in the two dicts nn.Module keeps them in; a parameter may be None, as in PyTorch."""

    def __init__(self, **members):
        self._parameters = {k: v for k, v in members.items() if not isinstance(v, Module)}
        self._modules = {k: v for k, v in members.items() if isinstance(v, Module)}

    def named_modules(self, memo=None, prefix=""):
        memo = set() if memo is None else memo
        if id(self) in memo:
            return
        memo.add(id(self))
        yield prefix, self
        for name, m in self._modules.items():
            yield from m.named_modules(memo, f"{prefix}.{name}" if prefix else name)

    def named_parameters(self, prefix=""):
        seen = set()
        for module_prefix, m in self.named_modules(prefix=prefix):
            for name, p in m._parameters.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{module_prefix}.{name}" if module_prefix else name), p


def _set_device(i):
    current["device"] = i
    current["set_device_calls"] += 1


@contextlib.contextmanager
def _device(i):
    previous = current["device"]
    current["device"] = i
    try:
        yield
    finally:
        current["device"] = previous


class Stream:
    def __init__(self, device=None):
        self.device = current["device"] if device is None else device
        self.capture = None  # the CUDAGraph capturing on this stream


_default_streams: dict[int, Stream] = {}  # device -> its default stream, shared by every thread


def _default_stream_of(dev):
    with _lock:
        if dev not in _default_streams:
            _default_streams[dev] = Stream(dev)
        return _default_streams[dev]


def _current_stream(dev=None):
    """The calling thread's current stream on `dev` (default: its current device)."""
    dev = current["device"] if dev is None else dev
    streams = getattr(_thread, "streams", None)
    if streams is None:
        streams = _thread.streams = {}
    return streams.get(dev) or _default_stream_of(dev)


@contextlib.contextmanager
def _stream(s):
    """torch.cuda.stream(s): `s` is the calling thread's current stream on its device inside."""
    _current_stream(s.device)  # makes this thread's table
    streams = _thread.streams
    previous = streams.get(s.device)
    streams[s.device] = s
    try:
        yield
    finally:
        if previous is None:
            del streams[s.device]
        else:
            streams[s.device] = previous


def launch(fn):
    """A kernel: recorded by the capture underway on the current stream, else run now."""
    capture = _current_stream().capture
    if capture is not None:
        capture.work.append(fn)
    else:
        fn()


class CUDAGraph:
    captures = []  # (graph, pool id) of every capture_begin, for tests

    def __init__(self, keep_graph=False):
        self.work, self.stream, self.pool_id, self.captured = [], None, None, False

    @property
    def pool(self):
        return _pools_by_id.get(self.pool_id)

    def capture_begin(self, pool=None, capture_error_mode="global"):
        stream = _current_stream()
        if stream is _default_stream_of(stream.device):
            raise RuntimeError("CUDA graphs must be captured on a non-default stream.")
        if pool is None:
            pool = (next(_ids), 0)
        # The graph is one more user of its pool until reset (a new pool has no allocator: cudaMalloc).
        _incref(tuple(pool), None, stream.device)
        self.pool_id, self.stream, self.capture_error_mode = tuple(pool), stream, capture_error_mode
        stream.capture = self
        CUDAGraph.captures.append((self, self.pool_id))

    def capture_end(self):
        self.stream.capture = None
        self.captured = True

    def replay(self):
        assert self.captured, "replay without a capture"
        for fn in self.work:
            fn()

    def reset(self):
        """The graph's work goes and its pool has one user fewer (as when the graph is destroyed)."""
        if self.pool_id is not None:
            _release_pool(self.pool_id)
            self.pool_id, self.work, self.captured = None, [], False

    def __del__(self):
        try:
            self.reset()
        except Exception:  # noqa: BLE001 - a destructor at interpreter exit must not raise
            pass


class graph:
    """torch.cuda.graph, as PyTorch writes it: capture_begin(*pool) on the capture stream."""

    default_capture_stream = None

    def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        if graph.default_capture_stream is None:
            graph.default_capture_stream = Stream()
        self.pool = () if pool is None else (pool,)
        self.capture_stream = stream if stream is not None else graph.default_capture_stream
        self.cuda_graph, self.capture_error_mode = cuda_graph, capture_error_mode

    def __enter__(self):
        self.stream_ctx = _stream(self.capture_stream)
        self.stream_ctx.__enter__()
        self.cuda_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)

    def __exit__(self, *exc):
        self.cuda_graph.capture_end()
        self.stream_ctx.__exit__(*exc)


cuda = types.SimpleNamespace(
    is_available=lambda: True,
    current_device=lambda: current["device"],
    set_device=_set_device,
    device=_device,
    empty_cache=empty_cache,
    OutOfMemoryError=OutOfMemoryError,
    MemPool=MemPool,
    Stream=Stream,
    stream=_stream,
    current_stream=lambda device=None: _current_stream(device),
    CUDAGraph=CUDAGraph,
    graph=graph,
    memory=types.SimpleNamespace(
        CUDAPluggableAllocator=_Pluggable,
        MemPool=MemPool,
        use_mem_pool=use_mem_pool,
        _set_allocator_settings=settings_calls.append,
    ),
)
live_checks = []  # (device, pool id) of every _cuda_checkPoolLiveAllocations call, for tests


def _check_pool_live_allocations(device, pool_id, expected):
    """Whether the allocated blocks of a private pool are exactly `expected` (addresses), as
    PyTorch's CUDACachingAllocator::checkPoolLiveAllocations answers."""
    live_checks.append((device, tuple(pool_id)))
    pool = _pools_by_id[tuple(pool_id)]
    with _lock:
        live = {
            b["address"]
            for seg in pool.segments
            if seg["device"] == device
            for b in seg["blocks"]
            if b["state"] == "active_allocated"
        }
    return live == set(expected)


nn = types.SimpleNamespace(Module=Module)
_C = types.SimpleNamespace(_cuda_memoryStats=_memory_stats, _cuda_checkPoolLiveAllocations=_check_pool_live_allocations)
