"""Restore: items recomputed after a restore, and time to the first batch.

Batch 8, 2 workers, prefetch 2; items cost 1 ms or 10 us of CPU work. Per round:

* ours, fresh: build, ``iter()``, time to the first batch; consume up to ``--batches``
  batches, ``save_state_rank()``, close;
* ours, restored: build a new loader, ``restore_state_rank(state)``, ``iter()``, time to
  the first batch (restore call included), then sum ``replayed`` over
  ``worker_stats()``: the batches the workers recomputed at start-up;
* torch, fresh: torch's DataLoader over the same dataset, time to the first batch.

The three alternate (order reversed every other round) and the table reports medians.

    python benchmarks/bench_restore.py [--quick] [--rounds R] [--batches N]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import common

from savable_loader import RankState

BATCH = 8
WORKERS = 2
PREFETCH = 2


def _dataset(cost_us: float) -> common.SyntheticDataset:
    return common.SyntheticDataset(units=common.units_for(cost_us))


def _loader(kind: str, cost_us: float) -> Any:
    return common.make_loader(
        kind, _dataset(cost_us), batch_size=BATCH, num_workers=WORKERS, prefetch_factor=PREFETCH
    )


def fresh_ours(cost_us: float, batches: int, states: list[RankState]) -> dict[str, float]:
    """Time to first batch of a fresh loader; saves after ``batches`` batches."""
    loader = _loader("ours", cost_us)
    try:
        began = time.perf_counter()
        iterator = iter(loader)
        next(iterator)
        first = time.perf_counter() - began
        for _ in range(batches - 1):
            next(iterator)
        states.append(loader.save_state_rank())
        stats = loader.worker_stats()
        del iterator
    finally:
        common.close_loader(loader)
    produced = sum(s["seq"] for s in stats)
    return {
        "first_batch_ms": first * 1e3,
        # The saving workers' checkpoint policy explains the replay after restore.
        "checkpoint_cost_us": common.median([s["checkpoint_cost_s"] for s in stats]) * 1e6,
        "checkpoints_per_batch": sum(s["checkpoints_taken"] for s in stats) / max(produced, 1),
    }


def restored_ours(cost_us: float, states: list[RankState]) -> dict[str, float]:
    """Time to first batch after restoring the newest saved state into a new loader."""
    if not states:
        raise RuntimeError("no state saved yet: the fresh measurement runs first")
    state = states[-1]
    loader = _loader("ours", cost_us)
    try:
        began = time.perf_counter()
        loader.restore_state_rank(state)
        iterator = iter(loader)
        next(iterator)
        first = time.perf_counter() - began
        stats = loader.worker_stats()
        del iterator
    finally:
        common.close_loader(loader)
    replayed = sum(s["replayed"] for s in stats)
    return {
        "first_batch_ms": first * 1e3,
        "replayed_batches": replayed,
        "replayed_items": replayed * BATCH,
    }


def fresh_torch(cost_us: float) -> dict[str, float]:
    loader = _loader("torch", cost_us)
    try:
        began = time.perf_counter()
        iterator = iter(loader)
        next(iterator)
        first = time.perf_counter() - began
        del iterator
    finally:
        common.close_loader(loader)
    return {"first_batch_ms": first * 1e3}


def run_config(cost_us: float, batches: int, rounds: int) -> dict[str, list[dict[str, float]]]:
    states: list[RankState] = []
    results: dict[str, list[dict[str, float]]] = {"fresh": [], "restored": [], "torch": []}
    for round_index in range(rounds):
        # The restored loader needs the state its round's fresh loader saved: the fresh
        # loader always runs first, torch alternates before and after the pair.
        order = (
            ["torch", "fresh", "restored"] if round_index % 2 else ["fresh", "restored", "torch"]
        )
        for name in order:
            if name == "fresh":
                results[name].append(fresh_ours(cost_us, batches, states))
            elif name == "restored":
                results[name].append(restored_ours(cost_us, states))
            else:
                results[name].append(fresh_torch(cost_us))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds (smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per config (default 7)")
    parser.add_argument(
        "--batches", type=int, default=None, help="batches before the save (default 60)"
    )
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 7)
    batches = args.batches or (20 if args.quick else 60)

    print(f"burn unit: {common.calibrate():.3f} us per BLAKE2b call (main process)")
    rows: list[dict[str, Any]] = []
    samples: dict[str, Any] = {}
    for cost_us in (1000.0, 10.0):
        label = f"{cost_us:g} us"
        results = run_config(cost_us, batches, rounds)
        fresh = [r["first_batch_ms"] for r in results["fresh"]]
        restored = [r["first_batch_ms"] for r in results["restored"]]
        torch_first = [r["first_batch_ms"] for r in results["torch"]]
        replayed = [r["replayed_items"] for r in results["restored"]]
        row = {
            "item cost": f"{cost_us:g} us",
            "saved after": f"{batches} batches",
            "items recomputed (median)": int(common.median(replayed)),
            "items recomputed (max)": max(replayed),
            "rounds with recompute": f"{sum(1 for r in replayed if r)}/{len(replayed)}",
            "checkpoint cost us (saver, median)": common.median(
                [r["checkpoint_cost_us"] for r in results["fresh"]]
            ),
            "checkpoints per batch (saver)": common.median(
                [r["checkpoints_per_batch"] for r in results["fresh"]]
            ),
            "first batch, torch fresh ms": common.median(torch_first),
            "first batch, ours fresh ms": common.median(fresh),
            "first batch, ours restored ms": common.median(restored),
            "restored - ours fresh ms": common.median(
                [a - b for a, b in zip(restored, fresh, strict=True)]
            ),
            "restored / ours fresh": common.paired_ratio(restored, fresh),
            "ours fresh / torch fresh": common.paired_ratio(fresh, torch_first),
        }
        rows.append(row)
        samples[label] = results
        print(
            f"{label}: recomputed {row['items recomputed (median)']:g} items (median), "
            f"first batch restored/fresh {row['restored / ours fresh']:.2f}"
        )

    at_1ms = rows[0]
    verdict = "met" if at_1ms["items recomputed (max)"] == 0 else "MISSED"
    notes = [
        f"Batch {BATCH}, {WORKERS} workers, prefetch_factor {PREFETCH}, {rounds} rounds; the "
        f"state is saved after {batches} batches (mid-epoch) and restored into a new loader.",
        "Items recomputed: sum of worker_stats()['replayed'] (batches) after the first batch of "
        f"the restored loader, times the batch size {BATCH}.",
        "Checkpoint cost and checkpoints per batch: worker_stats() of the saving loader just "
        "before the save (the cost is the workers' median CPU time per checkpoint; the policy "
        "spends at most 1% of production time on checkpoints, so a batch is checkpointed only "
        "when 1% of its production time covers that cost).",
        "First batch: from iter() (restore_state_rank() included for the restored loader) to "
        "the first batch, worker start-up included; ratios are medians of per-round ratios.",
        f"Target 0 items recomputed at 1 ms: {verdict} (max {at_1ms['items recomputed (max)']:g}).",
    ]
    common.write_results(
        "bench_restore",
        title="Restore: recomputed items and time to first batch",
        parameters={
            "batch_size": BATCH,
            "num_workers": WORKERS,
            "prefetch_factor": PREFETCH,
            "rounds": rounds,
            "batches_before_save": batches,
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
