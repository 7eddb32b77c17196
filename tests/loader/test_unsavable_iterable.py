"""Plain ``IterableDataset``s without a savable position (issue 13): they iterate as with
torch's ``DataLoader``; saving raises a clear error; ``restore_state_rank(None)`` works."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from savable_loader import ConfigError, DatasetError, SavableDataLoader, UnsavableDatasetError
from savable_loader.datasets import Map


class Numbers(IterableDataset):
    """The first example of torch's ``IterableDataset`` documentation: each worker reads
    its share of ``[start, end)`` (``fail_at``: raise there)."""

    def __init__(self, start: int, end: int, fail_at: int | None = None) -> None:
        self.start, self.end, self.fail_at = start, end, fail_at

    def __iter__(self):
        info = get_worker_info()
        start, end = self.start, self.end
        if info is not None:
            per_worker = math.ceil((end - start) / float(info.num_workers))
            start = start + info.id * per_worker
            end = min(start + per_worker, end)
        for value in range(start, end):
            if value == self.fail_at:
                raise ValueError(f"bad item {value}")
            yield value


class Plain(IterableDataset):
    """The second example: ``worker_init_fn`` sets ``start``/``end`` of the worker's copy."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self):
        return iter(range(self.start, self.end))


def shard(worker_id: int) -> None:
    info = get_worker_info()
    dataset = info.dataset
    overall_start, overall_end = dataset.start, dataset.end
    per_worker = math.ceil((overall_end - overall_start) / float(info.num_workers))
    dataset.start = overall_start + worker_id * per_worker
    dataset.end = min(dataset.start + per_worker, overall_end)


def _lists(batches):
    return [b.tolist() if isinstance(b, torch.Tensor) else b for b in batches]


def _two_epochs(loader):
    return [_lists(loader), _lists(loader)]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(batch_size=3),
        dict(batch_size=None),
        pytest.param(dict(batch_size=2, num_workers=2), marks=pytest.mark.slow),
        pytest.param(dict(batch_size=2, num_workers=3, drop_last=True), marks=pytest.mark.slow),
    ],
)
def test_iterates_as_torch_does(kwargs):
    expected = _two_epochs(DataLoader(Numbers(3, 20), **kwargs))
    with SavableDataLoader(Numbers(3, 20), **kwargs) as loader:
        assert _two_epochs(loader) == expected


@pytest.mark.slow
def test_worker_init_fn_shards_the_workers_copies_as_torch_does():
    kwargs = dict(batch_size=2, num_workers=2, worker_init_fn=shard)
    expected = _two_epochs(DataLoader(Plain(3, 10), **kwargs))
    with SavableDataLoader(Plain(3, 10), **kwargs) as loader:
        assert _two_epochs(loader) == expected
    assert expected[0] == [[3, 4], [7, 8], [5, 6], [9]]


def _assert_names_the_fix(error: BaseException, name: str) -> None:
    message = str(error)
    assert isinstance(error, ConfigError)
    assert name in message
    assert "savable_loader.SavableDataset" in message
    assert "save_state()/restore_state()" in message
    assert "state_dict()/load_state_dict()" in message


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_saving_raises_naming_the_dataset_and_the_fix(num_workers):
    with SavableDataLoader(Numbers(0, 10), batch_size=2, num_workers=num_workers) as loader:
        saves = (loader.save_state_rank, loader.save_state_global, loader.state_dict)
        for save in saves:
            with pytest.raises(UnsavableDatasetError) as raised:
                save()
            _assert_names_the_fix(raised.value, "Numbers")
        iterator = iter(loader)
        first = next(iterator).tolist()
        for save in saves:
            with pytest.raises(UnsavableDatasetError):
                save()
        torch_loader = DataLoader(Numbers(0, 10), batch_size=2, num_workers=num_workers)
        assert [first, *_lists(iterator)] == _lists(torch_loader)


def test_a_transform_over_it_iterates_and_refuses_to_save():
    with SavableDataLoader(Map(Numbers(0, 4), lambda x: x * 10), batch_size=None) as loader:
        assert _lists(loader) == [0, 10, 20, 30]
        with pytest.raises(UnsavableDatasetError, match="Numbers"):
            loader.save_state_rank()


def test_restore_none_starts_over_and_a_saved_state_is_refused():
    with SavableDataLoader(list(range(10)), batch_size=2) as savable:
        state = savable.save_state_rank()
        state_dict = savable.state_dict()
    with SavableDataLoader(Numbers(0, 10), batch_size=2) as loader:
        iterator = iter(loader)
        next(iterator)
        loader.restore_state_rank(None)
        assert _lists(loader) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
        with pytest.raises(UnsavableDatasetError, match="Numbers"):
            loader.restore_state_rank(state)
        with pytest.raises(UnsavableDatasetError):
            loader.load_state_dict(state_dict)


def _epoch_with_errors(loader: Any) -> list[Any]:
    """One epoch's items, an error's type name in its place where one was raised."""
    iterator, outcomes = iter(loader), []
    while True:
        try:
            outcomes.append(int(next(iterator)))
        except StopIteration:
            return outcomes
        except ValueError as error:
            outcomes.append(type(error).__name__)


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_after_an_error_it_goes_on_as_torchs_loader_does(num_workers):
    """The generator that raised is finished, so that worker's epoch ends after the error,
    of its own type, as in torch (NOTE [ Going on after an error ] in _runtime.py);
    the next epoch reads the dataset anew."""
    want = _epoch_with_errors(
        DataLoader(Numbers(0, 10, fail_at=5), batch_size=None, num_workers=num_workers)
    )
    assert "ValueError" in want
    loader = SavableDataLoader(Numbers(0, 10, fail_at=5), batch_size=None, num_workers=num_workers)
    with loader:
        assert _epoch_with_errors(loader) == want
        assert _epoch_with_errors(loader) == want
        with pytest.raises(DatasetError, match="bad item 5"):
            list(loader)
        loader.restore_state_rank(None)
        assert _epoch_with_errors(loader) == want
