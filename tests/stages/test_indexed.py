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


def _order(data, epoch, **kwargs):
    """The epoch's order on one rank: every index once."""
    shard = _shard(data, 0, 1, 0, 0, None, **kwargs)
    shard.restore({"epoch": epoch, "pos": 0, "order": 2})
    return list(shard)


@given(
    n=st.integers(0, 60),
    world=st.integers(1, 3),
    workers=st.integers(0, 4),
    batch=st.one_of(st.none(), st.integers(1, 5)),
    shuffle=st.booleans(),
    even=st.sampled_from(["pad", "drop"]),
)
def test_shards_cover_the_padded_or_cut_epoch_and_ranks_read_as_many(
    n, world, workers, batch, shuffle, even
):
    data = list(range(n))
    length = -(-n // world) * world if even == "pad" else n // world * world
    for epoch in range(2):
        order = _order(data, epoch, shuffle=shuffle, seed=3, even=even)
        assert sorted(order) == data
        seen = []
        per_rank = []
        for rank in range(world):
            read = 0
            for worker in range(max(workers, 1)):
                shard = _shard(
                    data, rank, world, worker, workers, batch, shuffle=shuffle, seed=3, even=even
                )
                shard.restore({"epoch": epoch, "pos": 0, "order": 2})
                length_of_shard = shard.shard_length
                items = list(shard)
                assert len(items) == length_of_shard
                seen += items
                read += len(items)
            per_rank.append(read)
        # Position p of the padded epoch is the order's p % n (the start comes again).
        assert sorted(seen) == sorted(order[p % n] for p in range(length))
        assert per_rank == [length // world] * world


def test_iteration_ends_the_epoch_and_moves_to_the_next():
    shard = _shard(list(range(5)), 0, 1, 0, 0, None, shuffle=True, seed=1)
    first = list(shard)
    assert shard.state() == {"epoch": 1, "pos": 0, "order": 2}
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
