"""The environment variables the Python package reads: one table, as the C++ side has one
(allocator/src/common/options.cpp). Every module of torpor reads the environment through this
module, so the names, defaults and parsing are written once.

The C library reads its own variables (TORPOR_BACKEND, TORPOR_LOG, TORPOR_GROUP_TIMEOUT_MS, ...)
through options.cpp; this table holds only what the Python layer itself reads. Each row has a
name, a default (the value an unset variable reads as), what it does, and its kind:

- ``text``: the value as set (the default when unset or empty);
- ``flag``: set to anything but 0, false, no, off (any case) or empty means on, as
  options.cpp's kill switches parse;
- ``exact``: on only when the value is exactly one of the row's ``on`` texts; with ``off`` texts,
  a value in neither is torpor.InvalidArgument (torch_memory_saver's get_bool_env_var, csrc/utils.h
  at 4a43c97: 1, true, TRUE, yes, YES on; 0, false, FALSE, no, NO off; anything else exits);
- ``alloc_conf``: PyTorch's allocator settings, ``key:value`` items separated by commas.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from .errors import InvalidArgument

_FALSY = ("", "0", "false", "no", "off")
_TMS_TRUE = ("1", "true", "TRUE", "yes", "YES")
_TMS_FALSE = ("", "0", "false", "FALSE", "no", "NO")  # unset reads as "" too


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    description: str
    kind: str  # text, flag, exact, alloc_conf
    on: tuple[str, ...] = ()  # kind exact: the values that mean on
    off: tuple[str, ...] = ()  # kind exact: the values that mean off; when given, any other is an error


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
        "PYTORCH_HIP_ALLOC_CONF",
        "",
        "PyTorch's allocator settings on ROCm, read after the two above",
        "alloc_conf",
    ),
    Variable(
        "TMS_INIT_ENABLE",
        "",
        "torch_memory_saver's preload-mode switch: every cudaMalloc of a thread is in a region from the start "
        "(libtorpor_preload.so reads it too, in C, with the same values)",
        "exact",
        on=_TMS_TRUE,
        off=_TMS_FALSE,
    ),
    Variable(
        "TMS_INIT_ENABLE_CPU_BACKUP",
        "",
        "torch_memory_saver: allocations outside an explicit region choice keep a CPU backup (preload mode)",
        "exact",
        on=_TMS_TRUE,
        off=_TMS_FALSE,
    ),
    Variable(
        "TMS_INIT_CPU_BACKUP_BACKEND",
        "",
        "torch_memory_saver's default cpu_backup_backend, mmap or pinned (empty: pinned); mmap makes "
        "torpor.tms configure the pools' host store pageable",
        "text",
    ),
    Variable(
        "TMS_INIT_ENABLE_DISK_BACKUP",
        "",
        "torch_memory_saver: allocations outside an explicit region choice back up to disk (preload mode)",
        "exact",
        on=_TMS_TRUE,
        off=_TMS_FALSE,
    ),
    Variable(
        "TMS_RETAIN_CPU_BACKUP",
        "",
        "torch_memory_saver's retain_cpu_backup at start: host backups stay after resume",
        "exact",
        on=_TMS_TRUE,
        off=_TMS_FALSE,
    ),
    Variable(
        "TMS_DISK_BACKUP_DIR",
        "",
        "torch_memory_saver's process-wide disk backup directory: torpor.tms puts the pools' disk tier there",
        "text",
    ),
    Variable(
        "LD_PRELOAD",
        "",
        "torpor.tms.configure_subprocess() puts libtorpor_preload.so first on it for children (preload mode)",
        "text",
    ),
    Variable(
        "NCCL_GRAPH_REGISTER",
        "",
        "NCCL's graph buffer registration: torpor's graph capture sets it to 0 when unset (torpor.graph)",
        "text",
    ),
    Variable(
        "VLLM_POISON_DISCARDED_PAGES",
        "",
        "vLLM's: the vLLM mode's wakes fill discarded bytes with 0xFF (read at each wake, as vLLM reads it)",
        "flag",
    ),
    Variable(
        "VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY",
        "",
        "vLLM's: after each wake the vLLM mode gives its host copies back (torpor.release_host_store)",
        "flag",
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
        if row.off and value not in row.on and value not in row.off:
            # torch_memory_saver exits the process on such a value (get_bool_env_var)
            raise InvalidArgument(
                f"{row.name}={value!r} is neither on ({', '.join(row.on)}) nor off "
                f"({', '.join(v for v in row.off if v)}, or unset)"
            )
        return value in row.on
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


# PyTorch's precedence among its allocator-settings variables: the first one set is in force.
ALLOC_CONF_PRECEDENCE = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def alloc_conf() -> str:
    """PyTorch's allocator settings in force: the first of ALLOC_CONF_PRECEDENCE that is set."""
    for name in ALLOC_CONF_PRECEDENCE:
        value = os.environ.get(variable(name).name)
        if value:
            return value
    return ""


def with_alloc_flag(conf: str, key: str, enabled: bool) -> str:
    """`conf` with only `key` set to True/False, every other item as it was. PyTorch parses the
    settings as a whole and resets every item the string it is given leaves out, so a change of
    one item must write the whole string (vLLM's alloc_conf.py says the same, index id
    68986858546)."""
    want = f"{key}:{'True' if enabled else 'False'}"
    items = [item.strip() for item in conf.split(",") if item.strip()]
    for i, item in enumerate(items):
        if item.partition(":")[0].strip() == key:
            items[i] = want
            return ",".join(items)
    return ",".join(items + [want])


def set_default(name: str, value: str) -> bool:
    """Set the variable to `value` when it is unset (or empty); whether it was set now."""
    row = variable(name)
    if os.environ.get(row.name):
        return False
    os.environ[row.name] = value
    return True


@contextlib.contextmanager
def prepended_path(name: str, entry: str, separator: str = os.pathsep):
    """Inside: `entry` first on the path-list variable `name` (`separator`-separated: the dynamic
    loader splits LD_PRELOAD at ':' and spaces), for the child processes started there; the
    previous value (or its absence) comes back after."""
    row = variable(name)
    previous = os.environ.get(row.name)
    os.environ[row.name] = separator.join([entry] + ([previous] if previous else []))
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(row.name, None)
        else:
            os.environ[row.name] = previous


@contextlib.contextmanager
def replaced(key: str, value: str):
    """Inside: any variable `key` (listed here or not: a write for child processes, as
    torch_memory_saver's change_env in its tests) set to `value`; its previous value or absence
    after."""
    previous = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous


__all__ = [
    "ALLOC_CONF_PRECEDENCE",
    "VARIABLES",
    "alloc_conf",
    "alloc_conf_true",
    "enabled",
    "is_set",
    "prepended_path",
    "replaced",
    "with_alloc_flag",
    "Variable",
    "text",
    "variable",
]
