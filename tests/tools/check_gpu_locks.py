"""ctest gpu.locks: every test that touches a GPU holds the GPU lock, and every test that reads
device-wide memory also runs alone.

ctest -j runs tests side by side. On a GPU machine a test that opens the CUDA driver takes device
memory (its context, its allocations), so a test that reads device-wide free memory
(torch.cuda.mem_get_info, cuMemGetInfo) sees another test's bytes unless neither overlaps it
(issue 28: python.test_engines_gpu failed 1 run in 2 on one H200). The rule is in
tests/CMakeLists.txt; this reads ctest's own list of tests (ctest --show-only=json-v1) and judges
each test by signs independent of how CMake set its properties:

- a test touches a GPU when it does not force the host backend (--backend host in its command,
  TORPOR_BACKEND=host in its environment) and either it is a gtest case or a Python file whose
  name says CUDA, GPU or NCCL (a gtest typed over the cuda backend, PoolTest.X<PoolTest/cuda...>;
  a Python GPU file, test_*_gpu), or it is not a gtest case and runs the torpor CLI or a
  benchmark (their backend is then auto);
- a Python test file reads device-wide memory when its source calls mem_get_info;
- a test whose environment picks the host backend's mode (TORPOR_HOST_MODE) forces the host
  backend too (as above) or holds the lock: the mode means nothing to the cuda backend, so on a
  GPU machine such a test would otherwise run on the GPU unlocked, whatever its name. (The
  host_async_env entries lost TORPOR_BACKEND=host on their way through gtest_discover_tests once.)

usage: check_gpu_locks.py CTEST BUILD_DIR REPO
"""

import json
import os
import re
import subprocess
import sys

LOCK = "torpor_gpu"
GPU_NAME = re.compile(r"cuda|gpu|nccl", re.I)


def properties(test):
    return {p["name"]: p["value"] for p in test.get("properties", [])}


def host_forced(test, props):
    command = " ".join(test.get("command", []))
    env = props.get("ENVIRONMENT", [])
    return "--backend host" in command or "TORPOR_BACKEND=host" in env


def runs_a_torpor_program(test):
    for arg in test.get("command", []):
        path = arg.split("=", 1)[1] if arg.startswith("-DCOMMAND=") else arg
        base = os.path.basename(path)
        if base == "torpor" or base.startswith("torpor_bench"):
            return True
    return False


def touches_gpu(test, props):
    if host_forced(test, props):
        return False
    is_gtest = any(a.startswith("--gtest_filter") for a in test.get("command", []))
    if (is_gtest or test["name"].startswith("python.")) and GPU_NAME.search(test["name"]):
        return True
    return not is_gtest and runs_a_torpor_program(test)


def reads_device_memory(test, repo):
    m = re.fullmatch(r"python\.(test_\w+)", test["name"])
    if not m:
        return False
    path = os.path.join(repo, "tests", "python", m.group(1) + ".py")
    return os.path.exists(path) and "mem_get_info" in open(path, encoding="utf-8").read()


def main(ctest, build, repo):
    out = subprocess.run([ctest, "--show-only=json-v1"], cwd=build, capture_output=True, text=True, check=True)
    tests = json.loads(out.stdout)["tests"]
    missing, not_serial, locked, half_host = [], [], 0, []
    for t in tests:
        props = properties(t)
        has_lock = LOCK in props.get("RESOURCE_LOCK", [])
        host_mode = any(e.startswith("TORPOR_HOST_MODE=") for e in props.get("ENVIRONMENT", []))
        if host_mode and not host_forced(t, props) and not has_lock:
            half_host.append(t["name"])
        if touches_gpu(t, props):
            if has_lock:
                locked += 1
            else:
                missing.append(t["name"])
        if reads_device_memory(t, repo) and not props.get("RUN_SERIAL"):
            not_serial.append(t["name"])
    for name in missing:
        print(f"no RESOURCE_LOCK {LOCK}: {name}")
    for name in not_serial:
        print(f"reads device-wide memory but not RUN_SERIAL: {name}")
    for name in half_host:
        print(f"sets TORPOR_HOST_MODE, neither forces the host backend nor holds the lock: {name}")
    if missing or not_serial or half_host:
        print(
            f"FAIL: {len(missing)} GPU tests without the lock, {len(not_serial)} measuring tests not run alone, "
            f"{len(half_host)} tests in a host mode without TORPOR_BACKEND=host (of {len(tests)}); "
            f"tests/CMakeLists.txt says how to add them (torpor_discover_tests, RESOURCE_LOCK ${{TORPOR_GPU_LOCK}}, "
            f"RUN_SERIAL, torpor_gtest_discover's ENVIRONMENT)"
        )
        return 1
    print(f"PASS: {locked} GPU tests of {len(tests)} hold {LOCK}; the measuring ones run alone")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
