"""Memory: checkpoint ring per worker and saved state size per worker.

A simple pipeline (``common.SyntheticDataset``, batch 32, prefetch 2) with 2 and 4
workers, items costing 1 ms of CPU work (every batch is checkpointed, so the ring is as
full as it gets) or 10 us (checkpoints every few milliseconds of work). After
``--batches`` batches, ``worker_stats()`` gives each worker's ring entries and the size of
its newest checkpoint encoded with msgpack; ring memory is estimated as their product.
The saved state is ``save_state_rank()`` encoded as a state file
(``savable_loader.serialization.dumps(state.to_plain())``), divided by the workers.

    python benchmarks/bench_memory.py [--quick] [--batches N]
"""

from __future__ import annotations

import argparse
from typing import Any

import common

from savable_loader import SavableDataLoader, serialization

BATCH = 32
PREFETCH = 2
TARGET_KIB = 32


def measure(workers: int, cost_us: float, batches: int) -> dict[str, Any]:
    dataset = common.SyntheticDataset(units=common.units_for(cost_us))
    loader = SavableDataLoader(
        dataset, batch_size=BATCH, num_workers=workers, prefetch_factor=PREFETCH
    )
    try:
        iterator = iter(loader)
        for _ in range(batches):
            next(iterator)
        stats = loader.worker_stats()
        state = loader.save_state_rank()
        del iterator
    finally:
        common.close_loader(loader)
    state_bytes = len(serialization.dumps(state.to_plain()))
    ring = [s["ring_entries"] * s["checkpoint_bytes"] for s in stats]
    return {
        "workers": workers,
        "item cost": f"{cost_us:g} us",
        "ring entries per worker": "/".join(str(s["ring_entries"]) for s in stats),
        "checkpoint bytes": max(s["checkpoint_bytes"] for s in stats),
        "ring KiB per worker (max)": max(ring) / 1024,
        "state file bytes": state_bytes,
        "state KiB per worker": state_bytes / workers / 1024,
        "checkpoints taken": sum(s["checkpoints_taken"] for s in stats),
        "checkpoint cost us (median)": common.median([s["checkpoint_cost_s"] for s in stats]) * 1e6,
        "_stats": stats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches (smoke run)")
    parser.add_argument(
        "--batches", type=int, default=None, help="batches before measuring (default 60)"
    )
    args = parser.parse_args()
    batches = args.batches or (15 if args.quick else 60)

    print(f"burn unit: {common.calibrate():.3f} us per BLAKE2b call (main process)")
    rows = []
    samples: dict[str, Any] = {}
    for workers in (2, 4):
        for cost_us in (1000.0, 10.0):
            row = measure(workers, cost_us, batches)
            samples[f"{workers} workers, {cost_us:g} us"] = row.pop("_stats")
            rows.append(row)
            print(
                f"{workers} workers, {cost_us:g} us: ring {row['ring KiB per worker (max)']:.1f} "
                f"KiB/worker, state {row['state KiB per worker']:.1f} KiB/worker"
            )

    worst_ring = max(r["ring KiB per worker (max)"] for r in rows)
    worst_state = max(r["state KiB per worker"] for r in rows)
    notes = [
        f"Batch {BATCH}, prefetch_factor {PREFETCH}; measured after {batches} batches, then the "
        "state is saved. Ring entries are listed per worker.",
        "Ring KiB per worker = ring entries x the newest checkpoint's msgpack size (dataset "
        "state plus the three generator states); in the worker the entries are kept as "
        "Python objects of about that size.",
        "State KiB per worker = the whole state file (header, loader fields, one checkpoint "
        "per worker) divided by the number of workers.",
        f"Target < {TARGET_KIB} KiB per worker: saved state "
        f"{'met' if worst_state < TARGET_KIB else 'MISSED'} (max {worst_state:.1f} KiB); "
        f"ring memory {'met' if worst_ring < TARGET_KIB else 'MISSED'} "
        f"(max {worst_ring:.1f} KiB).",
    ]
    common.write_results(
        "bench_memory",
        title="Memory: checkpoint ring and saved state per worker",
        parameters={
            "batch_size": BATCH,
            "prefetch_factor": PREFETCH,
            "batches": batches,
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
