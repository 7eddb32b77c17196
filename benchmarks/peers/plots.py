"""The figures of ``docs/benchmarks.md``, drawn from ``bench_peers.py``'s samples.

Every bar is a median over rounds; whiskers, where drawn, span min..max over rounds.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {
    "torch": "#7f7f7f",
    "torchdata_1": "#1f77b4",
    "torchdata_64": "#9ecae1",
    "energon": "#ff7f0e",
    "ours": "#2ca02c",
}


def _bars(
    axis: Any,
    groups: Sequence[str],
    series: dict[str, list[float]],
    names: dict[str, str],
    *,
    errors: dict[str, tuple[list[float], list[float]]] | None = None,
    labels: bool = False,
    fmt: str = "{:.2f}",
) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (key, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        yerr = None
        if errors is not None and key in errors:
            low, high = errors[key]
            yerr = [
                [max(v - lo, 0) for v, lo in zip(values, low, strict=True)],
                [max(hi - v, 0) for v, hi in zip(values, high, strict=True)],
            ]
        bars = axis.bar(
            xs, values, width, label=names[key], color=COLORS.get(key), yerr=yerr, capsize=2
        )
        if labels:
            axis.bar_label(bars, [fmt.format(v) for v in values], fontsize=6, padding=1)
    axis.set_xticks(range(len(groups)))
    axis.set_xticklabels([g.replace(" (", "\n(") for g in groups], fontsize=8)


def draw(
    throughput: dict[str, dict[str, list[dict[str, float]]]],
    saves: dict[str, list[dict[str, list[float]]]],
    resume: dict[str, dict[str, list[list[dict[str, Any]]]]],
    names: dict[str, str],
    points: Sequence[int],
    directory: Path,
) -> list[Path]:
    """Writes ``peers_*.png`` into ``directory`` and returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    workloads = list(throughput)

    # Throughput ratio to torch.
    figure, axis = plt.subplots(figsize=(8, 4))
    keys = [key for key in next(iter(throughput.values())) if key != "torch"]
    series, errors = {}, {}
    for key in keys:
        medians, lows, highs = [], [], []
        for workload in workloads:
            runs, base = throughput[workload][key], throughput[workload]["torch"]
            ratios = [r["items_per_s"] / t["items_per_s"] for r, t in zip(runs, base, strict=True)]
            medians.append(statistics.median(ratios))
            lows.append(min(ratios))
            highs.append(max(ratios))
        series[key], errors[key] = medians, (lows, highs)
    _bars(axis, workloads, series, names, errors=errors, labels=True)
    axis.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axis.set_ylabel("items/s relative to torch DataLoader")
    axis.set_title("Throughput (median over rounds; whiskers: min..max)")
    axis.legend(fontsize=7, loc="lower left")
    written.append(_save(figure, directory / "peers_throughput.png"))

    # Save latency.
    figure, axis = plt.subplots(figsize=(7, 3.5))
    keys = list(saves)
    medians = [statistics.median([x for run in saves[k] for x in run["latency_ms"]]) for k in keys]
    maxima = [max(x for run in saves[k] for x in run["latency_ms"]) for k in keys]
    xs = range(len(keys))
    bars = axis.bar(xs, medians, 0.6, color=[COLORS.get(k) for k in keys], label="median")
    axis.bar_label(bars, [f"{v:.2f}" for v in medians], fontsize=7, padding=1)
    axis.scatter(xs, maxima, marker="_", s=400, color="black", label="max", zorder=3)
    axis.set_xticks(list(xs))
    axis.set_xticklabels([names[k].replace(", ", ",\n") for k in keys], fontsize=8)
    axis.set_yscale("log")
    axis.set_ylabel("save call, ms (log)")
    axis.set_title("Save latency while workers are busy (2 ms items)")
    axis.legend(fontsize=7)
    written.append(_save(figure, directory / "peers_save_latency.png"))

    # Restore: time to first batch and items recomputed, at the last save point.
    point = max(points)
    keys = list(next(iter(resume.values())))

    def at_point(field: str) -> dict[str, list[float]]:
        return {
            key: [
                statistics.median(
                    [
                        run[field]
                        for round_runs in resume[workload][key]
                        for run in round_runs
                        if run["point"] == point
                    ]
                )
                for workload in workloads
            ]
            for key in keys
        }

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5))
    _bars(top, workloads, at_point("restore_to_first_batch_ms"), names, labels=True, fmt="{:.0f}")
    top.set_yscale("log")
    top.set_ylabel("ms (log)")
    top.set_title(f"Restore -> first batch, state saved after {point} batches of 8")
    top.legend(fontsize=7)
    recomputed = at_point("items_recomputed")
    _bars(bottom, workloads, recomputed, names, labels=True, fmt="{:.0f}")
    bottom.set_yscale("symlog", linthresh=1)
    bottom.set_ylim(0, max(1.0, *(v for vs in recomputed.values() for v in vs)) * 4)
    bottom.set_ylabel("items (symlog)")
    bottom.set_title(f"Items recomputed on restore ({point * 8} items had been delivered)")
    written.append(_save(figure, directory / "peers_restore.png"))

    # State size and worker memory.
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    keys = list(next(iter(resume.values())))
    sizes = [
        statistics.median(
            [
                run["state_bytes"]
                for workload in workloads
                for round_runs in resume[workload][key]
                for run in round_runs
            ]
        )
        / 1024
        for key in keys
    ]
    bars = left.bar(range(len(keys)), sizes, 0.6, color=[COLORS.get(k) for k in keys])
    left.bar_label(bars, [f"{v:.1f}" for v in sizes], fontsize=7, padding=1)
    left.set_xticks(range(len(keys)))
    left.set_xticklabels([names[k].replace(", ", ",\n") for k in keys], fontsize=7)
    left.set_ylabel("KiB")
    left.set_title("State size (2 workers)")
    memory = {
        key: [
            statistics.median([r["workers_pss_kib"] for r in throughput[w][key]]) / 1024
            for w in workloads
        ]
        for key in next(iter(throughput.values()))
    }
    _bars(right, workloads, memory, names, labels=True, fmt="{:.0f}")
    right.set_ylabel("MiB")
    right.set_title("Worker memory: PSS summed over 2 workers")
    right.set_ylim(0, max(v for vs in memory.values() for v in vs) * 1.45)
    right.legend(fontsize=6, loc="upper left", ncol=2)
    written.append(_save(figure, directory / "peers_state_memory.png"))
    return written


def _save(figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
