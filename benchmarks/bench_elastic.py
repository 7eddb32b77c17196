"""Elastic resume: the cost of moving a save onto another number of workers and ranks.

A shuffled ``IndexedDataset`` over ``N`` cheap items (``deterministic_items``), batch 32.
Two simulated ranks of 2 workers (``WorkerConfig(rank=r, world_size=2)``) run 60 and 57
batches into epoch 0 and save. Per round, alternating:

* elastic: a loader of rank 0 of 3 ranks x 3 workers, ``restore_state_rank(states)``
  (every old rank's state: the reshard), ``iter()``, time to the first batch;
* same layout: a loader of rank 0 of 2 x 2, ``restore_state_rank(states[0])``, first batch;
* torch: torch's ``DataLoader`` over the same data with 3 workers, first batch.

Also reported: the time of ``loader.reshard(states, rank=0)`` alone, and the size of the
resharded state file against the saved one (the consumed positions above ``done_below``
are listed, so it grows with how far apart the ranks stood).

    python benchmarks/bench_elastic.py [--quick] [--rounds R]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import common
import numpy as np
from torch.utils.data import DataLoader

from savable_loader import RankState, SavableDataLoader, WorkerConfig
from savable_loader.datasets import IndexedDataset
from savable_loader.state.files import encode_state

BATCH = 32
STEPS = (60, 57)


def _dataset(n: int) -> IndexedDataset[Any]:
    return IndexedDataset(np.arange(n), shuffle=True, seed=1, deterministic_items=True)


def _loader(n: int, workers: int, rank: int, ranks: int) -> SavableDataLoader:
    return SavableDataLoader(
        _dataset(n),
        batch_size=BATCH,
        num_workers=workers,
        seed=1,
        worker_config=WorkerConfig(rank=rank, world_size=ranks),
    )


def _save(n: int) -> list[RankState]:
    states = []
    for rank, steps in enumerate(STEPS):
        loader = _loader(n, 2, rank, len(STEPS))
        try:
            stream = iter(loader)
            for _ in range(steps):
                next(stream)
            states.append(loader.save_state_rank())
            del stream
        finally:
            loader.close()
    return states


def _first_batch(loader: Any, restore: Any) -> float:
    try:
        began = time.perf_counter()
        restore(loader)
        next(iter(loader))
        return (time.perf_counter() - began) * 1e3
    finally:
        common.close_loader(loader)


def _measures(n: int, states: list[RankState]) -> dict[str, Any]:
    return {
        "elastic": lambda: _first_batch(
            _loader(n, 3, 0, 3), lambda loader: loader.restore_state_rank(states)
        ),
        "same": lambda: _first_batch(
            _loader(n, 2, 0, 2), lambda loader: loader.restore_state_rank(states[0])
        ),
        "torch": lambda: _first_batch(
            DataLoader(np.arange(n), batch_size=BATCH, shuffle=True, num_workers=3),
            lambda loader: None,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds, small sizes only")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per size (default 5)")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    sizes = (100_000,) if args.quick else (100_000, 1_000_000, 10_000_000)
    rows: list[dict[str, Any]] = []
    samples: dict[str, Any] = {}
    for n in sizes:
        states = _save(n)
        measures = _measures(n, states)
        results = common.alternate(measures, rounds, progress=f"{n} items")
        probe = _loader(n, 3, 0, 3)
        reshard_ms = []
        try:
            for _ in range(rounds):
                began = time.perf_counter()
                moved = probe.reshard(states, rank=0)
                reshard_ms.append((time.perf_counter() - began) * 1e3)
        finally:
            probe.close()
        row = {
            "items": f"{n:,}",
            "reshard ms (rank 0 of 3x3)": common.median(reshard_ms),
            "first batch, elastic ms": common.median(results["elastic"]),
            "first batch, same layout ms": common.median(results["same"]),
            "first batch, torch ms": common.median(results["torch"]),
            "elastic / same layout": common.paired_ratio(results["elastic"], results["same"]),
            "elastic / torch": common.paired_ratio(results["elastic"], results["torch"]),
            "saved state B (rank 0)": len(encode_state(states[0])),
            "resharded state B (rank 0)": len(encode_state(moved)),
        }
        rows.append(row)
        samples[str(n)] = {**results, "reshard_ms": reshard_ms}
        print(
            f"{n:,} items: reshard {row['reshard ms (rank 0 of 3x3)']:.1f} ms, first batch "
            f"elastic/same {row['elastic / same layout']:.2f}"
        )
    notes = [
        f"Batch {BATCH}; saved on 2 simulated ranks x 2 workers after {STEPS[0]} and "
        f"{STEPS[1]} batches; restored onto rank 0 of 3 ranks x 3 workers; {rounds} rounds, "
        "medians, ratios are medians of per-round ratios.",
        "First batch includes restore_state_rank() and the workers' start-up; torch builds "
        "no state at all, so elastic / torch is the whole price of resuming on a new layout.",
        "The reshard runs in the main process, once per restore whatever the number of "
        "new ranks: it brings each old worker from its checkpoint to the consumer's "
        "position, then works out what is left of the epoch from the old positions "
        "without building the epoch (the shuffled order is computed, NOTE [ Elastic "
        "indexed order ]); every new stream of the restore shares that answer.",
    ]
    common.write_results(
        "bench_elastic",
        title="Elastic resume: reshard cost, first batch, state size",
        parameters={"batch_size": BATCH, "steps": STEPS, "rounds": rounds, "sizes": sizes},
        columns=list(rows[0]),
        rows=rows,
        notes=notes,
        samples=samples,
        write=not args.quick,
    )


if __name__ == "__main__":
    main()
