"""Finding and loading libtorpor.so, the ctypes prototypes of its C API, and what an installed
package carries beside the library (its VERSION, the CMake package).

Nothing here is compiled: ctypes binds the C API (torpor.h, torch_allocator.h) at run time,
so one package works with any Python 3 and any PyTorch. The library is looked up in this
order, the first hit wins:

1. ``TORPOR_LIBRARY``: a path to the library. When set it must load; torpor does not fall
   back to another copy, so a wrong path is an error rather than a surprise.
2. The copy bundled into the package when it was installed (``torpor/_lib/lib/libtorpor.so``,
   built by ``pip install .``: setup.py at the repository root).
3. The repository's build directories when the package is used from a checkout:
   ``build/allocator/`` then ``build-gpu/allocator/``.
4. The system's library path (``libtorpor.so.0``, where ``cmake --install`` puts it).

The library is loaded once per process, on first use, so ``import torpor`` never fails. On
loading, the values of the C enumerations (status codes, memory classes, backends, fills,
handle kinds, sleep levels) are read from the library (torpor_status_value, torpor_class_name,
...), never copied here.

The package's version is read from the one place it is written, the repository's VERSION file:
an installed package carries a copy (``torpor/VERSION``, put there by setup.py), a checkout used
through PYTHONPATH reads the repository's own. CMake reads the same file for the library
(``torpor_version()``, ``library_version()``) and the CLI (``torpor --version``); the ctest
``version.agree`` and tests/python/test_version.py check that they agree.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pathlib
import threading

from . import environment
from .errors import InternalError, LibraryNotFound, bind_status_codes, error_for

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
_REPO_DIR = _PACKAGE_DIR.parent.parent  # python/torpor -> repository root, in a checkout
# Bundled copy first: an installed package must report its own version, not a checkout's.
_VERSION_FILES = (_PACKAGE_DIR / "VERSION", _REPO_DIR / "VERSION")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_path: str | None = None
_status_ok: int | None = None
# enumeration -> {lower-case name: value}, read from the library when it loads.
_enums: dict[str, dict[str, int]] = {}
_ENUM_NAME_FUNCTIONS = {
    "memory_class": "torpor_class_name",
    "backend": "torpor_backend_name",
    "fill": "torpor_fill_name",
    "handle_kind": "torpor_handle_kind_name",
    "sleep_level": "torpor_sleep_level_name",
}
_ENUM_LIMIT = 256  # no enumeration of torpor.h comes near; guards against a library that never says NULL


class Closing:
    """What owners of a C handle share: close() on leaving a with-block and when collected (never
    raising from the finaliser: the interpreter may be shutting down). Subclasses define close()."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass


FABRIC_HANDLE_BYTES = 64  # TORPOR_FABRIC_HANDLE_BYTES (sizeof(CUmemFabricHandle))
EXPORT_TAG_MAX = 255  # TORPOR_EXPORT_TAG_MAX


class ChunkExport(ctypes.Structure):
    """torpor_chunk_export: one chunk's shareable handle (torpor.exports wraps it)."""

    _fields_ = [
        ("va", ctypes.c_void_p),
        ("bytes", ctypes.c_size_t),
        ("kind", ctypes.c_int),
        ("fd", ctypes.c_int),
        ("fabric", ctypes.c_ubyte * FABRIC_HANDLE_BYTES),
        ("gpu_direct_rdma", ctypes.c_int),
        ("tag", ctypes.c_char * (EXPORT_TAG_MAX + 1)),
    ]


def _candidates() -> list[tuple[str, str]]:
    """(path, where it came from) in search order, after TORPOR_LIBRARY."""
    out = [(str(_PACKAGE_DIR / "_lib" / "lib" / "libtorpor.so"), "bundled with the package")]
    for build in ("build", "build-gpu"):
        out.append((str(_REPO_DIR / build / "allocator" / "libtorpor.so"), f"the repository's {build}/ directory"))
    return out


def _load() -> tuple[ctypes.CDLL, str]:
    env = environment.text("TORPOR_LIBRARY")
    if env:
        try:
            return ctypes.CDLL(env), os.path.realpath(env)
        except OSError as e:
            raise LibraryNotFound(
                f"TORPOR_LIBRARY={env} could not be loaded: {e}. Point it at libtorpor.so "
                f"(e.g. build/allocator/libtorpor.so after `cmake --build build`), or unset it"
            ) from None
    tried = []
    for path, where in _candidates():
        if os.path.exists(path):
            try:
                return ctypes.CDLL(path), os.path.realpath(path)
            except OSError as e:
                tried.append(f"{path} ({where}): {e}")
        else:
            tried.append(f"{path} ({where}): missing")
    name = ctypes.util.find_library("torpor") or "libtorpor.so.0"
    try:
        lib = ctypes.CDLL(name)
        return lib, _loaded_path(lib, name)
    except OSError as e:
        tried.append(f"{name} (system library path): {e}")
    raise LibraryNotFound(
        "libtorpor.so was not found. Build it (`cmake -S . -B build -G Ninja && cmake --build build`), "
        "then set TORPOR_LIBRARY=/path/to/libtorpor.so or reinstall the package from a tree that has it. "
        "Tried: " + "; ".join(tried)
    )


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _loaded_path(lib: ctypes.CDLL, fallback: str) -> str:
    """The file a library loaded by name came from, by dladdr() on one of its symbols:
    PyTorch's CUDAPluggableAllocator must open that same file."""
    try:
        dladdr = ctypes.CDLL(None).dladdr
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        info = _DlInfo()
        if dladdr(ctypes.cast(lib.torpor_last_error, ctypes.c_void_p), ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(info.dli_fname.decode())
    except (AttributeError, OSError):
        pass
    return fallback


# torpor.h's sleep hooks: before_sleep(user, pool, level, tags, count, message, capacity) -> status,
# after_wake(user, pool, tags, count, ok).
BEFORE_SLEEP_HOOK = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.POINTER(ctypes.c_char_p),
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_size_t,
)
AFTER_WAKE_HOOK = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t, ctypes.c_int
)

# torpor.h's tag hooks: before_unmap(user, pool, tag, message, capacity) -> status,
# after_map(user, pool, tag).
BEFORE_UNMAP_HOOK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t
)
AFTER_MAP_HOOK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)


def _prototypes(lib: ctypes.CDLL) -> None:
    P, S, I, C = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p
    PP, PS = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)
    CC = ctypes.POINTER(ctypes.c_char_p)
    protos = {
        # torpor_pool_options* as a plain pointer: torpor.pool.options builds that struct from its rows
        "torpor_pool_options_init": (None, [P]),
        "torpor_pool_create": (I, [P, PP]),
        "torpor_pool_destroy": (I, [P]),
        "torpor_alloc": (I, [P, S, C, I, C, PP]),
        "torpor_free": (I, [P, P]),
        "torpor_mark": (I, [P, P, S, I, C]),
        "torpor_mark_ranges": (I, [P, S, PP, PS, ctypes.POINTER(ctypes.c_int), CC]),
        "torpor_release_host_store": (I, [P, PS]),
        "torpor_prepare_host_store": (I, [P, S, I, PS]),
        "torpor_sleep_host_bytes": (I, [P, I, CC, S, PS]),
        "torpor_set_preserve": (I, [P, CC, S]),
        "torpor_sleep": (I, [P, I, CC, S]),
        "torpor_wake_up": (I, [P, CC, S]),
        "torpor_add_sleep_hook": (I, [P, BEFORE_SLEEP_HOOK, AFTER_WAKE_HOOK, P, ctypes.POINTER(ctypes.c_ulonglong)]),
        "torpor_remove_sleep_hook": (I, [P, ctypes.c_ulonglong]),
        "torpor_set_fill_on_wake": (I, [P, I, ctypes.POINTER(ctypes.c_int)]),
        "torpor_add_tag_hooks": (I, [P, C, BEFORE_UNMAP_HOOK, AFTER_MAP_HOOK, P, ctypes.POINTER(ctypes.c_ulonglong)]),
        "torpor_remove_tag_hooks": (I, [P, ctypes.c_ulonglong]),
        "torpor_run_after_map_hooks": (I, [P]),
        "torpor_stats_json": (I, [P, ctypes.c_char_p, S, PS]),
        "torpor_last_report_json": (I, [P, ctypes.c_char_p, S, PS]),
        "torpor_tags_json": (I, [P, ctypes.c_char_p, S, PS]),
        "torpor_pool_backend": (C, [P]),
        "torpor_find": (I, [P, P, PP, PS]),
        "torpor_export_handles": (I, [P, CC, S, I, ctypes.POINTER(ChunkExport), S, PS]),
        "torpor_pool_exportable": (I, [P, ctypes.POINTER(ctypes.c_int)]),
        "torpor_copy": (I, [P, P, P, S]),
        "torpor_read_host_copy": (I, [P, P, S, P, ctypes.POINTER(ctypes.c_int)]),
        "torpor_group_create_callbacks": (I, [I, I, P, I, PP]),
        "torpor_group_destroy": (I, [P]),
        "torpor_gather_append": (I, [P, P, S]),
        "torpor_gather_fail": (None, [P, C]),
        "torpor_collective_sleep": (I, [P, P, I, CC, S]),
        "torpor_collective_wake_up": (I, [P, P, CC, S]),
        "torpor_last_error": (C, []),
        "torpor_version": (C, []),
        "torpor_status_name": (C, [I]),
        "torpor_status_value": (I, [C]),
        "torpor_class_name": (C, [I]),
        "torpor_backend_name": (C, [I]),
        "torpor_fill_name": (C, [I]),
        "torpor_handle_kind_name": (C, [I]),
        "torpor_sleep_level_name": (C, [I]),
        "torpor_graph_memory_nodes": (I, [ctypes.c_ulonglong, PS]),
        "torpor_graph_memory": (I, [I, ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_ulonglong)]),
        # torch_allocator.h
        "torpor_torch_malloc": (P, [S, I, P]),
        "torpor_torch_free": (None, [P, S, I, P]),
        "torpor_set_current_tag": (I, [C]),
        "torpor_current_tag": (C, []),
        "torpor_set_current_class": (I, [I]),
        "torpor_current_class": (I, []),
        "torpor_torch_pool": (I, [I, PP]),
        "torpor_torch_configure": (I, [P]),
        "torpor_torch_failures": (ctypes.c_ulonglong, [ctypes.POINTER(ctypes.c_int)]),
        "torpor_torch_set_memory_margin": (I, [S]),
        "torpor_torch_memory_margin": (S, []),
    }
    for name, (restype, argtypes) in protos.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise LibraryNotFound(
                f"{library_path()} has no {name}: it is older than this Python package; rebuild libtorpor.so "
                f"from the same checkout"
            ) from None
        fn.restype = restype
        fn.argtypes = argtypes


def _enumerate(name_of) -> dict[str, int]:
    """{name: value} of one enumeration, from its torpor_*_name function (NULL past the end)."""
    out = {}
    for value in range(_ENUM_LIMIT):
        name = name_of(value)
        if name is None:
            break
        out[name.decode()] = value
    return out


def _bind(lib: ctypes.CDLL) -> None:
    """Read the C enumerations' values from the library."""
    global _status_ok
    _status_ok = lib.torpor_status_value(b"TORPOR_OK")
    bind_status_codes(lambda name: lib.torpor_status_value(name.encode()))
    for enum, fn in _ENUM_NAME_FUNCTIONS.items():
        _enums[enum] = _enumerate(getattr(lib, fn))


def lib() -> ctypes.CDLL:
    """The loaded library (loaded on first call)."""
    global _lib, _path
    if _lib is None:
        with _lock:
            if _lib is None:
                loaded, path = _load()
                _path = path
                _prototypes(loaded)
                _bind(loaded)
                _lib = loaded
    return _lib


def enum_values(enum: str) -> dict[str, int]:
    """{name: value} of a C enumeration as the library defines it (its torpor_*_name function):
    "memory_class", "backend", "fill", "handle_kind" or "sleep_level"; in value order."""
    lib()
    return _enums[enum]


def enum_value(enum: str, name: str) -> int:
    """The library's value of `name` in a C enumeration (see enum_values)."""
    try:
        return enum_values(enum)[name]
    except KeyError:
        raise InternalError(
            f"{library_path()} defines no {enum} '{name}' (it has {', '.join(enum_values(enum))}): "
            f"it is older or newer than this Python package; rebuild libtorpor.so from the same "
            f"checkout"
        ) from None


def library_path() -> str:
    """The path of the libtorpor.so in use (loading it if needed)."""
    lib()
    assert _path is not None
    return _path


def cmake_dir() -> str:
    """The CMake package that `pip install .` put in the package (torpor/_lib/lib/cmake/torpor):
    pass it as ``-Dtorpor_DIR=...`` (or its prefix, ``torpor/_lib``, in CMAKE_PREFIX_PATH) and
    ``find_package(torpor)`` gives torpor::torpor, torpor::kernels and torpor::fusion. Raises
    LibraryNotFound when the package was installed without one (TORPOR_LIBRARY bundled a
    prebuilt library, or the package is used from a checkout)."""
    path = _PACKAGE_DIR / "_lib" / "lib" / "cmake" / "torpor"
    if not (path / "torporConfig.cmake").is_file():
        raise LibraryNotFound(
            f"no CMake package in {path}: this torpor was not installed with `pip install .` building the library "
            f"(TORPOR_LIBRARY unset); in a checkout, use `cmake --install build --prefix DIR` and DIR/lib/cmake/torpor"
        )
    return str(path)


def package_version() -> str:
    """The first line of the first VERSION file found; "0+unknown" when there is none (a package
    copied without it: `import torpor` never fails for want of a version)."""
    for path in _VERSION_FILES:
        try:
            text = path.read_text(encoding="utf-8").strip()
        except OSError:
            continue
        if text:
            return text.splitlines()[0].strip()
    return "0+unknown"


def library_version() -> str:
    """torpor_version() of the loaded library: the VERSION it was built from (torpor.__version__
    is the package's; the two differ only when the library comes from another checkout)."""
    return lib().torpor_version().decode()


def last_error() -> str:
    """torpor_last_error() of this thread."""
    msg = lib().torpor_last_error()
    return msg.decode(errors="replace") if msg else ""


def status_ok() -> int:
    """TORPOR_OK's value."""
    lib()
    assert _status_ok is not None
    return _status_ok


def check(status: int) -> None:
    """Raise the typed exception for a failed C API call."""
    if status != status_ok():
        raise error_for(status, last_error())


def encode_list(values: list[str]):
    """A (char**, count) pair for the C API; the array keeps the bytes alive."""
    arr = (ctypes.c_char_p * len(values))(*[v.encode() for v in values])
    return arr, len(values)
