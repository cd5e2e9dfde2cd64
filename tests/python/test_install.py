"""`pip install .` (the repository root) works offline with Debian's packages; with
TORPOR_LIBRARY set it bundles that libtorpor.so instead of building one (the quick path tested
here; scripts/check_wheel.sh builds the library with CMake), and the installed package finds
the bundled copy, reports the repository's VERSION, with no environment variable set."""

import importlib.util
import os
import subprocess
import sys

import pytest

import torpor
from conftest import REPO, copy_python_source


def missing_build_tools():
    for module in ("pip", "setuptools", "wheel"):
        if importlib.util.find_spec(module) is None:
            return module
    return None


@pytest.mark.skipif(
    missing_build_tools() is not None,
    reason=f"{missing_build_tools()} is not installed for {sys.executable} "
    f"(Debian: python3-pip python3-setuptools python3-wheel)",
)
def test_pip_install_bundles_the_library(tmp_path):
    src = copy_python_source(tmp_path / "src")
    site = tmp_path / "site"
    env = dict(os.environ, TORPOR_LIBRARY=torpor.library_path(), PIP_DISABLE_PIP_VERSION_CHECK="1")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-build-isolation",
            "--no-index",
            "--no-deps",
            "--quiet",
            "--target",
            str(site),
            str(src),
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    bundled = site / "torpor" / "_lib" / "lib" / "libtorpor.so"
    assert bundled.is_file() and not bundled.is_symlink()

    env = {k: v for k, v in os.environ.items() if k not in ("TORPOR_LIBRARY", "PYTHONPATH")}
    code = (
        "import torpor\n"
        "p = torpor.Pool(0, backend='host', va_bytes=1 << 30)\n"
        "a = p.alloc(4096, 'weights', 'state')\n"
        "p.write(a, b'kept'); p.sleep(2); p.wake_up()\n"
        "print(torpor.library_path(), p.read(a, 4).decode(), torpor.__version__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(env, PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    version = (REPO / "VERSION").read_text().split()[0]
    assert out.stdout.split() == [str(bundled.resolve()), "kept", version]
    assert (site / "torpor" / "LICENSE").is_file() and (site / "torpor" / "THIRD_PARTY_NOTICES.md").is_file()
