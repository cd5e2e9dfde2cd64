#!/usr/bin/env python3
"""Plot a bench/torch_sleep_bench.py JSON: torpor against torch_memory_saver through PyTorch.

    bench/plot_torch_sleep.py bench/results/<run>.json [-o out.png]

Bars per engine: the first sleep (which pins host memory), the steady sleep and wake with every
byte changed, and the sleep with nothing changed, in seconds (log scale); torpor's Python
overhead (wall time minus the engine's own time) is annotated. Needs matplotlib.
"""

import plotting  # before pyplot: selects the file-only backend
import matplotlib.pyplot as plt

PHASES = [
    ("first_sleep_seconds", "first sleep"),
    ("steady_sleep_seconds", "sleep (changed)"),
    ("steady_wake_seconds", "wake"),
    ("steady_unchanged_sleep_seconds", "sleep (unchanged)"),
]


def main():
    a, j = plotting.read_results(__doc__)
    engines = [(name, e["summary"]) for name, e in j["engines"].items() if e.get("summary")]
    if not engines:
        raise SystemExit(f"{a.json}: no engine has results")
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(engines)
    for k, (name, s) in enumerate(engines):
        xs = [i + k * width for i in range(len(PHASES))]
        ys = [s.get(key) or 0 for key, _ in PHASES]
        bars = ax.bar(xs, ys, width, label=name)
        for b, y in zip(bars, ys):
            ax.annotate(
                f"{y:.3f}",
                (b.get_x() + b.get_width() / 2, y),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(PHASES))])
    ax.set_xticklabels([label for _, label in PHASES])
    ax.set_yscale("log")
    ax.set_ylabel("seconds (log)")
    sc = j["scenario"]
    title = (
        f"{sc['params']} x {sc['param_bytes'] >> 20} MiB parameters, {sc['state_bytes'] >> 20} MiB state, "
        f"{sc['cache_bytes'] >> 30} GiB cache{' (prepared)' if sc.get('prepare') else ''}"
    )
    t = dict(engines).get("torpor", {})
    if t.get("python_overhead_sleep_seconds") is not None:
        title += f"\ntorpor Python overhead per sleep: {t['python_overhead_sleep_seconds'] * 1e3:.2f} ms"
    ax.set_title(title, fontsize=10)
    ax.legend()
    plotting.save(fig, a)


if __name__ == "__main__":
    main()
