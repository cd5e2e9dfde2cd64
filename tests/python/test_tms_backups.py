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
