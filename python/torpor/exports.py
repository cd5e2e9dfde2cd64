"""Shareable handles of an exportable pool's memory (torpor_export_handles), for KV transports.

    with pool.export_handles("kv_cache") as chunks:       # torpor.Pool, or torpor.export_handles()
        for c in chunks:                                   # for PyTorch's pools
            transport.register(c.va, c.nbytes, c.fd if c.kind == "posix_fd" else c.fabric_handle)

One ExportedChunk per chunk (one physical handle mapped at a fixed span): ``va``, ``nbytes``,
``tag``, ``kind`` ("posix_fd": a descriptor for a process of this node; "fabric": 64 bytes for any
node of the NVLink domain, through the IMEX service), ``fd`` or ``fabric_handle``, and
``gpu_direct_rdma`` (created GPUDirect RDMA capable: a NIC may register it).

Ownership: an ExportedChunk owns its descriptor. close() (also on leaving a with-block, and when
the object is collected) closes it; ``detach_fd()`` hands it over, after which the caller closes
it. ExportedHandles, the list export_handles returns, closes all of its chunks the same way.

A handle names the memory mapped now. The tag's next sleep releases that memory, and its wake
maps new memory, with new handles, at the same addresses; an open descriptor, like any import of
it, may keep the released memory alive (on the host backend it does). So a transport closes its
handles in a before_unmap tag hook and exports again in an after_map one
(torpor.engine.hooks.add_mapping_hooks, Pool.add_tag_hooks, vLLM's register_tag_hooks in the vLLM mode).
"""

from __future__ import annotations

import ctypes
import os

from . import _lib
from .errors import InvalidArgument, InvalidState

# How often an export is asked again when chunks appeared between the count and the export.
_RETRIES = 8


class ExportedChunk(_lib.Closing):
    """One chunk's shareable handle (see the module note)."""

    def __init__(
        self,
        va: int,
        nbytes: int,
        tag: str,
        kind: str,
        fd: int | None,
        fabric_handle: bytes | None,
        gpu_direct_rdma: bool,
    ):
        self.va = va
        self.nbytes = nbytes
        self.tag = tag
        self.kind = kind
        self.fabric_handle = fabric_handle
        self.gpu_direct_rdma = gpu_direct_rdma
        self._fd = fd

    @property
    def fd(self) -> int | None:
        """The descriptor (kind "posix_fd"), still owned by this object; None for a fabric
        handle. InvalidState once closed or detached."""
        if self.kind != "posix_fd":
            return None
        if self._fd is None:
            raise InvalidState(
                f"the descriptor of chunk {self.va:#x} (tag '{self.tag}') was closed or detached; export again"
            )
        return self._fd

    def detach_fd(self) -> int:
        """Hand the descriptor over: the caller owns it from now on and must os.close() it."""
        fd = self.fd
        if fd is None:
            raise InvalidArgument(f"chunk {self.va:#x} was exported as a {self.kind} handle: it has no descriptor")
        self._fd = None
        return fd

    @property
    def closed(self) -> bool:
        return self.kind == "posix_fd" and self._fd is None

    def close(self) -> None:
        """Close the descriptor (idempotent; nothing to do for a fabric handle)."""
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)

    def __repr__(self) -> str:
        held = f"fd {self._fd}" if self._fd is not None else ("closed" if self.kind == "posix_fd" else "fabric")
        return f"<torpor.ExportedChunk {self.tag!r} {self.va:#x}+{self.nbytes:#x} {held}>"


class ExportedHandles(list):
    """The ExportedChunks of one export, in address order; close() (or leaving a with-block)
    closes every descriptor not detached."""

    def close(self) -> None:
        errors = []
        for chunk in self:
            try:
                chunk.close()
            except OSError as e:  # close the rest regardless
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> "ExportedHandles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _chunk(e, kinds: dict[int, str]) -> ExportedChunk:
    kind = kinds[e.kind]
    return ExportedChunk(
        va=int(e.va or 0),
        nbytes=int(e.bytes),
        tag=e.tag.decode("utf-8", errors="replace"),
        kind=kind,
        fd=int(e.fd) if kind == "posix_fd" else None,
        fabric_handle=bytes(e.fabric) if kind == "fabric" else None,
        gpu_direct_rdma=bool(e.gpu_direct_rdma),
    )


def export(handle: int, tags_array, count: int, kind: int) -> ExportedHandles:
    """torpor_export_handles on pool `handle` (tags already encoded: None and 0 for every tag):
    asks how many chunks there are, then exports them into a buffer of that size, asking again
    should chunks appear in between. Every descriptor received is owned by an ExportedChunk
    before anything else can fail."""
    lib = _lib.lib()
    kinds = {v: k for k, v in _lib.enum_values("handle_kind").items()}
    needed = ctypes.c_size_t(0)
    _lib.check(lib.torpor_export_handles(handle, tags_array, count, kind, None, 0, ctypes.byref(needed)))
    for _ in range(_RETRIES):
        capacity = needed.value
        if capacity == 0:
            return ExportedHandles()
        buf = (_lib.ChunkExport * capacity)()
        got = ctypes.c_size_t(0)
        status = lib.torpor_export_handles(handle, tags_array, count, kind, buf, capacity, ctypes.byref(got))
        if status == InvalidArgument.status and got.value > capacity:
            needed = got  # chunks appeared since the count: nothing was exported, ask again
            continue
        _lib.check(status)
        out = ExportedHandles()
        try:
            for i in range(got.value):
                out.append(_chunk(buf[i], kinds))
        except BaseException:
            out.close()
            for i in range(len(out), got.value):  # not wrapped yet: close them here
                if buf[i].fd >= 0:
                    os.close(buf[i].fd)
            raise
        return out
    raise InvalidState(f"export_handles: the pool's chunks kept changing while they were exported ({_RETRIES} tries)")


__all__ = ["ExportedChunk", "ExportedHandles"]
