"""The version matrix (tests/python/stand_ins/README.md): torpor's plugin against the stand-in vLLM
of each generation, each case in a process of its own as vLLM's workers are, and what the newest
generation asks on top: the tag hooks of a KV connector, Model Runner V2's graph pool, the newest
sleep-mode backend contract with its options, vLLM's sleep options, and the parameter
registration kept true across a weight update. Oracles: the bytes the stand-in wrote (patterns),
the decode step's arithmetic recomputed from its inputs, and the pool's own statistics."""

import json
import os
import subprocess
import sys

import pytest

from conftest import subprocess_env
from test_vllm_plugin import KIB, STAND_INS, check_sleep_cycle, dist, drive  # noqa: F401 - dist is the fixture

GENERATIONS = {
    "v0": ("vllm.worker.worker.Worker", "cumem"),
    "v1": ("vllm.v1.worker.gpu_worker.Worker", "cumem"),
    "mrv2": ("vllm.v1.worker.gpu_worker.Worker", "torpor"),
}


def without_graph_tag(seen: dict) -> dict:
    """check_sleep_cycle's view: the graph pool's tag (mrv2) sleeps with the rest."""
    return dict(seen, level1_asleep=[t for t in seen["level1_asleep"] if t != "cudagraph"])


def run(dist, generation, *args, backend=None, **env):  # noqa: F811 - dist is the fixture
    worker, default_backend = GENERATIONS[generation]
    return drive(
        dist,
        "--worker",
        worker,
        "--backend",
        backend or default_backend,
        *args,
        TORPOR_VLLM="1",
        STAND_IN_VLLM_GENERATION=generation,
        **env,
    )


@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_every_generation_takes_its_route_to_torpor(dist, generation):  # noqa: F811
    seen = run(dist, generation)
    check_sleep_cycle(without_graph_tag(seen))
    assert ("discard_kv_asleep" in seen) == (generation != "v0"), "discard exists from the v1 worker on"
    assert ("kv_events" in seen) == (generation == "mrv2")


@pytest.mark.parametrize("backend", ["cumem", "torpor"])
def test_mrv2_graphs_hooks_and_backend_contract(dist, backend):  # noqa: F811
    seen = run(dist, "mrv2", backend=backend)
    check_sleep_cycle(without_graph_tag(seen))
    assert seen["captured_into_cumem"] == [True], "is_capturing_into_cumem_pool() during the capture"
    assert seen["graph_mapped_bytes_asleep"] == 0, "sleep gave the graph pool's memory back"
    assert seen["level1_tokens_identical"], "the same graph replays after wake, same tokens"
    assert seen["graph_const_kept"] and seen["level2_tokens_match_oracle"]
    # The KV connector's registration: dropped before each unmap, made again once mapped.
    assert seen["kv_events"] == ["deregister", "register"] * 3, seen["kv_events"]
    assert seen["level1_asleep"] == ["cudagraph", "kv_cache", "weights"]
    if backend == "torpor":
        assert seen["suspended_tags_level1"] == ["cudagraph", "kv_cache", "weights"], "what the suspend put to sleep"


def test_the_torpor_backend_takes_backend_options_and_refuses_unknown_ones(dist):  # noqa: F811
    seen = run(dist, "mrv2", "--fill", "zero", "--backend-options", json.dumps({"poison_discarded_pages": True}))
    assert seen["level1_kv_poisoned"], "the backend option reached the allocator's poison"
    seen = run(dist, "mrv2", "--fill", "zero")
    assert seen["level1_kv_zero"] and not seen["level1_kv_poisoned"], "without it: the pools' own fill"
    with pytest.raises(AssertionError, match="unknown option.*bogus.*accepted: suspend_tags"):
        run(dist, "mrv2", "--backend-options", json.dumps({"bogus": 1}))
    with pytest.raises(AssertionError, match="fill_on_wake is an option of torpor's pools.*torpor.configure"):
        run(dist, "mrv2", "--backend-options", json.dumps({"fill_on_wake": "poison"}))


def test_vllms_variables_poison_and_release_host_memory(dist):  # noqa: F811
    seen = run(dist, "mrv2", "--fill", "zero", VLLM_POISON_DISCARDED_PAGES="1")
    assert seen["level1_kv_poisoned"]
    assert run(dist, "v1", "--fill", "zero", VLLM_POISON_DISCARDED_PAGES="1")["level1_kv_poisoned"]
    kept = run(dist, "v1")["host_retained_after_wake"]
    released = run(dist, "v1", VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY="1")["host_retained_after_wake"]
    assert kept > 0 and released == 0


def test_preserve_parameter_names_keep_parameters_and_unmatched_globs_raise(dist):  # noqa: F811
    seen = run(dist, "mrv2", "--preserve", "b")
    assert seen["level2_parameter_bytes_offloaded"] == 32 * KIB, "the preserved parameter is kept through level 2"
    seen = run(dist, "mrv2", "--preserve", "b,lm_head.*")
    assert seen["load_error"].startswith("ValueError: sleep_preserve_parameter_names: 'lm_head.*'"), seen
    assert "w, b" in seen["load_error"], "the message names the parameters the globs are matched against"


@pytest.mark.parametrize("reregister", [True, False])
def test_a_level_2_after_a_weight_update_discards_exactly_the_new_parameters(dist, reregister):  # noqa: F811
    seen = run(dist, "mrv2", *([] if reregister else ["--register-only-at-load"]))
    new = seen["update_new_parameter_bytes"]
    assert new == 128 * KIB
    if reregister:
        assert seen["update_parameter_bytes_asleep"] == new, "exactly the new parameters are parameters"
        assert seen["update_parameter_bytes_offloaded"] == 0 and seen["update_new_parameters_discarded"]
        assert seen["update_buffers_kept"], "every buffer kept, without the worker's stash"
    else:  # the negative control: registered once at load, nothing in the tag is a parameter any more,
        # so level 2 falls back to vLLM's policy and the buffer goes with everything else
        assert seen["update_parameter_bytes_asleep"] == 0 and not seen["update_buffers_kept"]


@pytest.mark.parametrize("generation", ["v1", "mrv2"])
def test_the_torpor_backend_answers_every_capability_flag_of_its_generation(dist, generation):  # noqa: F811
    """Each generation's base class declares its flags (the old names in v1, the new in mrv2): the
    torpor backend answers every one itself, and accepts that generation's suspend call."""
    code = (
        "import json, vllm.device_allocator.sleep_mode_backend as b\n"
        "import torpor.vllm_backend as t\n"
        "flags = [n for n in dir(b.SleepModeBackend) if n.startswith(('preserves_', 'supports_'))]\n"
        "print(json.dumps({n: [n in vars(t.TorporSleepModeBackend), getattr(t.TorporSleepModeBackend, n)()]"
        " for n in flags}))\n"
    )
    e = subprocess_env(STAND_IN_VLLM_GENERATION=generation)
    e["PYTHONPATH"] = os.pathsep.join([str(STAND_INS), str(dist), e["PYTHONPATH"]])
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    flags = json.loads(out.stdout)
    expected = (
        {"preserves_communicators", "preserves_graphs_with_communicators"}
        if generation == "v1"
        else {"preserves_nccl", "preserves_graphs_with_nccl", "supports_selective_offload"}
    )
    assert expected <= set(flags), flags
    assert all(own for own, _ in flags.values()), flags
    assert all(value for name, (_, value) in flags.items() if name != "supports_durable_storage"), flags
