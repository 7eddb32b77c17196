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
    return IndexedDataset(data, **kwargs).cursor(
        WorkerContext(rank, world, worker, workers, 0, batch)
    )


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
                shard.restore({"epoch": epoch, "pos": 0})
                length = shard.shard_length
                items = list(shard)
                assert len(items) == length
                seen += items
        assert sorted(seen) == data


def test_iteration_ends_the_epoch_and_moves_to_the_next():
    shard = _shard(list(range(5)), 0, 1, 0, 0, None, shuffle=True, seed=1)
    first = list(shard)
    assert shard.state() == {"epoch": 1, "pos": 0}
    second = list(shard)
    assert sorted(first) == sorted(second) == list(range(5))
    assert first != second or len(first) < 2


@pytest.mark.parametrize("deterministic", [False, True])
def test_skip_is_exact(deterministic):
    data = Squares(20)
    torch.manual_seed(0)
    reference = _shard(data, 0, 1, 0, 0, None, deterministic_items=deterministic)
    for _ in range(7):
        next(reference)
    after = next(reference)
    torch.manual_seed(0)
    skipper = _shard(data, 0, 1, 0, 0, None, deterministic_items=deterministic)
    assert skipper.skip(7) == 7
    assert skipper.state() == {"epoch": 0, "pos": 7}
    got = next(skipper)
    assert got["index"] == after["index"]
    if not deterministic:  # skipped items were fetched: torch's generator advanced alike
        assert torch.equal(got["noise"], after["noise"])
    assert skipper.skip(12) == 12  # to the end of the epoch, not past it
    assert skipper.state() == {"epoch": 0, "pos": 20}
    assert skipper.skip(100) == 0  # the epoch ends: the next one begins, as reading does
    assert skipper.state() == {"epoch": 1, "pos": 0}


def test_bad_state_is_refused():
    shard = IndexedDataset([1, 2, 3]).cursor(WorkerContext(0, 1, 0, 0, 0, None))
    for bad in ({"epoch": -1, "pos": 0}, {"pos": 0}, [0, 0], {"epoch": 0, "pos": "1"}):
        with pytest.raises(StateError):
            shard.restore(bad)
