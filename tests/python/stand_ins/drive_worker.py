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
    args = ap.parse_args()
    torpor.configure(backend="host", fill_on_wake="poison", va_bytes=1 << 30)

    from vllm.v1.worker.gpu_model_runner import pattern
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(enable_sleep_mode=not args.no_sleep_mode, sleep_mode_backend=args.backend),
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
    except AssertionError as e:
        out["load_error"] = str(e)
        print(json.dumps(out))
        return
    worker.initialize_from_config(None)
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
    worker.wake_up()
    out["level1_weights_kept"] = read(params["w"]) == pattern(96 << 10, 1) and read(rope) == pattern(16 << 10, 99)
    out["level1_kv_poisoned"] = poisoned(kv)

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

    if hasattr(worker, "discard"):
        worker.discard(("kv_cache",))
        out["discard_kv_asleep"] = pool.stats()["tags"]["kv_cache"]["asleep"]
        out["discard_weights_awake"] = not pool.stats()["tags"]["weights"]["asleep"]
        worker.wake_up(["kv_cache"])
        out["backend_state"] = worker._get_sleep_mode_backend().state()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
