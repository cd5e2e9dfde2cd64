"""ctest build.host_only_ignores_nccl_h: a host-only build (-DTORPOR_CUDA=OFF) compiles on a
machine whose nccl.h needs the CUDA headers.

The GPU image's /usr/include/nccl.h includes cuda_runtime.h, and a host-only build has no CUDA
include path, so a host-only build that includes nccl.h anywhere fails there (issue 28: the
ASan stage of scripts/test.sh did). NCCL support is decided once by CMake (TORPOR_NCCL, only
with the CUDA backend). This check stands in for that machine: it puts a fake nccl.h that
includes cuda_runtime.h (and then refuses outright, in case a cuda_runtime.h is on the default
path) first on the include path and on CMake's search path, configures a host-only build, and
preprocesses every source of that build with its own compile command. It fails if CMake turns
NCCL on, or if any source of the host-only build includes nccl.h.

usage: python3 check_host_build_ignores_nccl_h.py REPO WORK_DIR
"""

import concurrent.futures
import json
import os
import shlex
import shutil
import subprocess
import sys

FAKE_NCCL_H = """/* A stand-in for the GPU image's nccl.h, which includes cuda_runtime.h. */
#include <cuda_runtime.h>
#error "a host-only torpor build included nccl.h (TORPOR_NCCL must stay off without TORPOR_CUDA)"
"""


def preprocess(entry):
    """Runs the entry's compile command with -E into /dev/null; returns (file, error or None)."""
    args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    out = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "-o":
            skip = True
            continue
        if a in ("-c",) or a.startswith("-MF") or a in ("-MD", "-MMD"):
            continue
        out.append(a)
    out += ["-E", "-o", os.devnull]
    r = subprocess.run(out, cwd=entry["directory"], capture_output=True, text=True)
    return entry["file"], (r.stderr.strip() or f"exit {r.returncode}") if r.returncode != 0 else None


def main(repo, work):
    shutil.rmtree(work, ignore_errors=True)
    fake = os.path.join(work, "fake-include")
    os.makedirs(fake)
    with open(os.path.join(fake, "nccl.h"), "w") as f:
        f.write(FAKE_NCCL_H)
    build = os.path.join(work, "build")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CMAKE_") or k.endswith("_LAUNCHER")}
    configure = [
        "cmake", "-S", repo, "-B", build, "-G", "Ninja", "-DTORPOR_CUDA=OFF", "-DTORPOR_BUILD_TESTS=OFF",
        "-DTORPOR_BUILD_BENCH=OFF", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON", f"-DCMAKE_INCLUDE_PATH={fake}",
        f"-DCMAKE_CXX_FLAGS=-isystem {fake}", f"-DCMAKE_C_FLAGS=-isystem {fake}",
    ]  # fmt: skip
    r = subprocess.run(configure, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        print(r.stdout, r.stderr)
        print("FAIL: the host-only configure failed (above)")
        return 1
    if "torpor: NCCL support OFF" not in r.stdout:
        print(r.stdout)
        print("FAIL: a host-only configure turned NCCL support on (it needs the CUDA backend)")
        return 1
    with open(os.path.join(build, "compile_commands.json")) as f:
        entries = [e for e in json.load(f) if e["file"].endswith((".cpp", ".c"))]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failures = [(f, e) for f, e in pool.map(preprocess, entries) if e is not None]
    for f, e in failures:
        print(f"{f}:\n{e}\n")
    if failures:
        print(f"FAIL: {len(failures)} of {len(entries)} sources of a host-only build do not preprocess with a "
              f"nccl.h that needs the CUDA headers on the include path (above)")  # fmt: skip
        return 1
    shutil.rmtree(work, ignore_errors=True)
    print(f"PASS: {len(entries)} sources of a host-only build preprocess with such an nccl.h first on the path")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
