"""Drives the stand-in vLLM worker as vLLM's engine would, in a process of its own, and prints
what it saw as JSON (tests/python/test_vllm_plugin.py asserts on it).

    python3 drive_worker.py --worker vllm.v1.worker.gpu_worker.Worker --backend cumem

Before vLLM, PyTorch is fake_torch (tests/python/fake_torch.py) and torpor's PyTorch pools use the
host backend with discarded bytes poisoned (0xFF)."""

import argparse
import ctypes
import json
import pathlib
import sys
import types

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # fake_torch
import fake_torch  # noqa: E402

sys.modules["torch"] = fake_torch

import torpor  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", default="vllm.v1.worker.gpu_worker.Worker")
    ap.add_argument("--backend", default="cumem", help="model_config.sleep_mode_backend")
    ap.add_argument("--no-sleep-mode", action="store_true")
    ap.add_argument("--drop-stash", action="store_true", help="forget the worker's level-2 buffer stash")
    ap.add_argument("--fill", default="poison", help="torpor.configure's fill_on_wake for the PyTorch pools")
    ap.add_argument("--backend-options", default="{}", help="model_config.sleep_mode_backend_options (JSON)")
    ap.add_argument("--preserve", default="", help="model_config.sleep_preserve_parameter_names (comma list)")
    ap.add_argument(
        "--register-only-at-load", action="store_true", help="negative control: the plugin re-registers nothing"
    )
    args = ap.parse_args()
    torpor.configure(backend="host", fill_on_wake=args.fill, va_bytes=1 << 30)
    if args.register_only_at_load:
        from torpor import vllm_plugin

        vllm_plugin.WORKER_METHODS = ("load_model",)

    from vllm.v1.worker.gpu_model_runner import pattern, step, write
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(
            enable_sleep_mode=not args.no_sleep_mode,
            enable_cumem_allocator=not args.no_sleep_mode,  # vLLM's ModelConfig turns it on with sleep mode
            sleep_mode_backend=args.backend,
            sleep_mode_backend_options=json.loads(args.backend_options),
            sleep_preserve_parameter_names=[g for g in args.preserve.split(",") if g],
        ),
        parallel_config=types.SimpleNamespace(worker_cls=args.worker),
    )
    out = {}
    wrapper = WorkerWrapperBase()
    wrapper.init_worker([{"vllm_config": config}])
    import vllm.device_allocator.cumem as cumem

    out["allocator"] = f"{cumem.CuMemAllocator.__module__}.{cumem.CuMemAllocator.__qualname__}"
    worker = wrapper.worker
    worker.init_device()
    try:
        worker.load_model()
    except (AssertionError, ValueError) as e:
        out["load_error"] = str(e) if isinstance(e, AssertionError) else f"{type(e).__name__}: {e}"
        print(json.dumps(out))
        return
    worker.initialize_from_config(None)
    from vllm import GENERATION

    mrv2 = GENERATION == "mrv2"
    runner = worker.model_runner
    if mrv2:
        worker.compile_or_warm_up_model()
        out["captured_into_cumem"] = runner.captured_into_cumem
        tokens = runner.decode()
    model = worker.get_model()
    params = dict(model.named_parameters())
    rope = dict(model.named_buffers())["rope"].t
    kv = worker.model_runner.kv_cache
    pool = torpor.Pool.torch(0)
    out["in_torpor"] = all(pool.contains(t.data_ptr()) for t in (*params.values(), rope, kv))
    tags = pool.stats()["tags"]
    out["registered_bytes"] = tags["weights"]["classes"]["parameter"]["allocated_bytes"]

    def read(t):
        return ctypes.string_at(t.data_ptr(), t._nbytes)

    def poisoned(t):
        return read(t) == b"\xff" * t._nbytes

    # vLLM's level 1: weights offloaded, the KV cache discarded.
    worker.sleep(level=1)
    out["level1_asleep"] = sorted(t for t, s in pool.stats()["tags"].items() if s["asleep"])
    backend = worker._get_sleep_mode_backend() if hasattr(worker, "_get_sleep_mode_backend") else None
    if backend is not None and hasattr(backend, "suspended_tags"):
        out["suspended_tags_level1"] = backend.suspended_tags()
    if mrv2:
        out["graph_mapped_bytes_asleep"] = pool.stats()["tags"]["cudagraph"]["mapped_bytes"]
    worker.wake_up()
    out["level1_weights_kept"] = read(params["w"]) == pattern(96 << 10, 1) and read(rope) == pattern(16 << 10, 99)
    out["level1_kv_poisoned"] = poisoned(kv)
    out["level1_kv_zero"] = read(kv) == bytes(kv._nbytes)
    out["host_retained_after_wake"] = pool.stats()["retained_bytes"]
    if mrv2:
        write(kv, pattern(256 << 10, 7))  # the engine recomputes its KV cache
        out["level1_tokens_identical"] = runner.decode() == tokens

    # vLLM's level 2, the RL pattern: wake weights, reload, wake the KV cache.
    worker.sleep(level=2)
    st = pool.stats()["tags"]["weights"]["classes"]
    out["level2_parameter_bytes_offloaded"] = st["parameter"]["offloaded_bytes"]
    out["level2_state_bytes_offloaded"] = st["state"]["offloaded_bytes"]
    if args.drop_stash:
        worker._sleep_saved_buffers = {}
    worker.wake_up(["weights"])
    out["level2_rope_kept"] = read(rope) == pattern(16 << 10, 99)
    out["level2_parameters_poisoned"] = all(poisoned(p) for p in params.values())
    out["kv_asleep_after_weights"] = pool.stats()["tags"]["kv_cache"]["asleep"]
    worker.reload_weights(version=5)
    worker.wake_up(["kv_cache"])
    out["reloaded"] = read(params["w"]) == pattern(96 << 10, 5)
    out["kv_poisoned"] = poisoned(kv)
    if mrv2:
        write(kv, pattern(256 << 10, 7))
        w_now = read(params["w"])[: len(tokens)]
        const = ctypes.string_at(runner.graph_const.data_ptr(), len(tokens))
        out["graph_const_kept"] = const == pattern(len(tokens), 42)
        out["level2_tokens_match_oracle"] = runner.decode() == step(w_now, pattern(256 << 10, 7)[: len(tokens)], const)

    if hasattr(worker, "discard"):
        worker.discard(("kv_cache",))
        out["discard_kv_asleep"] = pool.stats()["tags"]["kv_cache"]["asleep"]
        out["discard_weights_awake"] = not pool.stats()["tags"]["weights"]["asleep"]
        worker.wake_up(["kv_cache"])
        out["backend_state"] = worker._get_sleep_mode_backend().state()
    if mrv2:
        out["kv_events"] = list(worker.kv_connector.events)
        out["kv_wake_ups"] = worker.kv_wake_ups
        del model, params  # the old model goes, as in the worker once its runner holds the new one
        weight_update(worker, pool, out, read, poisoned, rope)
    print(json.dumps(out))


def weight_update(worker, pool, out, read, poisoned, rope):
    """The weight-transfer engine re-creates the parameters; a level 2 after it must discard
    exactly the new parameters and keep every buffer (without the worker's stash)."""
    from vllm.v1.worker.gpu_model_runner import pattern

    worker.init_weight_transfer_engine({"backend": "stand-in"})
    worker.start_weight_update()
    worker.update_weights({"version": 11})
    worker.finish_weight_update()
    params = dict(worker.get_model().named_parameters())
    new_bytes = sum(p._nbytes for p in params.values())
    out["update_new_parameter_bytes"] = new_bytes
    worker.sleep(level=2)
    classes = pool.stats()["tags"]["weights"]["classes"]
    out["update_parameter_bytes_asleep"] = classes["parameter"]["allocated_bytes"]
    out["update_parameter_bytes_offloaded"] = classes["parameter"]["offloaded_bytes"]
    worker._sleep_saved_buffers = {}  # torpor must keep the buffers itself
    worker.wake_up(["weights"])
    out["update_new_parameters_discarded"] = all(poisoned(p) for p in params.values())
    out["update_buffers_kept"] = read(rope) == pattern(16 << 10, 99)
    worker.wake_up(None)


if __name__ == "__main__":
    main()
