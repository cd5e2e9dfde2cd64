"""What the engine-compatible modes (torpor.vllm, torpor.tms) share: errors that are caught where
the engines' own are, and the name torpor.CuMemAllocator keeps for the vLLM mode's allocator.

vLLM raises RuntimeError when its allocator fails (a failed wake is a CUDA error from its C
extension), and engines and their tests catch exactly that. torpor's errors derive from the
built-in exception their kind suggests (OutOfMemory is a MemoryError, InvalidArgument a
ValueError), so the compatible modes re-raise them as ``runtime_error(e)``: an instance of a
class deriving from both the original class and RuntimeError, with torpor's message, so
``except RuntimeError``, ``except torpor.OutOfMemory`` and ``except MemoryError`` all catch it.
"""

from __future__ import annotations

import contextlib

from .errors import TorporError

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


def __getattr__(name):
    # torpor.CuMemAllocator (and torpor.compat.CuMemAllocator, its first home) is the vLLM
    # mode's allocator; imported on first use so that torpor.vllm can import this module.
    if name == "CuMemAllocator":
        from .vllm import CuMemAllocator

        return CuMemAllocator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CuMemAllocator", "runtime_error", "runtime_error_class"]  # noqa: F822 (module __getattr__)


@contextlib.contextmanager
def as_runtime_errors():
    """Inside: a TorporError leaves as runtime_error(e), with its traceback."""
    try:
        yield
    except TorporError as e:
        raise runtime_error(e).with_traceback(e.__traceback__) from None
