"""An IterableDataset without a state whose iterator has one (NOTE [ A position kept by
the iterator ]): the loader saves the iterator's state, as torchdata's
``StatefulDataLoader`` does, and asks which kind a dataset is without changing it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from savable_loader import SavableDataLoader, WorkerConfig
from savable_loader.datasets import StatefulDataset
from savable_loader.errors import ConfigError, SavableLoaderError, StateError, UnsavableDatasetError
from savable_loader.state import RankState
from savable_loader.testing import assert_resumes_exactly


class _Share:
    """An iterator over ``items``, shuffled with torch's global generator when asked;
    its state holds its position and torch's generator, as torchdata's examples save."""

    def __init__(self, items: list[int], shuffle: bool) -> None:
        self.items, self.shuffle, self.pos = items, shuffle, 0

    def __iter__(self) -> _Share:
        return self

    def __next__(self) -> dict[str, Any]:
        if self.pos >= len(self.items):
            raise StopIteration
        pick = int(torch.randint(len(self.items), ())) if self.shuffle else self.pos
        self.pos += 1
        return {"i": self.items[pick], "noise": float(torch.rand(()))}

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = state["pos"]
        torch.set_rng_state(state["rng"])


class _Sized(IterableDataset):
    """No state of its own. Each worker reads its own share of sizes; without workers
    ``__iter__`` rebinds ``self.sizes`` to one share of everything, as torchdata's test
    dataset does, so a dataset changed by a call made in the main process would give
    worker 1 no share at all."""

    def __init__(self, sizes: list[int], shuffle: bool = False) -> None:
        self.sizes, self.shuffle = sizes, shuffle

    def __iter__(self) -> _Share:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        if info is None:
            self.sizes = [sum(self.sizes)]
        start = sum(self.sizes[:worker])
        return _Share(list(range(start, start + self.sizes[worker])), self.shuffle)


def _loader(dataset: Any, num_workers: int, **options: Any) -> SavableDataLoader[Any]:
    return SavableDataLoader(dataset, batch_size=3, num_workers=num_workers, **options)


def test_it_is_adapted_and_asking_leaves_it_as_it_was():
    dataset = _Sized([5, 8])
    with _loader(dataset, 2) as loader:
        assert isinstance(loader.source, StatefulDataset)
        assert dataset.sizes == [5, 8]
        items = sorted(i for batch in loader for i in batch["i"].tolist())
    assert items == list(range(13))
    torch_items = sorted(i for b in DataLoader(_Sized([5, 8]), batch_size=3, num_workers=2)
                         for i in b["i"].tolist())  # fmt: skip
    assert items == torch_items


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_it_resumes_exactly(num_workers, shuffle):
    """With 0 workers the iterator's state is loaded as the epoch's first item is read,
    after the loader put the pipeline's generators back: its ``torch.get_rng_state()``
    must be the pipeline's too (NOTE [ No workers ] in ``_worker/runtime.py``)."""
    report = assert_resumes_exactly(
        lambda: _loader(
            _Sized([7, 4], shuffle),
            num_workers,
            worker_config=WorkerConfig(checkpoint_share=1.0),
        ),
        num_points=4,
        chain_items=(1,),
        inline_chains=True,
    )
    batches = 4 if num_workers == 0 else 3 + 2  # 11 items; per worker 7 and 4, by 3
    assert report.items_per_epoch == [batches, batches]


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata's
@pytest.mark.parametrize("num_workers", [0, 2])
def test_it_resumes_the_items_torchdatas_stateful_loader_resumes(num_workers):
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
    runs = []
    for loader_class in (stateful_dataloader.StatefulDataLoader, SavableDataLoader):
        first = loader_class(_Sized([6, 5]), batch_size=2, num_workers=num_workers)
        iterator = iter(first)
        head = [next(iterator)["i"].tolist() for _ in range(2)]
        state = first.state_dict()
        rest = [batch["i"].tolist() for batch in iterator]
        second = loader_class(_Sized([6, 5]), batch_size=2, num_workers=num_workers)
        second.load_state_dict(state)
        assert [batch["i"].tolist() for batch in second] == rest, loader_class.__name__
        runs.append(head + rest)
        if isinstance(first, SavableDataLoader):
            first.close()
            second.close()
    assert runs[0] == runs[1]


class _Generated(IterableDataset):
    def __iter__(self):
        yield from range(4)


class _RaisesInMain(IterableDataset):
    def __iter__(self) -> _Share:
        if get_worker_info() is None:
            raise RuntimeError("only in workers")
        return _Share([1, 2], shuffle=False)


class _PlainInWorkers(IterableDataset):
    """Returns an iterator with a state where the loader asks, a plain one in workers."""

    def __iter__(self) -> Any:
        if get_worker_info() is None:
            return _Share([1, 2], shuffle=False)
        return iter([1, 2])


@pytest.mark.parametrize("dataset", [_Generated(), _RaisesInMain()], ids=["generator", "raises"])
def test_without_an_iterators_state_it_stays_unsavable(dataset):
    with _loader(dataset, 0) as loader:
        assert not isinstance(loader.source, StatefulDataset)
        with pytest.raises(UnsavableDatasetError, match="the iterator its __iter__ returns"):
            loader.save_state_rank()


def test_an_iterator_without_a_state_in_a_worker_is_a_clear_error():
    with _loader(_PlainInWorkers(), 1) as loader:
        assert isinstance(loader.source, StatefulDataset)
        with pytest.raises(SavableLoaderError, match="has no state_dict"):
            next(iter(loader))


def test_from_stateful_refuses_an_object_without_either_state():
    with pytest.raises(ConfigError, match="nor is what its __iter__ returns"):
        StatefulDataset(_Generated())


def test_a_state_holding_an_objects_state_is_refused_for_one_without():
    with _loader(_Sized([3]), 0) as loader:
        next(iter(loader))
        state = loader.save_state_rank().to_plain()
    stage = state["workers"][0]["checkpoint"]["state"]
    while "parent" in stage:
        stage = stage["parent"]
    assert stage["obj"] is None
    assert stage["iterator"]["pos"] == 3
    stage["obj"] = {"pos": 0}
    with _loader(_Sized([3]), 0) as loader:
        loader.restore_state_rank(RankState.from_plain(state))
        with pytest.raises(StateError, match="saves no state"):
            next(iter(loader))  # the pipeline restores as the stream starts
