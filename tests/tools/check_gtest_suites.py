"""ctest ctest.suites_self_test: the ctest entries by suite (TORPOR_TESTS_BY_SUITE,
tests/support/gtest_suites.cmake) report what their tests did.

It turns tests/support/suites_probe.cpp's program into entries by suite, six tests at most to an
entry, in a ctest directory of its own, runs ctest there with TORPOR_SUITES_PROBE=1 (one probe test
then fails) and checks: the suite with a skipped and a failing test fails (a skip must not hide a
failure); the suite whose tests all skip is reported skipped; the seven-test suite is two entries
that pass and together run each of its tests once. Then without TORPOR_SUITES_PROBE every entry
but the skipped one passes.

usage: check_gtest_suites.py CMAKE CTEST PROBE_EXE SUITES_SCRIPT WORK_DIR
"""

import os
import re
import shutil
import subprocess
import sys


def run_ctest(ctest, work, probed):
    env = dict(os.environ)
    env.pop("TORPOR_SUITES_PROBE", None)
    if probed:
        env["TORPOR_SUITES_PROBE"] = "1"
    r = subprocess.run([ctest, "--test-dir", work, "-V"], capture_output=True, text=True, env=env)
    status = {}
    for m in re.finditer(r"Test +#\d+: (\S+) \.+\**\s*(Passed|Failed|Skipped)", r.stdout):
        status[m.group(1)] = m.group(2)
    ran = re.findall(r"\[ +OK \] Many\.(T\d)", r.stdout)
    return status, ran, r.stdout


def main(cmake, ctest, probe, script, work):
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    params = os.path.join(work, "params.cmake")
    with open(params, "w") as f:
        f.write(
            "set(prefix [==[probe.]==])\nset(filter [==[*]==])\n"
            "set(props [====[ TIMEOUT [==[60]==]]====])\nset(per_entry 6)\n"
        )
    out = os.path.join(work, "entries.cmake")
    subprocess.run([cmake, f"-DEXE={probe}", f"-DPARAMS={params}", f"-DOUT={out}", "-P", script], check=True)
    with open(os.path.join(work, "CTestTestfile.cmake"), "w") as f:
        f.write(f"include([==[{out}]==])\n")

    problems = []
    status, ran, log = run_ctest(ctest, work, probed=True)
    want = {
        "probe.Mixed.*": "Failed",
        "probe.AllSkip.*": "Skipped",
        "probe.Many.*[1/2]": "Passed",
        "probe.Many.*[2/2]": "Passed",
    }
    if status != want:
        problems.append(f"with one test failing, ctest reported {status}; expected {want}")
    if sorted(ran) != [f"T{i}" for i in range(1, 8)]:
        problems.append(f"the split suite ran {sorted(ran)}; expected T1..T7 once each")
    status, _, _ = run_ctest(ctest, work, probed=False)
    want["probe.Mixed.*"] = "Passed"
    if status != want:
        problems.append(f"with no test failing, ctest reported {status}; expected {want}")
    if problems:
        print(log[-4000:])
        for p in problems:
            print("FAIL:", p)
        return 1
    print(
        "PASS: a suite entry fails when one of its tests fails, is skipped only when all skip, "
        "and a split suite runs each test once"
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 6:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(*sys.argv[1:]))
