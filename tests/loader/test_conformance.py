"""Drop-in conformance: with ``sampler=``, ``batch_sampler=``, ``generator=`` and
``persistent_workers=False``, ``SavableDataLoader`` yields what torch's ``DataLoader``
yields with the same arguments, and resumes that stream exactly.

Each case builds both loaders from the same recipe, with the global generators seeded
alike before each build (a sampler without a generator of its own draws from torch's
global generator, as in torch). The training loop calls ``set_epoch`` when the sampler
has it, as DDP scripts do.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    get_worker_info,
)

from savable_loader import ConfigError, SavableDataLoader, StateError
from savable_loader.state.files import decode_state, encode_state

EPOCHS = 3


class Numbers(Dataset[dict[str, Any]]):
    """Item ``i`` is ``i`` plus, in a worker, one draw from each global generator (so the
    workers' seeds show); without workers the item is deterministic."""

    def __init__(self, n: int = 23) -> None:
        self.n = n
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.fetched.append(index)
        item: dict[str, Any] = {"i": index}
        if get_worker_info() is not None:
            item["t"] = torch.rand(()).item()
            item["n"] = float(np.random.random())
            item["p"] = random.random()
        return item


class EveryOtherSampler(Sampler[int]):
    """A user's own sampler: every other index, from a random start drawn from the
    global torch generator, with an epoch the loop sets."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        start = int(torch.randint(0, 2, ()).item())
        return iter(range((start + self.epoch) % 2, self.n, 2))

    def __len__(self) -> int:
        return self.n // 2


class Buckets(Sampler[list[int]]):
    """A user's bucketing batch sampler: batches of varying length from a seeded order."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.n, generator=self.generator).tolist()
        sizes = [1, 2, 3, 4]
        at, k = 0, 0
        while at < len(order):
            size = sizes[k % len(sizes)]
            yield order[at : at + size]
            at, k = at + size, k + 1

    def __len__(self) -> int:
        return -(-self.n // 10) * 4


def _case(name: str, dataset: Numbers) -> dict[str, Any]:
    """The DataLoader arguments of case ``name`` (fresh samplers and generators)."""
    n = len(dataset)
    cases: dict[str, Callable[[], dict[str, Any]]] = {
        "random": lambda: {"sampler": RandomSampler(dataset), "batch_size": 4},
        "random_generator": lambda: {
            "sampler": RandomSampler(dataset, generator=torch.Generator().manual_seed(3)),
            "batch_size": 4,
        },
        "random_replacement": lambda: {
            "sampler": RandomSampler(dataset, replacement=True, num_samples=37),
            "batch_size": 5,
        },
        "random_num_samples": lambda: {
            "sampler": RandomSampler(dataset, num_samples=30),
            "batch_size": 4,
            "drop_last": True,
        },
        "subset": lambda: {"sampler": SubsetRandomSampler(range(3, 20)), "batch_size": 3},
        "weighted": lambda: {
            "sampler": WeightedRandomSampler([1.0 + i % 3 for i in range(n)], 19),
            "batch_size": 4,
        },
        "distributed": lambda: {
            "sampler": DistributedSampler(dataset, num_replicas=2, rank=1, seed=5),
            "batch_size": 4,
        },
        "distributed_no_shuffle": lambda: {
            "sampler": DistributedSampler(dataset, num_replicas=3, rank=0, shuffle=False),
            "batch_size": 2,
        },
        "own_sampler": lambda: {"sampler": EveryOtherSampler(n), "batch_size": 3},
        "sequential_unbatched": lambda: {"sampler": SequentialSampler(dataset), "batch_size": None},
        "batch_sampler": lambda: {
            "batch_sampler": BatchSampler(RandomSampler(dataset), batch_size=4, drop_last=False)
        },
        "bucketing": lambda: {"batch_sampler": Buckets(n, seed=11)},
        "shuffle_generator": lambda: {
            "shuffle": True,
            "batch_size": 4,
            "generator": torch.Generator().manual_seed(7),
        },
        "sampler_generator": lambda: {
            "sampler": RandomSampler(dataset),
            "batch_size": 4,
            "generator": torch.Generator().manual_seed(9),
        },
    }
    return cases[name]()


CASES = [
    "random",
    "random_generator",
    "random_replacement",
    "random_num_samples",
    "subset",
    "weighted",
    "distributed",
    "distributed_no_shuffle",
    "own_sampler",
    "sequential_unbatched",
    "batch_sampler",
    "bucketing",
    "shuffle_generator",
    "sampler_generator",
]


def _seed_globals(seed: int = 0) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _build(cls: type, name: str, **loader: Any) -> Any:
    _seed_globals()
    dataset = Numbers()
    arguments = _case(name, dataset)
    built = cls(dataset, **arguments, **loader)
    #: What the training loop calls set_epoch on.
    built.case_sampler = arguments.get("sampler", arguments.get("batch_sampler"))
    built.case_generator = arguments.get("generator")
    return built


def _set_epoch(loader: Any, epoch: int) -> None:
    if hasattr(loader.case_sampler, "set_epoch"):
        loader.case_sampler.set_epoch(epoch)


def _plain(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, dict):
        return {key: _plain(value) for key, value in batch.items()}
    if isinstance(batch, list):
        return [_plain(value) for value in batch]
    return batch


def _stream(loader: Any, epochs: int = EPOCHS) -> list[list[Any]]:
    out = []
    for epoch in range(epochs):
        _set_epoch(loader, epoch)
        out.append([_plain(batch) for batch in loader])
    return out


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (3, True)])
def test_the_stream_is_torchs(name: str, num_workers: int, persistent: bool) -> None:
    options = {"num_workers": num_workers, "persistent_workers": persistent}
    torchs = _build(DataLoader, name, **options)
    expected = _stream(torchs)
    with _build(SavableDataLoader, name, **options) as ours:
        assert len(ours) == len(torchs)
        got = _stream(ours)
    if torchs.case_generator is None and num_workers > 0:
        # Without generator=, the workers' generators derive from seed= (reproducible
        # without global seeding) instead of torch's global generator: the order is
        # torch's, the workers' draws are the loader's own.
        got, expected = _indices(got), _indices(expected)
    assert got == expected


def _indices(stream: list[list[Any]]) -> list[list[Any]]:
    return [[batch["i"] for batch in epoch] for epoch in stream]


def _saving_run(
    name: str, options: dict[str, Any], stops: Sequence[int]
) -> tuple[list[list[Any]], dict[int, tuple[int, Any]]]:
    """Runs the stream in one loader up to the last of ``stops``, saving (through the file
    encoding) after each of ``stops`` batches; returns what it yielded, by epoch, and each
    stop's epoch and state. One saving run serves every stop: a loader of its own for each
    stop ran the same batches again up to it."""
    seen: list[list[Any]] = []
    saves: dict[int, tuple[int, Any]] = {}
    taken = 0
    with _build(SavableDataLoader, name, **options) as first:
        for epoch in range(EPOCHS):
            _set_epoch(first, epoch)
            seen.append([])
            iterator = iter(first)
            while True:
                if taken in stops and taken not in saves:
                    saves[taken] = (epoch, decode_state(encode_state(first.save_state_rank())))
                batch = next(iterator, None) if taken < max(stops) else None
                if batch is None:
                    break
                seen[-1].append(_plain(batch))
                taken += 1
            if taken == max(stops) and max(stops) in saves:
                break
    assert sorted(saves) == sorted(set(stops)), f"saved after {sorted(saves)} of {stops}"
    return seen, saves


def _resumed(
    name: str, options: dict[str, Any], before: list[list[Any]], saved: tuple[int, Any]
) -> list[list[Any]]:
    """``before`` (the batches up to the save, by epoch), then the epoch of the save and the
    next one from a fresh loader restored from the state saved there. (Epochs further on
    are the resume harness's, tests/resume/test_resume.py: a restored loader goes to the end of
    every run there.)"""
    epoch_at, state = saved
    out = [list(epoch) for epoch in before]
    _seed_globals(99)  # the restoring process's global generators differ
    with _build(SavableDataLoader, name, **options) as second:
        _seed_globals(123)
        second.restore_state_rank(state)
        for epoch in range(epoch_at, min(epoch_at + 2, EPOCHS)):
            _set_epoch(second, epoch)
            if epoch > epoch_at:
                out.append([])
            out[-1].extend(_plain(batch) for batch in second)
    return out


def _assert_resumed(
    name: str, options: dict[str, Any], stops: Sequence[int], expected: Any
) -> None:
    """Saves after each of ``stops`` batches in one run, which must yield the uninterrupted
    stream ``expected`` (a save does not disturb it), and resumes each save in a fresh
    loader: the batches before the save and the restored loader's are ``expected``'s."""
    seen, saves = _saving_run(name, options, stops)
    *whole, last = seen
    assert whole == expected[: len(whole)], "the saving run differs from the uninterrupted one"
    assert last == expected[len(whole)][: len(last)], "the saving run differs"
    for stop in stops:
        epoch_at, _ = saves[stop]
        before = [list(epoch) for epoch in seen[:epoch_at]]
        before.append(seen[epoch_at][: stop - sum(len(epoch) for epoch in before)])
        got = _resumed(name, options, before, saves[stop])
        assert len(got) >= min(2, EPOCHS)
        assert got == expected[: len(got)], f"saved after {stop} batches"


#: The cases resumed with 2 workers (restarted each epoch and persistent) at every save
#: point; the others are resumed with 3 persistent workers at a few.
WITH_TWO_WORKERS = [
    "random",
    "random_replacement",
    "distributed",
    "own_sampler",
    "bucketing",
    "shuffle_generator",
]


def _resume_layouts() -> list[Any]:
    """Every case in-process, the cases of ``WITH_TWO_WORKERS`` with 2 workers too."""
    layouts = [(name, 0, False) for name in CASES]
    layouts += [(name, 2, p) for p in (False, True) for name in WITH_TWO_WORKERS]
    return [pytest.param(*layout, id=f"{layout[1]}-{layout[2]}-{layout[0]}") for layout in layouts]


@pytest.mark.parametrize(("name", "num_workers", "persistent"), _resume_layouts())
def test_a_resumed_stream_is_the_uninterrupted_one(
    name: str, num_workers: int, persistent: bool
) -> None:
    options = {"num_workers": num_workers, "persistent_workers": persistent}
    with _build(SavableDataLoader, name, **options) as loader:
        expected = _stream(loader)
    per_epoch = len(expected[0])
    stops = (0, 1, per_epoch - 1, per_epoch, per_epoch + 2, 2 * per_epoch + 1)
    _assert_resumed(name, options, stops, expected)


def _three_worker_stops(per_epoch: int) -> tuple[int, int, int]:
    """Mid-epoch with a worker other than the first next in the round-robin, after the
    epoch's last batch (before its StopIteration), and just into the next epoch."""
    mid = per_epoch // 2
    return (mid + (mid % 3 == 0), per_epoch, per_epoch + 1)


def _three_workers(name: str) -> None:
    options = {"num_workers": 3, "persistent_workers": True}
    with _build(SavableDataLoader, name, **options) as loader:
        expected = _stream(loader)
    _assert_resumed(name, options, _three_worker_stops(len(expected[0])), expected)


@pytest.mark.parametrize("name", [name for name in CASES if name not in WITH_TWO_WORKERS])
def test_three_persistent_workers_resume_exactly(name: str) -> None:
    _three_workers(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", WITH_TWO_WORKERS)
def test_three_persistent_workers_resume_the_cases_resumed_with_two(name: str) -> None:
    _three_workers(name)


@pytest.mark.parametrize("persistent", [False, True])
def test_generator_state_is_part_of_the_state(persistent: bool) -> None:
    options = {"num_workers": 2, "persistent_workers": persistent}
    with _build(SavableDataLoader, "shuffle_generator", **options) as loader:
        iterator = iter(loader)
        next(iterator)
        state = loader.save_state_rank()
    assert state.order is not None
    assert len(state.order.before.generators) == 1
    with _build(SavableDataLoader, "shuffle_generator", **options) as other:
        other.case_generator.manual_seed(12345)  # whatever the new generator holds, the state wins
        other.restore_state_rank(state)
        rest = [_plain(batch) for batch in other]
    with _build(SavableDataLoader, "shuffle_generator", **options) as loader:
        expected = [_plain(batch) for batch in loader][1:]
    assert rest == expected


def test_a_sampler_epoch_other_than_the_saved_one_is_refused() -> None:
    with _build(SavableDataLoader, "distributed", num_workers=0) as loader:
        _set_epoch(loader, 2)
        next(iter(loader))
        state = loader.save_state_rank()
    with _build(SavableDataLoader, "distributed", num_workers=0) as other:
        other.restore_state_rank(state)
        _set_epoch(other, 0)
        with pytest.raises(StateError, match=r"set_epoch\(2\)"):
            next(iter(other))


def test_a_restore_skips_the_sampler_without_fetching_the_skipped_items() -> None:
    dataset = Numbers(400)
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(1))
    with SavableDataLoader(dataset, sampler=sampler, batch_size=4) as loader:
        iterator = iter(loader)
        for _ in range(60):
            next(iterator)
        state = loader.save_state_rank()
    fresh = Numbers(400)
    sampler = RandomSampler(fresh, generator=torch.Generator().manual_seed(1))
    with SavableDataLoader(fresh, sampler=sampler, batch_size=4) as other:
        other.restore_state_rank(state)
        next(iter(other))
    assert len(fresh.fetched) == 4  # the next batch only


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sampler": [0, 1], "shuffle": True},
        {"batch_sampler": [[0, 1]], "batch_size": 2},
        {"batch_sampler": [[0, 1]], "drop_last": True},
        {"batch_sampler": [[0, 1]], "sampler": [0]},
        {"batch_size": None, "drop_last": True},
        {"persistent_workers": True},
        {"num_workers": -1},
        {"num_workers": 2, "prefetch_factor": -1},
        {"prefetch_factor": 2},
        {"timeout": -1},
        # Two mistakes: torch's first check decides which is reported.
        {"persistent_workers": True, "sampler": [0, 1], "shuffle": True},
        {"num_workers": -1, "prefetch_factor": 2, "timeout": -1},
    ],
)
def test_invalid_combinations_raise_what_torch_raises(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as torch_error:
        DataLoader(Numbers(), **kwargs)
    with pytest.raises(ValueError) as our_error:
        SavableDataLoader(Numbers(), **kwargs)
    assert isinstance(our_error.value, type(torch_error.value))
    assert isinstance(our_error.value, ConfigError)
    assert str(our_error.value) == str(torch_error.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"batch_size": 3, "drop_last": True},
        {"batch_size": None},
        {"batch_sampler": [[0, 1], [2]]},
        {"sampler": [2, 0], "batch_size": 2},
    ],
)
def test_batch_size_and_drop_last_read_as_torchs(kwargs: dict[str, Any]) -> None:
    """Code that re-creates a loader from its attributes (a trainer injecting a sampler)
    reads back what torch's would report."""
    ours, torchs = SavableDataLoader(Numbers(), **kwargs), DataLoader(Numbers(), **kwargs)
    with ours:
        assert (ours.batch_size, ours.drop_last) == (torchs.batch_size, torchs.drop_last)


class _Stream(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


@pytest.mark.parametrize(
    "kwargs", [{"sampler": [0, 1]}, {"batch_sampler": [[0, 1]]}, {"shuffle": True}]
)
def test_an_iterable_dataset_refuses_sampling_as_torch_does(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as torch_error:
        DataLoader(_Stream(), **kwargs)
    with pytest.raises(ValueError) as our_error:
        SavableDataLoader(_Stream(), **kwargs)
    assert str(our_error.value) == str(torch_error.value)


@pytest.mark.slow
# shuffle_generator's stream with spawned workers: test_spawned_workers_resume_exactly.
@pytest.mark.parametrize("name", ["bucketing"])
def test_spawned_workers_give_torchs_stream(name: str) -> None:
    options = {"num_workers": 2, "multiprocessing_context": "spawn", "persistent_workers": True}
    # Torch's stream with forked workers: torch draws the order and the workers' base seed
    # in the main process whatever the start method, and a spawned worker takes seconds.
    torchs = _build(DataLoader, name, num_workers=2, persistent_workers=True)
    expected = _stream(torchs, epochs=2)
    with _build(SavableDataLoader, name, **options) as ours:
        got = _stream(ours, epochs=2)
    if torchs.case_generator is None:
        got, expected = _indices(got), _indices(expected)
    assert got == expected


@pytest.mark.slow
def test_spawned_workers_resume_exactly() -> None:
    # The uninterrupted stream is torch's with forked workers: with generator=, worker
    # seeds come from it whatever the start method (test_the_stream_is_torchs and
    # test_spawned_workers_give_torchs_stream), and a spawned worker takes seconds to start.
    options = {"num_workers": 2, "multiprocessing_context": "spawn"}
    expected = _stream(_build(DataLoader, "shuffle_generator", num_workers=2))
    stop = len(expected[0]) + 1  # in the second epoch, whose workers were started anew
    _assert_resumed("shuffle_generator", options, [stop], expected)
