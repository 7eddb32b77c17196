"""IndexedDataset: shards cover each epoch exactly once; state and skip are exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pipelines import Squares

from savable_loader import StateError, WorkerContext
from savable_loader.datasets import IndexedDataset


def _shard(data, rank, world, worker, workers, batch, **kwargs):
    dataset = IndexedDataset(data, **kwargs)
    dataset.setup(WorkerContext(rank, world, worker, workers, 0, batch))
    return dataset


@given(
    n=st.integers(0, 60),
    world=st.integers(1, 3),
    workers=st.integers(0, 4),
    batch=st.one_of(st.none(), st.integers(1, 5)),
    shuffle=st.booleans(),
)
def test_shards_partition_every_epoch(n, world, workers, batch, shuffle):
    data = list(range(n))
    for epoch in range(2):
        seen = []
        for rank in range(world):
            for worker in range(max(workers, 1)):
                shard = _shard(data, rank, world, worker, workers, batch, shuffle=shuffle, seed=3)
                shard.restore_state({"epoch": epoch, "pos": 0})
                items = list(shard)
                assert len(items) == len(shard)
                seen += items
        assert sorted(seen) == data


def test_iteration_ends_the_epoch_and_moves_to_the_next():
    shard = _shard(list(range(5)), 0, 1, 0, 0, None, shuffle=True, seed=1)
    first = list(shard)
    assert shard.save_state() == {"epoch": 1, "pos": 0}
    second = list(shard)
    assert sorted(first) == sorted(second) == list(range(5))
    assert first != second or len(first) < 2


@pytest.mark.parametrize("deterministic", [False, True])
def test_skip_is_exact(deterministic):
    data = Squares(20)
    torch.manual_seed(0)
    reference = _shard(data, 0, 1, 0, 0, None, deterministic_items=deterministic)
    iterator = iter(reference)
    for _ in range(7):
        next(iterator)
    after = next(iterator)
    torch.manual_seed(0)
    skipper = _shard(data, 0, 1, 0, 0, None, deterministic_items=deterministic)
    skipper.skip(7)
    assert skipper.save_state() == {"epoch": 0, "pos": 7}
    got = next(iter(skipper))
    assert got["index"] == after["index"]
    if not deterministic:  # skipped items were fetched: torch's generator advanced alike
        assert torch.equal(got["noise"], after["noise"])
    skipper.skip(100)
    assert skipper.save_state() == {"epoch": 0, "pos": 20}


def test_bad_state_is_refused():
    shard = IndexedDataset([1, 2, 3])
    for bad in ({"epoch": -1, "pos": 0}, {"pos": 0}, [0, 0], {"epoch": 0, "pos": "1"}):
        with pytest.raises(StateError):
            shard.restore_state(bad)
