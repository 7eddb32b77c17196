"""Save latency: how long ``save_state_rank()`` takes while workers are busy in an item.

Batch 1, 2 workers, prefetch 2. The consumer takes an item, then calls
``save_state_rank()`` and times it, ``--saves`` times; the workers meanwhile produce
the next items (50 ms or 1 ms each, as CPU work or as a sleep). A save asks each worker's
command thread for a checkpoint from its ring, so it should cost an IPC round trip, not
the item in progress. Also timed: a save right after ``iter()``, before the first item,
which waits for the workers to start (fresh loader each time, ``--fresh`` times).

CPU-bound configurations run first: sleeping workers are the case the benchmark is
about (a worker blocked in an item), but on the VM this was written on, sleeping slowed
down whatever ran afterwards (NOTE [ Item cost ] in ``common.py``).

    python benchmarks/bench_save_latency.py [--quick] [--saves N] [--fresh N]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import common

from savable_loader import SavableDataLoader

WORKERS = 2
PREFETCH = 2
TARGET_MEDIAN_MS = 10.0


def build(cost_ms: float, mode: str) -> SavableDataLoader:
    dataset = common.SyntheticDataset(
        units=common.units_for(cost_ms * 1000) if mode == "cpu" else 0,
        mode=mode,
        sleep_s=cost_ms / 1000 if mode == "sleep" else 0.0,
    )
    return SavableDataLoader(dataset, batch_size=1, num_workers=WORKERS, prefetch_factor=PREFETCH)


def saves_between_items(cost_ms: float, mode: str, saves: int, warmup: int) -> list[float]:
    """Latencies (ms) of ``saves`` saves, one after each item, on a running loader."""
    loader = build(cost_ms, mode)
    latencies = []
    try:
        iterator = iter(loader)
        for _ in range(warmup):
            next(iterator)
        for _ in range(saves):
            next(iterator)
            began = time.perf_counter()
            loader.save_state_rank()
            latencies.append((time.perf_counter() - began) * 1e3)
        del iterator
    finally:
        common.close_loader(loader)
    return latencies


def save_after_iter(cost_ms: float, mode: str) -> dict[str, float]:
    """A fresh loader: save right after ``iter()``, then time the first item."""
    loader = build(cost_ms, mode)
    try:
        began = time.perf_counter()
        iterator = iter(loader)
        iterated = time.perf_counter()
        loader.save_state_rank()
        saved = time.perf_counter()
        next(iterator)
        first = time.perf_counter()
        del iterator
    finally:
        common.close_loader(loader)
    return {
        "iter_ms": (iterated - began) * 1e3,
        "save_ms": (saved - iterated) * 1e3,
        "first_item_after_save_ms": (first - saved) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer saves (smoke run)")
    parser.add_argument("--saves", type=int, default=None, help="saves per config (default 30)")
    parser.add_argument(
        "--fresh",
        type=int,
        default=None,
        help="fresh loaders for the save after iter() (default 5)",
    )
    args = parser.parse_args()
    saves = args.saves or (8 if args.quick else 30)
    fresh = args.fresh or (2 if args.quick else 5)
    warmup = 2 if args.quick else 4

    print(f"burn unit: {common.calibrate():.3f} us per BLAKE2b call (main process)")
    configs = [(50.0, "cpu"), (1.0, "cpu"), (50.0, "sleep"), (1.0, "sleep")]
    rows: list[dict[str, Any]] = []
    samples: dict[str, Any] = {}
    for cost_ms, mode in configs:
        label = f"{cost_ms:g} ms {mode}"
        latencies = saves_between_items(cost_ms, mode, saves, warmup)
        starts = [save_after_iter(cost_ms, mode) for _ in range(fresh)]
        after_iter = [s["save_ms"] for s in starts]
        row = {
            "item": f"{cost_ms:g} ms",
            "work": "CPU (BLAKE2b)" if mode == "cpu" else "time.sleep",
            "saves": len(latencies),
            "median ms": common.median(latencies),
            "p90 ms": sorted(latencies)[int(0.9 * (len(latencies) - 1))],
            "max ms": max(latencies),
            "after iter(): median ms": common.median(after_iter),
            "after iter(): max ms": max(after_iter),
            "first item after that save, median ms": common.median(
                [s["first_item_after_save_ms"] for s in starts]
            ),
        }
        rows.append(row)
        samples[label] = {"between_items_ms": latencies, "after_iter": starts}
        print(
            f"{label}: median {row['median ms']:.2f} ms, max {row['max ms']:.2f} ms; "
            f"after iter() median {row['after iter(): median ms']:.1f} ms"
        )

    notes = [
        f"Batch 1, {WORKERS} workers, prefetch_factor {PREFETCH}; {saves} saves per row, one "
        f"after each item, after {warmup} warm-up items; one loader per row.",
        f"'after iter()': a save on a fresh loader right after iter(), before the first item "
        f"(it waits for the workers to start and answer); {fresh} fresh loaders per row. "
        "'first item after that save': time from that save's return to the first item.",
    ]
    at_50 = [r for r in rows if r["item"] == "50 ms"]
    for row in at_50:
        verdict = "met" if row["median ms"] < TARGET_MEDIAN_MS else "MISSED"
        notes.append(
            f"Target median < {TARGET_MEDIAN_MS:g} ms with 50 ms items ({row['work']}): "
            f"{verdict} ({row['median ms']:.2f} ms)."
        )
    common.write_results(
        "bench_save_latency",
        title="Save latency: save_state_rank() while workers are busy",
        parameters={
            "num_workers": WORKERS,
            "prefetch_factor": PREFETCH,
            "batch_size": 1,
            "saves": saves,
            "fresh_loaders": fresh,
            "warmup_items": warmup,
            "quick": args.quick,
        },
        columns=list(rows[0]),
        rows=rows,
        notes=notes,
        samples=samples,
        write=not args.quick,
    )


if __name__ == "__main__":
    main()
