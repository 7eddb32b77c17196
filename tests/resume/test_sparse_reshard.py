"""The elastic rest of an indexed epoch is computed without building the epoch (NOTE
[ Elastic indexed order ]): checked against the direct computation over every position,
on random layouts, progress and earlier rests."""

from __future__ import annotations

import random
import time
import tracemalloc

import numpy as np
import pytest

from savable_loader import WorkerContext
from savable_loader.datasets.index.order import global_position, remaining_positions, shard_length
from savable_loader.datasets.index.reshard import rest_after


def _direct(length, below, done, streams, ranks, even):
    """The computation over one flag per position, as the elastic note states it."""
    remaining = remaining_positions(length, below, done)
    consumed = np.ones(length, dtype=bool)
    consumed[remaining] = False
    for context, count in streams:
        consumed[remaining[global_position(np.arange(count, dtype=np.int64), context)]] = True
    if not consumed.any():
        return None
    open_positions = np.flatnonzero(~consumed)
    if even == "pad":
        consumed = np.concatenate([consumed, np.zeros(-len(open_positions) % ranks, dtype=bool)])
    elif len(open_positions) % ranks:
        consumed = consumed[: open_positions[-(len(open_positions) % ranks)]]
    open_positions = np.flatnonzero(~consumed)
    new_below = int(open_positions[0]) if len(open_positions) else len(consumed)
    return len(consumed), new_below, (np.flatnonzero(consumed[new_below:]) + new_below).tolist()


def _scenario(rng: random.Random):
    length = rng.randint(0, 90)
    below = rng.randint(0, length)
    candidates = list(range(below + 1, length))
    done = np.array(sorted(rng.sample(candidates, rng.randint(0, len(candidates)))), dtype=np.int64)
    world, workers, batch = rng.randint(1, 4), rng.randint(0, 3), rng.choice([None, 1, 2, 3, 5])
    open_before = length - below - len(done)
    streams = []
    for rank in range(world):
        for worker in range(max(workers, 1)):
            context = WorkerContext(rank, world, worker, workers, 0, batch)
            count = shard_length(open_before, context)
            streams.append((context, rng.choice([0, count, rng.randint(0, count)])))
    return length, below, done, streams, rng.randint(1, 5), rng.choice(["pad", "drop"])


def test_the_rest_equals_the_direct_computation_on_random_cases() -> None:
    rng = random.Random(11)
    for _ in range(3000):
        length, below, done, streams, ranks, even = _scenario(rng)
        want = _direct(length, below, done, streams, ranks, even)
        got = rest_after(length, below, done, streams, ranks, even)
        if want is None:
            assert got is None
            continue
        assert got is not None
        assert (got[0], got[1], got[2].tolist()) == want, (
            length,
            below,
            done,
            streams,
            ranks,
            even,
        )


def test_a_reshard_of_a_billion_positions_costs_what_its_state_holds() -> None:
    contexts = [WorkerContext(r, 4, w, 2, 0, 32) for r in range(4) for w in range(2)]
    length = 10**9
    streams = [(c, 1000 + 17 * i) for i, c in enumerate(contexts)]
    tracemalloc.start()
    began = time.perf_counter()
    rest = rest_after(length, 0, np.zeros(0, dtype=np.int64), streams, 3, "pad")
    elapsed = time.perf_counter() - began
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert rest is not None
    assert rest[1] > 0
    assert len(rest[2]) < 10_000
    assert peak < 5_000_000
    assert elapsed < 30  # generous for a loaded machine; the peak above is the real bound


@pytest.mark.parametrize("even", ["pad", "drop"])
def test_nothing_read_is_a_fresh_epoch(even: str) -> None:
    context = WorkerContext(0, 1, 0, 0, 0, None)
    assert rest_after(10, 0, np.zeros(0, dtype=np.int64), [(context, 0)], 3, even) is None
