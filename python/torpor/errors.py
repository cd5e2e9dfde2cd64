"""torpor's errors as Python exceptions.

One class per status code of the C API (torpor.h), each also deriving from the built-in
exception a Python caller would expect (InvalidArgument is a ValueError, OutOfMemory a
MemoryError, ...), so generic handlers keep working. The message is torpor's own
(torpor_last_error()), which names the thing and the fix.

The engine-compatible modes (torpor.vllm, torpor.tms) raise these as ``runtime_error(e)``: an
instance of a class deriving from both e's class and RuntimeError (vLLM's allocator raises
RuntimeError, and engines and their tests catch exactly that), with torpor's message, so
``except RuntimeError``, ``except torpor.OutOfMemory`` and ``except MemoryError`` all catch it.

A class knows its status by name (``status_name``, as written in torpor.h); the numeric code
(``status``) comes from the library when it loads (torpor._lib binds it), so nothing here
copies the C values. Before that the classes are importable, raisable and catchable, and
``status`` is None.
"""

from __future__ import annotations

import contextlib
from typing import Callable


class TorporError(Exception):
    """Base of every torpor error. ``status`` is the C API's status code (None for errors
    raised by the Python layer itself, and before the library is loaded), ``status_name`` its
    name."""

    status: int | None = None
    status_name: str = "TORPOR_ERROR"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(TorporError, ValueError):
    """A request that can never succeed as asked: bad size, pointer, tag, class, level."""

    status_name = "TORPOR_ERROR_INVALID_ARGUMENT"


class InvalidType(InvalidArgument, TypeError):
    """An argument of the wrong type (a float or bool where a whole number is meant, a non-str
    tag, something not iterable where a list is meant), refused by the Python layer before the
    C API sees it. An InvalidArgument, and a TypeError as Python's own checks raise."""


class InvalidState(TorporError, RuntimeError):
    """A valid request in the wrong state, e.g. allocating into a sleeping tag."""

    status_name = "TORPOR_ERROR_INVALID_STATE"


class OutOfMemory(TorporError, MemoryError):
    """Device memory, address space or the host backing store is exhausted."""

    status_name = "TORPOR_ERROR_OUT_OF_MEMORY"


class DriverError(TorporError, RuntimeError):
    """A CUDA driver call (or the host backend's emulation of one) failed."""

    status_name = "TORPOR_ERROR_DRIVER"


class Timeout(TorporError, TimeoutError):
    """A bounded wait ran out."""

    status_name = "TORPOR_ERROR_TIMEOUT"


class InvalidHandle(TorporError, ValueError):
    """The pool was destroyed (or never created)."""

    status_name = "TORPOR_ERROR_INVALID_HANDLE"


class InternalError(TorporError, RuntimeError):
    """A bug in torpor: please report it with the message."""

    status_name = "TORPOR_ERROR_INTERNAL"


class Unavailable(TorporError, RuntimeError):
    """The backend or feature is not available here (e.g. the cuda backend without a usable GPU)."""

    status_name = "TORPOR_ERROR_UNAVAILABLE"


class LibraryNotFound(TorporError, ImportError):
    """libtorpor.so could not be found or loaded (the message lists where torpor looked)."""


class TorchUnavailable(TorporError, ImportError):
    """A PyTorch entry point was called where PyTorch or a CUDA device is missing."""


# The classes of the C API's error statuses (TORPOR_OK has none).
STATUS_CLASSES: tuple[type[TorporError], ...] = (
    InvalidArgument,
    InvalidState,
    OutOfMemory,
    DriverError,
    Timeout,
    InvalidHandle,
    InternalError,
    Unavailable,
)

_by_status: dict[int, type[TorporError]] = {}


def bind_status_codes(value_of: Callable[[str], int]) -> None:
    """Give every status class its code from the loaded library. value_of: a status name ->
    its code, or -1 when the library does not define that name (an older library: the class
    then keeps status None and is never chosen by error_for)."""
    by_status = {}
    for cls in STATUS_CLASSES:
        code = value_of(cls.status_name)
        cls.status = code if code >= 0 else None
        if cls.status is not None:
            by_status[code] = cls
    _by_status.clear()
    _by_status.update(by_status)


def error_for(status: int, message: str) -> TorporError:
    """The exception for a C API status code (one the loaded library returned: loading it bound
    the codes, so this module never imports the loader back)."""
    cls = _by_status.get(status)
    if cls is None:
        return InternalError(f"unknown torpor status {status}: {message}")
    return cls(message)


# -- the same errors as RuntimeError, for the engine-compatible modes ---------------------------

_runtime_classes: dict[type, type] = {}


def runtime_error_class(cls: type[TorporError]) -> type[TorporError]:
    """A class deriving from `cls` and RuntimeError (`cls` itself when it already is one)."""
    if issubclass(cls, RuntimeError):
        return cls
    made = _runtime_classes.get(cls)
    if made is None:
        made = type(
            cls.__name__,
            (cls, RuntimeError),
            {
                "__module__": __name__,
                "__qualname__": f"RuntimeError[{cls.__qualname__}]",
                "__doc__": f"{cls.__name__}, also a RuntimeError (vLLM's allocator raises those).",
            },
        )
        _runtime_classes[cls] = made
    return made


def runtime_error(e: TorporError) -> TorporError:
    """`e` as an instance of runtime_error_class(type(e)), same message and status."""
    cls = runtime_error_class(type(e))
    if cls is type(e):
        return e
    out = cls(e.message)
    out.status = e.status
    return out


@contextlib.contextmanager
def as_runtime_errors():
    """Inside: a TorporError leaves as runtime_error(e), with its traceback."""
    try:
        yield
    except TorporError as e:
        raise runtime_error(e).with_traceback(e.__traceback__) from None
