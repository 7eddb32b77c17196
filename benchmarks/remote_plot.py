"""The figure of ``docs/benchmarks.md``'s remote section, drawn from ``bench_remote.py``'s
samples: per source and remote configuration, the ratio to local disk of the items per
second and of the time to the first batch, with the issue's targets marked.

Every bar is the median of the per-round ratios; whiskers span min..max over rounds.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {
    "s3-cache": "#2ca02c",
    "s3-cache:files": "#98df8a",
    "s3-cache:counts": "#17becf",
    "s3-cache:listed": "#bcbd22",
    "s3-direct": "#7f7f7f",
}
#: The issue's targets: items/s at least 0.9x local, the first batch within 2x local.
THROUGHPUT_TARGET, FIRST_BATCH_TARGET = 0.9, 2.0


def _ratios(
    samples: dict[str, dict[str, list[dict[str, Any]]]],
    baselines: dict[str, dict[str, str]],
    field: str,
) -> dict[str, dict[str, list[float]]]:
    """Per remote configuration, per source, the per-round ratios of ``field`` to local."""
    ratios: dict[str, dict[str, list[float]]] = {config: {} for config in COLORS}
    for source, configs in samples.items():
        for config, runs in configs.items():
            if config not in COLORS:
                continue
            local = configs[baselines[source][config]]
            ratios[config][source] = [
                run[field] / base[field] for run, base in zip(runs, local, strict=True)
            ]
    return {config: values for config, values in ratios.items() if values}


def _panel(
    axis: Any,
    sources: list[str],
    ratios: dict[str, dict[str, list[float]]],
    target: float,
    target_label: str,
) -> None:
    width = 0.8 / max(len(ratios), 1)
    for i, (config, by_source) in enumerate(ratios.items()):
        xs, medians, low, high = [], [], [], []
        for g, source in enumerate(sources):
            if source not in by_source:
                continue
            values = by_source[source]
            median = statistics.median(values)
            xs.append(g + (i - (len(ratios) - 1) / 2) * width)
            medians.append(median)
            low.append(max(median - min(values), 0.0))
            high.append(max(max(values) - median, 0.0))
        bars = axis.bar(
            xs,
            medians,
            width,
            label=config,
            color=COLORS[config],
            yerr=[low, high],
            capsize=2,
        )
        labels = [f"{v:.2f}" if v < 10 else f"{v:.0f}" for v in medians]
        axis.bar_label(bars, labels, fontsize=6, padding=1)
    axis.axhline(target, color="#d62728", linewidth=1.0, linestyle="--", label=target_label)
    axis.axhline(1.0, color="black", linewidth=0.6)
    axis.set_xticks(range(len(sources)))
    axis.set_xticklabels(sources, fontsize=8)
    axis.set_yscale("log")


def draw(
    samples: dict[str, dict[str, list[dict[str, Any]]]],
    baselines: dict[str, dict[str, str]],
    path: Path,
) -> Path:
    """Writes the figure to ``path`` and returns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sources = list(samples)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7))
    throughput = _ratios(samples, baselines, "items_per_s")
    _panel(top, sources, throughput, THROUGHPUT_TARGET, f"target >= {THROUGHPUT_TARGET}")
    smallest = min(v for by in throughput.values() for vs in by.values() for v in vs)
    top.set_ylim(10 ** math.floor(math.log10(min(smallest, 0.5))), 3)
    top.set_ylabel("items/s relative to local (log)")
    top.set_title("Throughput after the first batch (median over rounds; whiskers: min..max)")
    top.legend(fontsize=7, loc="lower left", ncol=3)
    first = _ratios(samples, baselines, "first_batch_s")
    _panel(bottom, sources, first, FIRST_BATCH_TARGET, f"target <= {FIRST_BATCH_TARGET:.0f}")
    largest = max(v for by in first.values() for vs in by.values() for v in vs)
    bottom.set_ylim(0.5, 10 ** math.ceil(math.log10(max(largest, 10) * 2)))
    bottom.set_ylabel("time to first batch relative to local (log)")
    bottom.set_title("Time to the first batch (building the loader included)")
    bottom.legend(fontsize=7, loc="upper left", ncol=3)
    figure.suptitle("S3 behind 30 ms first-byte latency against local disk (2 workers, 2 cores)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
