"""What the engine-compatible modes (torpor.vllm, torpor.tms) share, under its first name:
errors that are caught where the engines' own are (torpor.errors defines them), and the name
torpor.CuMemAllocator keeps for the vLLM mode's allocator.

vLLM raises RuntimeError when its allocator fails (a failed wake is a CUDA error from its C
extension), and engines and their tests catch exactly that. torpor's errors derive from the
built-in exception their kind suggests (OutOfMemory is a MemoryError, InvalidArgument a
ValueError), so the compatible modes re-raise them as ``runtime_error(e)``: an instance of a
class deriving from both the original class and RuntimeError, with torpor's message, so
``except RuntimeError``, ``except torpor.OutOfMemory`` and ``except MemoryError`` all catch it.
"""

from __future__ import annotations

from .errors import as_runtime_errors, runtime_error, runtime_error_class
from .vllm import CuMemAllocator

__all__ = ["CuMemAllocator", "as_runtime_errors", "runtime_error", "runtime_error_class"]
