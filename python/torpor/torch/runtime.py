"""PyTorch, imported lazily (so `import torpor` works without it), and the small device helpers
every module of torpor.torch shares."""

from __future__ import annotations

import contextlib
import ctypes

from ..errors import InvalidArgument, TorchUnavailable


def torch_module():
    """The torch module, or TorchUnavailable saying torpor.Pool works without it."""
    try:
        import torch
    except ImportError as e:
        raise TorchUnavailable(
            f"this part of torpor needs PyTorch, which cannot be imported ({e}); " f"torpor.Pool works without it"
        ) from None
    return torch


def cuda_torch():
    """The torch module, when it sees a CUDA device."""
    torch = torch_module()
    if not torch.cuda.is_available():
        raise TorchUnavailable(
            "PyTorch sees no CUDA device (torch.cuda.is_available() is False); torpor's "
            "PyTorch pools need one. torpor.Pool works without it, on the host backend"
        )
    return torch


def keep_forever(obj) -> None:
    """Leak one reference: see 'Pool lifetime' in torpor.torch's package note."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def device_index(torch, device) -> int:
    """The CUDA device index of `device` (None: the current device; an int, a str or a
    torch.device of type cuda)."""
    if device is None:
        return torch.cuda.current_device()
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if d.type != "cuda":
        raise InvalidArgument(f"device {device!r} is not a CUDA device")
    return torch.cuda.current_device() if d.index is None else d.index


@contextlib.contextmanager
def keep_current_device(torch):
    """The CUDA current device is restored after the block (the driver calls of a sleep make
    the pool's device current)."""
    previous = torch.cuda.current_device()
    try:
        yield
    finally:
        torch.cuda.set_device(previous)


def span_bytes(t) -> int:
    """Bytes from a tensor's first element to past its last (exact for any strided view)."""
    if t.is_contiguous():
        return t.nbytes  # the same extent, without walking shape and strides in Python
    if t.numel() == 0:
        return 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return extent * t.element_size()
