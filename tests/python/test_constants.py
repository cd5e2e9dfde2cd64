"""The Python package's constants agree with the C and C++ headers, which are the oracle here:
parsed from the source tree, not taken from the library or the package."""

import ctypes
import re
import subprocess
import sys

import pytest

import torpor
from conftest import REPO, subprocess_env
from torpor import errors
from torpor.pool import CPoolOptions, PoolOptions
from torpor.values import SleepLevel

INCLUDE = REPO / "allocator" / "include" / "torpor"


def test_the_tag_names_are_the_cpp_apis():
    cpp = dict(re.findall(r'inline constexpr char (\w+)\[\] = "([^"]*)";', (INCLUDE / "tags.hpp").read_text()))
    c = dict(re.findall(r'#define TORPOR_TAG_(\w+) "([^"]*)"', (INCLUDE / "torpor.h").read_text()))
    assert cpp and {k.upper(): v for k, v in cpp.items()} == c, "tags.hpp and torpor.h name the same tags"
    py = {name: getattr(torpor.tags, name) for name in torpor.tags.__all__}
    assert py == c


def header_enum(name: str) -> dict[str, int]:
    """The enumerators of `typedef enum name { ... }` in torpor.h or the C headers it includes."""
    text = "".join((INCLUDE / h).read_text() for h in ("torpor.h", "status.h", "backend.h"))
    body = re.search(r"typedef enum %s \{(.*?)\}" % name, text, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    return {k: int(v) for k, v in re.findall(r"(\w+)\s*=\s*(-?\d+)", body)}


def lower_names(enumerators: dict[str, int], prefix: str) -> dict[str, int]:
    return {k[len(prefix) :].lower(): v for k, v in enumerators.items()}


def test_every_c_status_has_its_python_class_with_the_same_value():
    statuses = header_enum("torpor_status")
    assert "TORPOR_OK" in statuses and len(statuses) >= 9, statuses
    lib = torpor._lib.lib()
    by_name = {cls.status_name: cls for cls in errors.STATUS_CLASSES}
    assert set(by_name) == set(statuses) - {"TORPOR_OK"}, "one Python class per error status of torpor.h"
    assert torpor._lib.status_ok() == statuses["TORPOR_OK"]
    for name, value in statuses.items():
        assert lib.torpor_status_name(value).decode() == name
        if name == "TORPOR_OK":
            continue
        cls = by_name[name]
        assert cls.status == value, name
        err = errors.error_for(value, "message")
        assert type(err) is cls and err.status == value and str(err) == "message"


def test_classes_backends_fills_and_handle_kinds_are_the_headers():
    classes = lower_names(header_enum("torpor_class"), "TORPOR_CLASS_")
    backends = lower_names(header_enum("torpor_backend"), "TORPOR_BACKEND_")
    fills = lower_names(header_enum("torpor_fill"), "TORPOR_FILL_")
    handle_kinds = lower_names(header_enum("torpor_handle_kind"), "TORPOR_HANDLE_")
    assert torpor._lib.enum_values("memory_class") == classes
    assert torpor._lib.enum_values("backend") == backends
    assert torpor._lib.enum_values("fill") == fills
    assert torpor._lib.enum_values("handle_kind") == handle_kinds == {"auto": 0, "posix_fd": 1, "fabric": 2}
    assert {m.value for m in torpor.MemoryClass} == set(classes)
    for member in torpor.MemoryClass:
        assert int(member) == classes[member.value]
        assert torpor.MemoryClass(classes[member.value]) is member
        assert torpor.pool.to_memory_class(classes[member.value]) is member
    o = PoolOptions(backend="cuda", fill_on_wake="poison").c_struct(0)
    assert (o.backend, o.fill_on_wake) == (backends["cuda"], fills["poison"])


def test_the_pool_options_are_the_headers_struct_in_its_order():
    """torpor.pool.options builds the C struct from PoolOptions' rows: they must be torpor.h's
    torpor_pool_options fields, in its order, after the device."""
    text = (INCLUDE / "torpor.h").read_text()
    body = re.search(r"typedef struct torpor_pool_options \{(.*?)\} torpor_pool_options;", text, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    fields = re.findall(r"(\w+);", body)
    assert fields[0] == "device" and list(PoolOptions.names()) == fields[1:]
    assert [name for name, _ in CPoolOptions._fields_] == fields + ["_reserved"]
    defaults = PoolOptions().c_struct(3)
    init = CPoolOptions()
    torpor._lib.lib().torpor_pool_options_init(ctypes.byref(init))
    for name in fields[1:]:
        assert getattr(defaults, name) == getattr(init, name), f"{name}: the library's default, not Python's"
    assert defaults.device == 3


def test_the_sleep_levels_are_the_headers():
    """SleepLevel is built from the library (torpor_sleep_level_name), not listed in Python: its
    members, names and values are torpor.h's torpor_sleep_level, and so is the range a level is
    checked against."""
    levels = lower_names(header_enum("torpor_sleep_level"), "TORPOR_SLEEP_")
    assert levels == {"none": 0, "offload": 1, "discard_parameters": 2}, levels
    assert torpor._lib.enum_values("sleep_level") == levels
    assert {level.name.lower(): int(level) for level in SleepLevel} == levels
    assert len(SleepLevel) == len(levels)
    for name, value in levels.items():
        member = getattr(SleepLevel, name.upper())
        assert member == value and isinstance(member, SleepLevel) and SleepLevel(value) == member
    top = max(levels.values())
    with pytest.raises(
        torpor.InvalidArgument, match=f"sleep level {top + 1} is out of range \\(accepted: 0 to {top}\\)"
    ):
        SleepLevel(top + 1)


def test_the_errors_are_usable_before_the_library_loads_and_without_it():
    code = (
        "import torpor, torpor._lib as L\n"
        "assert L._lib is None and torpor.InvalidArgument.status is None\n"
        "try:\n    raise torpor.InvalidArgument('x')\nexcept ValueError as e:\n    assert e.status is None\n"
        "assert torpor.MemoryClass('state') is torpor.MemoryClass.STATE and L._lib is None\n"
        "try:\n    torpor.Pool(0, backend='host', va_bytes=1 << 30).close()\n"
        "except torpor.LibraryNotFound:\n    print('missing')\n"
        "print(torpor.InvalidArgument.status)\n"
    )
    value = header_enum("torpor_status")["TORPOR_ERROR_INVALID_ARGUMENT"]
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == [str(value)], out.stdout + out.stderr
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(TORPOR_LIBRARY="/nonexistent/libtorpor.so"),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and out.stdout.split() == ["missing", "None"], out.stdout + out.stderr


def test_the_export_entry_sizes_are_the_headers():
    text = (INCLUDE / "torpor.h").read_text()
    defines = dict(re.findall(r"#define (TORPOR_\w+) (\d+)", text))
    assert int(defines["TORPOR_FABRIC_HANDLE_BYTES"]) == torpor._lib.FABRIC_HANDLE_BYTES
    assert int(defines["TORPOR_EXPORT_TAG_MAX"]) == torpor._lib.EXPORT_TAG_MAX
    body = re.search(r"typedef struct torpor_chunk_export \{(.*?)\} torpor_chunk_export;", text, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    fields = re.findall(r"(\w+)(?:\[[^\]]*\])?;", body)
    assert fields == [name for name, _ in torpor._lib.ChunkExport._fields_], "the same fields in the same order"
