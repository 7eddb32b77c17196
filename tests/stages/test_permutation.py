"""Computed epoch orders (NOTE [ Computed epoch orders ] in ``datasets/index/permutation.py``):
a keyed bijection of ``[0, n)`` evaluated position by position, so a shuffled epoch of
10**10 items costs what one of 10**6 does; states saved before keep their stored order."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from savable_loader import WorkerContext
from savable_loader.datasets import IndexedDataset
from savable_loader.datasets.index.order import nth_remaining, remaining_positions
from savable_loader.datasets.index.permutation import KeyedPermutation
from savable_loader.rng import derive_seed

ALONE = WorkerContext(0, 1, 0, 0, 0, None)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 16, 17, 100, 1023, 1025, 4097, 65_537])
def test_it_is_a_bijection_of_the_range(n: int) -> None:
    permutation = KeyedPermutation(n, key=12_345)
    images = permutation(np.arange(n))
    assert sorted(images.tolist()) == list(range(n))
    for position in range(0, n, max(1, n // 9)):
        assert permutation(position) == images[position]


def test_keys_give_unrelated_orders() -> None:
    n = 10_000
    orders = [KeyedPermutation(n, key)(np.arange(n)) for key in (0, 1, 2**40, -7)]
    for i, first in enumerate(orders):
        for second in orders[i + 1 :]:
            assert (first == second).sum() < 10  # about 1 fixed match expected
    # Not the identity, nor close to it: positions move far on average.
    assert np.abs(orders[0] - np.arange(n)).mean() > n / 5


def test_ten_billion_items_cost_no_memory() -> None:
    tracemalloc.start()
    began = time.perf_counter()
    permutation = KeyedPermutation(10**10, key=3)
    tail = permutation(np.arange(10**10 - 1000, 10**10))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert tail.min() >= 0
    assert tail.max() < 10**10
    assert len(set(tail.tolist())) == 1000
    assert peak < 1_000_000
    assert time.perf_counter() - began < 30  # a pass over 10**10 items would take hours


class _Huge:
    """A map-style dataset of 10**10 items whose item is its index."""

    def __len__(self) -> int:
        return 10**10

    def __getitem__(self, index: int) -> int:
        return index


def test_an_indexed_dataset_of_ten_billion_items_reads_and_restores_at_once() -> None:
    stage = IndexedDataset(_Huge(), shuffle=True, seed=5)
    context = WorkerContext(1, 4, 1, 2, 0, 32)
    tracemalloc.start()
    cursor = stage.cursor(context)
    head = cursor.take(64)
    state = cursor.state()
    again = stage.cursor(context)
    again.restore(state)
    assert again.take(64) == cursor.take(64)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(set(head)) == 64
    assert state["order"] == 2
    assert peak < 5_000_000


def test_a_state_saved_before_computed_orders_keeps_its_stored_order() -> None:
    data = list(range(50))
    stage = IndexedDataset(data, shuffle=True, seed=9)
    old = stage.cursor(ALONE)
    old.restore({"epoch": 2, "pos": 0})  # a state of an earlier version: no "order"
    seed = derive_seed(9, 0x1D, 2)
    assert list(old) == np.random.default_rng(seed).permutation(50).tolist()
    assert "order" not in old.state()  # later epochs keep the stored permutations
    assert list(old) == np.random.default_rng(derive_seed(9, 0x1D, 3)).permutation(50).tolist()
    new = stage.cursor(ALONE)
    new.restore({"epoch": 2, "pos": 0, "order": 2})
    assert list(new) == KeyedPermutation(50, seed)(np.arange(50)).tolist()
    fresh = stage.cursor(ALONE)
    assert fresh.state()["order"] == 2


def test_the_kth_open_position_is_found_without_the_epoch() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        length = int(rng.integers(1, 80))
        below = int(rng.integers(0, length))
        candidates = np.arange(below + 1, length)
        done = (
            np.sort(
                rng.choice(
                    candidates, size=int(rng.integers(0, len(candidates) + 1)), replace=False
                )
            )
            if len(candidates)
            else np.zeros(0, dtype=np.int64)
        )
        done = done.astype(np.int64)
        remaining = remaining_positions(length, below, done)
        found = nth_remaining(np.arange(len(remaining)), below, done)
        assert found.tolist() == remaining.tolist()
