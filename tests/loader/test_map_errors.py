"""An error of a map-style read goes on as torch's DataLoader goes on
(NOTE [ Going on after an error ] in ``_worker/runtime.py``): the exception keeps its type, the
batch is dropped,
the next ``next()`` reads the next batch, and a save anywhere, just after an error
included, resumes exactly."""

from __future__ import annotations

import gc
import math
import pickle
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    get_worker_info,
)

from savable_loader import DatasetError, SavableDataLoader, SavableDataset, WorkerConfig


class _Broken(Dataset):
    """Torch's ``Dataset`` without ``__getitem__``: every read raises NotImplementedError."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


class _FailsOn(Dataset):
    """Raises ``KeyError`` for the indices in ``bad``; every read draws from torch's
    global generator first, so a replay that skipped or repeated a read would draw
    other numbers."""

    def __init__(self, size: int, bad: set[int]) -> None:
        self.size, self.bad = size, bad

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        noise = float(torch.rand(()))
        if index in self.bad:
            raise KeyError(f"no item {index}")
        return {"i": index, "noise": noise}


class _FailsOnAtOnce(_FailsOn):
    """Reads a whole batch in one ``__getitems__`` call (NOTE [ A batch read at once ])."""

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        return [self[i] for i in indices]


def _collate_refusing_odd_sums(batch: list[dict[str, Any]]) -> list[Any]:
    if sum(item["i"] for item in batch) % 2:
        raise ValueError("odd sum")
    return [(item["i"], item["noise"]) for item in batch]


def _errors_per_epoch(loader: Any) -> int:
    iterator, errors = iter(loader), 0
    while True:
        try:
            next(iterator)
        except NotImplementedError:
            errors += 1
        except StopIteration:
            return errors


@pytest.mark.parametrize(
    "options",
    [
        {"batch_size": 2, "shuffle": True},
        {"batch_size": 3, "shuffle": True, "num_workers": 2},
        {"batch_size": 2, "num_workers": 2, "persistent_workers": True},
        {"batch_size": None},
        {"batch_sampler": BatchSampler(RandomSampler(range(11)), 4, drop_last=False)},
    ],
    ids=["shuffle", "workers", "persistent", "unbatched", "batch_sampler"],
)
def test_a_loop_that_catches_the_error_meets_it_once_a_batch_as_with_torch(options, monkeypatch):
    with monkeypatch.context() as patch:
        # Torch's persistent workers, after the errors, take two of its status intervals
        # (5 s each) to stop; the interval only paces torch's waits.
        patch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 0.25)
        torch_loader = DataLoader(_Broken(11), **options)
        torch_errors = _errors_per_epoch(torch_loader)
        del torch_loader  # its persistent workers stop with it (torch 2.4 needs the collection)
        gc.collect()
    with SavableDataLoader(_Broken(11), **options) as loader:
        errors = _errors_per_epoch(loader)
        assert errors == torch_errors == len(loader)
        assert _errors_per_epoch(loader) == errors  # the next epoch too
    assert errors == math.ceil(11 / (options.get("batch_size") or 1)) or "batch_sampler" in options


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_error_keeps_its_type_and_says_where_it_came_from(num_workers):
    with SavableDataLoader(_FailsOn(6, {3}), batch_size=2, num_workers=num_workers) as loader:
        iterator = iter(loader)
        assert next(iterator)["i"].tolist() == [0, 1]
        with pytest.raises(KeyError) as caught:
            next(iterator)
        assert next(iterator)["i"].tolist() == [4, 5]
    error = caught.value
    assert isinstance(error, DatasetError)
    assert type(error).__name__ == "KeyError"
    assert error.worker_id == (1 if num_workers else 0)
    assert "no item 3" in str(error)
    assert "The batch is dropped and the loader goes on with the next one" in str(error)
    assert isinstance(error.__cause__, KeyError)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)


def test_a_collate_error_drops_only_its_batch():
    options = {"batch_size": 2, "collate_fn": _collate_refusing_odd_sums}
    with SavableDataLoader(_FailsOn(8, set()), **options) as loader:
        outcomes = _outcomes(iter(loader), 10)
    # Batches [0, 1], [2, 3], [4, 5], [6, 7] sum to 1, 5, 9, 13: all odd.
    assert outcomes == ["ValueError"] * 4 + ["end"]


def _outcomes(iterator: Any, steps: int) -> list[Any]:
    """What ``steps`` calls of ``next()`` give: a batch's values, an error's type name,
    or "end" (after which nothing more is read)."""
    outcomes: list[Any] = []
    for _ in range(steps):
        try:
            batch = next(iterator)
        except StopIteration:
            outcomes.append("end")
            break
        except DatasetError as error:
            outcomes.append(type(error).__name__)
        else:
            outcomes.append(
                batch if isinstance(batch, list) else {k: v.tolist() for k, v in batch.items()}
            )
    return outcomes


#: Sparse checkpoints: a restore replays many batches, across errors when it could.
SPARSE = WorkerConfig(checkpoint_share=0.01)
SHUFFLED = {"batch_size": 3, "shuffle": True}
BUILDS = {
    "indexed": lambda: (_FailsOn(23, {2, 9, 10, 17}), SHUFFLED),
    "getitems": lambda: (_FailsOnAtOnce(23, {2, 9, 17}), SHUFFLED),
    "sampler": lambda: (
        _FailsOn(23, {2, 9, 17}),
        {
            "batch_size": 3,
            "sampler": RandomSampler(range(23), generator=torch.Generator().manual_seed(5)),
        },
    ),
    "collate": lambda: (
        _FailsOn(23, {9}),
        {"batch_size": 2, "collate_fn": _collate_refusing_odd_sums},
    ),
}


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_save_anywhere_resumes_exactly_errors_included(build, num_workers):
    """Two epochs uninterrupted, then a save after every step (just after an error
    included) restored into a new loader: the rest, errors and all, is the same."""

    def loader() -> SavableDataLoader[Any]:
        dataset, options = BUILDS[build]()
        return SavableDataLoader(dataset, num_workers=num_workers, worker_config=SPARSE, **options)

    with loader() as reference:
        steps = len(reference) + 1
        want = _outcomes(iter(reference), steps) + _outcomes(iter(reference), steps)
    assert "KeyError" in want or "ValueError" in want
    assert len(want) == 2 * steps
    assert want[steps - 1] == "end"
    # Every step of the first epoch, and after its end (a new iter(), before its first
    # step). A cut past the first epoch read the same: _outcomes stops at "end", so the
    # save came right after the new iter() for every one of them.
    for cut in range(1, steps + 1):
        with loader() as first:
            iterator = iter(first)
            got = _outcomes(iterator, cut)
            if got[-1] == "end":
                iterator = iter(first)
            state = first.save_state_rank()
        with loader() as second:
            second.restore_state_rank(state)
            rest = _outcomes(iter(second), len(want))
            if len(got) + len(rest) < len(want):
                rest += _outcomes(iter(second), len(want))
        assert got + rest[: len(want) - len(got)] == want, f"saved after step {cut}"


class _Counter(SavableDataset):
    """An iterable: its errors keep the rule of NOTE [ Pipeline errors ]."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self):
        while self.pos < 4:
            if self.pos == 2:
                raise OSError("flaky")
            self.pos += 1
            yield self.pos - 1

    def save_state(self) -> int:
        return self.pos

    def restore_state(self, state: int | None) -> None:
        self.pos = state or 0


def test_an_iterable_pipeline_still_retries_the_item_with_our_error():
    with SavableDataLoader(_Counter(), batch_size=None) as loader:
        iterator = iter(loader)
        assert [next(iterator), next(iterator)] == [0, 1]
        for _ in range(2):
            with pytest.raises(DatasetError, match=r"next\(\) retries it") as caught:
                next(iterator)
            assert not isinstance(caught.value, OSError)


class _Generated(IterableDataset):
    """A plain iterable (no position): each worker's generator raises at its fourth item."""

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        for i in range(6):
            if i == 3:
                raise ValueError(f"bad item in worker {worker}")
            yield worker * 100 + i


class _RaisesInIter(IterableDataset):
    def __iter__(self):
        raise RuntimeError("Error in __iter__")


def _iterable_outcomes(loader: Any) -> list[Any]:
    iterator, outcomes = iter(loader), []
    while True:
        try:
            outcomes.append(next(iterator).tolist())
        except StopIteration:
            return outcomes
        except (ValueError, RuntimeError) as error:
            outcomes.append(type(error).__name__)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_plain_iterables_error_ends_that_workers_epoch_as_with_torch(num_workers):
    """Its generator is finished once it raised: torch's worker then ends its iteration,
    and so does the loader's, after handing on the error with its own type."""
    options = {"batch_size": 2, "num_workers": num_workers}
    want = _iterable_outcomes(DataLoader(_Generated(), **options))
    with SavableDataLoader(_Generated(), **options) as loader:
        assert _iterable_outcomes(loader) == want
        assert _iterable_outcomes(loader) == want  # and the next epoch begins anew
    assert want.count("ValueError") == max(num_workers, 1)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iter_that_raises_is_met_once_per_worker_then_the_epoch_ends(num_workers):
    with SavableDataLoader(_RaisesInIter(), batch_size=2, num_workers=num_workers) as loader:
        assert _iterable_outcomes(loader) == ["RuntimeError"] * max(num_workers, 1)
        with pytest.raises(RuntimeError, match="Error in __iter__"):
            list(loader)
