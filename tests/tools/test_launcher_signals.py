#!/usr/bin/env python3
"""The --processes launcher under signals (issue 19, item 7).

SIGTERM, SIGINT or SIGHUP to the launcher, and SIGINT to its whole process group (Ctrl-C in a
terminal), must end every rank (none left orphaned) and leave no rendezvous directory in TMPDIR;
the launcher dies of the signal. SIGKILL to the launcher (which can clean nothing up) must still
end every rank within seconds, not at the group's timeout (issue 33 N17). A --json path in a
missing directory, or on /dev/full, makes the command exit non-zero (item 9), and so does text
output to a full stdout (issue 33 N16).

Usage: test_launcher_signals.py PATH/TO/torpor
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

CLI = sys.argv[1]
FAILURES = []


def children_of(pid):
    """The pids whose parent is `pid` (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[1]) == pid:
            kids.append(int(entry))
    return kids


def alive(pid):
    """Whether `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print(f"FAIL: {what}", flush=True)


def run_and_signal(sig, whole_group):
    name = f"{signal.Signals(sig).name}{' to the process group' if whole_group else ''}"
    with tempfile.TemporaryDirectory(prefix="torpor-launcher-test-") as tmp:
        env = dict(os.environ, TMPDIR=tmp)
        launcher = subprocess.Popen(
            [
                CLI,
                "stress",
                "--backend",
                "host",
                "--ranks",
                "2",
                "--processes",
                "--cycles",
                "100000",
                "--no-progress",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        ranks = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(ranks) < 2:
            ranks = children_of(launcher.pid)
            time.sleep(0.05)
        check(len(ranks) == 2, f"{name}: the launcher started 2 ranks (saw {ranks})")
        time.sleep(1.0)  # the ranks form their group and start working
        if whole_group:
            os.killpg(launcher.pid, sig)
        else:
            os.kill(launcher.pid, sig)
        try:
            code = launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
            check(False, f"{name}: the launcher did not exit within 30 s")
            return
        check(code == -sig, f"{name}: the launcher dies of the signal (exit {code})")
        gone_by = time.monotonic() + 10
        while time.monotonic() < gone_by and any(alive(p) for p in ranks):
            time.sleep(0.05)
        check(
            not any(alive(p) for p in ranks),
            f"{name}: every rank ended ({[p for p in ranks if alive(p)]} left)",
        )
        if sig != signal.SIGKILL:  # a killed launcher cannot remove it
            left = [e for e in os.listdir(tmp) if e.startswith("torpor-group-")]
            check(not left, f"{name}: no rendezvous left in TMPDIR (found {left})")
        print(f"ok: {name}", flush=True)


def json_write_failure(path):
    run = subprocess.run(
        [
            CLI,
            "symmetric-check",
            "--backend",
            "host",
            "--ranks",
            "2",
            "--bytes",
            "1M",
            "--json",
            path,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    check(
        run.returncode != 0,
        f"symmetric-check --json {path}: non-zero exit (got {run.returncode})",
    )
    check(
        "could not write" in run.stderr,
        f"symmetric-check --json {path}: says why ({run.stderr.strip()[-200:]})",
    )
    print(f"ok: --json {path}", flush=True)


def text_output_to_a_full_stdout():
    """Issue 33 N16: text printed to a stdout that cannot take it is a failed command."""
    with open("/dev/full", "w") as full:
        run = subprocess.run(
            [CLI, "probe", "--backend", "host"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60
        )
    check(run.returncode != 0, f"probe > /dev/full: non-zero exit (got {run.returncode})")
    check("writing the output failed" in run.stderr, f"probe > /dev/full: says why ({run.stderr.strip()[-200:]})")
    print("ok: probe > /dev/full", flush=True)


for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    run_and_signal(s, whole_group=False)
run_and_signal(signal.SIGINT, whole_group=True)
run_and_signal(signal.SIGKILL, whole_group=False)
json_write_failure("/nonexistent-torpor-dir/out.json")
if os.path.exists("/dev/full"):
    json_write_failure("/dev/full")
    text_output_to_a_full_stdout()
sys.exit(1 if FAILURES else 0)
