"""``python -m torpor``: where the installed package keeps what C++ and build tools need.

    python -m torpor --cmake-dir   the CMake package (cmake -Dtorpor_DIR=$(python -m torpor --cmake-dir))
    python -m torpor --library     the libtorpor.so the package loads
    python -m torpor --version     the package's version (VERSION)
"""

from __future__ import annotations

import argparse
import sys

from . import __version__, cmake_dir, library_path
from .errors import TorporError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torpor", description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--cmake-dir", action="store_true", help="print the directory of torpor's CMake package")
    what.add_argument("--library", action="store_true", help="print the path of the libtorpor.so in use")
    what.add_argument("--version", action="store_true", help="print the package's version")
    args = parser.parse_args(argv)
    try:
        if args.cmake_dir:
            print(cmake_dir())
        elif args.library:
            print(library_path())
        else:
            print(__version__)
    except TorporError as e:
        print(f"python -m torpor: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
