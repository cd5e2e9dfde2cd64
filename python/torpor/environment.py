"""The environment variables the Python package reads: one table, as the C++ side has one
(allocator/src/common/options.cpp). Every module of torpor reads the environment through this
module, so the names, defaults and parsing are written once.

The C library reads its own variables (TORPOR_BACKEND, TORPOR_LOG, TORPOR_GROUP_TIMEOUT_MS, ...)
through options.cpp; this table holds only what the Python layer itself reads. Each row has a
name, a default (the value an unset variable reads as), what it does, and its kind:

- ``text``: the value as set (the default when unset or empty);
- ``flag``: set to anything but 0, false, no, off (any case) or empty means on, as
  options.cpp's kill switches parse;
- ``exact``: on only when the value is exactly the row's ``on`` text (torch_memory_saver reads
  TMS_INIT_ENABLE as ``== "1"``);
- ``alloc_conf``: PyTorch's allocator settings, ``key:value`` items separated by commas.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

_FALSY = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    description: str
    kind: str  # text, flag, exact, alloc_conf
    on: str = ""  # kind exact: the value that means on


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "TORPOR_LIBRARY",
        "",
        "path of the libtorpor.so to load; when set it must load (torpor._lib says the search order)",
        "text",
    ),
    Variable(
        "TORPOR_VLLM",
        "",
        "turns on the vLLM plugin (torpor.vllm_plugin) in every vLLM process",
        "flag",
    ),
    Variable(
        "PYTORCH_CUDA_ALLOC_CONF",
        "",
        "PyTorch's allocator settings: expandable_segments:True makes use_pool turn them off inside",
        "alloc_conf",
    ),
    Variable(
        "PYTORCH_ALLOC_CONF",
        "",
        "PyTorch's newer name for PYTORCH_CUDA_ALLOC_CONF, read the same way",
        "alloc_conf",
    ),
    Variable(
        "TMS_INIT_ENABLE",
        "",
        "torch_memory_saver's preload-mode switch: torpor.tms warns that it captures only regions",
        "exact",
        on="1",
    ),
    Variable(
        "NCCL_GRAPH_REGISTER",
        "",
        "NCCL's graph buffer registration: torpor's graph capture sets it to 0 when unset (torpor.graph)",
        "text",
    ),
    Variable(
        "TORPOR_PREPARE_SLEEP",
        "auto",
        "host store page-locked in the background once the model is loaded (torpor.torch.prepare): auto "
        "(engine modes, for their default sleep level), 1 or 2 (that level, torpor.use_pool too), off",
        "text",
    ),
    Variable(
        "PYTHONPATH",
        "",
        "torpor.tms.configure_subprocess() puts the torch_memory_saver shim first on it for children",
        "text",
    ),
)

_BY_NAME = {v.name: v for v in VARIABLES}


def variable(name: str) -> Variable:
    """The row of `name` (KeyError for a variable the table does not list: add it there)."""
    return _BY_NAME[name]


def text(name: str) -> str:
    """The value of a variable, or its default when unset or empty."""
    row = variable(name)
    return os.environ.get(row.name) or row.default


def is_set(name: str) -> bool:
    """Whether the variable is set, to anything (an empty value counts as unset)."""
    return bool(os.environ.get(variable(name).name))


def enabled(name: str) -> bool:
    """A flag or exact row: whether the variable turns its switch on."""
    row = variable(name)
    value = os.environ.get(row.name, row.default)
    if row.kind == "exact":
        return value == row.on
    if row.kind != "flag":
        raise KeyError(f"{name} is a {row.kind} variable, not a switch")
    return value.strip().lower() not in _FALSY


def alloc_conf_true(key: str) -> bool:
    """Whether any alloc_conf row sets `key` to true (PyTorch's settings: key:value, ...)."""
    for row in VARIABLES:
        if row.kind != "alloc_conf":
            continue
        for item in os.environ.get(row.name, row.default).split(","):
            k, _, value = item.partition(":")
            if k.strip() == key and value.strip().lower() == "true":
                return True
    return False


def set_default(name: str, value: str) -> bool:
    """Set the variable to `value` when it is unset (or empty); whether it was set now."""
    row = variable(name)
    if os.environ.get(row.name):
        return False
    os.environ[row.name] = value
    return True


@contextlib.contextmanager
def prepended_path(name: str, entry: str):
    """Inside: `entry` first on the path-list variable `name` (os.pathsep-separated), for the
    child processes started there; the previous value (or its absence) comes back after."""
    row = variable(name)
    previous = os.environ.get(row.name)
    os.environ[row.name] = os.pathsep.join([entry] + ([previous] if previous else []))
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(row.name, None)
        else:
            os.environ[row.name] = previous


__all__ = ["VARIABLES", "Variable", "alloc_conf_true", "enabled", "is_set", "prepended_path", "text", "variable"]
