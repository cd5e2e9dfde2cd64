"""Build step of the Python package: `pip install .` at the repository root builds libtorpor.

The package itself is pure Python over ctypes; what makes the wheel platform-specific is the
library inside it. build_py puts under ``torpor/_lib/`` (the package's own prefix):

- ``lib/libtorpor.so``: the library torpor._lib loads when TORPOR_LIBRARY is unset;
- ``include/`` and ``lib/cmake/torpor/``: the headers and the CMake package (torpor::torpor,
  torpor::kernels, torpor::fusion), so a C++ project finds torpor from pip with
  ``-DCMAKE_PREFIX_PATH=$(python -m torpor --cmake-dir)``;
- ``VERSION`` and the licence files.

The library is built here with CMake (a configure and build of its targets only: no tests, tools
or benchmarks) in build-wheel/ with -DTORPOR_WHEEL=ON: the library carries no SOVERSION, and fmt is compiled into
it (cmake/TorporFmt.cmake), so the wheel needs nothing but the C and C++ runtimes (CUDA and NCCL
are opened at run time). CMAKE_BUILD_PARALLEL_LEVEL, CMAKE_ARGS (extra configure arguments) and the compiler
launchers of the environment (ccache) are honoured. Set TORPOR_LIBRARY to bundle a library built
beforehand instead (no CMake run, no headers or CMake package in the wheel).
"""

import os
import pathlib
import shlex
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from wheel.bdist_wheel import bdist_wheel
except ImportError:  # no wheel package: `pip install` still works through setup.py's own install
    bdist_wheel = None

HERE = pathlib.Path(__file__).resolve().parent


def read_version():
    text = (HERE / "VERSION").read_text(encoding="utf-8").strip()
    if not text:
        raise SystemExit(f"{HERE / 'VERSION'} is empty: write the version (MAJOR.MINOR.PATCH) there")
    return text.splitlines()[0].strip()


def prebuilt_library():
    env = os.environ.get("TORPOR_LIBRARY")
    if not env:
        return None
    for path in (pathlib.Path(env), HERE / env):
        if path.is_file():
            return path.resolve()
    raise SystemExit(
        f"TORPOR_LIBRARY={env} is not a file (relative paths are tried from {os.getcwd()} and {HERE}); "
        f"point it at libtorpor.so, or unset it to build the library with CMake"
    )


def run(cmd, **kw):
    print("torpor:", " ".join(shlex.quote(str(c)) for c in cmd), flush=True)
    try:
        subprocess.run([str(c) for c in cmd], check=True, **kw)
    except FileNotFoundError:
        raise SystemExit(f"{cmd[0]} is not installed: building libtorpor needs CMake and Ninja or make") from None
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"building libtorpor failed ({cmd[0]} exited with {e.returncode}); the output is above")


def build_with_cmake(prefix: pathlib.Path):
    cmake = shutil.which("cmake")
    if cmake is None:
        raise SystemExit("cmake is not installed: `pip install .` builds libtorpor with CMake (apt-get install cmake)")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    # Beside the release build (build-wheel/ next to build/): at the same depth below the repository,
    # the library's compile lines are the release build's, so ccache (CCACHE_BASEDIR at the
    # repository, as scripts/test.sh sets it) hands the wheel the release build's objects.
    build_dir = HERE / "build-wheel"
    # A stale cache of another generator would refuse the configure: start over then.
    cache = build_dir / "CMakeCache.txt"
    if cache.exists() and generator and "CMAKE_GENERATOR:INTERNAL=Ninja" not in cache.read_text():
        shutil.rmtree(build_dir)
    run(
        [
            cmake,
            "-S",
            HERE,
            "-B",
            build_dir,
            *generator,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DTORPOR_WHEEL=ON",
            "-DTORPOR_BUILD_TESTS=OFF",
            "-DTORPOR_BUILD_TOOLS=OFF",
            "-DTORPOR_BUILD_BENCH=OFF",
            f"-DCMAKE_INSTALL_PREFIX={prefix}",
            "-DCMAKE_INSTALL_LIBDIR=lib",
            *shlex.split(os.environ.get("CMAKE_ARGS", "")),
        ]
    )
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
    run(
        [
            cmake,
            "--build",
            build_dir,
            "-j",
            jobs,
            "--target",
            "torpor",
            "torpor_kernels",
            "torpor_fusion",
            "torpor_preload",
        ]
    )
    if prefix.exists():
        shutil.rmtree(prefix)
    run([cmake, "--install", build_dir], stdout=subprocess.DEVNULL)


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        package = pathlib.Path(self.build_lib) / "torpor"
        prefix = package / "_lib"
        lib = prebuilt_library()
        if lib is None:
            build_with_cmake(prefix.resolve())
        else:
            target = prefix / "lib"
            target.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(lib, target / "libtorpor.so")  # the file itself, not a symlink
            self.announce(f"torpor: bundled {lib} (TORPOR_LIBRARY)", level=3)
        for name in ("VERSION", "LICENSE", "THIRD_PARTY_NOTICES.md"):
            shutil.copyfile(HERE / name, package / name)


cmdclass = {"build_py": BuildPyWithLibrary}
if bdist_wheel is not None:

    class PlatformWheel(bdist_wheel):
        """A wheel of this platform (it holds libtorpor.so), for any Python 3: the package binds
        the library through ctypes, so no CPython ABI is involved."""

        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False

        def get_tag(self):
            _, _, platform = super().get_tag()
            return "py3", "none", platform

    cmdclass["bdist_wheel"] = PlatformWheel

setup(version=read_version(), cmdclass=cmdclass, options={"build": {"build_base": "build/_python"}})
