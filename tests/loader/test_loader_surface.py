"""What a training script reads from the loader is what torch's ``DataLoader`` shows:
``loader.sampler`` and ``loader.batch_sampler`` are the ones it passed (or torch built),
``loader.dataset`` its dataset, while torch's iterator underneath still reads the worker
wrapper and an endless placeholder (NOTE [ What the loader shows of its arguments ] in
``savable_loader/_main/shown.py``).
"""

from __future__ import annotations

import copy
import os
import pickle
import warnings
from collections.abc import Iterator
from typing import Any, get_args, get_origin, get_type_hints
from unittest import mock

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from savable_loader import SavableDataLoader
from savable_loader.state.files import decode_state, encode_state

EPOCHS = 3


class Numbers(Dataset[int]):
    def __init__(self, n: int = 23) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class Pids(Dataset[int]):
    """Each item is the process that fetched it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return os.getpid()


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


class SizedStream(IterableDataset[int]):
    """An iterable dataset that reports a length (``n``) it may not keep to."""

    def __init__(self, n: int, length: int) -> None:
        self.n, self.length = n, length

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.length


class EpochBuckets(Sampler[list[int]]):
    """A user's batch sampler with ``set_epoch`` and no ``.sampler``: batches of varying
    length in an order drawn from (seed, epoch)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch))
        indices = order.tolist()
        at, size = 0, 1
        while at < self.n:
            yield indices[at : at + size]
            at, size = at + size, size % 4 + 1

    def __len__(self) -> int:
        return 10


def _distributed(dataset: Numbers) -> DistributedSampler[int]:
    return DistributedSampler(dataset, num_replicas=2, rank=1, seed=5)


def _plain(epoch: Any) -> list[list[int]]:
    return [batch.tolist() for batch in epoch]


def _epochs(loader: Any, set_epoch: Any, epochs: range = range(EPOCHS)) -> list[list[list[int]]]:
    """The training loop of a DDP script: ``set_epoch`` before every epoch."""
    out = []
    for epoch in epochs:
        set_epoch(loader, epoch)
        out.append(_plain(loader))
    return out


def _through_loader(loader: Any, epoch: int) -> None:
    loader.sampler.set_epoch(epoch)


def _through_batch_sampler(loader: Any, epoch: int) -> None:
    loader.batch_sampler.sampler.set_epoch(epoch)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_sampler_set_epoch_gives_torchs_epochs(num_workers: int) -> None:
    dataset = Numbers()
    torchs = DataLoader(dataset, sampler=_distributed(dataset), batch_size=4)
    expected = _epochs(torchs, _through_loader)
    assert expected[0] != expected[1]  # set_epoch matters
    sampler = _distributed(dataset)
    with SavableDataLoader(dataset, sampler=sampler, batch_size=4, num_workers=num_workers) as ours:
        assert _epochs(ours, _through_loader) == expected
    assert sampler.epoch == EPOCHS - 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_sampler_set_epoch_resumes_exactly(num_workers: int) -> None:
    dataset = Numbers()
    expected = _epochs(
        DataLoader(dataset, sampler=_distributed(dataset), batch_size=4), _through_loader
    )
    options: dict[str, Any] = {"batch_size": 4, "num_workers": num_workers}
    with SavableDataLoader(dataset, sampler=_distributed(dataset), **options) as first:
        head = _epochs(first, _through_loader, range(1))
        first.sampler.set_epoch(1)
        iterator = iter(first)
        head.append([next(iterator).tolist() for _ in range(2)])
        state = decode_state(encode_state(first.save_state_rank()))
    with SavableDataLoader(dataset, sampler=_distributed(dataset), **options) as second:
        second.restore_state_rank(state)
        rest = _epochs(second, _through_loader, range(1, EPOCHS))
    assert [head[0], head[1] + rest[0], *rest[1:]] == expected


def _cases(dataset: Numbers) -> dict[str, dict[str, Any]]:
    return {
        "distributed": {"sampler": _distributed(dataset), "batch_size": 4},
        "random": {"sampler": RandomSampler(dataset, num_samples=7), "batch_size": 2},
        "shuffle_generator": {"shuffle": True, "generator": torch.Generator().manual_seed(1)},
        "generator": {"generator": torch.Generator().manual_seed(1)},
    }


@pytest.mark.parametrize("case", ["distributed", "random", "shuffle_generator", "generator"])
def test_loader_sampler_reads_as_torchs(case: str) -> None:
    names = ("num_replicas", "rank", "seed", "shuffle", "num_samples", "replacement", "epoch")

    def read(sampler: Any) -> tuple[Any, ...]:
        kept = tuple(getattr(sampler, name, "-") for name in names)
        return (len(sampler), *kept, getattr(sampler, "generator", None) is not None)

    torchs = DataLoader(Numbers(), **_cases(Numbers())[case])
    with SavableDataLoader(Numbers(), **_cases(Numbers())[case]) as ours:
        assert read(ours.sampler) == read(torchs.sampler)


def test_a_batch_samplers_sampler_gets_set_epoch_through_loader_batch_sampler() -> None:
    """``loader.batch_sampler`` is the one passed, as with torch (whose iterator
    underneath reads none), and ``loader.sampler`` the sampler torch builds beside it."""
    dataset = Numbers()
    torchs = DataLoader(dataset, batch_sampler=BatchSampler(_distributed(dataset), 4, False))
    expected = _epochs(torchs, _through_batch_sampler)
    batch_sampler = BatchSampler(_distributed(dataset), 4, False)
    with SavableDataLoader(dataset, batch_sampler=batch_sampler, num_workers=2) as ours:
        assert ours.batch_sampler is batch_sampler
        assert type(ours.sampler) is type(torchs.sampler)
        assert ours.batch_size is None
        assert _epochs(ours, _through_batch_sampler) == expected


def test_a_batch_sampler_without_a_sampler_gets_set_epoch_itself() -> None:
    torchs = DataLoader(Numbers(), batch_sampler=EpochBuckets(23))
    expected = _epochs(torchs, lambda loader, epoch: loader.batch_sampler.set_epoch(epoch))
    assert expected[0] != expected[1]
    batch_sampler = EpochBuckets(23)
    with SavableDataLoader(Numbers(), batch_sampler=batch_sampler) as ours:
        assert ours.batch_sampler is batch_sampler
        assert (
            _epochs(ours, lambda loader, epoch: loader.batch_sampler.set_epoch(epoch)) == expected
        )
    assert batch_sampler.epoch == EPOCHS - 1


def test_writes_reach_the_sampler() -> None:
    sampler = _distributed(Numbers())
    with SavableDataLoader(Numbers(), sampler=sampler) as loader:
        assert loader.sampler is sampler
        assert isinstance(loader.sampler, DistributedSampler)
        loader.sampler.epoch = 4
    assert sampler.epoch == 4


def test_without_a_sampler_the_view_is_torchs_placeholder() -> None:
    torchs = DataLoader(Stream())
    with SavableDataLoader(Stream()) as ours:
        for loader in (torchs, ours):
            assert not callable(getattr(loader.sampler, "set_epoch", None))  # Lightning skips it
            with pytest.raises(AttributeError):
                loader.sampler.set_epoch(1)
            with pytest.raises(TypeError, match="has no len"):
                len(loader.sampler)
            assert next(iter(loader.sampler)) is None
        assert _plain(ours) == _plain(torchs)


@pytest.mark.parametrize(
    ("batch_size", "drop_last"), [(None, False), (1, False), (3, False), (3, True), (12, False)]
)
def test_len_of_an_iterable_dataset_with_a_length_is_torchs(batch_size, drop_last) -> None:
    """Trainers size an epoch with ``len(loader)`` (Lightning, Hugging Face's Trainer): for
    an iterable dataset that has ``__len__`` torch answers from it, even where the data
    does not keep to it (here 10 items reported, 7 yielded); one without stays a
    TypeError."""
    options = {"batch_size": batch_size, "drop_last": drop_last}
    torchs = DataLoader(SizedStream(7, 10), **options)
    with SavableDataLoader(SizedStream(7, 10), **options) as ours:
        assert len(ours) == len(torchs)
        assert [torch.as_tensor(b).tolist() for b in ours] == [
            torch.as_tensor(b).tolist() for b in torchs
        ]  # not cut to len()
    for loader in (DataLoader(Stream(), **options), SavableDataLoader(Stream(), **options)):
        with pytest.raises(TypeError):
            len(loader)


def _warnings(loader: Any) -> tuple[list[Any], list[str]]:
    """The batches of an epoch and the warnings raised while they were read."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = [torch.as_tensor(b).tolist() for b in loader]
    return batches, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize(("batch_size", "num_workers"), [(None, 0), (None, 2), (2, 0)])
def test_an_iterable_longer_than_its_length_warns_as_torch_does(batch_size, num_workers):
    """Once ``len(loader)`` was read, every batch beyond ``len(dataset)`` warns with torch's
    message (the usual cause: each worker yields the whole dataset); before, none does."""
    options = {"batch_size": batch_size, "num_workers": num_workers}
    torchs = DataLoader(SizedStream(5, 2), **options)
    with SavableDataLoader(SizedStream(5, 2), **options) as ours:
        assert _warnings(ours)[1] == [] == _warnings(torchs)[1]
        assert len(ours) == len(torchs)
        (torch_batches, torch_warned), (our_batches, we_warned) = map(_warnings, (torchs, ours))
    assert our_batches == torch_batches
    assert len(we_warned) == len(torch_warned) > 0
    for ours_, torchs_ in zip(we_warned, torch_warned, strict=True):
        # The same but for the address: the two loaders read two instances.
        assert ours_.split(" object at ")[0] == torchs_.split(" object at ")[0]
        assert ours_.split(">", 1)[1] == torchs_.split(">", 1)[1]


def test_the_view_copies_and_pickles() -> None:
    with SavableDataLoader(Numbers(), sampler=_distributed(Numbers())) as loader:
        for view in (copy.deepcopy(loader.sampler), pickle.loads(pickle.dumps(loader.sampler))):
            assert (view.num_replicas, view.rank, len(view)) == (2, 1, 12)
    with SavableDataLoader(Stream()) as loader:
        assert next(iter(copy.deepcopy(loader.sampler))) is None


def test_persistent_workers_and_the_dataset_read_as_passed() -> None:
    """``persistent_workers`` reads False as passed (torch's persistent iterator runs
    underneath) and the workers restart every epoch; ``dataset`` is the user's dataset,
    and a loader rebuilt from the attributes reads the same batches."""
    dataset = Pids()
    with SavableDataLoader(dataset, batch_size=4, num_workers=2) as loader:
        assert loader.persistent_workers is False
        assert loader.dataset is dataset
        assert loader.source.data is dataset
        first, second = ({pid for batch in loader for pid in batch.tolist()} for _ in range(2))
        assert len(first) == 2
        assert first.isdisjoint(second)
    original = SavableDataLoader(Numbers(), batch_size=3, num_workers=2)
    names = ("batch_size", "drop_last", "collate_fn", "sampler", "generator", "num_workers")
    rebuilt = SavableDataLoader(
        original.dataset, **{name: getattr(original, name) for name in names}
    )
    with original, rebuilt:
        assert _plain(rebuilt) == _plain(original) == _plain(DataLoader(Numbers(), batch_size=3))


class Labelled(Numbers):
    """A dataset with the attributes scripts read through ``loader.dataset``."""

    classes = ("even", "odd")

    @property
    def targets(self) -> list[int]:
        return [index % 2 for index in range(self.n)]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_datasets_length_and_attributes_read_through_loader_dataset(workers: int) -> None:
    """``len(loader.dataset)`` (the PyTorch examples' sample count) and attributes such as
    ``loader.dataset.classes`` are the user's dataset's, as with torch; the wrapper still
    runs the workers and pickles (spawn) with them."""
    dataset = Labelled()
    torchs = DataLoader(dataset, batch_size=4, num_workers=workers)
    with SavableDataLoader(dataset, batch_size=4, num_workers=workers) as ours:
        for name in ("classes", "targets", "n"):
            assert getattr(ours.dataset, name) == getattr(torchs.dataset, name), name
        assert len(ours.dataset) == len(torchs.dataset) == 23
        with pytest.raises(AttributeError, match="'Labelled' object has no attribute 'nope'"):
            _ = ours.dataset.nope
        assert len(pickle.loads(pickle.dumps(ours.dataset))) == 23
        assert [b.tolist() for b in ours] == [b.tolist() for b in torchs]


def test_an_iterable_datasets_missing_length_is_torchs_error() -> None:
    with pytest.raises(TypeError) as torchs:
        len(DataLoader(Stream()).dataset)
    with SavableDataLoader(Stream()) as loader, pytest.raises(TypeError) as ours:
        len(loader.dataset)
    assert str(ours.value) == str(torchs.value)


def test_the_loader_is_generic_as_torchs() -> None:
    """Annotations such as ``SavableDataLoader[list[Tensor]]`` evaluate, as
    ``DataLoader[list[Tensor]]`` does (scripts evaluate them at run time)."""

    def batches() -> SavableDataLoader[list[torch.Tensor]]:
        return SavableDataLoader(Numbers(), batch_size=2)

    hints = get_type_hints(batches)
    assert get_origin(hints["return"]) is SavableDataLoader
    assert get_args(hints["return"]) == get_args(DataLoader[list[torch.Tensor]])
    with batches() as loader:
        assert isinstance(loader, DataLoader)


def test_samplers_that_hold_themselves_or_make_new_objects_build_at_once() -> None:
    """The search for the samplers' generators stops: a sampler holding its own batch
    sampler (a cycle) and a Mock (a new object at every attribute) both build, as with
    torch, instead of walking forever."""
    sampler = SequentialSampler(range(8))
    batch_sampler = BatchSampler(sampler, 2, False)
    sampler.sampler = batch_sampler  # type: ignore[attr-defined]
    with SavableDataLoader(range(8), batch_sampler=batch_sampler) as loader:
        assert _plain(loader) == _plain(DataLoader(range(8), batch_sampler=batch_sampler))
    mocked = mock.MagicMock(spec=BatchSampler)
    mocked.__iter__.return_value = iter([[0, 1], [2, 3]])
    mocked.__len__.return_value = 2
    with SavableDataLoader(range(4), batch_sampler=mocked) as loader:
        assert loader.batch_sampler is mocked


def _read_in_child(loader: SavableDataLoader[Any], queue: Any) -> None:
    queue.put([batch.tolist() for batch in loader])


@pytest.mark.slow
def test_a_loader_sent_to_a_spawned_process_reads_its_stream_there() -> None:
    """``mp.spawn`` (Lightning's ``ddp_spawn``) pickles its arguments through shared
    memory, where a ``torch.Generator`` cannot go (NOTE [ A loader sent to a spawned
    process ] in ``_main/shown.py``): the loader's own generators travel as bytes."""
    with SavableDataLoader(list(range(10)), batch_size=3, shuffle=True, seed=2) as loader:
        want = _plain(SavableDataLoader(list(range(10)), batch_size=3, shuffle=True, seed=2))
        context = torch.multiprocessing.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=_read_in_child, args=(loader, queue))
        child.start()
        try:
            got = queue.get(timeout=120)
        finally:
            child.join(60)
            child.kill()
    assert got == want
    assert child.exitcode == 0


@pytest.mark.parametrize("given", ["sampler", "batch_sampler"])
def test_lightning_rebuilds_it_with_a_distributed_sampler_as_it_rebuilds_torchs(given) -> None:
    """Lightning re-creates a loader built in a ``*_dataloader`` hook with a
    ``DistributedSampler`` from the arguments it recorded, and its record of the dataset
    is the user's, not the wrapper torch reads (NOTE [ What the loader shows of its
    arguments ] in ``_main/shown.py``): the rebuilt loader reads rank 0's share, as torch's."""
    hooks = pytest.importorskip("lightning.fabric.utilities.data")
    update = pytest.importorskip("lightning.pytorch.utilities.data")._update_dataloader
    dataset = Numbers()
    options = {"batch_size": 4} if given == "sampler" else {}
    batches = []
    for loader_class in (DataLoader, SavableDataLoader):
        if given == "batch_sampler":
            options = {"batch_sampler": BatchSampler(SequentialSampler(dataset), 4, False)}
        with hooks._replace_dunder_methods(DataLoader, "dataset"):
            loader = loader_class(dataset, **options)
        sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=False)
        rebuilt = update(loader, sampler)
        assert type(rebuilt) is loader_class
        inner = rebuilt.sampler if given == "sampler" else rebuilt.batch_sampler.sampler
        assert inner is sampler
        batches.append(_plain(rebuilt))
        if isinstance(rebuilt, SavableDataLoader):
            rebuilt.close()
    assert batches[0] == batches[1]
    assert sorted(i for batch in batches[1] for i in batch) == list(range(0, 23, 2))
