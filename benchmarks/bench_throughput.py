"""Throughput: items per second of SavableDataLoader against torch's DataLoader.

Same dataset class (``common.SyntheticDataset``), batch 32, prefetch 2, item costs of
200 us and 0 us of CPU work, with 2 workers and with none. Each measurement builds a
loader, discards the first batches (worker start-up, queues filling), times batches for
a fixed duration and closes the loader; the two loaders alternate over rounds and the
table reports medians (NOTE [ Alternation ] in ``common.py``).

    python benchmarks/bench_throughput.py [--quick] [--rounds R] [--seconds S]
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import common

BATCH = 32
PREFETCH = 2
TARGET_RATIO = 0.97


def measure(
    kind: str, *, cost_us: float, workers: int, warmup: int, seconds: float
) -> dict[str, float]:
    """Builds a loader, skips ``warmup`` batches, times batches for ``seconds``, closes it.

    Returns the timed rate (items per wall-clock second) and the CPU time per item of
    the whole measurement (main process plus its reaped workers, start-up and warm-up
    included), which other jobs on the machine disturb less than wall-clock time.
    """
    cpu_began = common.cpu_seconds()
    dataset = common.SyntheticDataset(units=common.units_for(cost_us))
    loader = common.make_loader(
        kind, dataset, batch_size=BATCH, num_workers=workers, prefetch_factor=PREFETCH
    )
    try:
        iterator = iter(loader)
        for _ in range(warmup):
            next(iterator)
        batches = 0
        began = time.perf_counter()
        while True:
            next(iterator)
            batches += 1
            if batches % 8 == 0:
                elapsed = time.perf_counter() - began
                if elapsed >= seconds:
                    break
        del iterator
    finally:
        common.close_loader(loader)
    cpu = common.cpu_seconds() - cpu_began
    return {
        "items_per_s": batches * BATCH / elapsed,
        "batches": batches,
        "cpu_us_per_item": cpu / ((batches + warmup) * BATCH) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 0.5 s (smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per config (default 9)")
    parser.add_argument("--seconds", type=float, default=None, help="timed seconds per measurement")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 9)
    seconds = args.seconds or (0.5 if args.quick else 2.0)
    warmup = 5 if args.quick else 20

    print(f"burn unit: {common.calibrate():.3f} us per BLAKE2b call (main process)")
    configs = [(200, 2), (0, 2), (200, 0), (0, 0)]
    rows: list[dict[str, Any]] = []
    samples: dict[str, Any] = {}
    for cost_us, workers in configs:
        # Without workers the main process does all the work: time it for less.
        duration = seconds if workers else seconds / 2
        label = f"{cost_us} us, {workers} workers"
        results = common.alternate(
            {
                kind: functools.partial(
                    measure, kind, cost_us=cost_us, workers=workers, warmup=warmup, seconds=duration
                )
                for kind in ("torch", "ours")
            },
            rounds,
            progress=label,
        )
        torch_rates = [r["items_per_s"] for r in results["torch"]]
        our_rates = [r["items_per_s"] for r in results["ours"]]
        ratio = common.paired_ratio(our_rates, torch_rates)
        torch_cpu = [r["cpu_us_per_item"] for r in results["torch"]]
        our_cpu = [r["cpu_us_per_item"] for r in results["ours"]]
        spread = [a / b for a, b in zip(our_rates, torch_rates, strict=True)]
        row = {
            "item cost": f"{cost_us} us",
            "workers": workers,
            "torch items/s": common.median(torch_rates),
            "ours items/s": common.median(our_rates),
            "ratio ours/torch": ratio,
            "ratio min..max": f"{min(spread):.3f}..{max(spread):.3f}",
            "torch CPU us/item": common.median(torch_cpu),
            "ours CPU us/item": common.median(our_cpu),
            "CPU ratio ours/torch": common.paired_ratio(our_cpu, torch_cpu),
            "batches timed": int(common.median([r["batches"] for r in results["ours"]])),
        }
        rows.append(row)
        samples[label] = {
            "torch_items_per_s": torch_rates,
            "ours_items_per_s": our_rates,
            "torch_cpu_us_per_item": torch_cpu,
            "ours_cpu_us_per_item": our_cpu,
        }
        print(
            f"{label}: ratio ours/torch {ratio:.3f} (spread {min(spread):.3f}..{max(spread):.3f}),"
            f" CPU per item ours/torch {row['CPU ratio ours/torch']:.3f}"
        )

    notes = [
        f"Batch {BATCH}, prefetch_factor {PREFETCH}, {rounds} alternating rounds, "
        f"{seconds:g} s timed per measurement with workers ({seconds / 2:g} s without) "
        f"after {warmup} warm-up batches.",
        "ratio = median over rounds of (ours / torch) items per second measured in the same "
        "round; min..max is its spread over rounds.",
        "CPU us/item: CPU time of the main process and its workers over a whole measurement "
        "(start-up and warm-up included) per item consumed; CPU ratio = median of per-round "
        "ratios (above 1: ours spends more CPU per item).",
    ]
    at_200 = next(r for r in rows if r["item cost"] == "200 us" and r["workers"] == 2)
    verdict = "met" if at_200["ratio ours/torch"] >= TARGET_RATIO else "MISSED"
    notes.append(
        f"Target ratio >= {TARGET_RATIO} at 200 us with 2 workers: {verdict} "
        f"({at_200['ratio ours/torch']:.3f})."
    )
    common.write_results(
        "bench_throughput",
        title="Throughput: SavableDataLoader vs torch DataLoader",
        parameters={
            "batch_size": BATCH,
            "prefetch_factor": PREFETCH,
            "rounds": rounds,
            "seconds": seconds,
            "warmup_batches": warmup,
            "quick": args.quick,
        },
        columns=list(rows[0]),
        rows=rows,
        notes=notes,
        samples=samples,
    )


if __name__ == "__main__":
    main()
