"""torpor's vLLM plugin (torpor/vllm_plugin.py) against a stand-in vLLM (tests/python/stand_ins:
the call sites of vLLM's plugin loader, allocator module, sleep-mode backends and workers, see its
README), each case in a process of its own, as vLLM's workers are. The plugin is found the way vLLM
finds it: an entry point of group vllm.general_plugins, declared in pyproject.toml."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import torpor
from conftest import REPO, copy_python_source, subprocess_env

STAND_INS = REPO / "tests" / "python" / "stand_ins"
KIB = 1 << 10


def declared_entry_point() -> str:
    try:
        import tomllib
    except ImportError:
        pytest.skip("tomllib (Python >= 3.11) is needed to read the entry point from pyproject.toml")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["entry-points"]["vllm.general_plugins"]["torpor"]


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """A site directory where importlib.metadata finds torpor's declared entry points."""
    site = tmp_path_factory.mktemp("site")
    info = site / "torpor-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torpor\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\ntorpor = {declared_entry_point()}\n")
    return site


def run_stand_in(script, dist, args, env):
    """A stand-in driver script in a child with the stand-in vLLM and `dist` on its path; the JSON
    of its last line."""
    env["PYTHONPATH"] = os.pathsep.join([str(STAND_INS), str(dist), env["PYTHONPATH"]])
    env.setdefault("TORPOR_LOG", "error")
    out = subprocess.run(
        [sys.executable, str(STAND_INS / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def drive(dist, *args, **env):
    return run_stand_in("drive_worker.py", dist, args, subprocess_env(**env))


def check_sleep_cycle(seen):
    """What vLLM's worker must see with torpor's allocator and the model registered."""
    assert seen["allocator"] == "torpor.vllm.CuMemAllocator"
    assert seen["in_torpor"], "the weights and the KV cache live in torpor's pools"
    assert seen["registered_bytes"] == 128 * KIB, "the plugin registered the parameters after load"
    assert seen["level1_asleep"] == ["kv_cache", "weights"]
    assert seen["level1_weights_kept"] and seen["level1_kv_poisoned"]
    assert seen["level2_parameter_bytes_offloaded"] == 0, "no parameter is copied to host memory"
    assert seen["level2_state_bytes_offloaded"] == 16 * KIB, "the buffer is (nothing else in weights is state)"
    assert seen["level2_rope_kept"] and seen["level2_parameters_poisoned"]
    assert seen["kv_asleep_after_weights"], "wake_up(['weights']) leaves the KV cache asleep"
    assert seen["reloaded"] and seen["kv_poisoned"]


def test_without_torpor_vllm_the_plugin_leaves_vllm_alone(dist):
    for env in ({}, {"TORPOR_VLLM": "0"}, {"TORPOR_VLLM": "off"}):
        seen = drive(dist, **env)
        assert seen["allocator"] == "vllm.device_allocator.cumem.CuMemAllocator"
        assert seen["load_error"] == "cumem allocator is not available"


def test_vllm_plugins_can_leave_torpor_out(dist):
    seen = drive(dist, TORPOR_VLLM="1", VLLM_PLUGINS="some_other_plugin")
    assert seen["allocator"] == "vllm.device_allocator.cumem.CuMemAllocator"
    seen = drive(dist, TORPOR_VLLM="1", VLLM_PLUGINS="some_other_plugin,torpor")
    assert seen["allocator"] == "torpor.vllm.CuMemAllocator"


def test_current_worker_with_vllms_default_backend(dist):
    seen = drive(dist, "--backend", "cumem", TORPOR_VLLM="1")
    check_sleep_cycle(seen)
    assert seen["discard_kv_asleep"] and seen["discard_weights_awake"]
    assert seen["backend_state"] == "RUNNING"


def test_current_worker_with_the_torpor_backend(dist):
    seen = drive(dist, "--backend", "torpor", TORPOR_VLLM="1")
    check_sleep_cycle(seen)
    assert seen["discard_kv_asleep"] and seen["discard_weights_awake"]
    assert seen["backend_state"] == "RUNNING"


def test_the_workers_buffer_stash_is_not_needed(dist):
    seen = drive(dist, "--drop-stash", TORPOR_VLLM="1")
    assert seen["level2_rope_kept"], "torpor kept the buffer by itself"
    assert seen["level2_parameter_bytes_offloaded"] == 0


def test_oldest_worker_without_backends_gets_torpor_through_its_module_import(dist):
    seen = drive(dist, "--worker", "vllm.worker.worker.Worker", TORPOR_VLLM="1", STAND_IN_VLLM_NO_BACKENDS="1")
    check_sleep_cycle(seen)
    assert "discard_kv_asleep" not in seen


def drive_kv_connector(dist, *args, **env):
    """drive_kv_connector.py on the newest worker (mrv2); what the KV transport saw."""
    env = subprocess_env(STAND_IN_VLLM_GENERATION="mrv2", TORPOR_VLLM="1", **env)
    return run_stand_in("drive_kv_connector.py", dist, args, env)


def test_a_kv_connector_without_sleep_mode_gets_an_exportable_kv_cache_another_process_reads(dist):
    """vLLM with a KV connector and the cumem allocator but no sleep mode (--enable-cumem-allocator,
    vllm#33648): the KV cache lives in torpor's pools, which are exportable, and the handles a
    transport takes reach the KV cache's bytes from another process."""
    seen = drive_kv_connector(dist, "--kv-connector", "NixlConnector", "--no-sleep-mode")
    assert seen["kv_in_torpor"] and seen["exportable"], seen
    assert seen["chunks"] >= 1 and seen["kinds"] == ["posix_fd"]
    assert seen["gpu_direct_rdma"], "the host backend's devices emulate GPUDirect RDMA with VMM"
    assert seen["read_elsewhere_matches"], "another process read the KV cache's bytes through the descriptor"


def test_a_kv_connector_with_sleep_mode_re_registers_around_sleep_and_the_new_handles_reach_the_new_memory(dist):
    seen = drive_kv_connector(dist, "--kv-connector", "NixlConnector")
    assert seen["exportable"] and seen["read_elsewhere_matches"], seen
    assert seen["closed_before_unmap"], "the transport closed its handles in before_unmap"
    assert seen["events"] == ["register", "deregister", "register"], "after_map exported new handles"
    assert seen["kv_poisoned_after_wake"], "the KV cache was discarded (vLLM's level 1): new memory"
    assert seen["same_address_after_wake"]
    assert seen["read_elsewhere_after_wake_matches"], "the new handle reaches what the engine wrote after the wake"


def test_without_a_kv_connector_the_pools_are_not_exportable_and_the_export_names_the_fix(dist):
    seen = drive_kv_connector(dist)
    assert seen["kv_in_torpor"] and not seen["exportable"], seen
    assert "not exportable" in seen["export_error"] and "exportable=True" in seen["export_error"]


def test_the_torpor_backend_exists_only_when_enabled(dist):
    code = (
        "import vllm.plugins, vllm.device_allocator.sleep_mode_backend as b\n"
        "vllm.plugins.load_general_plugins()\n"
        "import torpor.vllm_plugin as p\n"
        "p.install(); p.register()  # twice more: nothing changes\n"
        "print(sorted(b.SleepModeBackendFactory._registry))\n"
    )

    def registered(**env):
        e = subprocess_env(**env)
        e["PYTHONPATH"] = os.pathsep.join([str(STAND_INS), str(dist), e["PYTHONPATH"]])
        out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert registered(TORPOR_VLLM="1") == "['cumem', 'torpor']"


def test_the_plugin_switches_nccl_graph_registration_off_before_any_communicator(dist):
    code = (
        "import os, vllm.plugins\n"
        "vllm.plugins.load_general_plugins()\n"
        "print(os.environ.get('NCCL_GRAPH_REGISTER', 'unset'))\n"
    )

    def value(**env):
        e = subprocess_env(**env)
        if "NCCL_GRAPH_REGISTER" not in env:
            e.pop("NCCL_GRAPH_REGISTER", None)
        e["PYTHONPATH"] = os.pathsep.join([str(STAND_INS), str(dist), e["PYTHONPATH"]])
        out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert value(TORPOR_VLLM="1") == "0"
    assert value(TORPOR_VLLM="0") == "unset", "the plugin does nothing when the mode is off"
    assert value(TORPOR_VLLM="1", NCCL_GRAPH_REGISTER="1") == "1", "the user's value is theirs"


def missing_build_tools():
    for module in ("pip", "setuptools", "wheel"):
        if importlib.util.find_spec(module) is None:
            return module
    return None


@pytest.mark.skipif(missing_build_tools() is not None, reason=f"{missing_build_tools()} is not installed")
def test_pip_install_declares_the_entry_point_and_ships_the_tms_shim(tmp_path):
    src = copy_python_source(tmp_path / "src")
    site = tmp_path / "site"
    env = dict(os.environ, TORPOR_LIBRARY=torpor.library_path(), PIP_DISABLE_PIP_VERSION_CHECK="1")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-index", "--no-deps", "--quiet"]
        + ["--target", str(site), str(src)],
        env=env,
        check=True,
        capture_output=True,
    )
    (entry_points,) = site.glob("torpor-*.dist-info/entry_points.txt")
    assert "[vllm.general_plugins]\ntorpor = torpor.vllm_plugin:register" in entry_points.read_text()
    assert (site / "torpor" / "_shims" / "torch_memory_saver" / "__init__.py").is_file()
    assert (site / "torpor" / "vllm_backend.py").is_file()
