"""Values that cross into the C API, checked where they enter: whole numbers in a C type's range
(sizes, addresses, ids), C strings, names of the library's enumerations and sleep levels. Every
Python function that hands such a value to ctypes checks it here first. A SleepLevel, once made,
passes every later call unchecked (the level is validated once per boundary, as the C API
validates it once on its side). The levels themselves are the library's
(torpor_sleep_level_name), as the memory classes are."""

from __future__ import annotations

from . import _lib
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


def choice(enum: str, value, what: str) -> int:
    """The library's value of the name `value` in its enumeration `enum` (a backend, a fill, a
    handle kind: torpor._lib.enum_values); InvalidArgument listing the names otherwise."""
    table = _lib.enum_values(enum)
    try:
        return table[value]
    except (KeyError, TypeError):  # TypeError: an unhashable value, e.g. a list
        raise InvalidArgument(f"unknown {what} '{value}' (expected {', '.join(table)})") from None


class _LibraryLevels(type):
    """SleepLevel's members are the library's levels (torpor_sleep_level_name), read when it
    loads: ``SleepLevel.OFFLOAD`` is the level the library names "offload", iterating gives every
    level in value order. Nothing here lists them, so a level torpor.h adds is a member at once."""

    def __getattr__(cls, name: str) -> "SleepLevel":
        if name.startswith("_"):
            raise AttributeError(name)
        value = _lib.enum_values("sleep_level").get(name.lower())
        if value is None or name != name.upper():
            raise AttributeError(
                f"SleepLevel has no member {name!r} (the library's levels: "
                f"{', '.join(n.upper() for n in _lib.enum_values('sleep_level'))})"
            )
        return cls(value)

    def __iter__(cls):
        return iter([cls(value) for value in _lib.enum_values("sleep_level").values()])

    def __len__(cls) -> int:
        return len(_lib.enum_values("sleep_level"))


class SleepLevel(int, metaclass=_LibraryLevels):
    """A sleep level (torpor_sleep_level in torpor.h; what each does to each class: DESIGN's sleep
    table): an int whose value is one of the library's levels, with the library's name
    (``.name``, upper case, as an enum member's). ``SleepLevel(value)`` checks `value` once
    (``sleep_level``); a SleepLevel passes every later call unchecked."""

    __slots__ = ()

    def __new__(cls, value, what: str = "sleep level") -> "SleepLevel":
        if isinstance(value, SleepLevel):
            return value
        levels = _lib.enum_values("sleep_level")
        return super().__new__(cls, whole(value, what, min(levels.values()), max(levels.values())))

    @property
    def name(self) -> str:
        return next(name.upper() for name, value in _lib.enum_values("sleep_level").items() if value == self)

    @property
    def value(self) -> int:
        return int(self)

    def __repr__(self) -> str:
        return f"<SleepLevel.{self.name}: {int(self)}>"

    __str__ = int.__repr__  # as an IntEnum's: the number, so messages read "level 2"


def sleep_level(value, what: str = "sleep level") -> SleepLevel:
    """`value` (a whole number among the library's levels, or a SleepLevel) as a SleepLevel;
    InvalidArgument naming `what` and the accepted range otherwise (InvalidType for a value
    that is not a whole number: bool, float, str). The one check of a level, at every boundary
    where one enters (torpor.Pool, the PyTorch embedding's sleep, the collective sleep)."""
    return SleepLevel(value, what)
