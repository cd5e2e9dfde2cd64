"""torch_memory_saver's backup settings over torpor (torpor.tms), each in a child process because
they configure the pools' host store before the first allocation: the disk backup
(set_disk_backup_dir, TMS_DISK_BACKUP_DIR, region(enable_disk_backup=True)) lands in torpor's disk
tier, TMS_INIT_CPU_BACKUP_BACKEND=mmap makes the store pageable, TMS_RETAIN_CPU_BACKUP sets
retain_cpu_backup. The oracle is torch_memory_saver at 4a43c97 (test/examples/disk_backup.py,
cpu_backup.py; csrc/utils.h get_bool_env_var) and the bytes written before the pause; each setting
has its control run without it."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, subprocess_env

CHILD = f"""
import json, os, sys
sys.path.insert(0, {str(REPO / "tests" / "python")!r})
import fake_torch
sys.modules["torch"] = fake_torch
import torpor
from torpor.tms import torch_memory_saver as saver

torpor.configure(backend="host", va_bytes=1 << 30, fill_on_wake="poison")
mode, directory = sys.argv[1], sys.argv[2]
if mode == "set_dir":
    saver.set_disk_backup_dir(directory)
n = 8 << 20
with saver.region(tag="disk", enable_disk_backup=mode != "cpu", enable_cpu_backup=mode == "cpu"):
    kept = fake_torch.empty(n)
with saver.region(tag="nobackup"):
    lost = fake_torch.empty(n)
pool = torpor.Pool.torch(0)
kept_bytes, lost_bytes = os.urandom(n), os.urandom(n)
pool.write(kept.data_ptr(), kept_bytes)
pool.write(lost.data_ptr(), lost_bytes)
saver.pause()
files = {{f: os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)}}
st = pool.stats()
saver.resume()
print(json.dumps(dict(
    files=files,
    retain=saver.retain_cpu_backup,
    spill_used=st["spill_used_bytes"],
    pinned=st["host_store_pinned_bytes"],
    pageable=st["host_store_pageable_bytes"],
    kept=pool.read(kept.data_ptr(), n) == kept_bytes,
    lost=pool.read(lost.data_ptr(), n) != lost_bytes,
)))
"""

N = 8 << 20


def child(mode, directory, **env):
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(directory)],
        env=subprocess_env(TORPOR_LOG="off", **env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out


def run_child(mode, directory, **env):
    out = child(mode, directory, **env)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("TMS_DISK_BACKUP_DIR", "TMS_INIT_CPU_BACKUP_BACKEND", "TMS_RETAIN_CPU_BACKUP"):
        monkeypatch.delenv(name, raising=False)


def test_set_disk_backup_dir_puts_the_disk_regions_backup_in_torpors_disk_tier_there(tmp_path, clean_env):
    r = run_child("set_dir", tmp_path / "tier")  # created by set_disk_backup_dir, as TMS does
    assert r["kept"] and r["lost"], "disk region restored bit-exact, the region without backup discarded"
    assert r["spill_used"] >= N and r["pinned"] == 0, "the disk region's bytes went to the disk tier"
    assert sum(r["files"].values()) >= N, f"a spill file in the directory holds them: {r['files']}"


def test_tms_disk_backup_dir_is_read_from_the_environment(tmp_path, clean_env):
    r = run_child("env_dir", tmp_path, TMS_DISK_BACKUP_DIR=str(tmp_path))
    assert r["kept"] and r["lost"] and r["spill_used"] >= N and sum(r["files"].values()) >= N


def test_control_a_cpu_backup_without_a_disk_directory_stays_in_page_locked_memory(tmp_path, clean_env):
    r = run_child("cpu", tmp_path)
    assert r["kept"] and r["lost"]
    assert r["files"] == {} and r["spill_used"] == 0 and r["pinned"] >= N and r["pageable"] == 0
    assert r["retain"] is False


def test_tms_init_cpu_backup_backend_mmap_makes_the_host_store_pageable(tmp_path, clean_env):
    r = run_child("cpu", tmp_path, TMS_INIT_CPU_BACKUP_BACKEND="mmap")
    assert r["kept"] and r["lost"]
    assert r["pageable"] >= N and r["pinned"] == 0 and r["files"] == {}


@pytest.mark.parametrize("value, on", [("1", True), ("yes", True), ("TRUE", True), ("0", False), ("NO", False)])
def test_tms_retain_cpu_backup_is_read_with_tms_values(tmp_path, clean_env, value, on):
    assert run_child("cpu", tmp_path, TMS_RETAIN_CPU_BACKUP=value)["retain"] is on


@pytest.mark.parametrize("name, value", [("TMS_RETAIN_CPU_BACKUP", "2"), ("TMS_INIT_CPU_BACKUP_BACKEND", "disk")])
def test_a_tms_variable_with_a_value_tms_does_not_take_is_an_error_naming_it(tmp_path, clean_env, name, value):
    out = child("cpu", tmp_path, **{name: value})
    assert out.returncode != 0
    assert "InvalidArgument" in out.stderr and f"{name}={value!r}" in out.stderr


def test_disk_backup_after_the_pools_hold_memory_is_refused_and_nothing_changes(tmp_path, clean_env):
    code = CHILD.split("mode, directory")[0] + (
        "x = torpor.Pool.torch(0)\n"
        "with saver.region(tag='early'):\n"
        "    fake_torch.empty(1 << 20)\n"
        "try:\n"
        f"    saver.set_disk_backup_dir({str(tmp_path)!r})\n"
        "except torpor.Unavailable as e:\n"
        "    print('refused:', e)\n"
        "with saver.region(tag='later', enable_cpu_backup=True):\n"
        "    fake_torch.empty(1 << 20)\n"
        "saver.pause(); saver.resume(); print('still works')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(TORPOR_LOG="off"), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "refused: torpor.tms: disk backup into" in out.stdout and out.stdout.rstrip().endswith("still works")
    assert os.listdir(tmp_path) == []


# torch_memory_saver's test/examples/disk_backup.py (4a43c97), restated on the host backend: a file
# per disk-backed allocation in the directory while paused, their sizes covering the bytes and
# constant across cycles, the bytes restored bit-exact, and the example's own removal of the
# directory before exit taken without an error on stderr.
DISK_CHILD = f"""
import json, os, shutil, sys
sys.path.insert(0, {str(REPO / "tests" / "python")!r})
import fake_torch
sys.modules["torch"] = fake_torch
import torpor
from torpor.tms import torch_memory_saver as saver

torpor.configure(backend="host", va_bytes=1 << 30, fill_on_wake="poison")
directory = sys.argv[1]
saver.set_disk_backup_dir(directory)
big_n, small_n = (1 << 20) * 13 + 12345 * 4, 1 << 20  # two segments: the second does not fit the first's tail
with saver.region(enable_disk_backup=True):
    big = fake_torch.empty(big_n)
    small = fake_torch.empty(small_n)
with saver.region(enable_disk_backup=False):
    lost = fake_torch.empty(8 << 20)
pool = torpor.Pool.torch(0)
data = {{"big": os.urandom(big_n), "small": os.urandom(small_n)}}
pool.write(big.data_ptr(), data["big"])
pool.write(small.data_ptr(), data["small"])
segments = len({{pool.find(t.data_ptr())[0] for t in (big, small)}})
cycles = []
for _ in range(3):
    pool.write(lost.data_ptr(), b"\\x14" * (8 << 20))
    saver.pause()
    files = sorted(os.listdir(directory))
    cycles.append(dict(files=len(files), total=sum(os.path.getsize(os.path.join(directory, f)) for f in files)))
    saver.resume()
    cycles[-1].update(
        exact=pool.read(big.data_ptr(), big_n) == data["big"] and pool.read(small.data_ptr(), small_n) == data["small"],
        lost=pool.read(lost.data_ptr(), 16) == b"\\xff" * 16,
        after_resume=len(os.listdir(directory)),
    )
saver.pause()
shutil.rmtree(directory)  # as the example's finally: before the process (and torpor) ends
print(json.dumps(dict(segments=segments, cycles=cycles, big=big_n, small=small_n)))
"""


def test_disk_backup_writes_a_file_per_disk_backed_allocation_as_tms_example(tmp_path, clean_env):
    directory = tmp_path / "tms_disk_backup"
    out = subprocess.run(
        [sys.executable, "-c", DISK_CHILD, str(directory)],
        env=subprocess_env(TORPOR_LOG="warn"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["segments"] == 2, "the two tensors are two allocations of the pool"
    for c in r["cycles"]:
        assert c["files"] == r["segments"], f"a backup file per disk-backed allocation: {r['cycles']}"
        assert c["total"] >= r["big"] + r["small"], "the files hold at least the paused bytes"
        assert c["exact"] and c["lost"], "disk-backed bytes restored bit-exact; the region without backup discarded"
        assert c["after_resume"] == 0, "a resume without retain gives the disk back"
    assert len({c["total"] for c in r["cycles"]}) == 1, f"disk usage constant across cycles: {r['cycles']}"
    assert "torpor error" not in out.stderr, f"a spill file removed by the caller is no error: {out.stderr}"
