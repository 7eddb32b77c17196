"""from_stateful over Hugging Face iterable datasets, torchdata nodes and plain objects."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from pipelines import StatefulCounter
from torch.utils.data import default_collate, get_worker_info
from torchdata.nodes import IterableWrapper, Loader, Mapper

from savable_loader import SavableDataLoader, WorkerConfig, WorkerContext
from savable_loader.datasets import from_stateful
from savable_loader.errors import ConfigError, StateError
from savable_loader.testing import ResumeMismatch, assert_resumes_exactly

slow = pytest.mark.slow
DENSE = WorkerConfig(checkpoint_share=1.0)


def _noise(example: dict[str, Any]) -> dict[str, Any]:
    """A map function that draws from the global numpy and torch generators."""
    return {"np": float(np.random.rand()), "torch": float(torch.rand(()))}


def _double(example: dict[str, Any]) -> dict[str, Any]:
    return {"b": 2 * example["a"]}


def _hf(*, noisy: bool = False, shuffle: bool = False) -> Any:
    """30 rows in 6 shards. With ``shuffle``, a map before a shuffle buffer: datasets 5
    runs it in the threads that read shards ahead, so a map that draws from the global
    generators goes after the shuffle (there it runs in the consuming thread)."""
    datasets = pytest.importorskip("datasets", reason="needs the hf extra (Hugging Face datasets)")
    ds = datasets.Dataset.from_dict({"a": list(range(30))}).to_iterable_dataset(num_shards=6)
    if shuffle:
        ds = ds.map(_double).shuffle(seed=7, buffer_size=6)
    return ds.map(_noise) if noisy else ds


class _Shard:
    """Counts 0..n-1, keeping the items of this worker (a node's source shards itself)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(worker, self.n, workers))


class _ReadAhead:
    """Reads one item ahead and draws its noise when reading it, as a prefetching reader
    does; its state (items read) loses the item read ahead, like a shuffle buffer's."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        ahead = None
        while self.pos < self.n:
            index = self.pos
            self.pos += 1
            if index % workers == worker:
                item = {"i": index, "noise": float(torch.rand(())), "np": np.random.rand()}
                if ahead is not None:
                    yield ahead
                ahead = item
        if ahead is not None:
            yield ahead
        self.pos = 0


class _Position:
    """An iterator that holds the position, with ``state_dict()`` of its own; each item
    draws noise from torch's global generator."""

    def __init__(self, n: int, step: int, start: int) -> None:
        self.n, self.step, self.pos = n, step, start

    def __iter__(self) -> _Position:
        return self

    def __next__(self) -> dict[str, Any]:
        if self.pos >= self.n:
            raise StopIteration
        self.pos += self.step
        return {"i": self.pos - self.step, "noise": float(torch.rand(()))}

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


class _OwnIterator(_Position, torch.utils.data.IterableDataset):
    """Its own iterator (NOTE [ Objects that are their own iterator ]): ``__iter__`` starts
    a pass, creating the position ``state_dict()`` reads, and returns the object."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> _OwnIterator:
        info = get_worker_info()
        self.pos, self.step = (info.id, info.num_workers) if info is not None else (0, 1)
        return self


class _PassesWithPosition(torch.utils.data.IterableDataset):
    """Its state counts the passes begun; the position is its iterator's (``_Position``)."""

    def __init__(self, n: int) -> None:
        self.n, self.passes = n, 0

    def __iter__(self) -> _Position:
        self.passes += 1
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        return _Position(self.n, step, start)

    def state_dict(self) -> dict[str, int]:
        return {"passes": self.passes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.passes = state["passes"]


def _node() -> Any:
    return Mapper(IterableWrapper(_Shard(25)), lambda i: {"i": i, "noise": torch.rand(2)})


def _check(make: Any, *, num_workers: int, dense: bool = True, **kwargs: Any) -> Any:
    """The resume harness; with workers, without the peek and the break after the last
    epoch: the adapter's state there is an epoch's start, as without workers, where
    every build is checked with them, and the loader's peek and break with workers are
    tests/resume/test_resume.py's."""
    config = DENSE if dense else WorkerConfig()
    kwargs.setdefault("interruptions", num_workers == 0)
    return assert_resumes_exactly(
        lambda: SavableDataLoader(
            make(), batch_size=2, num_workers=num_workers, worker_config=config
        ),
        inline_chains=True,
        **kwargs,
    )


BUILDS = {
    "hf": lambda: from_stateful(_hf()),
    "hf_map_rng": lambda: from_stateful(_hf(noisy=True)),
    "hf_map_rng_replay": lambda: from_stateful(_hf(noisy=True), resume="replay"),
    "hf_shuffle": lambda: from_stateful(_hf(shuffle=True)),
    "hf_shuffle_map_rng": lambda: from_stateful(_hf(shuffle=True, noisy=True)),
    "node": lambda: from_stateful(_node()),
    "node_given_as_is": _node,
    "hf_given_as_is": lambda: _hf(shuffle=True),
    "node_replay": lambda: from_stateful(_node(), resume="replay"),
    "plain": lambda: from_stateful(StatefulCounter(15)),
    "plain_replay": lambda: from_stateful(StatefulCounter(15), resume="replay"),
    "read_ahead_replay": lambda: from_stateful(_ReadAhead(17), resume="replay"),
    "own_iterator": lambda: _OwnIterator(13),
    "own_iterator_replay": lambda: from_stateful(_OwnIterator(13), resume="replay"),
    "stateful_iterator": lambda: _PassesWithPosition(13),
}


@pytest.mark.parametrize("name", list(BUILDS))
def test_resumes_exactly_without_workers(name):
    report = _check(BUILDS[name], num_workers=0, num_points=8)
    assert len(report.items_per_epoch) == 2
    assert all(count > 0 for count in report.items_per_epoch)


# Two workers: each reads its own shards of the Hugging Face dataset (3 of 6) or of the
# object (uneven for read_ahead_replay), as three did; round-robin over three workers and
# more is tests/resume/test_resume.py's. The plain Hugging Face dataset ("hf") is the path of
# "hf_shuffle_map_rng" (an exact state_dict in each worker) without its shuffle and draws.
@slow
@pytest.mark.parametrize(
    "name",
    ["hf_map_rng_replay", "hf_shuffle_map_rng", "node", "read_ahead_replay", "own_iterator"],
)
def test_resumes_exactly_with_workers(name):
    _check(BUILDS[name], num_workers=2, num_points=3, chain_items=(1,))


@slow
def test_resumes_exactly_with_default_checkpoints():
    """Sparse checkpoints: the loader replays on top of the adapter's own replay."""
    _check(BUILDS["hf_shuffle_map_rng"], num_workers=2, dense=False, num_points=3, chain_items=(1,))


def _noisy_collate(batch: list[Any]) -> Any:
    return default_collate(batch), torch.rand(1)


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=slow)])
def test_replay_keeps_draws_made_around_the_object(num_workers):
    """The collate function draws between items: a replay still makes the same draws."""
    assert_resumes_exactly(
        lambda: SavableDataLoader(
            from_stateful(_ReadAhead(17), resume="replay"),
            batch_size=2,
            num_workers=num_workers,
            collate_fn=_noisy_collate,
            worker_config=DENSE,
        ),
        num_points=4,
        chain_items=(1,),
        inline_chains=True,
        interruptions=num_workers == 0,  # as _check
    )


def test_epochs_differ_with_shuffle():
    loader = SavableDataLoader(from_stateful(_hf(shuffle=True)), batch_size=None)
    first, second = ([item["a"] for item in loader] for _ in range(2))
    assert sorted(first) == sorted(second) == list(range(30))
    assert first != second


def test_hugging_face_state_with_shuffle_buffer_is_not_exact():
    """HF's own state loses its shuffle buffer: the replay mode is needed."""
    with pytest.raises(ResumeMismatch):
        _check(lambda: from_stateful(_hf(shuffle=True), resume="state"), num_workers=0)


def test_inexact_state_of_a_plain_object_needs_replay():
    """Replay runs from the restore point's generators: the item read ahead draws again."""
    with pytest.raises(ResumeMismatch):
        _check(lambda: from_stateful(_ReadAhead(17)), num_workers=0)


CONTEXT = WorkerContext(rank=0, world_size=1, worker_id=0, num_workers=0, seed=0, batch_size=None)


def test_each_worker_sets_its_own_hugging_face_epoch():
    stage = from_stateful(_hf())
    original = stage.obj
    cursor = stage.cursor(
        WorkerContext(rank=0, world_size=1, worker_id=1, num_workers=3, seed=0, batch_size=2)
    )
    cursor.obj.set_epoch(4)
    assert cursor.obj is not original
    assert (cursor.obj.epoch, original.epoch) == (4, 0)


def test_auto_mode():
    assert from_stateful(_hf()).resume == "state"
    assert from_stateful(_hf(noisy=True)).resume == "state"
    assert from_stateful(_hf(shuffle=True)).resume == "replay"
    assert from_stateful(_hf(shuffle=True, noisy=True)).resume == "replay"
    assert from_stateful(_node()).resume == "state"
    assert from_stateful(StatefulCounter(3)).resume == "state"
    assert from_stateful(_hf(), resume="replay").config()["resume"] == "replay"


def test_config_errors():
    with pytest.raises(ConfigError, match="resume must be"):
        from_stateful(_hf(), resume="fast")
    with pytest.raises(ConfigError, match="state_dict"):
        from_stateful([1, 2, 3])


@pytest.mark.parametrize(
    "wrap",
    [
        lambda loader: loader,
        from_stateful,
        lambda loader: from_stateful(loader, resume="replay"),
    ],
    ids=["given_as_is", "from_stateful", "replay"],
)
def test_a_torchdata_loader_is_refused_naming_its_root(wrap):
    """A torchdata ``Loader`` ignores a ``load_state_dict`` that follows a ``state_dict``
    taken before its first ``iter()``: it restarted from item 0 and, with workers, read
    its whole source in every worker. Its root node is what to pass, and resumes exactly
    (``node`` in ``BUILDS``)."""
    torchdata_loader = Loader(_node())
    with pytest.raises(
        ConfigError, match=r"torchdata\.nodes\.Loader, .*pass its root node"
    ) as info:
        SavableDataLoader(wrap(torchdata_loader), batch_size=2)
    assert "Loader(root).root" in str(info.value)


@pytest.mark.parametrize(
    "state",
    [
        "nonsense",
        {"epoch": 0},
        {"resume": "replay", "epoch": -1, "obj": None, "consumed": 0},
        {"resume": "replay", "epoch": 0, "obj": None, "consumed": "3"},
        {"resume": "replay", "epoch": True, "obj": None, "consumed": 0},
        {"resume": "state", "epoch": 0, "obj": None, "consumed": 0},
        {"resume": "replay", "epoch": 0, "obj": None, "consumed": 0, "rng": None},
    ],
)
def test_malformed_state(state):
    with pytest.raises(StateError, match="from_stateful"):
        from_stateful(_hf(shuffle=True)).cursor(CONTEXT).restore(state)


def test_state_the_object_refuses():
    with pytest.raises(StateError, match="refused the saved state"):
        from_stateful(_node()).cursor(CONTEXT).restore(
            {"resume": "state", "epoch": 0, "obj": {}, "consumed": 0}
        )


def test_replay_past_the_end():
    cursor = from_stateful(StatefulCounter(4), resume="replay").cursor(CONTEXT)
    state = cursor.state()
    cursor.restore({**state, "consumed": 9})
    with pytest.raises(StateError, match="ended after 4 of the 9 items"):
        next(cursor)


class _MapStyleWithState(torch.utils.data.Dataset):
    """A map-style dataset that also has torch's Stateful methods (issue 13)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.loaded: Any = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index * 10

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


@pytest.mark.parametrize("shuffle", [None, False, True])
def test_map_style_dataset_with_state_dict_is_served_as_map_style(shuffle):
    from torch.utils.data import DataLoader

    from savable_loader.datasets import IndexedDataset, as_stage

    data = _MapStyleWithState(10)
    assert isinstance(as_stage(data, shuffle=shuffle), IndexedDataset)
    with SavableDataLoader(data, batch_size=3, shuffle=shuffle) as loader:
        assert isinstance(loader.source, IndexedDataset)
        assert len(loader) == 4
        iterator = iter(loader)
        head = next(iterator).tolist()
        state = loader.save_state_rank()
        tail = [b.tolist() for b in iterator]
    items = head + [x for b in tail for x in b]
    if shuffle:
        assert sorted(items) == [i * 10 for i in range(10)]
        assert items != sorted(items)
    else:
        assert [head, *tail] == [b.tolist() for b in DataLoader(data, batch_size=3)]
    with SavableDataLoader(_MapStyleWithState(10), batch_size=3, shuffle=shuffle) as resumed:
        resumed.restore_state_rank(state)
        assert [b.tolist() for b in resumed] == tail
    assert data.loaded is None  # the indexed source saves the position, not the dataset


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata's
@pytest.mark.parametrize("dataset", [_OwnIterator, _PassesWithPosition])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_its_iterators_position_resumes_as_torchdatas_stateful_loader_does(num_workers, dataset):
    """An object that is its own iterator, or whose iterator holds the position: saved
    after 3 batches and restored into a new loader, the rest is the rest of an
    uninterrupted run, which is also what torchdata's ``StatefulDataLoader`` resumes."""
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
    expected = []
    for loader_class in (stateful_dataloader.StatefulDataLoader, SavableDataLoader):
        options = {"batch_size": 2, "num_workers": num_workers}
        first = loader_class(dataset(13), **options)
        iterator = iter(first)
        head = [next(iterator)["i"].tolist() for _ in range(3)]
        state = first.state_dict()
        rest = [batch["i"].tolist() for batch in iterator]
        second = loader_class(dataset(13), **options)
        second.load_state_dict(state)
        assert [batch["i"].tolist() for batch in second] == rest, loader_class.__name__
        expected.append(head + rest)
        if loader_class is SavableDataLoader:
            first.close()
            second.close()
    assert expected[0] == expected[1]
    assert sorted(i for batch in expected[1] for i in batch) == list(range(13))
