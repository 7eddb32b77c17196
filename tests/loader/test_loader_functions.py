"""``loader.collate_fn`` and ``loader.worker_init_fn`` read as torch's and may be set after
construction (NOTE [ What the loader shows of its arguments ] and NOTE [ A collate_fn set
later ] in ``savable_loader/_main/shown.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from paths import GOLDEN
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate, get_worker_info

from savable_loader import ConfigError, SavableDataLoader, StateError
from savable_loader.state.files import decode_state, encode_state
from savable_loader.testing import assert_resumes_exactly


class Numbers(Dataset[int]):
    def __len__(self) -> int:
        return 22

    def __getitem__(self, index: int) -> int:
        return index


class Stream(IterableDataset[int]):
    """An iterable without a position: it cannot be saved."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(12))


def tagged(batch: list[int]) -> tuple[str, list[int]]:
    return ("tagged", default_collate(batch).tolist())


def noisy(batch: list[int]) -> list[float]:
    """A collate that draws, as augmenting collates do (the draw is in the stream)."""
    return (default_collate(batch).float() + torch.rand(len(batch))).tolist()


def _plain(batches: Any) -> list[Any]:
    return [b.tolist() if isinstance(b, torch.Tensor) else b for b in batches]


CASES: dict[str, dict[str, Any]] = {
    "batched": {"batch_size": 4},
    "unbatched": {"batch_size": None},
    "shuffled": {"batch_size": 4, "shuffle": True},
    "sampler": {"batch_size": None, "sampler": [3, 1, 2]},
    "batch_sampler": {"batch_sampler": [[0, 1], [2, 3, 4]]},
    "own": {"batch_size": 3, "collate_fn": tagged},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_collate_fn_reads_as_torchs(case: str) -> None:
    """Torch's default for the batching, or the user's function: what code that rebuilds
    a loader from its attributes (Lightning, Accelerate) passes on."""
    torchs = DataLoader(Numbers(), **CASES[case])
    with SavableDataLoader(Numbers(), **CASES[case]) as ours:
        assert ours.collate_fn is torchs.collate_fn
        rebuilt_options = {**CASES[case], "collate_fn": ours.collate_fn}
        with SavableDataLoader(Numbers(), **rebuilt_options) as rebuilt:
            assert rebuilt.fingerprint == ours.fingerprint
            assert _plain(rebuilt) == _plain(ours)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_collate_fn_set_between_epochs_batches_as_torchs(num_workers: int) -> None:
    """Set before the first epoch and again before the second (``persistent_workers``
    False, torch's default, where torch's new workers take the new function too)."""
    options: dict[str, Any] = {"batch_size": 5, "num_workers": num_workers}
    torchs = DataLoader(Numbers(), **options)
    with SavableDataLoader(Numbers(), **options) as ours:
        epochs: list[list[Any]] = [[], []]
        for loader, out in ((torchs, epochs[0]), (ours, epochs[1])):
            loader.collate_fn = tagged
            out.append(_plain(loader))
            loader.collate_fn = default_collate
            out.append(_plain(loader))
        assert epochs[1] == epochs[0]
        assert epochs[1][0][0] == ("tagged", [0, 1, 2, 3, 4])
        assert epochs[1][1][0] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_collate_fn_set_mid_epoch_collates_the_next_batch(
    num_workers: int, persistent: bool
) -> None:
    """Prefetched batches included; with persistent workers too, where torch's running
    workers would keep the old function."""
    options = {"batch_size": 4, "num_workers": num_workers, "persistent_workers": persistent}
    with SavableDataLoader(Numbers(), **options) as loader:
        iterator = iter(loader)
        head = [next(iterator).tolist() for _ in range(2)]
        loader.collate_fn = tagged
        assert loader.collate_fn is tagged
        rest = list(iterator)
        assert head == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert rest == [("tagged", list(range(at, min(at + 4, 22)))) for at in (8, 12, 16, 20)]
        assert _plain(loader)[0] == ("tagged", [0, 1, 2, 3])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_saved_after_the_change_resumes_with_it(num_workers: int) -> None:
    """The state carries the new function's name: a script that sets it the same way
    before restoring resumes exactly, and one that does not is refused."""
    options: dict[str, Any] = {"batch_size": 3, "num_workers": num_workers, "seed": 4}
    with SavableDataLoader(Numbers(), shuffle=True, **options) as first:
        iterator = iter(first)
        next(iterator)
        first.collate_fn = noisy
        next(iterator)
        state = decode_state(encode_state(first.save_state_rank()))
        expected = [list(iterator), list(first)]
    with SavableDataLoader(Numbers(), shuffle=True, **options) as second:
        second.collate_fn = noisy
        second.restore_state_rank(state)
        assert [list(second), list(second)] == expected
    with (
        SavableDataLoader(Numbers(), shuffle=True, **options) as unchanged,
        pytest.raises(StateError, match="fingerprint"),
    ):
        unchanged.restore_state_rank(state)


def test_a_collate_fn_set_after_construction_resumes_exactly_everywhere() -> None:
    """The resume harness over a loader whose drawing collate was set after construction."""

    def build() -> SavableDataLoader:
        loader = SavableDataLoader(Numbers(), batch_size=3, shuffle=True, num_workers=2, seed=1)
        loader.collate_fn = noisy
        return loader

    report = assert_resumes_exactly(build, epochs=2, num_points=4, chain_items=(2,))
    assert report.restores >= 4


def test_torchs_default_set_back_is_the_pipeline_as_built() -> None:
    with (
        SavableDataLoader(Numbers(), batch_size=4) as built,
        SavableDataLoader(Numbers(), batch_size=4, collate_fn=tagged) as loader,
    ):
        assert loader.fingerprint != built.fingerprint
        loader.collate_fn = default_collate
        assert loader.fingerprint == built.fingerprint
        assert _plain(loader) == _plain(built)


#: Saved by commit a83d9b3, before torch's default passed explicitly meant None: a loader
#: as below with ``collate_fn=default_collate``, after 2 batches ([1, 2, 16, 11] and
#: [20, 4, 7, 3]).
EXPLICIT_DEFAULT = GOLDEN / "explicit_default_collate.state"


@pytest.mark.parametrize("collate_fn", [None, default_collate])
def test_a_state_saved_with_torchs_default_passed_explicitly_still_restores(
    collate_fn: Any,
) -> None:
    state = decode_state(EXPLICIT_DEFAULT.read_bytes())
    options: dict[str, Any] = {"batch_size": 4, "shuffle": True, "seed": 3}
    with SavableDataLoader(Numbers(), collate_fn=collate_fn, **options) as loader:
        loader.restore_state_rank(state)
        rest = _plain(loader)
    assert rest == [[19, 21, 12, 14], [15, 0, 13, 9], [5, 17, 6, 10], [8, 18]]


def test_a_collate_fn_that_is_not_callable_is_refused() -> None:
    with SavableDataLoader(Numbers(), batch_size=4) as loader:
        with pytest.raises(ConfigError, match="collate_fn must be callable, got 3"):
            loader.collate_fn = 3
        assert loader.collate_fn is default_collate
        assert _plain(loader)[0] == [0, 1, 2, 3]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_unsavable_dataset_takes_a_new_collate_fn_only_before_it_streams(
    num_workers: int,
) -> None:
    """Its workers could not restart where they were: a clear error, and the stream goes
    on with the old function."""
    with SavableDataLoader(Stream(), batch_size=4, num_workers=num_workers) as loader:
        loader.collate_fn = tagged
        iterator = iter(loader)
        first = next(iterator)
        with pytest.raises(ConfigError, match="only when the dataset can save its position"):
            loader.collate_fn = default_collate
        assert loader.collate_fn is tagged
        rest = list(iterator)
    assert first[0] == "tagged"
    assert all(batch[0] == "tagged" for batch in rest)
    assert sum(len(batch[1]) for batch in [first, *rest]) == 12 * max(num_workers, 1)


class Offset(Dataset[int]):
    """Items shifted by ``offset``, which a ``worker_init_fn`` may set in each worker."""

    offset = 0

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return index + self.offset


def shift_by_worker(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    info.dataset.offset = 100 * (worker_id + 1)


def refuse_worker_one(worker_id: int) -> None:
    if worker_id == 1:
        raise KeyError("worker one")


def test_worker_init_fn_reads_as_torchs() -> None:
    for init in (None, shift_by_worker):
        torchs = DataLoader(Offset(), worker_init_fn=init)
        with SavableDataLoader(Offset(), worker_init_fn=init) as ours:
            assert ours.worker_init_fn is torchs.worker_init_fn


def test_a_worker_init_fn_set_later_runs_in_the_next_workers_as_with_torch() -> None:
    """Inside the loader's own start-up: ``get_worker_info().dataset`` is the worker's copy
    of the user's dataset, as when it is passed to the constructor."""
    options: dict[str, Any] = {"batch_size": 2, "num_workers": 2}
    torchs = DataLoader(Offset(), **options)
    with SavableDataLoader(Offset(), **options) as ours:
        epochs: list[list[Any]] = [[], []]
        for loader, out in ((torchs, epochs[0]), (ours, epochs[1])):
            out.append(_plain(loader))
            loader.worker_init_fn = shift_by_worker
            out.append(_plain(loader))
        assert ours.worker_init_fn is shift_by_worker
    assert epochs[1] == epochs[0]
    assert epochs[1][1][:2] == [[100, 101], [202, 203]]


def test_an_error_of_a_worker_init_fn_set_later_arrives_as_torchs() -> None:
    with SavableDataLoader(Offset(), batch_size=2, num_workers=2) as loader:
        loader.worker_init_fn = refuse_worker_one
        with pytest.raises(KeyError) as raised:
            list(loader)
    assert str(raised.value).startswith("Caught KeyError in DataLoader worker process 1.")
