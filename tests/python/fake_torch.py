"""A stand-in for the part of PyTorch that torpor's embedding touches, for CI (no torch, no
GPU). It is small on purpose and models exactly the behaviour torpor depends on:

- CUDAPluggableAllocator(path, alloc_name, free_name) loads the two entry points from the
  library and calls them for whole segments, on the allocating thread;
- MemPool(allocator) + use_mem_pool(pool, device) route the thread's allocations to the pool;
  a pool caches freed blocks and never returns segments while it lives (pytorch#145168);
- when a segment allocation fails: raise OutOfMemoryError (after the retry PyTorch makes);
- MemPool.snapshot() lists segments with their blocks and states, in address order;
- Module.named_parameters(prefix) yields tensors with data_ptr/shape/stride/element_size;
- CUDA graphs: cuda.graph(g, pool, stream, capture_error_mode) captures on a stream
  (capture_begin(pool) / capture_end, as torch.cuda.graph calls them); while a stream
  captures, its allocations come from the private pool of that id (a MemPool's, or a new one
  outside every torpor pool, like cudaMalloc) and launch(fn) records fn instead of running it;
  replay() runs the recorded work; blocks freed during capture stay cached in that pool.

Device memory is torpor's host backend, so tensor bytes are real and readable.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import types

SEGMENT = 2 << 20
ALIGN = 512

_ids = itertools.count(1)
_active: dict[int, "MemPool"] = {}  # device -> pool of the (single) allocating thread
_pools_by_id: dict[tuple, "MemPool"] = {}  # PyTorch's private pools, by id
settings_calls: list[str] = []
current = {"device": 0, "set_device_calls": 0}


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
        """What PyTorch does when the last reference goes: the block returns to its pool."""
        if self._block is not None:
            self._block["state"] = "inactive"
            self._block = None
            _count("allocation", "freed")
            _count("active", "freed")


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
    """cudaMalloc for a private pool without an allocator: addresses no torpor pool contains."""

    def malloc(self, nbytes, dev, stream):
        return 0x6000_0000_0000 + next(_ids) * (1 << 32)


class MemPool:
    def __init__(self, allocator=None, pool_id=None):
        self.allocator = allocator if allocator is not None else _NativeAllocator()
        self.id = pool_id if pool_id is not None else (0, next(_ids))
        self.device = current["device"]
        self.segments = []
        self.extra_segments = []  # what a test wants snapshot() to list besides (e.g. expandable)
        _pools_by_id[self.id] = self

    def allocate(self, nbytes, dev):
        size = -(-nbytes // ALIGN) * ALIGN
        for seg in self.segments:
            at = seg["address"]
            for i, b in enumerate(seg["blocks"]):
                if b["state"] == "inactive" and b["size"] >= size:
                    rest = b["size"] - size
                    b.update(size=size, state="active_allocated")
                    if rest:
                        seg["blocks"].insert(i + 1, {"address": at + size, "size": rest, "state": "inactive"})
                    _count("allocation", "allocated")
                    _count("active", "allocated")
                    return b["address"], b
                at += b["size"]
        seg_bytes = max(SEGMENT, -(-size // SEGMENT) * SEGMENT)
        ptr = None
        for _ in range(2):  # PyTorch frees cached blocks of other pools and retries once
            ptr = self.allocator.malloc(seg_bytes, dev, None)
            if ptr:
                break
        if not ptr:
            raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} bytes")
        block = {"address": ptr, "size": size, "state": "active_allocated"}
        blocks = [block] + (
            [{"address": ptr + size, "size": seg_bytes - size, "state": "inactive"}] if seg_bytes > size else []
        )
        _count("allocation", "allocated")
        _count("active", "allocated")
        self.segments.append(
            {
                "device": dev,
                "address": ptr,
                "total_size": seg_bytes,
                "is_expandable": False,
                "segment_pool_id": self.id,
                "blocks": blocks,
            }
        )
        return ptr, block

    def snapshot(self):
        return [dict(s, blocks=[dict(b) for b in s["blocks"]]) for s in self.segments] + self.extra_segments


@contextlib.contextmanager
def use_mem_pool(pool, device=None):
    dev = current["device"] if device is None else device
    previous = _active.get(dev)
    _active[dev] = pool
    try:
        yield
    finally:
        if previous is None:
            del _active[dev]
        else:
            _active[dev] = previous


def empty(nbytes, shape=None, element_size=4):
    """A CUDA tensor on the current device: in the pool of the capture underway on the current
    stream, else in the active pool, or (outside any pool) at a made-up address that no torpor
    pool contains, like PyTorch's default pool."""
    dev = current["device"]
    capture = _stream_state["current"].capture
    pool = capture.pool if capture is not None else _active.get(dev)
    if pool is None:
        _count("allocation", "allocated")  # PyTorch's counters are the device's, every pool's
        _count("active", "allocated")
        return Tensor(0x7000_0000_0000 + next(_ids) * SEGMENT, nbytes, dev, shape, element_size)
    address, block = pool.allocate(nbytes, dev)
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


_stream_state = {"current": Stream(0)}
_default_stream = _stream_state["current"]


@contextlib.contextmanager
def _stream(s):
    previous = _stream_state["current"]
    _stream_state["current"] = s
    try:
        yield
    finally:
        _stream_state["current"] = previous


def launch(fn):
    """A kernel: recorded by the capture underway on the current stream, else run now."""
    capture = _stream_state["current"].capture
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
        return _pools_by_id[self.pool_id] if self.pool_id in _pools_by_id else None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        stream = _stream_state["current"]
        if stream is _default_stream:
            raise RuntimeError("CUDA graphs must be captured on a non-default stream.")
        if pool is None:
            pool = (next(_ids), 0)
        if tuple(pool) not in _pools_by_id:
            MemPool(None, tuple(pool))  # PyTorch makes the private pool, with no allocator: cudaMalloc
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
    empty_cache=lambda: None,
    OutOfMemoryError=OutOfMemoryError,
    MemPool=MemPool,
    Stream=Stream,
    stream=_stream,
    current_stream=lambda: _stream_state["current"],
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
