"""An exception raised by the user's pipeline (reliability issue).

It reaches the main process as :class:`DatasetError` naming the worker and the item,
chained from the original; the stream is stopped (no worker left running); and the loader
can go on: retrying the failing item, saving, or restoring an earlier state into itself
or into a new loader, each time yielding exactly what an uninterrupted run yields.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
from pipelines import RandomCounter
from processes import kill

from savable_loader import (
    DatasetError,
    SavableDataLoader,
    SavableLoaderError,
    StorageError,
    WorkerError,
)
from savable_loader.testing import digest


class Flaky(RandomCounter):
    """A RandomCounter that raises on item ``fail_at`` while the file ``trigger`` exists.

    The file lives outside the dataset, so worker processes see it, and a test can make
    the failure go away (a transient error, such as a network read) by deleting it.
    """

    def __init__(self, n: int, *, fail_at: int, trigger: Path, at_start: bool = False) -> None:
        super().__init__(n)
        self.fail_at = fail_at
        self.trigger = str(trigger)
        self.at_start = at_start

    def restore_state(self, state: Any) -> None:
        if self.at_start and os.path.exists(self.trigger):
            raise ValueError("cannot open the shard")
        super().restore_state(state)

    def __iter__(self) -> Any:
        for item in super().__iter__():
            if item["index"] == self.fail_at and os.path.exists(self.trigger):
                raise ValueError(f"boom at index {item['index']}")
            yield item


class StorageFailure(RandomCounter):
    def __iter__(self) -> Any:
        for item in super().__iter__():
            if item["index"] == 3:
                raise StorageError("Cannot read s3://bucket/shard-3: connection reset")
            yield item


class Unpicklable(Exception):
    """An exception type torch could not send back: defined in a function, holding a lock."""


def _drain(iterator: Any) -> None:
    for _ in range(100):
        next(iterator)


def _reference(n: int, num_workers: int, epochs: int = 2) -> list[str]:
    with SavableDataLoader(RandomCounter(n), batch_size=2, num_workers=num_workers) as loader:
        return [digest(item) for _ in range(epochs) for item in loader]


def _flaky(tmp_path: Path, num_workers: int, **kwargs: Any) -> tuple[SavableDataLoader, Path]:
    trigger = tmp_path / "fail"
    trigger.touch()
    dataset = Flaky(20, fail_at=kwargs.pop("fail_at", 13), trigger=trigger, **kwargs)
    return SavableDataLoader(dataset, batch_size=2, num_workers=num_workers), trigger


def _read_until_error(items: Any, got: list[str]) -> DatasetError:
    """Reads ``items`` (a loader: a new iterator; or an iterator, which the error leaves
    where it stood) until the DatasetError."""

    def read() -> None:
        got.extend(digest(item) for item in items)

    with pytest.raises(DatasetError) as info:
        read()
    return info.value


@pytest.mark.parametrize("num_workers", [0, 2])
def test_error_names_worker_and_item_and_chains_the_original(tmp_path, num_workers):
    loader, _ = _flaky(tmp_path, num_workers)
    got: list[str] = []
    with loader:
        error = _read_until_error(loader, got)
        # The stream is stopped before the error reaches the user: no worker is left.
        assert multiprocessing.active_children() == []
    # Index 13 is in batch 6 ([12, 13]) of the only worker; with 2 workers sharding by
    # parity, in worker 1's batch 3 ([1, 3], [5, 7], [9, 11], [13, 15]).
    expected_worker, expected_item = (0, 6) if num_workers == 0 else (1, 3)
    assert (error.worker_id, error.index) == (expected_worker, expected_item)
    where = "the main process" if num_workers == 0 else "worker 1"
    assert f"ValueError: boom at index 13 (raised in {where} while producing item " in str(error)
    assert f"item {expected_item}, epoch 0)" in str(error)
    assert "next() retries it" in str(error)
    cause = error.__cause__
    assert isinstance(cause, ValueError)
    assert str(cause) == "boom at index 13"
    if num_workers == 0:
        assert cause.__traceback__ is not None  # the original object, its frames intact
        assert "Traceback in" not in str(error)
    else:
        # As torch does: the worker's traceback travels in the message.
        assert "Traceback in worker 1:\nTraceback (most recent call last):" in str(error)
        assert 'raise ValueError(f"boom at index {item' in str(error)
        assert "test_dataset_errors.py" in str(error)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterating_again_retries_the_item_and_continues_exactly(tmp_path, num_workers):
    expected = _reference(20, num_workers)
    loader, trigger = _flaky(tmp_path, num_workers)
    got: list[str] = []
    with loader:
        iterator = iter(loader)
        _read_until_error(iterator, got)
        # The failure persists: the same item fails again, nothing is skipped or repeated.
        error = _read_until_error(iterator, got)
        assert "boom at index 13" in str(error)
        trigger.unlink()  # the transient cause went away
        got += [digest(item) for item in iterator]  # the rest of the epoch
        got += [digest(item) for item in loader]  # a new iter(): the next epoch
    assert got == expected


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_saved_after_the_error_resumes_exactly(tmp_path, num_workers):
    expected = _reference(20, num_workers)
    loader, trigger = _flaky(tmp_path, num_workers)
    got: list[str] = []
    with loader:
        _read_until_error(loader, got)
        state = loader.save_state_rank()
    trigger.unlink()
    with SavableDataLoader(RandomCounter(20), batch_size=2, num_workers=num_workers) as fresh:
        fresh.restore_state_rank(state)
        got += [digest(item) for _ in range(2) for item in fresh]
    assert got == expected


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("into", ["new loader", "same loader"])
def test_state_saved_before_the_error_restores(tmp_path, num_workers, into):
    expected = _reference(20, num_workers)
    loader, trigger = _flaky(tmp_path, num_workers)
    with loader:
        iterator = iter(loader)
        before = [digest(next(iterator)) for _ in range(3)]
        state = loader.save_state_rank()
        _read_until_error(loader, [])
        trigger.unlink()
        if into == "same loader":
            loader.restore_state_rank(state)
            rest = [digest(item) for _ in range(2) for item in loader]
        else:
            with SavableDataLoader(
                RandomCounter(20), batch_size=2, num_workers=num_workers
            ) as fresh:
                fresh.restore_state_rank(state)
                rest = [digest(item) for _ in range(2) for item in fresh]
    assert before + rest == expected


@pytest.mark.parametrize("num_workers", [0, 2])
def test_error_in_a_later_epoch_and_after_a_restore(tmp_path, num_workers):
    expected = _reference(20, num_workers, epochs=3)
    trigger = tmp_path / "fail"
    dataset = Flaky(20, fail_at=5, trigger=trigger)
    with SavableDataLoader(dataset, batch_size=2, num_workers=num_workers) as loader:
        got = [digest(item) for item in loader]
        iterator = iter(loader)
        got += [digest(next(iterator)) for _ in range(2)]
        state = loader.save_state_rank()
        loader.restore_state_rank(state)  # restarts with placeholders (worker order)
        trigger.touch()
        iterator = iter(loader)  # the first iter() after a restore continues the epoch
        _read_until_error(iterator, got)
        trigger.unlink()
        got += [digest(item) for item in iterator]
        got += [digest(item) for item in loader]
    assert got == expected


@pytest.mark.parametrize("num_workers", [0, 2])
def test_error_while_a_worker_starts(tmp_path, num_workers):
    expected = _reference(20, num_workers)
    loader, trigger = _flaky(tmp_path, num_workers, at_start=True)
    trigger.unlink()
    with loader:
        iterator = iter(loader)
        got = [digest(next(iterator)) for _ in range(3)]
        # Workers start fresh without restoring (NOTE [ Fresh workers ]); from a
        # checkpoint they restore it, and that raises.
        loader.restore_state_rank(loader.save_state_rank())
        trigger.touch()
        iterator = iter(loader)
        with pytest.raises(DatasetError, match=r"while starting \(restoring its checkpoint"):
            next(iterator)
        assert multiprocessing.active_children() == []
        trigger.unlink()
        got += [digest(item) for item in iterator] + [digest(item) for item in loader]
    assert got == expected


def test_error_in_collate_fn_is_a_dataset_error():
    def collate(batch: list[Any]) -> Any:
        if batch[0]["index"] >= 4:
            raise TypeError("cannot collate")
        return [item["index"] for item in batch]

    loader = SavableDataLoader(RandomCounter(8), batch_size=2, num_workers=2, collate_fn=collate)
    with loader, pytest.raises(DatasetError, match="TypeError: cannot collate") as info:
        list(loader)
    assert isinstance(info.value.__cause__, TypeError)


def test_library_errors_keep_their_type():
    loader = SavableDataLoader(StorageFailure(10), batch_size=1, num_workers=2)
    with (
        loader,
        pytest.raises(StorageError, match=r"connection reset \(raised in worker 1") as info,
    ):
        list(loader)
    assert isinstance(info.value.__cause__, StorageError)


def test_an_exception_type_that_does_not_travel(tmp_path):
    class Local(Exception):
        pass

    class Odd(RandomCounter):
        def __iter__(self) -> Any:
            yield from ()
            raise Local(object())

    # A dataset defined in a function travels to fork workers only.
    context = multiprocessing.get_context("fork")
    loader = SavableDataLoader(Odd(4), num_workers=2, multiprocessing_context=context)
    with loader, pytest.raises(DatasetError, match="Local: <object object at") as info:
        next(iter(loader))
    # The type cannot be found in the main process: a RuntimeError names it instead.
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "Local" in str(info.value.__cause__)


def test_a_dead_worker_leaves_the_loader_broken_until_a_restore(tmp_path):
    expected = _reference(20, 2)
    with SavableDataLoader(RandomCounter(20), batch_size=2, num_workers=2) as loader:
        iterator = iter(loader)
        got = [digest(next(iterator)) for _ in range(3)]
        state = loader.save_state_rank()
        kill(loader.worker_stats()[0]["pid"])
        with pytest.raises(WorkerError):
            _drain(iterator)
        assert multiprocessing.active_children() == []
        for attempt in (lambda: next(iter(loader)), loader.save_state_rank):
            with pytest.raises(SavableLoaderError, match=r"cannot continue.*restore_state_rank"):
                attempt()
        loader.restore_state_rank(state)
        got += [digest(item) for _ in range(2) for item in loader]
    assert got == expected
