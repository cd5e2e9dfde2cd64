"""``python3 -m torpor.tms``: where the torch_memory_saver mode's pieces are.

    python3 -m torpor.tms --shim-path      the directory to put first on PYTHONPATH
    python3 -m torpor.tms --preload-path   libtorpor_preload.so, for LD_PRELOAD (hook_mode "preload")
"""

from __future__ import annotations

import argparse
import sys

from .library import PRELOAD_NAME, preload_library_path
from .shim import shim_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m torpor.tms", description="torpor's torch_memory_saver mode")
    ap.add_argument(
        "--shim-path",
        action="store_true",
        help="print the directory to put first on PYTHONPATH",
    )
    ap.add_argument(
        "--preload-path",
        action="store_true",
        help=f"print the path of {PRELOAD_NAME} to put on LD_PRELOAD (hook_mode 'preload')",
    )
    args = ap.parse_args(argv)
    if args.shim_path:
        print(shim_path())
        return 0
    if args.preload_path:
        print(preload_library_path())
        return 0
    ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
