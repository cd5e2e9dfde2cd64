"""The pool options (torpor.h's torpor_pool_options) in Python: one description, ``PoolOptions``,
used by everything that makes or configures a pool (torpor.Pool(...), torpor.configure,
torpor.use_pool(exportable=True), the engine modes through torpor.engine.reconfigure).

Each option is one row, a field of PoolOptions: its name, the ctypes type of its C field and the
function that checks a Python value and turns it into that C value. The C struct is built from
the rows (``CPoolOptions``: the device, then the rows in the header's order, then a reserve), so a
new option of torpor_pool_options is one row here and nothing else in Python. Defaults are the
library's: a field left at ``LIBRARY_DEFAULT`` keeps what torpor_pool_options_init writes, so
Python spells no default (nor any backend or fill name: those are read from the library).

Checks run when a PoolOptions is made (and again by dataclasses.replace), so an options object
that exists is valid; ``c_struct(device)`` gives the C struct for one device.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from typing import Any, Callable

from .. import _lib
from ..errors import InvalidArgument, InvalidType
from ..values import INT_MAX, SIZE_MAX, choice, whole


class _LibraryDefault:
    """The value of an option left to torpor_pool_options_init."""

    def __repr__(self) -> str:
        return "LIBRARY_DEFAULT"

    def __reduce__(self):
        return "LIBRARY_DEFAULT"


LIBRARY_DEFAULT: Any = _LibraryDefault()


def _choice(enum: str):
    """A name of the library's enumeration `enum` (torpor._lib.enum_values) -> its value."""

    def to_c(value, what: str) -> int:
        return choice(enum, value, what)

    return to_c


def _size(accepted: str):
    """A byte count for a size_t, the message saying what 0 means."""

    def to_c(value, what: str) -> int:
        return whole(value, f"{what} ({accepted})", 0, SIZE_MAX)

    return to_c


def _switch(error: type):
    """True or False exactly (`error` for anything else) -> 1 or 0."""

    def to_c(value, what: str) -> int:
        if not isinstance(value, bool):
            raise error(f"{what} {value!r} is not True or False")
        return 1 if value else 0

    return to_c


def _truth(value, what: str) -> int:
    """Any value, by its truth -> 1 or 0."""
    return 1 if value else 0


def _spill_dir(value, what: str) -> bytes | None:
    """None for none (None or ""), else the path's bytes, which must be UTF-8 (the pool reports its
    spill path as JSON text, so a path that is not UTF-8 would fail every stats() call for the
    pool's life) and hold no NUL (the C string would end there). The C API copies the string;
    ctypes keeps these bytes alive in the struct until then."""
    if value is None:
        return None
    try:
        path = os.fspath(value)
    except TypeError:
        raise InvalidType(
            f"{what} {value!r} is not a path (give a str, bytes or os.PathLike, or None for no disk tier)"
        ) from None
    raw = os.fsencode(path)  # a str path's undecodable bytes come back as they are on disk
    if not raw:
        return None
    if b"\0" in raw:
        raise InvalidArgument(f"{what} {path!r} holds a NUL character (C strings end there): remove it")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(
            f"{what} {path!r} is not valid UTF-8 (torpor reports the spill path as text): choose a directory "
            f"whose path is UTF-8"
        ) from None
    return raw


def _option(ctype, to_c: Callable[[Any, str], Any]):
    """One row: a field of PoolOptions with its C type and its check-and-convert."""
    return dataclasses.field(default=LIBRARY_DEFAULT, metadata={"ctype": ctype, "to_c": to_c})


@dataclasses.dataclass(frozen=True)
class PoolOptions:
    """The options of a pool (torpor_pool_options; allocator/include/torpor/pool.hpp's PoolOptions
    says more), each defaulting to the library's. The rows, in the C struct's order:

    - backend: auto (TORPOR_BACKEND, else cuda when usable, else host), host or cuda (the
      library's torpor_backend names).
    - va_bytes: address space to reserve (0 = twice the device's memory).
    - fill_on_wake: what discarded bytes hold after wake: none, zero, or poison (0xFF bytes, NaN in
      fp32/fp16/bf16, so a forgotten weight reload shows).
    - exportable: memory with shareable handles (POSIX descriptors; fabric handles where the device
      can), GPUDirect RDMA capable where the device can (Pool.export_handles). True or False.
    - skip_unchanged (default on): keep the host copies after wake so that an unchanged re-sleep
      copies nothing, at the price of that host memory while awake (release_host_store() gives
      it back).
    - host_store_limit: page-locked host bytes at most (0 = none); beyond it backups go to
      pageable memory, or with spill_dir to a file there.
    - host_store_prepare: bytes to start page-locking in the background when the pool is made.
    - spill_dir: the disk tier's directory (UTF-8, no NUL; None or "" for none).
    - spill_limit: disk bytes at most (0 = what the disk holds).
    - spill_file_per_allocation: a file of its own in spill_dir for each allocation's backed-up
      bytes (torch_memory_saver's layout) instead of one file per pool. True or False.
    """

    backend: str = _option(ctypes.c_int, _choice("backend"))
    va_bytes: int = _option(ctypes.c_size_t, _size("0 = twice the device's memory"))
    fill_on_wake: str = _option(ctypes.c_int, _choice("fill"))
    exportable: bool = _option(ctypes.c_int, _switch(InvalidType))
    skip_unchanged: bool = _option(ctypes.c_int, _truth)
    host_store_limit: int = _option(ctypes.c_size_t, _size("0 = no limit"))
    host_store_prepare: int = _option(ctypes.c_size_t, _size("0 = none"))
    spill_dir: str | os.PathLike | bytes | None = _option(ctypes.c_char_p, _spill_dir)
    spill_limit: int = _option(ctypes.c_size_t, _size("0 = what the disk holds"))
    spill_file_per_allocation: bool = _option(ctypes.c_int, _switch(InvalidArgument))

    def __post_init__(self) -> None:
        self._c_values()  # an options object that exists is valid

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options' names, in the C struct's order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def given(self) -> dict[str, Any]:
        """{name: value} of the options not left to the library's default."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not LIBRARY_DEFAULT
        }

    def _c_values(self) -> dict[str, Any]:
        """{field: its C value} of the options given, each checked."""
        return {name: _ROWS[name].metadata["to_c"](value, name) for name, value in self.given().items()}

    def c_struct(self, device: int = 0) -> CPoolOptions:
        """torpor_pool_options for `device`: the library's defaults (torpor_pool_options_init),
        then the device and every option given."""
        out = CPoolOptions()
        _lib.lib().torpor_pool_options_init(ctypes.byref(out))
        out.device = whole(device, "device", 0, INT_MAX)
        for name, value in self._c_values().items():
            setattr(out, name, value)
        return out


_ROWS = {f.name: f for f in dataclasses.fields(PoolOptions)}


class CPoolOptions(ctypes.Structure):
    """torpor_pool_options, from the rows of PoolOptions. The trailing reserve keeps
    torpor_pool_options_init inside this buffer should a later library append fields (it writes
    the whole C struct)."""

    _fields_ = (
        [("device", ctypes.c_int)]
        + [(f.name, f.metadata["ctype"]) for f in dataclasses.fields(PoolOptions)]
        + [("_reserved", ctypes.c_char * 256)]
    )


__all__ = ["LIBRARY_DEFAULT", "CPoolOptions", "PoolOptions"]
