"""The host store prepared by default where sleep is intended (torpor.torch.prepare, issue 30), in
CI: the vLLM and torch_memory_saver modes and torpor.use_pool (with TORPOR_PREPARE_SLEEP) on
fake_torch over the host backend. The oracle is the first sleep's own report: it copies into
page-locked memory that was there before it started (no "host_pinning_wait" phase, the store does
not grow), and what was pinned is what that sleep holds, rounded up to the store's 2 MiB blocks.
With TORPOR_PREPARE_SLEEP=off the same first sleep has to pin (the phase is there), so the checks
tell the two apart."""

import sys
import time

import pytest

import fake_torch
import torpor
from torpor.torch import prepare, routing
from torpor.tms import TorchMemorySaver
from torpor.vllm import CuMemAllocator
from conftest import MiB, TORCH_POOL_OPTIONS, fresh_torch_layer

BLOCK = 2 * MiB  # HostStore::block_rounding


@pytest.fixture
def torch(monkeypatch):
    torpor.configure(**TORCH_POOL_OPTIONS)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    fresh_torch_layer(monkeypatch)
    monkeypatch.setattr(CuMemAllocator, "instance", None)
    monkeypatch.delenv(prepare.ENV, raising=False)
    prepare.forget()
    pool = torpor.Pool.torch(0)
    pool.wake_up()
    pool.release_host_store()
    assert pool.stats()["host_store_bytes"] == 0, "a clean store: what is pinned below is this test's"
    yield fake_torch
    prepare.forget()
    torpor.wake_up()
    lib = torpor._lib.lib()
    for (tag, cls, device), pools in routing.registry.mempools.items():
        for p in pools:
            for seg in routing.own_segments(p, device):
                lib.torpor_torch_free(seg["address"], seg["total_size"], device, None)
    pool.release_host_store()


def settled_stats(timeout=10.0) -> dict:
    """The device pool's stats once no host store block is being pinned."""
    deadline = time.monotonic() + timeout
    while True:
        st = torpor.Pool.torch(0).stats()
        if st["host_store_pinning_bytes"] == 0:
            return st
        assert time.monotonic() < deadline, "the background pinning did not finish"
        time.sleep(0.005)


def assert_first_sleep_found_the_store_prepared(before: dict, reports: list) -> None:
    """`reports`: every report of the first sleep (the process's pool also holds the tags of other
    tests, which an engine mode's sleep puts to sleep too)."""
    after = torpor.Pool.torch(0).stats()
    copied = sum(r["bytes_offloaded"] for r in reports)
    held = after["host_store_used_bytes"]  # what the sleep holds in host memory (all of it this sleep's)
    assert held >= copied
    assert before["host_store_pinned_bytes"] >= held, "prepared before the sleep, page-locked"
    assert before["host_store_pinned_bytes"] - held < BLOCK, "no more than that sleep holds, in 2 MiB blocks"
    for r in reports:
        assert "host_pinning_wait" not in r["phases"], "the sleep pinned nothing itself"
    assert after["host_store_bytes"] == before["host_store_bytes"], "the store did not grow"


def every_report(allocator) -> list:
    return [r for step in allocator.last_reports.values() for r in step.values()]


class VllmEngine:
    """A vLLM worker's memory: a model (two parameters and a buffer) in "weights", a KV cache."""

    def __init__(self, torch, allocator, register=False):
        with allocator.use_memory_pool(tag="weights"):
            self.w = torch.empty(6 * MiB)
            self.b = torch.empty(2 * MiB)
            self.rope = torch.empty(MiB)  # a buffer computed at load
        self.model = torch.nn.Module(w=self.w, b=self.b)  # registration keeps a weak reference
        if register:
            torpor.register_parameters(self.model)
        with allocator.use_memory_pool(tag="kv_cache"):
            self.kv = torch.empty(1 << 20)


def test_vllm_mode_prepares_for_its_level_1_sleep_once_the_model_is_loaded(torch):
    allocator = CuMemAllocator.get_instance()
    VllmEngine(torch, allocator)
    before = settled_stats()
    assert before["host_store_pinned_bytes"] > 0, "the weights' exit started the pinning"
    allocator.sleep(offload_tags=("weights",))  # vLLM's level 1
    assert_first_sleep_found_the_store_prepared(before, every_report(allocator))
    allocator.wake_up()


def test_vllm_mode_level_2_prepares_only_the_state_bytes(torch, monkeypatch):
    monkeypatch.setenv(prepare.ENV, "2")
    allocator = CuMemAllocator.get_instance()
    e = VllmEngine(torch, allocator, register=True)
    before = settled_stats()
    allocator.sleep(offload_tags=())  # vLLM's level 2
    assert_first_sleep_found_the_store_prepared(before, every_report(allocator))
    kept = torpor.Pool.torch(0).stats()["tags"]["weights"]["offloaded_bytes"]
    assert e.rope._nbytes <= kept < e.w._nbytes + e.b._nbytes, "only state travelled"
    allocator.wake_up()


def test_vllm_mode_level_2_without_registration_prepares_nothing(torch, monkeypatch):
    monkeypatch.setenv(prepare.ENV, "2")
    allocator = CuMemAllocator.get_instance()
    VllmEngine(torch, allocator)
    before = settled_stats()
    allocator.sleep(offload_tags=())
    assert_first_sleep_found_the_store_prepared(before, every_report(allocator))
    assert torpor.Pool.torch(0).stats()["tags"]["weights"]["offloaded_bytes"] == 0, "vLLM's level 2: all discarded"
    allocator.wake_up()


def test_tms_mode_prepares_for_pause(torch):
    saver = TorchMemorySaver()
    with saver.region(tag="weights", enable_cpu_backup=True):
        torch.empty(512 << 10)
    with saver.region(tag="kv_cache"):
        torch.empty(1 << 20)
    before = settled_stats()
    assert before["host_store_pinned_bytes"] > 0
    saver.pause()
    reports = [torpor.Pool.torch(0).last_report()]
    assert_first_sleep_found_the_store_prepared(before, reports)
    saver.resume()


def test_use_pool_prepares_only_when_asked(torch, monkeypatch):
    with torpor.use_pool("weights"):
        torch.empty(256 << 10)
    assert settled_stats()["host_store_bytes"] == 0, "auto: plain use_pool prepares nothing"
    monkeypatch.setenv(prepare.ENV, "1")
    with torpor.use_pool("weights"):
        torch.empty(256 << 10)
    before = settled_stats()
    reports = list(torpor.sleep(1).values())
    assert_first_sleep_found_the_store_prepared(before, reports)


def test_off_prepares_nothing_and_the_first_sleep_pins(torch, monkeypatch):
    monkeypatch.setenv(prepare.ENV, "off")
    allocator = CuMemAllocator.get_instance()
    VllmEngine(torch, allocator)
    assert settled_stats()["host_store_bytes"] == 0
    allocator.sleep(offload_tags=("weights",))
    (report,) = allocator.last_reports["offload"].values()
    assert "host_pinning_wait" in report["phases"], "unprepared, the first sleep pins the store itself"
    allocator.wake_up()


def test_a_bad_setting_warns_and_never_fails_the_load(torch, monkeypatch, caplog):
    monkeypatch.setenv(prepare.ENV, "3")
    VllmEngine(torch, CuMemAllocator.get_instance())  # loads
    assert "TORPOR_PREPARE_SLEEP='3' is not auto, off, 1 or 2" in caplog.text
    assert settled_stats()["host_store_bytes"] == 0
