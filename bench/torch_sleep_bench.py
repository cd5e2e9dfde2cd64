#!/usr/bin/env python3
"""The sleep scenario of issue 3 through PyTorch: torpor's Python path against the C++ engine's
own time, and torch_memory_saver on the same scenario, in one run.

    bench/torch_sleep_bench.py [--engines torpor,tms,torpor-vllm,torpor-tms] [--cycles 3]
                               [--serve-seconds S] [--json OUT.json]

Scenario (defaults; smaller with the flags): 2048 parameter tensors of 16 MiB, 256 MiB of state
tensors (buffers, 1 MiB each) in the weights tag, 16 GiB of KV cache in 1 GiB tensors. Per cycle:
every parameter and state byte changes, a level-1 sleep (weights offloaded, cache discarded),
wake, the same sleep with nothing changed, wake; every wake is checked (a checksum of every
surviving tensor equals the one before the sleep). Cycle 1 is reported apart: it pins the host
memory (with --prepare, torpor.prepare_host_store() runs while the model loads).

Each engine runs in its own process (both replace PyTorch's allocator for the process):
- torpor: torpor.sleep/wake_up; the Python overhead is the wall time minus the engine's own
  time from its report (issue 15's target: within 5 ms);
- tms: torch_memory_saver (hook_mode "torch", importable from PYTHONPATH, e.g. built from its
  public source with pip install --target), weights region with enable_cpu_backup, cache
  region without; pause/resume.
- torpor-vllm, torpor-tms: torpor's engine modes as the engines drive them, with their default
  preparation (TORPOR_PREPARE_SLEEP=auto: the host store is page-locked in the background once the
  model is loaded, issue 30): torpor.vllm.CuMemAllocator (use_memory_pool, sleep(offload_tags=
  ("weights",)), wake_up) and torpor.tms.torch_memory_saver (regions, pause, resume). After the
  load they serve for --serve-seconds (the time an engine runs before its first sleep) and then
  sleep; the first sleep is set against the steady ones of the same process.
The JSON holds every engine's cycles; bench/plot_torch_sleep.py draws them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MiB = 1 << 20
GiB = 1 << 30


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": MiB, "G": GiB, "T": 1 << 40}
    t = text.strip().upper().rstrip("B").rstrip("I")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


# -- one engine, in this process -----------------------------------------------------------


class Scenario:
    def __init__(self, torch, a, allocate_weights, allocate_cache):
        self.torch = torch
        elements = a.param_bytes // 2
        with allocate_weights():
            self.params = [torch.empty(elements, dtype=torch.bfloat16, device="cuda") for _ in range(a.params)]
            self.state = [
                torch.empty(MiB // 4, dtype=torch.float32, device="cuda") for _ in range(a.state_bytes // MiB)
            ]
        with allocate_cache():
            self.cache = [
                torch.empty(min(GiB, a.cache_bytes), dtype=torch.uint8, device="cuda")
                for _ in range(max(1, a.cache_bytes // GiB))
            ]
        self.moved = sum(t.numel() * t.element_size() for t in self.params + self.state)
        self.change(0)

    def change(self, cycle: int) -> None:
        """Every parameter and state byte changes (cycle-dependent)."""
        g = self.torch.Generator(device="cuda")
        g.manual_seed(1000 + cycle)
        for t in self.params + self.state:
            t.view(self.torch.int16 if t.element_size() == 2 else self.torch.int32).random_(generator=g)
        self.torch.cuda.synchronize()

    def checksums(self):
        torch = self.torch
        out = []
        for t in self.params + self.state:
            out.append(t.view(torch.int16 if t.element_size() == 2 else torch.int32).to(torch.int64).sum())
        return torch.stack(out).cpu()


def timed(torch, fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, result


def engine_seconds(reports) -> float:
    """The C++ engine's own time in torpor's {device: report}."""
    return sum(r["seconds"] for r in reports.values())


def run_torpor(a) -> dict:
    import torch

    import torpor

    torpor.configure(backend="cuda")
    prepare_seconds = None
    sc = Scenario(
        torch,
        a,
        lambda: torpor.use_pool("weights"),
        lambda: torpor.use_pool("kv_cache"),
    )
    module = torch.nn.Module()
    module.params = torch.nn.ParameterList([torch.nn.Parameter(t, requires_grad=False) for t in sc.params])
    torpor.register_parameters(module)
    if a.prepare:
        t0 = time.perf_counter()
        torpor.prepare_host_store()  # returns at once; pins while the "load" below goes on
        prepare_seconds = time.perf_counter() - t0
        sc.change(0)  # stands for the rest of the model load
    cycles = []
    for c in range(1, a.cycles + 1):
        sc.change(c)
        before = sc.checksums()
        row = {"cycle": c}
        for name, level_changed in (("changed", True), ("unchanged", False)):
            secs, reports = timed(torch, lambda: torpor.sleep(1))
            engine = engine_seconds(reports)
            row[f"sleep_{name}"] = {
                "wall_seconds": secs,
                "engine_seconds": engine,
                "python_overhead_seconds": secs - engine,
                "bytes_offloaded": sum(r["bytes_offloaded"] for r in reports.values()),
                "bytes_skipped": sum(r["bytes_skipped"] for r in reports.values()),
            }
            wsecs, wreports = timed(torch, lambda: torpor.wake_up())
            weng = engine_seconds(wreports)
            row[f"wake_{name}"] = {
                "wall_seconds": wsecs,
                "engine_seconds": weng,
                "python_overhead_seconds": wsecs - weng,
            }
            if not torch.equal(before, sc.checksums()):
                raise SystemExit(f"torpor: cycle {c} ({name}): the bytes did not survive the sleep")
        print(
            f"torpor cycle {c}: sleep {row['sleep_changed']['wall_seconds']:.3f} s "
            f"(engine {row['sleep_changed']['engine_seconds']:.3f}) wake {row['wake_changed']['wall_seconds']:.3f} s | "
            f"unchanged sleep {row['sleep_unchanged']['wall_seconds']:.4f} s "
            f"(engine {row['sleep_unchanged']['engine_seconds']:.4f})",
            flush=True,
        )
        cycles.append(row)
    st = torpor.stats(0)
    return {
        "engine": "torpor",
        "moved_bytes": sc.moved,
        "prepare": a.prepare,
        "prepare_call_seconds": prepare_seconds,
        "host_store_bytes": st["host_store_bytes"],
        "host_registration_refused": st["host_registration_refused"],
        "cycles": cycles,
    }


def run_tms(a) -> dict:
    import torch

    try:
        from torch_memory_saver import torch_memory_saver as tms
    except ImportError as e:
        return {"engine": "tms", "skipped": f"torch_memory_saver not importable ({e})"}
    tms.hook_mode = "torch"
    sc = Scenario(
        torch,
        a,
        lambda: tms.region(tag="weights", enable_cpu_backup=True),
        lambda: tms.region(tag="kv_cache", enable_cpu_backup=False),
    )
    return engine_mode_cycles(a, torch, sc, "tms", tms.pause, tms.resume)


def engine_mode_cycles(a, torch, sc, name, sleep, wake) -> dict:
    """Wall-clock cycles of an engine's own sleep and wake (torpor's engine modes, torch_memory_saver):
    no engine report to split; the load is followed by --serve-seconds of serving."""
    time.sleep(a.serve_seconds)  # the engine serves; the preparation, if any, runs meanwhile
    cycles = []
    for c in range(1, a.cycles + 1):
        sc.change(c)
        before = sc.checksums()
        row = {"cycle": c}
        for phase in ("changed", "unchanged"):
            secs, _ = timed(torch, sleep)
            row[f"sleep_{phase}"] = {"wall_seconds": secs}
            wsecs, _ = timed(torch, wake)
            row[f"wake_{phase}"] = {"wall_seconds": wsecs}
            if not torch.equal(before, sc.checksums()):
                raise SystemExit(f"{name}: cycle {c} ({phase}): the bytes did not survive the sleep")
        print(
            f"{name} cycle {c}: sleep {row['sleep_changed']['wall_seconds']:.3f} s wake "
            f"{row['wake_changed']['wall_seconds']:.3f} s | unchanged sleep "
            f"{row['sleep_unchanged']['wall_seconds']:.4f} s",
            flush=True,
        )
        cycles.append(row)
    return {"engine": name, "moved_bytes": sc.moved, "serve_seconds": a.serve_seconds, "cycles": cycles}


def run_torpor_vllm(a) -> dict:
    import torch

    import torpor
    from torpor.vllm import CuMemAllocator

    torpor.configure(backend="cuda")
    allocator = CuMemAllocator.get_instance()
    sc = Scenario(
        torch,
        a,
        lambda: allocator.use_memory_pool(tag="weights"),
        lambda: allocator.use_memory_pool(tag="kv_cache"),
    )
    result = engine_mode_cycles(
        a, torch, sc, "torpor-vllm", lambda: allocator.sleep(offload_tags=("weights",)), allocator.wake_up
    )
    result["host_store_bytes"] = torpor.stats(0)["host_store_bytes"]
    return result


def run_torpor_tms(a) -> dict:
    import torch

    import torpor
    from torpor.tms import torch_memory_saver as saver

    torpor.configure(backend="cuda")
    sc = Scenario(
        torch,
        a,
        lambda: saver.region(tag="weights", enable_cpu_backup=True),
        lambda: saver.region(tag="kv_cache", enable_cpu_backup=False),
    )
    result = engine_mode_cycles(a, torch, sc, "torpor-tms", saver.pause, saver.resume)
    result["host_store_bytes"] = torpor.stats(0)["host_store_bytes"]
    return result


RUNNERS = {"torpor": run_torpor, "tms": run_tms, "torpor-vllm": run_torpor_vllm, "torpor-tms": run_torpor_tms}


# -- the driver: one process per engine ----------------------------------------------------


def summary(result: dict) -> dict:
    cycles = result.get("cycles", [])
    if not cycles:
        return {}
    steady = cycles[1:] or cycles

    def med(key, field="wall_seconds"):
        # The median (statistics.median): with the default 3 cycles there are 2 steady ones, and
        # the upper middle element alone was the larger of the two.
        v = [c[key][field] for c in steady if field in c[key]]
        return statistics.median(v) if v else None

    out = {
        "first_sleep_seconds": cycles[0]["sleep_changed"]["wall_seconds"],
        "first_wake_seconds": cycles[0]["wake_changed"]["wall_seconds"],
        "steady_sleep_seconds": med("sleep_changed"),
        "steady_wake_seconds": med("wake_changed"),
        "steady_unchanged_sleep_seconds": med("sleep_unchanged"),
    }
    if result["engine"] == "torpor":
        out["python_overhead_sleep_seconds"] = med("sleep_changed", "python_overhead_seconds")
        out["python_overhead_wake_seconds"] = med("wake_changed", "python_overhead_seconds")
        out["python_overhead_unchanged_sleep_seconds"] = med("sleep_unchanged", "python_overhead_seconds")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="torpor,tms", help="comma-separated: " + ", ".join(RUNNERS))
    ap.add_argument("--params", type=int, default=2048)
    ap.add_argument("--param-bytes", type=parse_size, default=16 * MiB)
    ap.add_argument("--state-bytes", type=parse_size, default=256 * MiB)
    ap.add_argument("--cache-bytes", type=parse_size, default=16 * GiB)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument(
        "--prepare",
        action="store_true",
        help="torpor.prepare_host_store() during the load",
    )
    ap.add_argument(
        "--serve-seconds",
        type=float,
        default=0.0,
        help="every engine but torpor (the engine modes, tms): seconds between the load and the first sleep",
    )
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # internal: run one engine in this process
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.cycles < 1 or a.params < 1 or a.param_bytes < 2 or a.state_bytes < MiB:
        ap.error("--cycles and --params at least 1, --param-bytes at least 2, --state-bytes at least 1M")
    if not 0 <= a.serve_seconds <= 3600:
        ap.error("--serve-seconds between 0 and 3600")

    if a.engine:
        result = RUNNERS[a.engine](a)
        with open(a.result, "w") as f:
            json.dump(result, f)
        return 0

    out = {
        "scenario": {
            "params": a.params,
            "param_bytes": a.param_bytes,
            "state_bytes": a.state_bytes,
            "cache_bytes": a.cache_bytes,
            "cycles": a.cycles,
            "prepare": a.prepare,
            "serve_seconds": a.serve_seconds,
        },
        "commit": os.environ.get("TORPOR_COMMIT", "unknown"),
        "engines": {},
    }
    status = 0
    for engine in [e.strip() for e in a.engines.split(",") if e.strip()]:
        if engine not in RUNNERS:
            ap.error(f"unknown engine {engine!r} ({', '.join(RUNNERS)})")
        result_path = f"{a.json or 'torch-sleep'}.{engine}.part"
        cmd = [
            sys.executable,
            __file__,
            "--engine",
            engine,
            "--result",
            result_path,
            "--params",
            str(a.params),
        ]
        cmd += [
            "--param-bytes",
            str(a.param_bytes),
            "--state-bytes",
            str(a.state_bytes),
        ]
        cmd += ["--cache-bytes", str(a.cache_bytes), "--cycles", str(a.cycles), "--serve-seconds", str(a.serve_seconds)]
        cmd += ["--prepare"] if a.prepare else []
        rc = subprocess.call(cmd)
        if not os.path.exists(result_path):
            out["engines"][engine] = {"engine": engine, "error": f"exit {rc}"}
            status = 1
            continue
        with open(result_path) as f:
            result = json.load(f)
        os.unlink(result_path)
        if rc != 0:
            # The process wrote its checked cycles, then died on the way out (torch_memory_saver
            # can crash at interpreter exit): its numbers stand, and the exit is on record.
            result["exit_status"] = rc
            print(f"{engine}: the process exited with status {rc} after writing its results", flush=True)
            status = status or (1 if engine == "torpor" else 0)
        result["summary"] = summary(result)
        out["engines"][engine] = result
        if "skipped" in result:
            print(f"{engine}: SKIPPED: {result['skipped']}")
            continue
        s = result["summary"]
        print(
            f"{engine}: " + ", ".join(f"{k} {v:.4f}" for k, v in s.items() if v is not None),
            flush=True,
        )
    t = out["engines"].get("torpor", {}).get("summary", {})
    if t:
        over = t.get("python_overhead_sleep_seconds")
        target = 2.0 if not a.prepare else 0.8
        out["targets"] = {
            "python_overhead_sleep_seconds": {
                "value": over,
                "target": "<= 0.005",
                "met": over is not None and over <= 0.005,
            },
            "first_sleep_seconds": {
                "value": t["first_sleep_seconds"],
                "target": f"<= {target}",
                "met": t["first_sleep_seconds"] <= target,
            },
        }
        for k, v in out["targets"].items():
            print(f"  {k:<34} {v['value']:.4f}  target {v['target']:<8} {'met' if v['met'] else 'MISSED'}")
    for engine in ("torpor-vllm", "torpor-tms"):
        m = out["engines"].get(engine, {}).get("summary", {})
        if m and m.get("steady_sleep_seconds"):
            ratio = m["first_sleep_seconds"] / m["steady_sleep_seconds"]
            out.setdefault("targets", {})[f"{engine}_first_over_steady_sleep"] = {
                "value": ratio,
                "target": "<= 1.10",
                "met": ratio <= 1.10,
            }
            print(
                f"  {engine} first sleep / steady sleep {ratio:.3f}  target <= 1.10 "
                f"{'met' if ratio <= 1.10 else 'MISSED'}"
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {a.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
