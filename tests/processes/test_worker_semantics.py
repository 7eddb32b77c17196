"""Torch's worker semantics inside the loader (issue 13): ``get_worker_info().dataset``,
errors of ``worker_init_fn``, each compared with torch's own ``DataLoader``."""

from __future__ import annotations

import gc
import math
import time

import pytest
from torch.utils.data import DataLoader, Dataset, get_worker_info

from savable_loader import SavableDataLoader, SavableDataset, WorkerConfig

pytestmark = pytest.mark.slow

CONTEXTS = ["fork", "spawn"]


class Range(SavableDataset):
    """``range(start, end)``, savable; yields whether the worker's info shows this object."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.read = 0

    def __iter__(self):
        info = get_worker_info()
        while self.start + self.read < self.end:
            self.read += 1
            yield (self.start + self.read - 1, info is None or info.dataset is self)
        self.read = 0

    def save_state(self):
        return self.read

    def restore_state(self, state):
        self.read = state or 0

    def config(self):
        return {"start": self.start, "end": self.end}


class Squares(Dataset):
    """A map-style dataset whose items say whether the worker's info shows this object."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int):
        info = get_worker_info()
        return (index * index, info is None or info.dataset is self)


def shard_in_init(worker_id: int) -> None:
    """The ``worker_init_fn`` of torch's ``IterableDataset`` documentation."""
    info = get_worker_info()
    dataset = info.dataset
    overall_start, overall_end = dataset.start, dataset.end
    per_worker = math.ceil((overall_end - overall_start) / float(info.num_workers))
    dataset.start = overall_start + info.id * per_worker
    dataset.end = min(dataset.start + per_worker, overall_end)


class InitFailed(Exception):
    pass


def fail_slowly(worker_id: int) -> None:
    time.sleep(1.5)  # longer than the watchdog's poll interval
    raise KeyError(f"no shard for worker {worker_id}")


def fail_slowly_custom(worker_id: int) -> None:
    time.sleep(1.5)
    raise InitFailed(f"worker {worker_id} cannot start")


def fail_worker_one(worker_id: int) -> None:
    if worker_id == 1:
        time.sleep(1.5)
        raise KeyError("worker one")


def _plain(batch):
    return [column.tolist() for column in batch]


def _torch_error(dataset, **kwargs):
    """The type and message torch's DataLoader raises, its workers stopped."""
    try:
        list(DataLoader(dataset, **kwargs))
    except Exception as error:
        return type(error), str(error)
    finally:
        gc.collect()  # the iterator, held by the traceback, stops its workers
    raise AssertionError("torch raised nothing")


def _torch_items(dataset, **kwargs):
    return [tuple(x) for x in DataLoader(dataset, batch_size=None, **kwargs)]


@pytest.mark.parametrize("context", CONTEXTS)
def test_worker_init_fn_shards_through_worker_info_dataset_as_with_torch(context):
    kwargs = dict(num_workers=2, worker_init_fn=shard_in_init, multiprocessing_context=context)
    with SavableDataLoader(Range(3, 10), batch_size=None, **kwargs) as loader:
        items = [tuple(x) for x in loader]
        assert [tuple(x) for x in loader] == items  # the next epoch reads the same shards
    assert items == [(3, True), (7, True), (4, True), (8, True), (5, True), (9, True), (6, True)]
    if context == "fork":
        assert items == _torch_items(Range(3, 10), **kwargs)


@pytest.mark.parametrize("context", CONTEXTS)
def test_worker_info_dataset_is_the_map_style_dataset_the_worker_reads(context):
    kwargs = dict(num_workers=2, multiprocessing_context=context)
    with SavableDataLoader(Squares(), batch_size=None, **kwargs) as loader:
        items = sorted(tuple(x) for x in loader)
    assert items == [(i * i, True) for i in range(6)]
    if context == "fork":
        assert items == sorted(_torch_items(Squares(), **kwargs))


def test_sharded_loader_resumes_exactly():
    def build():
        return SavableDataLoader(
            Range(0, 20), batch_size=2, num_workers=2, worker_init_fn=shard_in_init
        )

    with build() as loader:
        iterator = iter(loader)
        head = [_plain(next(iterator)) for _ in range(3)]
        state = loader.save_state_rank()
        tail = [_plain(b) for b in iterator]
    assert head == [[[0, 1], [1, 1]], [[10, 11], [1, 1]], [[2, 3], [1, 1]]]
    assert len(tail) == 7
    with build() as loader:
        loader.restore_state_rank(state)
        assert [_plain(b) for b in loader] == tail


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize(
    ("init", "kind"), [(fail_slowly, KeyError), (fail_slowly_custom, InitFailed)]
)
def test_worker_init_fn_error_arrives_promptly_with_its_type(context, init, kind):
    loader = SavableDataLoader(
        Range(0, 8),
        num_workers=2,
        worker_init_fn=init,
        multiprocessing_context=context,
        worker_config=WorkerConfig(command_timeout=60),
    )
    began = time.monotonic()
    with loader, pytest.raises(kind) as raised:
        list(loader)
    elapsed = time.monotonic() - began
    assert elapsed < 30, f"the error took {elapsed:.1f} s"
    message = str(raised.value)
    assert message.startswith(f"Caught {kind.__name__} in DataLoader worker process 0.")
    assert "Original Traceback" in message
    assert f"in {init.__name__}" in message
    if context == "fork" and kind is KeyError:
        # One worker: the same first line ("... worker process 0."), and torch stops one
        # failed worker (a 5 s join) instead of two. Once: the line's form is torch's for
        # every type, and the type's name is pinned above.
        torch_kind, torch_message = _torch_error(Range(0, 8), num_workers=1, worker_init_fn=init)
        assert torch_kind is kind
        assert torch_message.splitlines()[0] == message.splitlines()[0]


def test_after_a_worker_init_fn_error_the_loader_keeps_its_position():
    loader = SavableDataLoader(
        Range(0, 8), batch_size=None, num_workers=2, worker_init_fn=fail_worker_one
    )
    with loader:
        iterator = iter(loader)
        assert next(iterator) == [0, True]  # worker 0's first item
        with pytest.raises(KeyError, match="worker process 1"):
            next(iterator)
        state = loader.save_state_rank()
        assert [w.delivered for w in state.workers] == [1, 0]
        with pytest.raises(KeyError, match="worker process 1"):
            list(loader)  # the workers, and worker_init_fn, start anew
    assert state.workers[1].checkpoint is None
