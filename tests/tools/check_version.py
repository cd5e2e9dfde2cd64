"""ctest version.agree: every place torpor states its version says what VERSION says.

VERSION (the repository root) is the one source; CMake reads it for the project, the library
(torpor_version(), through the generated torpor/version.h), the CLI (--version, which prints the
library's) and the CMake package's version file; the Python package reads it for
torpor.__version__ and for its metadata (setup.py). Each is read back here from what the build
produced, not from CMake's variables, so a version written by hand anywhere shows as a drift.

usage: python3 check_version.py REPO CLI LIBRARY CONFIG_VERSION_CMAKE (this python3 runs setup.py)
"""

import ctypes
import os
import re
import subprocess
import sys


def main(repo, cli, library, config_version):
    python = sys.executable
    with open(os.path.join(repo, "VERSION"), encoding="utf-8") as f:
        want = f.readline().strip()
    found = {}
    out = subprocess.run([cli, "--version"], capture_output=True, text=True, check=False)
    found["torpor --version"] = out.stdout.strip()
    lib = ctypes.CDLL(library)
    lib.torpor_version.restype = ctypes.c_char_p
    found["torpor_version() of " + library] = "torpor " + lib.torpor_version().decode()
    with open(config_version, encoding="utf-8") as f:
        m = re.search(r'set\(PACKAGE_VERSION "([^"]*)"\)', f.read())
    found[config_version] = "torpor " + (m.group(1) if m else "<no PACKAGE_VERSION>")
    env = dict(os.environ, PYTHONPATH=os.path.join(repo, "python"), PYTHONDONTWRITEBYTECODE="1")
    env.pop("TORPOR_LIBRARY", None)
    code = "import torpor; print(torpor.__version__)"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, check=False)
    found["torpor.__version__"] = "torpor " + (out.stdout.strip() or out.stderr.strip())
    out = subprocess.run(
        [python, "setup.py", "--version"], cwd=repo, capture_output=True, text=True, env=env, check=False
    )
    found["setup.py --version (the wheel's metadata)"] = "torpor " + (out.stdout.strip().splitlines() or [""])[-1]
    drift = {k: v for k, v in found.items() if v != "torpor " + want}
    for k, v in found.items():
        print(f"{k}: {v}")
    if drift:
        print(f"FAIL: VERSION says {want}; these differ: {', '.join(drift)}. Write the version only in VERSION")
        return 1
    print(f"PASS: every place says {want}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
