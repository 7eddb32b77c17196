"""Throughput: items per second of SavableDataLoader against torch's DataLoader.

Same dataset class (``common.SyntheticDataset``), batch 32, prefetch 2, item costs of
200 us and 0 us of CPU work, with 2 workers and with none. The two loaders alternate
over rounds and the table reports medians (NOTE [ Alternation ] in ``common.py``).

Two methods:

* ``fresh`` (default): each measurement builds a loader, discards the first batches
  (worker start-up, queues filling), times batches for ``--seconds`` and closes it; it
  also records the CPU time per item of the whole measurement (main process plus its
  reaped workers).
* ``interleaved``: both loaders are built once and stay alive; each round times a short
  chunk of each (after discarding the batches prefetched while it sat idle). Pairs are
  seconds apart instead of tens of seconds, so drift from other jobs on the machine
  cancels better; there is no CPU figure (the workers are still running).

    python benchmarks/bench_throughput.py [--quick] [--method fresh|interleaved]
        [--rounds R] [--seconds S]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Iterator
from typing import Any

import common

BATCH = 32
PREFETCH = 2
TARGET_RATIO = 0.97
CONFIGS = [(200, 2), (0, 2), (200, 0), (0, 0)]


def _loader(kind: str, cost_us: float, workers: int) -> Any:
    dataset = common.SyntheticDataset(units=common.units_for(cost_us))
    return common.make_loader(
        kind, dataset, batch_size=BATCH, num_workers=workers, prefetch_factor=PREFETCH
    )


def _time_batches(iterator: Iterator[Any], seconds: float) -> tuple[int, float]:
    """Takes batches until ``seconds`` passed; returns (batches, elapsed seconds)."""
    batches = 0
    began = time.perf_counter()
    while True:
        next(iterator)
        batches += 1
        if batches % 4 == 0:
            elapsed = time.perf_counter() - began
            if elapsed >= seconds:
                return batches, elapsed


def measure_fresh(
    kind: str, *, cost_us: float, workers: int, warmup: int, seconds: float
) -> dict[str, float]:
    """Builds a loader, skips ``warmup`` batches, times batches for ``seconds``, closes it.

    Returns the timed rate (items per wall-clock second) and the CPU time per item of
    the whole measurement (main process plus its reaped workers, start-up and warm-up
    included), which other jobs on the machine disturb somewhat less than wall time.
    """
    cpu_began = common.cpu_seconds()
    loader = _loader(kind, cost_us, workers)
    try:
        iterator = iter(loader)
        for _ in range(warmup):
            next(iterator)
        batches, elapsed = _time_batches(iterator, seconds)
        del iterator
    finally:
        common.close_loader(loader)
    cpu = common.cpu_seconds() - cpu_began
    return {
        "items_per_s": batches * BATCH / elapsed,
        "batches": batches,
        "cpu_us_per_item": cpu / ((batches + warmup) * BATCH) * 1e6,
    }


def run_fresh(
    cost_us: float, workers: int, rounds: int, seconds: float, warmup: int
) -> dict[str, list[dict[str, float]]]:
    return common.alternate(
        {
            kind: functools.partial(
                measure_fresh,
                kind,
                cost_us=cost_us,
                workers=workers,
                warmup=warmup,
                seconds=seconds,
            )
            for kind in ("torch", "ours")
        },
        rounds,
        progress=f"{cost_us} us, {workers} workers",
    )


def run_interleaved(
    cost_us: float, workers: int, rounds: int, seconds: float, warmup: int
) -> dict[str, list[dict[str, float]]]:
    loaders = {kind: _loader(kind, cost_us, workers) for kind in ("torch", "ours")}
    # Batches a loader prefetched while idle come for free: discard them (and as many
    # again) before timing a chunk.
    drain = 2 * PREFETCH * workers + 2
    try:
        iterators = {kind: iter(loader) for kind, loader in loaders.items()}
        for iterator in iterators.values():
            for _ in range(warmup):
                next(iterator)

        def chunk(kind: str) -> dict[str, float]:
            for _ in range(drain):
                next(iterators[kind])
            batches, elapsed = _time_batches(iterators[kind], seconds)
            return {"items_per_s": batches * BATCH / elapsed, "batches": batches}

        results = common.alternate(
            {kind: functools.partial(chunk, kind) for kind in loaders},
            rounds,
            progress=f"{cost_us} us, {workers} workers",
        )
        iterators.clear()
    finally:
        for loader in loaders.values():
            common.close_loader(loader)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 0.5 s (smoke run)")
    parser.add_argument("--method", choices=("fresh", "interleaved"), default="fresh")
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds per config (default 9; interleaved 25)"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="timed seconds per measurement with workers, half without (default 2; interleaved 0.6)",
    )
    args = parser.parse_args()
    interleaved = args.method == "interleaved"
    rounds = args.rounds or (2 if args.quick else 25 if interleaved else 9)
    seconds = args.seconds or (0.5 if args.quick else 0.6 if interleaved else 2.0)
    warmup = 5 if args.quick else 20
    run = run_interleaved if interleaved else run_fresh

    print(f"burn unit: {common.calibrate():.3f} us per BLAKE2b call (main process)")
    rows: list[dict[str, Any]] = []
    samples: dict[str, Any] = {}
    for cost_us, workers in CONFIGS:
        # Without workers the main process does all the work: time it for less.
        duration = seconds if workers else seconds / 2
        label = f"{cost_us} us, {workers} workers"
        results = run(cost_us, workers, rounds, duration, warmup)
        torch_rates = [r["items_per_s"] for r in results["torch"]]
        our_rates = [r["items_per_s"] for r in results["ours"]]
        ratios = [a / b for a, b in zip(our_rates, torch_rates, strict=True)]
        low, high = common.bootstrap_ci(ratios)
        row: dict[str, Any] = {
            "item cost": f"{cost_us} us",
            "workers": workers,
            "torch items/s": common.median(torch_rates),
            "ours items/s": common.median(our_rates),
            "ratio ours/torch": common.median(ratios),
            "95% CI of ratio": f"{low:.3f}..{high:.3f}",
            "ratio min..max": f"{min(ratios):.3f}..{max(ratios):.3f}",
        }
        samples[label] = {"torch_items_per_s": torch_rates, "ours_items_per_s": our_rates}
        if not interleaved:
            torch_cpu = [r["cpu_us_per_item"] for r in results["torch"]]
            our_cpu = [r["cpu_us_per_item"] for r in results["ours"]]
            row["torch CPU us/item"] = common.median(torch_cpu)
            row["ours CPU us/item"] = common.median(our_cpu)
            row["CPU ratio ours/torch"] = common.paired_ratio(our_cpu, torch_cpu)
            samples[label].update(torch_cpu_us_per_item=torch_cpu, ours_cpu_us_per_item=our_cpu)
        row["batches timed"] = int(common.median([r["batches"] for r in results["ours"]]))
        rows.append(row)
        print(
            f"{label}: ratio ours/torch {row['ratio ours/torch']:.3f} (95% CI {low:.3f}..{high:.3f},"
            f" spread {min(ratios):.3f}..{max(ratios):.3f})"
        )

    if interleaved:
        method = (
            f"Method interleaved: both loaders built once; {rounds} alternating rounds, each "
            f"timing a {seconds:g} s chunk of each loader with workers ({seconds / 2:g} s "
            f"without) after discarding the batches prefetched while it was idle "
            f"({warmup} warm-up batches at start)."
        )
    else:
        method = (
            f"Method fresh: {rounds} alternating rounds; each measurement builds a loader, "
            f"discards {warmup} warm-up batches, times {seconds:g} s of batches with workers "
            f"({seconds / 2:g} s without) and closes it."
        )
    notes = [
        f"Batch {BATCH}, prefetch_factor {PREFETCH}. {method}",
        "ratio = median over rounds of (ours / torch) items per second measured in the same "
        "round; 95% CI: percentile bootstrap of that median; min..max: spread over rounds.",
    ]
    if not interleaved:
        notes.append(
            "CPU us/item: CPU time of the main process and its workers over a whole "
            "measurement (start-up and warm-up included) per item consumed; CPU ratio = "
            "median of per-round ratios (above 1: ours spends more CPU per item)."
        )
    at_200 = next(r for r in rows if r["item cost"] == "200 us" and r["workers"] == 2)
    ratio = at_200["ratio ours/torch"]
    low, high = (float(x) for x in at_200["95% CI of ratio"].split(".."))
    verdict = "met" if ratio >= TARGET_RATIO else "MISSED"
    resolved = (
        " The confidence interval straddles the target: this run cannot tell."
        if low < TARGET_RATIO <= high
        else ""
    )
    notes.append(
        f"Target ratio >= {TARGET_RATIO} at 200 us with 2 workers: {verdict} "
        f"(median {ratio:.3f}, 95% CI {low:.3f}..{high:.3f}).{resolved}"
    )
    bench = "bench_throughput" + ("_interleaved" if interleaved else "")
    common.write_results(
        bench,
        title="Throughput: SavableDataLoader vs torch DataLoader"
        + (" (interleaved)" if interleaved else ""),
        parameters={
            "method": args.method,
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
        command=f"python benchmarks/bench_throughput.py --method {args.method}"
        + (" --quick" if args.quick else ""),
        write=not args.quick,
    )


if __name__ == "__main__":
    main()
