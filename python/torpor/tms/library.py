"""The tms library, libtorpor_preload.so: torch_memory_saver's C entry points over torpor (the
preload/ target). In hook mode "preload" it is on LD_PRELOAD and interposes the CUDA runtime's
cudaMalloc / cudaFree; in hook mode "torch" the same file is loaded with ctypes only (RTLD_LOCAL,
so it interposes nothing), for the entry points torch_memory_saver's examples reach through
``_impl._binary_wrapper.cdll`` and for its page-locked host memory.

Here: where the library is, whether this process preloaded it (and so which hook mode is the
default), its ctypes prototypes, and its per-thread region settings.
"""

from __future__ import annotations

import contextlib
import ctypes
import pathlib
from typing import Optional

from .. import engine, environment
from ..errors import LibraryNotFound, Unavailable

PRELOAD_NAME = "libtorpor_preload.so"
CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation, what tms_pause / tms_resume return for OOM


def preload_library_path() -> str:
    """libtorpor_preload.so of the libtorpor.so torpor loaded: beside it (an installed tree), or
    in the build tree's preload/ beside its allocator/. LibraryNotFound when neither exists."""
    lib = pathlib.Path(engine.library_path()).resolve()
    candidates = [lib.parent / PRELOAD_NAME, lib.parent.parent / "preload" / PRELOAD_NAME]
    for c in candidates:
        if c.is_file():
            return str(c)
    raise LibraryNotFound(
        f"{PRELOAD_NAME} (torch_memory_saver's preload mode) is not beside {lib}: looked in "
        f"{', '.join(str(c.parent) for c in candidates)}; build the torpor_preload target"
    )


def _preload_entries() -> list[str]:
    """The libtorpor_preload.so entries of this process's LD_PRELOAD."""
    value = environment.text("LD_PRELOAD")
    return [p for p in value.replace(" ", ":").split(":") if pathlib.Path(p).name.startswith("libtorpor_preload")]


def default_hook_mode() -> str:
    """torch_memory_saver's default, "preload" (_TorchMemorySaverImpl.__init__ in
    torch_memory_saver/entrypoint.py at 4a43c97), where this process has the preload library, as
    SGLang's scheduler processes do (python/sglang/srt/utils/torch_memory_saver_adapter.py at
    1373e4f sets hook_mode only on XPU, and calls configure_subprocess); "torch" elsewhere, where
    preload mode could not work."""
    return "preload" if len(_preload_entries()) == 1 else "torch"


def preloaded() -> str:
    """The libtorpor_preload.so on this process's LD_PRELOAD (exactly one, as torch_memory_saver
    asserts of its own, hooks/mode_preload.py at 4a43c97)."""
    value = environment.text("LD_PRELOAD")
    found = _preload_entries()
    if len(found) != 1:
        raise Unavailable(
            f"hook_mode='preload' needs exactly one {PRELOAD_NAME} on LD_PRELOAD when the process starts "
            f"(LD_PRELOAD={value!r}): start it inside torpor.tms.configure_subprocess(), or with "
            f"LD_PRELOAD=$(python3 -m torpor.tms --preload-path)"
        )
    return found[0]


def bind(path: str) -> ctypes.CDLL:
    """The library at `path` through ctypes, with torch_memory_saver's prototypes
    (binary_wrapper.py at 4a43c97) and torpor's host-memory entries."""
    cdll = ctypes.CDLL(path)
    c_bool, c_char_p = ctypes.c_bool, ctypes.c_char_p
    for name, args, res in (
        ("tms_set_current_tag", [c_char_p], None),
        ("tms_get_current_tag", [], c_char_p),
        ("tms_set_interesting_region", [c_bool], None),
        ("tms_get_interesting_region", [], c_bool),
        ("tms_set_enable_cpu_backup", [c_bool], None),
        ("tms_get_enable_cpu_backup", [], c_bool),
        ("tms_set_cpu_backup_backend", [c_char_p], None),
        ("tms_get_cpu_backup_backend", [], c_char_p),
        ("tms_set_enable_disk_backup", [c_bool], None),
        ("tms_get_enable_disk_backup", [], c_bool),
        ("tms_set_disk_backup_dir", [c_char_p], None),
        ("tms_pause", [c_char_p], ctypes.c_int),
        ("tms_resume", [c_char_p], ctypes.c_int),
        ("set_memory_margin_bytes", [ctypes.c_uint64], None),
        ("tms_set_retain_cpu_backup", [c_bool], None),
        ("tms_get_retain_cpu_backup", [], c_bool),
        ("tms_get_cpu_backup_pointer", [ctypes.c_void_p, ctypes.c_uint64], ctypes.c_void_p),
        ("torpor_preload_host_alloc", [ctypes.c_uint64, c_char_p], ctypes.c_void_p),
        ("torpor_preload_host_free", [ctypes.c_void_p], c_bool),
        ("torpor_preload_host_pinned", [ctypes.c_void_p], c_bool),
    ):
        fn = getattr(cdll, name)
        fn.argtypes, fn.restype = args, res
    return cdll


@contextlib.contextmanager
def region_settings(cdll: ctypes.CDLL, tag: str, cpu: bool, disk: bool, backend: Optional[str]):
    """The library's thread settings of a region for the block (tag, interesting, CPU backup and
    its backend, disk backup), the previous ones after (torch_memory_saver's
    _with_region_config)."""
    saved = (
        cdll.tms_get_current_tag(),
        cdll.tms_get_interesting_region(),
        cdll.tms_get_enable_cpu_backup(),
        cdll.tms_get_cpu_backup_backend(),
        cdll.tms_get_enable_disk_backup(),
    )

    def put(tag_b, interesting, cpu_b, backend_b, disk_b):
        cdll.tms_set_current_tag(tag_b)
        cdll.tms_set_interesting_region(interesting)
        cdll.tms_set_enable_cpu_backup(cpu_b)
        if backend_b is not None:
            cdll.tms_set_cpu_backup_backend(backend_b)
        cdll.tms_set_enable_disk_backup(disk_b)

    put(tag.encode(), True, cpu, backend.encode() if backend else None, disk)
    try:
        yield
    finally:
        put(*saved)


__all__ = ["PRELOAD_NAME", "bind", "default_hook_mode", "preload_library_path", "preloaded", "region_settings"]
