#!/usr/bin/env python3
"""Plot a torpor_bench_sleep JSON: throughput of each phase against the copy ceiling.

    bench/plot_sleep.py bench/results/<run>.json [-o out.png]

Bars: achieved GB/s of torpor's level-1 sleep and wake (steady state, changed bytes), the
per-allocation baseline's sleep and wake, against the pinned-copy ceiling measured in the
same run (D2H for sleeps, H2D for wakes). Latency-bound phases (unchanged level-1 sleep,
level-2 sleep and wake) are annotated in seconds. Needs matplotlib.
"""
import statistics

import plotting  # before pyplot: selects the file-only backend
import matplotlib.pyplot as plt


def main():
    a, j = plotting.read_results(__doc__)
    moved = j["moved_bytes"]
    ceil = j["ceiling"]
    d2h = ceil["bytes"] / ceil["d2h_seconds"] / 1e9
    h2d = ceil["bytes"] / ceil["h2d_seconds"] / 1e9
    st = j["steady"]
    bars = [
        ("torpor L1 sleep", moved / st["l1_sleep"] / 1e9, d2h),
        ("torpor L1 wake", moved / st["l1_wake"] / 1e9, h2d),
    ]
    base = j.get("baseline", {})
    if base.get("sleep_seconds"):
        bars.append(("per-allocation sleep", moved / statistics.median(base["sleep_seconds"]) / 1e9, d2h))
        bars.append(("per-allocation wake", moved / statistics.median(base["wake_seconds"]) / 1e9, h2d))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [b[0] for b in bars]
    ax.bar(names, [b[1] for b in bars], color=["#2b7bba", "#2b7bba", "#c44e52", "#c44e52"][: len(bars)])
    for i, (_, v, c) in enumerate(bars):
        ax.hlines(c, i - 0.4, i + 0.4, colors="black", linestyles="dashed")
        ax.text(i, max(v / 2, 1), f"{v:.1f} GB/s\n{100 * v / c:.0f}% of ceiling", ha="center", va="center", fontsize=8)
    ax.set_ylabel("GB/s (dashed: pinned-copy ceiling, same run)")
    gib = moved / 2**30
    ax.set_title(
        f"{j.get('device', '?')}: {gib:.2f} GiB offloaded/restored; steady state\n"
        f"L1 sleep unchanged {1e3 * st['l1_sleep_unchanged']:.0f} ms, "
        f"L2 sleep {1e3 * st['l2_sleep']:.0f} ms, L2 wake {1e3 * st['l2_wake']:.0f} ms"
        + (f"  (commit {j['commit'][:8]})" if "commit" in j else ""),
        fontsize=9,
    )
    ax.set_ylim(0, max(max(b[1] for b in bars), d2h, h2d) * 1.25)
    plotting.save(fig, a)


if __name__ == "__main__":
    main()
