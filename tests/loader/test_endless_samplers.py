"""Samplers that never end (or give more than their ``len()``) are read lazily, as torch
reads them, and resume exactly by count (NOTE [ Endless samplers ] in
``savable_loader/_main/sampling.py``)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Sampler

from savable_loader import ConfigError, SavableDataLoader
from savable_loader.serialization import dumps, loads
from savable_loader.testing import assert_resumes_exactly

ITEMS = 20
BATCHES = 14  # several rounds of the 20 items in batches of 3


class Forever(Sampler[int]):
    """``while True: yield from randperm(n)`` on torch's global generator."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        while True:
            yield from torch.randperm(self.n).tolist()


class InfiniteWithLen(Sampler[int]):
    """mmengine's ``InfiniteSampler`` as a generator function: endless, but ``len()`` is the
    dataset's size."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator()
        g.manual_seed(self.seed)
        while True:
            yield from torch.randperm(self.n, generator=g).tolist()

    def set_epoch(self, epoch: int) -> None:
        """A no-op, as mmengine's."""


class TrainingSampler(Sampler[int]):
    """detectron2's ``TrainingSampler``: endless, seeded, shuffled, no ``len()``, sliced to
    its rank."""

    def __init__(self, size: int, *, shuffle: bool = True, seed: int = 3) -> None:
        self._size, self._shuffle, self._seed = size, shuffle, seed
        self._rank, self._world_size = 0, 1

    def __iter__(self) -> Iterator[int]:
        yield from itertools.islice(self._infinite_indices(), self._rank, None, self._world_size)

    def _infinite_indices(self) -> Iterator[int]:
        g = torch.Generator()
        g.manual_seed(self._seed)
        while True:
            if self._shuffle:
                yield from torch.randperm(self._size, generator=g).tolist()
            else:
                yield from torch.arange(self._size).tolist()


class HeldStream(InfiniteWithLen):
    """mmengine's own ``InfiniteSampler``: one stream made in ``__init__``, which every
    ``iter()`` goes on with."""

    def __init__(self, n: int, seed: int = 0) -> None:
        super().__init__(n, seed)
        self.indices = super().__iter__()

    def __iter__(self) -> Iterator[int]:
        yield from self.indices


class Longer(Sampler[int]):
    """Gives three shuffles of ``n`` from its own generator, though its ``len()`` says one."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.generator = torch.Generator().manual_seed(5)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        for _ in range(3):
            yield from torch.randperm(self.n, generator=self.generator).tolist()


SAMPLERS: dict[str, Callable[[], Sampler[int]]] = {
    "while_true": lambda: Forever(ITEMS),
    "infinite_with_len": lambda: InfiniteWithLen(ITEMS),
    "training_sampler": lambda: TrainingSampler(ITEMS),
}


def _build(sampler: Callable[[], Sampler[int]], workers: int) -> SavableDataLoader[Any]:
    return SavableDataLoader(
        list(range(ITEMS)), batch_size=3, sampler=sampler(), num_workers=workers
    )


def _take(loader: Any, n: int) -> list[list[int]]:
    return [batch.tolist() for batch in itertools.islice(iter(loader), n)]


def _torch_batches(sampler: Callable[[], Sampler[int]], workers: int, n: int) -> list[list[int]]:
    torch.manual_seed(11)
    loader = DataLoader(list(range(ITEMS)), batch_size=3, sampler=sampler(), num_workers=workers)
    return [batch.tolist() for batch in itertools.islice(loader, n)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_an_endless_sampler_gives_torchs_batches(name: str, workers: int) -> None:
    expected = _torch_batches(SAMPLERS[name], workers, BATCHES)
    torch.manual_seed(11)
    with _build(SAMPLERS[name], workers) as loader:
        assert _take(loader, BATCHES) == expected


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_an_endless_sampler_resumes_exactly(name: str, workers: int) -> None:
    torch.manual_seed(11)
    with _build(SAMPLERS[name], workers) as loader:
        reference = _take(loader, BATCHES)
    for k in (0, 4, 9):
        torch.manual_seed(11)
        with _build(SAMPLERS[name], workers) as loader:
            stream = iter(loader)
            assert [next(stream).tolist() for _ in range(k)] == reference[:k]
            state: Any = loads(dumps(loader.state_dict()))
        torch.manual_seed(99)  # the restored order owes nothing to the global generator
        with _build(SAMPLERS[name], workers) as restored:
            restored.load_state_dict(state)
            stream = iter(restored)
            assert [next(stream).tolist() for _ in range(3)] == reference[k : k + 3]
            again: Any = loads(dumps(restored.state_dict()))  # a chain: save, restore
        with _build(SAMPLERS[name], workers) as chained:
            chained.load_state_dict(again)
            assert _take(chained, BATCHES - k - 3) == reference[k + 3 :]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", [0, 2])
def test_len_is_torchs(workers: int) -> None:
    with _build(SAMPLERS["infinite_with_len"], workers) as loader:
        assert len(loader) == len(DataLoader(list(range(ITEMS)), 3, sampler=InfiniteWithLen(20)))
    with _build(SAMPLERS["training_sampler"], workers) as loader, pytest.raises(TypeError):
        len(loader)


@pytest.mark.timeout(30)
def test_a_sampler_that_goes_on_with_one_stream_is_refused_naming_it() -> None:
    began = time.monotonic()
    with (
        SavableDataLoader(list(range(ITEMS)), batch_size=3, sampler=HeldStream(ITEMS)) as loader,
        pytest.raises(ConfigError, match=r"HeldStream.*anew"),
    ):
        next(iter(loader))
    assert time.monotonic() - began < 10


@pytest.mark.timeout(30)
def test_a_generator_object_as_the_sampler_is_refused() -> None:
    def endless() -> Iterator[int]:
        while True:
            yield from range(ITEMS)

    sampler: Any = endless()
    with (
        SavableDataLoader(list(range(ITEMS)), sampler=sampler) as loader,
        pytest.raises(ConfigError, match="generator object passed"),
    ):
        next(iter(loader))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_longer_than_its_len_is_read_to_its_end(workers: int) -> None:
    """Read lazily; its first epoch is torch's and ends where the sampler does, and the next
    epoch is a new order (NOTE [ Endless samplers ])."""
    data = list(range(8))
    torch_loader = DataLoader(data, batch_size=3, sampler=Longer(8), num_workers=workers)
    expected = [batch.tolist() for batch in torch_loader]
    with SavableDataLoader(data, batch_size=3, sampler=Longer(8), num_workers=workers) as loader:
        first, second = ([batch.tolist() for batch in loader] for _ in range(2))
    assert first == expected
    assert len(second) == len(first) == 8
    assert second != first


@pytest.mark.timeout(30)
def test_a_new_iter_over_an_endless_sampler_starts_it_over_as_torch() -> None:
    """A loop left with ``break`` and a new one: a sampler that re-seeds on each ``iter()``
    starts over, as with torch; one on the global generator goes on (and never hangs)."""

    def two_loops(loader: Any) -> list[list[int]]:
        seen = []
        for _ in range(2):
            for step, batch in enumerate(loader):
                seen.append(batch.tolist())
                if step == 3:
                    break
        return seen

    sampler, workers = SAMPLERS["training_sampler"], 0
    expected = two_loops(DataLoader(list(range(ITEMS)), batch_size=3, sampler=sampler()))
    with _build(sampler, workers) as loader:
        assert two_loops(loader) == expected
    with _build(SAMPLERS["while_true"], workers) as loader:
        assert len(two_loops(loader)) == 8


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_sampler_longer_than_its_len_resumes_exactly(workers: int) -> None:
    assert_resumes_exactly(
        lambda: SavableDataLoader(
            list(range(8)), batch_size=3, sampler=Longer(8), num_workers=workers
        ),
        num_points=3,
        chain_items=(1,),
    )


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_an_endless_sampler_reaches_spawned_workers() -> None:
    expected = _torch_batches(SAMPLERS["training_sampler"], 0, BATCHES)
    with SavableDataLoader(
        list(range(ITEMS)),
        batch_size=3,
        sampler=TrainingSampler(ITEMS),
        num_workers=2,
        multiprocessing_context="spawn",
    ) as loader:
        assert _take(loader, BATCHES) == expected
