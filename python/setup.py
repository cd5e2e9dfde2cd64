"""Build step that bundles libtorpor.so into the package (torpor/_lib/libtorpor.so).

The package itself is pure Python over ctypes. The library bundled is, in order: the file
TORPOR_LIBRARY names, else the repository's build/allocator/libtorpor.so (next to this
directory). Without either the package installs without a copy and looks for the library at
run time (TORPOR_LIBRARY, the repository's build directories, the system path). A bundled
copy is the machine's own build: the wheel is meant for this machine, not for distribution.
"""

import os
import pathlib
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent


def library_to_bundle():
    env = os.environ.get("TORPOR_LIBRARY")
    if env:
        # pip runs this from python/, so a relative path may mean the repository root's.
        for path in (pathlib.Path(env), HERE.parent / env):
            if path.is_file():
                return path
        raise SystemExit(
            f"TORPOR_LIBRARY={env} is not a file (relative paths are tried from {os.getcwd()} and "
            f"{HERE.parent}); point it at libtorpor.so or unset it"
        )
    default = HERE.parent / "build" / "allocator" / "libtorpor.so"
    return default if default.is_file() else None


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        lib = library_to_bundle()
        if lib is None:
            self.announce(
                "torpor: no libtorpor.so to bundle (set TORPOR_LIBRARY or build the repository first); "
                "the package will look for it at run time",
                level=3,
            )
            return
        target = pathlib.Path(self.build_lib) / "torpor" / "_lib"
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(lib.resolve(), target / "libtorpor.so")  # the file itself, not a symlink
        self.announce(f"torpor: bundled {lib.resolve()}", level=3)


setup(cmdclass={"build_py": BuildPyWithLibrary})
