"""Shared setup for the Python package's tests: the package from this checkout (python/),
small host-backend pools that poison discarded bytes, so "not restored" is visible."""

import os
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))

import torpor  # noqa: E402

MiB = 1 << 20
POISON = b"\xff"

# The one configuration of the PyTorch pools for every test on fake_torch: torpor_torch_configure
# is process-wide and refuses other options once a pool exists, so the test files must agree.
# 4 GiB of VA: test_pool_memory.py allocates segments with chunks of their own.
TORCH_POOL_OPTIONS = dict(backend="host", fill_on_wake="poison", va_bytes=4 << 30)


@pytest.fixture
def pool():
    with torpor.Pool(0, backend="host", va_bytes=1 << 30, fill_on_wake="poison") as p:
        yield p


def pattern(n: int, seed: int = 1) -> bytes:
    return bytes((i * 31 + seed * 7 + 3) % 251 for i in range(n))


# What the Python build (`pip install .` at the root) reads of the repository besides python/.
PYTHON_BUILD_FILES = ("pyproject.toml", "setup.py", "VERSION", "LICENSE", "THIRD_PARTY_NOTICES.md")


def copy_python_source(dest: pathlib.Path) -> pathlib.Path:
    """The repository's Python build inputs copied to dest (no CMake tree: install it with
    TORPOR_LIBRARY set, which bundles that library instead of building one)."""
    import shutil

    dest.mkdir(parents=True)
    for name in PYTHON_BUILD_FILES:
        shutil.copyfile(REPO / name, dest / name)
    shutil.copytree(
        REPO / "python", dest / "python", ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    )
    return dest


def subprocess_env(**extra) -> dict:
    """The environment for a child Python that imports this checkout's package."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra)
    return env


def fresh_torch_layer(monkeypatch) -> None:
    """A test's own view of torpor.torch's registries (MemPools, registered modules, re-marks),
    as if nothing had been allocated through PyTorch yet; the state-span sources stay (modules
    register them once, at import)."""
    from torpor.torch import parameters, prepare, remark, routing

    prepare.forget()  # no engine mode of an earlier test intends a sleep

    monkeypatch.setattr(routing, "registry", routing.Registry())
    monkeypatch.setattr(parameters, "registry", parameters.Registry())
    monkeypatch.setattr(remark, "cache", remark.Cache(state_sources=list(remark.cache.state_sources)))
