"""torpor's errors as Python exceptions.

One class per status code of the C API (torpor.h), each also deriving from the built-in
exception a Python caller would expect (InvalidArgument is a ValueError, OutOfMemory a
MemoryError, ...), so generic handlers keep working. The message is torpor's own
(torpor_last_error()), which names the thing and the fix.
"""

from __future__ import annotations


class TorporError(Exception):
    """Base of every torpor error. ``status`` is the C API's status code (None for errors
    raised by the Python layer itself), ``status_name`` its name."""

    status: int | None = None
    status_name: str = "TORPOR_ERROR"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(TorporError, ValueError):
    """A request that can never succeed as asked: bad size, pointer, tag, class, level."""

    status, status_name = 1, "TORPOR_ERROR_INVALID_ARGUMENT"


class InvalidState(TorporError, RuntimeError):
    """A valid request in the wrong state, e.g. allocating into a sleeping tag."""

    status, status_name = 2, "TORPOR_ERROR_INVALID_STATE"


class OutOfMemory(TorporError, MemoryError):
    """Device memory, address space or the host backing store is exhausted."""

    status, status_name = 3, "TORPOR_ERROR_OUT_OF_MEMORY"


class DriverError(TorporError, RuntimeError):
    """A CUDA driver call (or the host backend's emulation of one) failed."""

    status, status_name = 4, "TORPOR_ERROR_DRIVER"


class Timeout(TorporError, TimeoutError):
    """A bounded wait ran out."""

    status, status_name = 5, "TORPOR_ERROR_TIMEOUT"


class InvalidHandle(TorporError, ValueError):
    """The pool was destroyed (or never created)."""

    status, status_name = 6, "TORPOR_ERROR_INVALID_HANDLE"


class InternalError(TorporError, RuntimeError):
    """A bug in torpor: please report it with the message."""

    status, status_name = 7, "TORPOR_ERROR_INTERNAL"


class Unavailable(TorporError, RuntimeError):
    """The backend or feature is not available here (e.g. the cuda backend without a usable GPU)."""

    status, status_name = 8, "TORPOR_ERROR_UNAVAILABLE"


class LibraryNotFound(TorporError, ImportError):
    """libtorpor.so could not be found or loaded (the message lists where torpor looked)."""


class TorchUnavailable(TorporError, ImportError):
    """A PyTorch entry point was called where PyTorch or a CUDA device is missing."""


_BY_STATUS = {cls.status: cls for cls in (InvalidArgument, InvalidState, OutOfMemory, DriverError,
                                          Timeout, InvalidHandle, InternalError, Unavailable)}


def error_for(status: int, message: str) -> TorporError:
    """The exception for a C API status code."""
    cls = _BY_STATUS.get(status)
    if cls is None:
        err = InternalError(f"unknown torpor status {status}: {message}")
        return err
    return cls(message)
