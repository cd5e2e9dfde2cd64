#!/usr/bin/env python3
"""Plot a torpor_bench_fixed JSON: what each phase costs against the chunk count.

    bench/plot_fixed_costs.py bench/results/<run>/bench-fixed-costs.json [-o out.png]

Left: seconds of each phase (unchanged level-1 sleep, level-1 wake, level-2 sleep, level-2
wake) against the number of one-granule chunks, log-log, with the driver's floor for the same
chunks timed in the same run (dashed: unmap + release per chunk for sleeps, create + map per chunk
plus one set-access for wakes). Right: the cost per chunk of each phase beside those floors, and
the fitted cost per call. The scaling is linear when the per-chunk line is flat. Needs matplotlib.
"""
import plotting  # before pyplot: selects the file-only backend
import matplotlib.pyplot as plt

PHASES = [
    ("l1_sleep_unchanged", "L1 sleep, unchanged", "sleep_s", "#2b7bba"),
    ("l1_wake", "L1 wake", "wake_s", "#55a868"),
    ("l2_sleep", "L2 sleep", "sleep_s", "#c44e52"),
    ("l2_wake", "L2 wake", "wake_s", "#8172b2"),
]


def main():
    a, j = plotting.read_results(__doc__)
    sweep = sorted(j["sweep"], key=lambda r: r["chunks"])
    chunks = [r["chunks"] for r in sweep]
    floor = j["floor_per_chunk"]
    fit = j.get("fit", {})
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for key, label, floor_key, color in PHASES:
        rows = [r for r in sweep if key in r]
        if not rows:
            continue
        n = [r["chunks"] for r in rows]
        left.plot(n, [r[key]["seconds"] for r in rows], "o-", color=color, label=label)
        left.plot(n, [c * floor[floor_key] for c in n], "--", color=color, alpha=0.6)
        per_call = fit.get(key, {}).get("per_call_s")
        call = f", {1e3 * per_call:+.1f} ms/call" if per_call is not None else ""
        right.plot(n, [1e6 * r[key]["per_chunk_s"] for r in rows], "o-", color=color, label=f"{label}{call}")
    right.axhline(1e6 * floor["sleep_s"], color="black", ls="--", lw=1, label="floor: unmap + release")
    right.axhline(1e6 * floor["wake_s"], color="gray", ls=":", lw=1, label="floor: create + map + set-access")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("chunks (one granule each)")
        ax.grid(True, which="both", alpha=0.3)
    left.set_yscale("log")
    left.set_ylabel("seconds per call (dashed: driver floor, same run)")
    right.set_ylabel("microseconds per chunk")
    right.set_ylim(bottom=0)
    left.legend(fontsize=8)
    right.legend(fontsize=7)
    fig.suptitle(
        f"{j.get('device', '?')}: fixed costs of sleep and wake, {min(chunks)} to {max(chunks)} chunks"
        + (f"  (commit {j['commit'][:8]})" if "commit" in j else ""),
        fontsize=10,
    )
    plotting.save(fig, a)


if __name__ == "__main__":
    main()
