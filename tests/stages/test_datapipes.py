"""Torch's ``IterDataPipe`` reads as torch's ``DataLoader`` reads it: its sharding filter
splits the items over workers and ranks, ``shuffle=`` switches its shuffle steps, and
each epoch shuffles anew, alike everywhere (NOTE [ DataPipes ] in
``savable_loader/datasets/adapters/datapipes.py``)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from torch.utils.data import DataLoader

from savable_loader import SavableDataLoader, UnsavableDatasetError, WorkerConfig

with warnings.catch_warnings():  # torch marks DataPipes deprecated
    warnings.simplefilter("ignore")
    from torch.utils.data.datapipes.iter import IterableWrapper

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

N = 12


def _pipe(*, shuffled: bool = False) -> Any:
    pipe = IterableWrapper(range(N))
    if shuffled:
        pipe = pipe.shuffle()
    return pipe.sharding_filter()


def _epochs(loader: Any, epochs: int = 2) -> list[list[int]]:
    return [[int(item) for item in loader] for _ in range(epochs)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_sharding_filter_splits_the_items_over_the_workers_as_torchs(num_workers: int) -> None:
    expected = _epochs(DataLoader(_pipe(), num_workers=num_workers, batch_size=None))
    with SavableDataLoader(_pipe(), num_workers=num_workers, batch_size=None) as ours:
        assert _epochs(ours) == expected
    assert expected[0] == list(range(N))


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_shuffle_steps_shuffle_every_epoch_alike_in_every_worker(
    num_workers: int, persistent: bool
) -> None:
    """Every epoch is a new permutation of all the items, reproducible from the seed."""
    options = {"num_workers": num_workers, "persistent_workers": persistent, "batch_size": None}
    with (
        SavableDataLoader(_pipe(shuffled=True), seed=1, **options) as first,
        SavableDataLoader(_pipe(shuffled=True), seed=1, **options) as again,
        SavableDataLoader(_pipe(shuffled=True), seed=2, **options) as other,
    ):
        epochs = _epochs(first, 3)
        assert _epochs(again, 3) == epochs
        assert _epochs(other, 3) != epochs
    assert all(sorted(epoch) == list(range(N)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_false_switches_the_shuffle_steps_off_as_torchs(num_workers: int) -> None:
    options: dict[str, Any] = {"num_workers": num_workers, "batch_size": 4, "shuffle": False}
    expected = [
        [b.tolist() for b in epoch] for epoch in [DataLoader(_pipe(shuffled=True), **options)] * 2
    ]
    with SavableDataLoader(_pipe(shuffled=True), **options) as ours:
        assert [[b.tolist() for b in ours] for _ in range(2)] == expected
    step = max(num_workers, 1)  # each worker batches its own share, unshuffled
    assert expected[0][0] == list(range(0, 4 * step, step))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_two_ranks_read_disjoint_shares_of_the_same_shuffle(num_workers: int) -> None:
    shares = []
    for rank in (0, 1):
        config = WorkerConfig(rank=rank, world_size=2)
        with SavableDataLoader(
            _pipe(shuffled=True), num_workers=num_workers, batch_size=None, worker_config=config
        ) as loader:
            shares.append(_epochs(loader))
    for epoch in range(2):
        both = shares[0][epoch] + shares[1][epoch]
        assert sorted(both) == list(range(N))
        assert len(shares[0][epoch]) == len(shares[1][epoch]) == N // 2


def test_a_pipe_iterates_but_saving_raises() -> None:
    with SavableDataLoader(_pipe(), batch_size=None) as loader:
        iterator = iter(loader)
        next(iterator)
        with pytest.raises(UnsavableDatasetError):
            loader.save_state_rank()
