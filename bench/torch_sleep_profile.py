#!/usr/bin/env python3
"""Where torpor.sleep/wake_up spend their time outside the C++ engine (issue 15 item 2).

    bench/torch_sleep_profile.py [--cycles 4] [--json OUT.json] [--cprofile OUT.txt]

The scenario is torch_sleep_bench.py's, built the way users build a model: 2048 nn.Parameters of
16 MiB created inside torpor.use_pool("weights") and registered with register_parameters(), the
256 MiB of plain state tensors (1 MiB each) in the same tag, 16 GiB of KV cache in 1 GiB tensors
(use_pool("kv_cache")). Per cycle, as in the bench: every byte changes, a checksum (PyTorch's
default pool allocates and frees between sleeps, as a real job does), a level-1 sleep, wake, the
checksum again, the same sleep with nothing changed, wake; every wake is checked.

Per sleep and wake it prints the wall time, the engine's own time (its report) and the time of
each step of the Python path, measured by wrapping the functions the path calls (inclusive
times: a step that calls another includes it; the steps listed are those this checkout's
torpor.torch package has, a missing one is left out). Garbage collections that run inside the call,
asked for or automatic, are timed through gc.callbacks. Then the costs of the primitives a
cheaper path could use (PyTorch's allocator counters, a snapshot without traces, the parameters'
data pointers, the collections), and a cProfile of one changed and one unchanged sleep + wake
(top 30 by cumulative and by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import json
import pstats
import statistics
import sys
import time

MiB = 1 << 20
GiB = 1 << 30


# -- timing the steps of the path ----------------------------------------------------------


class Probes:
    """Wraps named callables; each call's duration goes to the current record, if any."""

    def __init__(self):
        self.record: dict | None = None
        self.installed: list[tuple[object, str, object]] = []
        self.gc_start: float | None = None
        gc.callbacks.append(self._gc)

    def _gc(self, phase, info):
        if self.record is None:
            return
        if phase == "start":
            self.gc_start = time.perf_counter()
        elif self.gc_start is not None:
            key = f"gc generation {info['generation']}"
            self._add(key, time.perf_counter() - self.gc_start)
            self.gc_start = None

    def _add(self, key: str, seconds: float) -> None:
        total, calls = self.record.get(key, (0.0, 0))
        self.record[key] = (total + seconds, calls + 1)

    def wrap(self, owner, attr: str, label: str) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            return
        # What to put back: a class's own attribute as stored (a classmethod stays one).
        stored = vars(owner).get(attr, original) if isinstance(owner, type) else original
        probes = self

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if probes.record is None:
                return original(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                probes._add(label, time.perf_counter() - t0)

        setattr(owner, attr, timed)
        self.installed.append((owner, attr, stored))

    def uninstall(self) -> None:
        for owner, attr, stored in reversed(self.installed):
            setattr(owner, attr, stored)
        self.installed.clear()


def install_probes(torch, torpor) -> Probes:
    from torpor import _lib, _marks
    from torpor.pool import Pool
    from torpor.torch import api, graphs, parameters, remark, routing

    p = Probes()
    # torpor.torch's steps (module globals, looked up at call time), in the order a sleep runs them
    # (the re-mark's from inside the C sleep: torpor.torch.sleep_hook calls them).
    steps = (
        (api, "_tags_by_device"),
        (parameters, "live_modules"),
        (parameters, "parameter_spans"),
        (remark, "refresh_classes"),
        (routing, "pools_of"),
        (routing, "own_segments"),
        (remark, "holds_parameters"),
        (remark, "block_counters"),
        (remark, "_nothing_allocated_or_freed"),
        (remark, "_live_blocks"),
        (remark, "state_spans"),
    )
    for module, name in steps:
        p.wrap(module, name, f"{module.__name__.rsplit('.', 1)[-1]}.{name}")
    p.wrap(graphs, "state_spans", "graphs.state_spans")
    p.wrap(_marks, "plan", "_marks.plan")
    p.wrap(_marks, "apply", "_marks.apply")
    for name in ("sleep", "wake_up", "stats", "tags", "last_report", "mark_ranges", "set_preserve"):
        p.wrap(Pool, name, f"Pool.{name}")
    p.wrap(Pool, "torch", "Pool.torch (handle lookup)")
    lib = _lib.lib()
    for name in (
        "torpor_sleep",
        "torpor_wake_up",
        "torpor_mark_ranges",
        "torpor_stats_json",
        "torpor_last_report_json",
    ):
        p.wrap(lib, name, f"C {name}")
    p.wrap(torch.cuda.memory.MemPool, "snapshot", "MemPool.snapshot")
    p.wrap(torch.cuda, "empty_cache", "torch.cuda.empty_cache")
    p.wrap(gc, "collect", "gc.collect (asked for)")
    return p


# -- the scenario --------------------------------------------------------------------------


def build(torch, torpor, a):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            elements = a.param_bytes // 2
            self.layers = torch.nn.ParameterList(
                [
                    torch.nn.Parameter(torch.empty(elements, dtype=torch.bfloat16, device="cuda"), requires_grad=False)
                    for _ in range(a.params)
                ]
            )

    with torpor.use_pool("weights"):
        model = Model()
        state = [torch.empty(MiB // 4, dtype=torch.float32, device="cuda") for _ in range(a.state_bytes // MiB)]
    with torpor.use_pool("kv_cache"):
        cache = [
            torch.empty(min(GiB, a.cache_bytes), dtype=torch.uint8, device="cuda")
            for _ in range(max(1, a.cache_bytes // GiB))
        ]
    registration = torpor.register_parameters(model)
    if registration.outside:
        raise SystemExit(f"{len(registration.outside)} parameters are outside torpor's pools")
    return model, state, cache


def tensors_of(model, state):
    return [p.data for p in model.parameters()] + state


def change(torch, tensors, cycle: int) -> None:
    g = torch.Generator(device="cuda")
    g.manual_seed(1000 + cycle)
    for t in tensors:
        t.view(torch.int16 if t.element_size() == 2 else torch.int32).random_(generator=g)
    torch.cuda.synchronize()


def checksums(torch, tensors):
    out = [t.view(torch.int16 if t.element_size() == 2 else torch.int32).to(torch.int64).sum() for t in tensors]
    return torch.stack(out).cpu()


def measured(torch, probes: Probes, fn):
    """(wall seconds, engine seconds, {step: (seconds, calls)}) of one sleep or wake_up."""
    torch.cuda.synchronize()
    probes.record = {}
    t0 = time.perf_counter()
    reports = fn()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    steps, probes.record = probes.record, None
    return wall, sum(r["seconds"] for r in reports.values()), steps


def show(label: str, wall: float, engine: float, steps: dict) -> None:
    print(
        f"  {label}: wall {wall * 1e3:9.3f} ms  engine {engine * 1e3:9.3f} ms  python {(wall - engine) * 1e3:8.3f} ms"
    )
    for key, (secs, calls) in sorted(steps.items(), key=lambda kv: -kv[1][0]):
        print(f"      {key:<42} {secs * 1e3:9.3f} ms  ({calls} call{'s' if calls != 1 else ''})")


# -- the primitives a cheaper path could use -------------------------------------------------


def best_of(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def primitives(torch, torpor, model) -> dict:
    from torpor.torch import parameters, routing

    device = torch.cuda.current_device()
    pools = [p for (tag, _, d), p in routing.every_mempool() if d == device]
    params = list(model.parameters())
    out = {
        "torch.cuda.memory_stats(device)": best_of(lambda: torch.cuda.memory_stats(device)),
        "torch._C._cuda_memoryStats(device)": best_of(lambda: torch._C._cuda_memoryStats(device)),
        "MemPool.snapshot() of every torpor MemPool": best_of(lambda: [p.mempool.snapshot() for p in pools]),
        "torpor.stats() (every device)": best_of(lambda: torpor.stats()),
        "Pool.torch(device).stats()": best_of(lambda: torpor.Pool.torch(device).stats()),
        "[p.data_ptr() for p in parameters]": best_of(lambda: [p.data_ptr() for p in params]),
        "list(model.named_parameters())": best_of(lambda: list(model.named_parameters())),
        "parameters.registered_spans()": best_of(parameters.registered_spans),
        "gc.collect(0)": best_of(lambda: gc.collect(0)),
        "gc.collect(1)": best_of(lambda: gc.collect(1)),
        "gc.collect(2)": best_of(lambda: gc.collect(2), repeat=2),
    }
    try:  # PyTorch versions whose snapshot takes include_traces (a lighter snapshot)
        pid = pools[0].mempool.id
        torch._C._cuda_memorySnapshot((pid[0], pid[1], False))
        out["_cuda_memorySnapshot((id, False)) of every torpor MemPool"] = best_of(
            lambda: [torch._C._cuda_memorySnapshot((p.mempool.id[0], p.mempool.id[1], False)) for p in pools]
        )
    except Exception as e:  # noqa: BLE001 - only a measurement
        out["_cuda_memorySnapshot((id, False))"] = f"not available: {e}"
    out["objects tracked by gc"] = len(gc.get_objects())
    out["gc.get_threshold()"] = list(gc.get_threshold())
    out["segments per torpor MemPool"] = {
        f"{tag}/{cls.value}/{d}": [
            len(p.mempool.snapshot()) for (t, c, dd), p in routing.every_mempool() if (t, c, dd) == (tag, cls, d)
        ]
        for (tag, cls, d) in {key for key, _ in routing.every_mempool()}
    }
    return out


def cprofile(torch, torpor, tensors, cycle: int) -> str:
    change(torch, tensors, cycle)
    prof = cProfile.Profile()
    prof.enable()
    torpor.sleep(1)
    torpor.wake_up()
    torpor.sleep(1)  # unchanged
    torpor.wake_up()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    for key in ("cumulative", "tottime"):
        text.write(f"== sorted by {key}\n")
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(30)
    return text.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=2048)
    ap.add_argument("--param-bytes", type=int, default=16 * MiB)
    ap.add_argument("--state-bytes", type=int, default=256 * MiB)
    ap.add_argument("--cache-bytes", type=int, default=16 * GiB)
    ap.add_argument("--cycles", type=int, default=4, help="cycle 1 pins the host store; the rest are steady")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--cprofile", help="write the cProfile tables here (default: stdout)")
    a = ap.parse_args()

    import torch

    import torpor

    print(f"torch {torch.__version__} cuda {torch.version.cuda}; python {sys.version.split()[0]}", flush=True)
    torpor.configure(backend="cuda")
    model, state, cache = build(torch, torpor, a)
    tensors = tensors_of(model, state)
    probes = install_probes(torch, torpor)
    rows = []
    try:
        for c in range(1, a.cycles + 1):
            change(torch, tensors, c)
            before = checksums(torch, tensors)
            print(f"cycle {c}:", flush=True)
            row = {"cycle": c}
            for name in ("changed", "unchanged"):
                for op, fn in (("sleep", lambda: torpor.sleep(1)), ("wake", lambda: torpor.wake_up())):
                    wall, engine, steps = measured(torch, probes, fn)
                    show(f"{op} {name:<9}", wall, engine, steps)
                    row[f"{op}_{name}"] = {
                        "wall_seconds": wall,
                        "engine_seconds": engine,
                        "python_overhead_seconds": wall - engine,
                        "steps": {k: {"seconds": s, "calls": n} for k, (s, n) in steps.items()},
                    }
                if not torch.equal(before, checksums(torch, tensors)):
                    raise SystemExit(f"cycle {c} ({name}): the bytes did not survive the sleep")
            rows.append(row)
    finally:
        probes.uninstall()

    steady = rows[1:] or rows
    summary = {}
    for key in ("sleep_changed", "sleep_unchanged", "wake_changed", "wake_unchanged"):
        summary[f"python_overhead_{key}_median_seconds"] = statistics.median(
            r[key]["python_overhead_seconds"] for r in steady
        )
    print("steady-state medians (python overhead):")
    for k, v in summary.items():
        print(f"  {k:<52} {v * 1e3:8.3f} ms")

    prims = primitives(torch, torpor, model)
    print("primitives (best of 5; seconds):")
    for k, v in prims.items():
        print(f"  {k:<58} {v * 1e3:.3f} ms" if isinstance(v, float) else f"  {k:<58} {v}")

    text = cprofile(torch, torpor, tensors, a.cycles + 1)
    if a.cprofile:
        with open(a.cprofile, "w") as f:
            f.write(text)
        print(f"wrote {a.cprofile}")
    else:
        print(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"torch": torch.__version__, "cycles": rows, "summary": summary, "primitives": prims}, f, indent=2
            )
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
