"""Values that cross into the C API, checked where they enter: whole numbers in a C type's range
(sizes, addresses, ids), C strings and sleep levels. Every Python function that hands such a
value to ctypes checks it here first. A SleepLevel, once made, passes every later call unchecked
(the level is validated once per boundary, as the C API validates it once on its side)."""

from __future__ import annotations

import enum

from .errors import InvalidArgument, InvalidType

SIZE_MAX = 2**64 - 1  # also the largest address a void* holds on the 64-bit targets torpor builds for
INT_MAX = 2**31 - 1
ULLONG_MAX = 2**64 - 1


def whole(value, what: str, lo: int, hi: int) -> int:
    """`value` as an int in [lo, hi]: InvalidArgument naming the range otherwise (a C size_t
    would silently wrap 2**64 + 5 to 5; bool and float are refused, not truncated)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidType(f"{what} {value!r} is not a whole number (accepted: {lo} to {hi})")
    v = value.__index__()
    if not lo <= v <= hi:
        raise InvalidArgument(f"{what} {v} is out of range (accepted: {lo} to {hi})")
    return v


def address(value, what: str) -> int:
    """A pointer for the C API, as an int in [0, 2**64 - 1] (ctypes would wrap 2**64 + p to p,
    and read a str as the address of its own buffer): see whole()."""
    return whole(value, what, 0, SIZE_MAX)


def text(value, what: str, allow_empty: bool = False) -> bytes:
    """`value` as UTF-8 bytes for the C API: a str without NUL (a C string ends there, so the
    rest would be cut silently) and without lone surrogates (not UTF-8); InvalidArgument naming
    `what` otherwise."""
    if not isinstance(value, str):
        raise InvalidType(f"{what} {value!r} is not a non-empty string (a {type(value).__name__})")
    if not value and not allow_empty:
        raise InvalidArgument(f"{what} {value!r} is not a non-empty string")
    if "\0" in value:
        raise InvalidArgument(f"{what} {value!r} holds a NUL character (C strings end there): remove it")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"{what} {value!r} is not valid Unicode text (a lone surrogate?)") from None


class SleepLevel(enum.IntEnum):
    """A sleep level, as torpor::SleepLevel (allocator/include/torpor/pool.hpp)."""

    NONE = 0  # nothing moves
    OFFLOAD = 1  # parameters and state offloaded, cache discarded
    DISCARD_PARAMETERS = 2  # parameters discarded too, unless preserved; state offloaded


def sleep_level(value, what: str = "sleep level") -> SleepLevel:
    """`value` (0, 1, 2 or a SleepLevel) as a SleepLevel; InvalidArgument naming `what` otherwise."""
    if isinstance(value, SleepLevel):
        return value
    return SleepLevel(whole(value, what, 0, 2))
