"""Iteration semantics are torch's: every ``iter(loader)`` begins a new epoch, except the
first one after a restore, which continues the restored position.

Each scenario is a small script over a loader class; it runs with torch's ``DataLoader``
and with ``SavableDataLoader`` over the same dataset and arguments, and the two must
yield exactly the same: a peek (``next(iter(loader))``) then a full loop yields the whole
next epoch, a loop left with ``break`` is followed by a whole new epoch, a second loop
after a full one is a new epoch, ``len()`` is torch's. The datasets: a map-style list,
the same shuffled by a seeded ``generator=`` (torch's ``RandomSampler`` draws its order
from it, so the orders compare), an ``IterableDataset`` sharded with
``get_worker_info()``, one sharded by a ``worker_init_fn`` that sets the range on
``get_worker_info().dataset`` (torch's documented pattern), the same with
``state_dict()``/``load_state_dict()`` (torchdata's ``Stateful``), and an iterable that
is its own iterator. Layouts: no workers, 2 workers started each epoch, 3 persistent ones.

The save and restore cases: a state saved after a peek or a ``break`` restores to that
mid-epoch position, into a fresh loader or into the saver itself, and both go on as the
uninterrupted run (torch's) does; a state saved in the new epoch that follows a ``break``
restores there; a state saved right after ``iter()`` restores over a dataset object
another loader already read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from savable_loader import SavableDataLoader
from savable_loader.state.files import decode_state, encode_state

BATCH = 2
BREAK_AFTER = 2


class WorkerShards(IterableDataset):
    """The first example of torch's ``IterableDataset`` documentation: each worker reads
    its share of ``[start, end)``, found through ``get_worker_info()``."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self):
        start, end = self.start, self.end
        info = get_worker_info()
        if info is not None:
            per_worker = math.ceil((end - start) / info.num_workers)
            start = start + info.id * per_worker
            end = min(start + per_worker, end)
        return iter(range(start, end))


class Range(IterableDataset):
    """The second example: reads ``[start, end)``, which ``shard`` sets on each worker's
    copy."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self):
        return iter(range(self.start, self.end))


class StatefulRange(Range):
    """``Range`` with torchdata's ``Stateful`` protocol: the state is the range and the
    next value. ``iter()`` starts a pass at ``start`` unless a state was loaded since the
    last pass began (then it goes on from the loaded position)."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__(start, end)
        self.next = start
        self.loaded = False

    def __iter__(self):
        if not self.loaded:
            self.next = self.start
        self.loaded = False
        return self._read()

    def _read(self):
        while self.next < self.end:
            self.next += 1
            yield self.next - 1

    def state_dict(self) -> dict[str, int]:
        return {"start": self.start, "end": self.end, "next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start, self.end, self.next = state["start"], state["end"], state["next"]
        self.loaded = True


def shard(worker_id: int) -> None:
    """The ``worker_init_fn`` of torch's ``IterableDataset`` documentation."""
    info = get_worker_info()
    dataset = info.dataset
    overall_start, overall_end = dataset.start, dataset.end
    per_worker = math.ceil((overall_end - overall_start) / info.num_workers)
    dataset.start = overall_start + worker_id * per_worker
    dataset.end = min(dataset.start + per_worker, overall_end)


class OwnIterator(IterableDataset):
    """An iterable that is its own iterator, ``Stateful``: ``iter()`` starts a pass (each
    worker reads every ``num_workers``-th value from its id) and returns the object."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos, self.step = 0, 1

    def __iter__(self) -> OwnIterator:
        info = get_worker_info()
        self.pos, self.step = (info.id, info.num_workers) if info is not None else (0, 1)
        return self

    def __next__(self) -> int:
        if self.pos >= self.n:
            raise StopIteration
        self.pos += self.step
        return self.pos - self.step

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos, self.step = state["pos"], state["step"]


@dataclass(frozen=True)
class Case:
    """A dataset and the loader arguments it is read with (built anew for every loader)."""

    dataset: Callable[[], Any]
    options: Callable[[], dict[str, Any]] = field(default=dict)
    savable: bool = True
    #: The order of an epoch begun after one left early is not torch's (README, Limits):
    #: torch's RandomSampler draws part of its permutation only once its iterator runs
    #: out, so torch's next order depends on how far (prefetching included) the left
    #: epoch was read; the loader draws every epoch whole, so it gives the order torch
    #: gives after a complete epoch. Loops are compared as multisets of items then.
    order_after_a_cut: bool = True


CASES = {
    "list": Case(lambda: list(range(12))),
    "shuffled": Case(
        lambda: list(range(14)),
        lambda: {"shuffle": True, "generator": torch.Generator().manual_seed(7)},
        order_after_a_cut=False,
    ),
    "worker_shards": Case(lambda: WorkerShards(3, 15), savable=False),
    "init_fn": Case(lambda: Range(3, 11), lambda: {"worker_init_fn": shard}, savable=False),
    "stateful_init_fn": Case(lambda: StatefulRange(3, 11), lambda: {"worker_init_fn": shard}),
    "own_iterator": Case(lambda: OwnIterator(13)),
}
SAVABLE = [name for name, case in CASES.items() if case.savable]

#: (num_workers, persistent_workers)
LAYOUTS = {"0": (0, False), "2": (2, False), "3p": (3, True)}


def _build(cls: type, name: str, layout: str) -> Any:
    num_workers, persistent = LAYOUTS[layout]
    case = CASES[name]
    return cls(
        case.dataset(),
        batch_size=BATCH,
        num_workers=num_workers,
        persistent_workers=persistent,
        **case.options(),
    )


def _plain(batch: Any) -> Any:
    return batch.tolist() if isinstance(batch, torch.Tensor) else batch


def _loop(loader: Any) -> list[Any]:
    return [_plain(batch) for batch in loader]


def _peek(loader: Any) -> Any:
    return _plain(next(iter(loader)))


def _head(loader: Any, count: int) -> list[Any]:
    """The first ``count`` batches of a ``for`` loop left with ``break``."""
    out = []
    for batch in loader:
        out.append(_plain(batch))
        if len(out) == count:
            break
    return out


def _close(loader: Any) -> None:
    if isinstance(loader, SavableDataLoader):
        loader.close()


# -- the scenarios: a script over a loader, run with both classes ----------------------


def peek_then_loop(loader: Any) -> Any:
    return [_peek(loader), _loop(loader)]


def break_then_loop(loader: Any) -> Any:
    return [_head(loader, BREAK_AFTER), _loop(loader)]


def two_loops(loader: Any) -> Any:
    return [_loop(loader), _loop(loader)]


def peeks_in_a_row(loader: Any) -> Any:
    return [_peek(loader), _peek(loader), _peek(loader), _loop(loader)]


def length(loader: Any) -> Any:
    try:
        return len(loader)
    except TypeError:  # an IterableDataset without __len__; the message says more here
        return "TypeError"


def loops_of_a_day(loader: Any) -> Any:
    """The scenarios above one after another on one loader: with workers, each
    ``iter()`` costs a start (or a reset) of the workers."""
    return [
        ("peek", _peek(loader)),
        ("peek again", _peek(loader)),
        ("loop after peeks", _loop(loader)),
        ("break", _head(loader, BREAK_AFTER)),
        ("loop after a break", _loop(loader)),
        ("loop after a loop", _loop(loader)),
        ("len", length(loader)),
    ]


SCENARIOS = [peek_then_loop, break_then_loop, two_loops, peeks_in_a_row, length]


def _run(cls: type, name: str, layout: str, scenario: Callable[[Any], Any]) -> Any:
    loader = _build(cls, name, layout)
    try:
        return scenario(loader)
    except Exception as error:  # a crash is an outcome to compare, reported with the rest
        if cls is DataLoader:
            raise
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        return f"raised {type(error).__name__}: {(lines or [''])[-1][:300]}"
    finally:
        _close(loader)


def _items_of_loops(outcome: Any) -> Any:
    """``outcome`` with every loop (a list of batches) as the sorted list of its items and
    every other batch as its size: what an epoch begun after a cut must agree on."""
    if isinstance(outcome, tuple):  # a labelled part of loops_of_a_day
        label, value = outcome
        return label, len(value) if label == "break" else _items_of_loops(value)
    if not isinstance(outcome, list):
        return outcome
    if outcome and all(isinstance(b, list) for b in outcome):
        if all(all(not isinstance(i, list) for i in batch) for batch in outcome):
            return sorted(item for batch in outcome for item in batch)
        return [_items_of_loops(part) for part in outcome]
    return len(outcome)


def _after_the_first(outcome: Any) -> Any:
    """``outcome`` of a scenario, its first part exact and the rest by ``_items_of_loops``."""
    if isinstance(outcome, list) and outcome:
        return [outcome[0], *(_items_of_loops(part) for part in outcome[1:])]
    return outcome


def _assert_as_torch(name: str, layout: str, scenarios: list[Callable[[Any], Any]]) -> None:
    failures = []
    for scenario in scenarios:
        expected = _run(DataLoader, name, layout, scenario)
        got = _run(SavableDataLoader, name, layout, scenario)
        if not CASES[name].order_after_a_cut and scenario is not two_loops:
            expected, got = _after_the_first(expected), _after_the_first(got)
        if got != expected:
            failures.append(f"{scenario.__name__}:\n  torch {expected}\n  here  {got}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", list(CASES))
def test_no_workers_iterate_as_torch(name: str) -> None:
    _assert_as_torch(name, "0", SCENARIOS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["list", "shuffled", "stateful_init_fn"])
def test_two_workers_started_each_epoch_iterate_as_torch(name: str) -> None:
    _assert_as_torch(name, "2", [loops_of_a_day])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_three_persistent_workers_iterate_as_torch(name: str) -> None:
    _assert_as_torch(name, "3p", [loops_of_a_day])


def test_the_issues_peek_example() -> None:
    """``list(range(8))``, batches of 2, two workers: torch yields the whole epoch after
    a peek."""
    with SavableDataLoader(list(range(8)), batch_size=2, num_workers=2) as loader:
        next(iter(loader))
        assert _loop(loader) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_the_issues_worker_init_fn_example() -> None:
    """A ``Stateful`` dataset over ``range(3, 11)`` sharded by ``worker_init_fn``: each
    value once, as with torch (nothing restored over what ``worker_init_fn`` set)."""
    options = {"batch_size": None, "num_workers": 2, "worker_init_fn": shard}
    expected = list(DataLoader(StatefulRange(3, 11), **options))
    with SavableDataLoader(StatefulRange(3, 11), **options) as loader:
        got = list(loader)
    assert got == expected
    assert sorted(got) == list(range(3, 11))


# -- saves and restores ----------------------------------------------------------------


def _through_a_file(loader: SavableDataLoader[Any]) -> Any:
    return decode_state(encode_state(loader.save_state_rank()))


def _continuations(name: str, layout: str, state: Any, saver: SavableDataLoader[Any]) -> Any:
    """Two loops of a fresh loader restored from ``state``, and two of ``saver`` restored
    from its own state: the rest of the saved epoch, then the next one."""
    with _build(SavableDataLoader, name, layout) as fresh:
        fresh.restore_state_rank(state)
        restored = [_loop(fresh), _loop(fresh)]
    saver.restore_state_rank(state)
    own = [_loop(saver), _loop(saver)]
    return restored, own


def _torchs_epochs(name: str, layout: str, count: int) -> list[list[Any]]:
    loader = _build(DataLoader, name, layout)
    return [_loop(loader) for _ in range(count)]


def _assert_resumed(head: list[Any], restored: Any, own: Any, expected: list[list[Any]]) -> None:
    assert restored == own, "a fresh loader and the saver restored from one state differ"
    assert head + restored[0] == expected[0], "the saved epoch did not continue"
    assert restored[1] == expected[1], "the epoch after the saved one is not torch's"


def _layouts(with_workers: list[tuple[str, str]]) -> list[Any]:
    """Every savable dataset without workers, and ``with_workers`` (marked slow)."""
    return [pytest.param(name, "0", id=f"0-{name}") for name in SAVABLE] + [
        pytest.param(name, layout, id=f"{layout}-{name}", marks=pytest.mark.slow)
        for name, layout in with_workers
    ]


@pytest.mark.parametrize(
    ("name", "layout"),
    _layouts([("shuffled", "2"), ("stateful_init_fn", "3p")]),
)
def test_a_break_saves_the_half_read_epoch(name: str, layout: str) -> None:
    with _build(SavableDataLoader, name, layout) as saver:
        head = _head(saver, BREAK_AFTER)
        state = _through_a_file(saver)
        restored, own = _continuations(name, layout, state, saver)
    _assert_resumed(head, restored, own, _torchs_epochs(name, layout, 2))


@pytest.mark.parametrize(("name", "layout"), _layouts([("list", "3p")]))
def test_a_peek_saves_the_epoch_it_began(name: str, layout: str) -> None:
    with _build(SavableDataLoader, name, layout) as saver:
        head = [_peek(saver)]
        state = _through_a_file(saver)
        restored, own = _continuations(name, layout, state, saver)
    _assert_resumed(head, restored, own, _torchs_epochs(name, layout, 2))


@pytest.mark.parametrize(("name", "layout"), _layouts([("shuffled", "3p")]))
def test_a_save_in_the_epoch_after_a_break_restores_there(name: str, layout: str) -> None:
    """Break in epoch 0, then a new loop (epoch 1) left after one batch: the state saved
    there restores into epoch 1, and the rest and epoch 2 are torch's."""
    with _build(SavableDataLoader, name, layout) as saver:
        _head(saver, BREAK_AFTER)
        head = _head(saver, 1)
        state = _through_a_file(saver)
        restored, own = _continuations(name, layout, state, saver)
    _assert_resumed(head, restored, own, _torchs_epochs(name, layout, 3)[1:])


@pytest.mark.parametrize("name", SAVABLE)
def test_a_state_saved_right_after_iter_restores_over_a_dataset_already_read(
    name: str,
) -> None:
    """Issue point 5 (``own_iterator``): saved after ``iter()`` before any ``next()``; the
    first loader then reads its epoch; a second loader over the same dataset object,
    restored from the state, yields that whole epoch again."""
    dataset = CASES[name].dataset() if name != "own_iterator" else OwnIterator(100)
    options = {**CASES[name].options(), "batch_size": None}
    with SavableDataLoader(dataset, **options) as first:
        iterator = iter(first)
        state = _through_a_file(first)
        epoch = [_plain(item) for item in iterator]
    with SavableDataLoader(dataset, **options) as second:
        second.restore_state_rank(state)
        again = _loop(second)
    assert len(again) == len(epoch)
    assert again == epoch
    if name == "own_iterator":
        assert len(epoch) == 100


@pytest.mark.parametrize("layout", ["0", pytest.param("2", marks=pytest.mark.slow)])
def test_an_epoch_after_one_left_early_is_ordered_as_after_a_whole_one(layout: str) -> None:
    """The documented difference for ``shuffle=True`` with a ``generator``: the epoch
    that follows a peek or a ``break`` is the one torch gives after a complete epoch."""
    whole = _run(SavableDataLoader, "shuffled", layout, two_loops)
    assert whole == _run(DataLoader, "shuffled", layout, two_loops)
    after_peek = _run(SavableDataLoader, "shuffled", layout, peek_then_loop)
    after_break = _run(SavableDataLoader, "shuffled", layout, break_then_loop)
    assert after_peek == [whole[0][0], whole[1]]
    assert after_break == [whole[0][:BREAK_AFTER], whole[1]]
