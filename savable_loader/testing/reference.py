"""The reference runs: a first pass that learns the epoch lengths, the choice of save
points, the runs the check will make, and the run that saves states on the way, with
the digest and producing worker of every item of both.

NOTE [ A peek and a break after the last epoch ]
A training loop does not always read an epoch from ``iter()`` to StopIteration: it peeks
(``next(iter(loader))``, the iterator dropped at once) or leaves a loop with ``break``,
and saves there. A new ``iter()`` begins a new epoch, except the first one after a
restore, which continues the restored one; so such a state must restore to its mid-epoch
position. After their epochs both reference runs begin one more (epoch E), each as a loop
would, from a loader never restored: the first pass peeks at its first item, saves, then
restores that state into itself and reads the rest of the epoch (the saver's own
continuation); the saving run breaks a loop a few items in and saves. Fresh loaders
restored from the two states must yield the rest of epoch E as the first pass read it,
and the saving run's items before its break must be the first pass's. Epoch E costs one
epoch and a few items; the other save points are compared up to its start, as before.
Both runs read epoch E after full epochs: what a new epoch after a peek or a break
holds is not compared here, since with workers or the global generators it may depend on
how much of the epoch before was read (tests/loader/test_torch_semantics.py compares it with
torch's).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..loader import SavableDataLoader
from ..state.models import RankState
from .digests import digest
from .divergence import ResumeMismatch
from .files import roundtrip


@dataclass(frozen=True)
class _Point:
    label: str
    epoch: int
    index: int
    between: bool
    boundary: bool
    state: RankState
    interruption: bool = False

    def start(self) -> tuple[int, int]:
        """Where a loader restored from this point continues: (epoch, position)."""
        return (self.epoch + 1, 0) if self.between else (self.epoch, self.index)


@dataclass
class _Reference:
    """Digest and producing worker of every item of the uninterrupted run, per epoch."""

    digests: list[list[str]]
    workers: list[list[int | None]]

    def remaining(self, start: tuple[int, int]) -> int:
        """Items of the first epoch a loader resumed at ``start`` still yields."""
        epoch, position = start
        return len(self.digests[epoch]) - position if epoch < len(self.digests) else 0


@dataclass
class _Run:
    """A reference run: its stream, the states it saved, and the error it raised after
    restoring its own state (reported after the restores into fresh loaders)."""

    reference: _Reference
    saved: list[_Point]
    failure: tuple[str, Exception] | None = None


def _first_pass(
    build: Callable[[], SavableDataLoader[Any]], epochs: int, interruptions: bool
) -> _Run:
    """Reads ``epochs`` epochs (their lengths choose the save points), then peeks at epoch
    E, saves, restores into itself and reads the rest of it (NOTE [ A peek and a break
    after the last epoch ])."""
    loader = build()
    run = _Run(_Reference([], []), [])
    try:
        for _ in range(epochs + interruptions):
            run.reference.digests.append([])
            run.reference.workers.append([])
        for epoch in range(epochs):
            for item in loader:
                run.reference.digests[epoch].append(digest(item))
                run.reference.workers[epoch].append(loader.last_worker)
        if interruptions:
            _peek(loader, run, epochs)
    finally:
        loader.close()
    return run


def _peek(loader: SavableDataLoader[Any], run: _Run, epoch: int) -> None:
    first = next(iter(loader), _END)
    if first is _END:
        return
    _record(run, epoch, first, loader.last_worker)
    total = sum(len(digests) for digests in run.reference.digests)
    label = f"epoch {epoch}, after item 1 (item {total} overall), a peek: next(iter(loader))"
    state = loader.save_state_rank()
    run.saved.append(_Point(label, epoch, 1, False, False, state, True))
    try:
        loader.restore_state_rank(roundtrip(state))
        for item in loader:
            _record(run, epoch, item, loader.last_worker)
    except Exception as error:
        run.failure = (label, error)


def _record(run: _Run, epoch: int, item: Any, worker: int | None) -> None:
    run.reference.digests[epoch].append(digest(item))
    run.reference.workers[epoch].append(worker)


_END = object()


def _choose_points(
    lengths: list[int],
    points: Iterable[int] | None,
    num_points: int,
    seed: int,
    last_items: bool,
) -> set[int]:
    if points is not None:
        return set(points)
    total = sum(lengths)
    rng = random.Random(seed)
    starts = [sum(lengths[:e]) for e in range(len(lengths))]
    chosen = set(rng.sample(range(1, total + 1), min(num_points, total))) if total else set()
    chosen.update(start + 1 for start, length in zip(starts, lengths, strict=True) if length)
    if last_items:
        chosen.update(start + length for start, length in zip(starts, lengths, strict=True))
    chosen.discard(0)
    return chosen


def _break_at(length: int) -> int:
    """After how many items of epoch E the saving run breaks its loop: a few, not 1 (the
    peek's) unless the epoch has only 1 item; 0 (no break) if it has none."""
    return min(3, max(1, length - 1))


def _planned_runs(
    lengths: list[int],
    chosen: set[int],
    chain_items: Sequence[int],
    boundaries: bool,
    tail: Sequence[tuple[int, int]] = (),
) -> int:
    """Loader runs the check makes: two reference passes, restores and chains; ``tail``:
    where the restores in epoch E start (NOTE [ A peek and a break after the last epoch ])."""
    total = sum(lengths)
    starts: list[tuple[int, int]] = []
    if boundaries:
        starts.append((0, 0))
        for epoch in range(len(lengths)):
            starts += [(epoch, 0), (epoch + 1, 0)]
    count = 0
    for epoch, length in enumerate(lengths):
        for position in range(1, length + 1):
            count += 1
            if count in chosen and count <= total:
                starts.append((epoch, position))
    runs = 2 + len(starts) + (1 if starts else 0)
    for epoch, position in starts:
        remaining = lengths[epoch] - position if epoch < len(lengths) else 0
        runs += sum(1 for items in chain_items if remaining > items)
    for position, length in tail:
        runs += 1 + sum(1 for items in chain_items if length - position > items)
    return runs


def _reference_run(
    build: Callable[[], SavableDataLoader[Any]],
    lengths: list[int],
    chosen: set[int],
    boundaries: bool,
    break_at: int = 0,
) -> _Run:
    """Reads the epochs saving on the way, then breaks a loop of epoch E after
    ``break_at`` items and saves (NOTE [ A peek and a break after the last epoch ])."""
    loader = build()
    reference = _Reference([], [])
    saved: list[_Point] = []
    if boundaries:
        saved.append(_Point("before iter()", 0, 0, False, True, loader.save_state_rank()))
    count = 0
    try:
        for epoch, length in enumerate(lengths):
            iterator = iter(loader)
            if boundaries:
                label = f"epoch {epoch}, after iter()"
                saved.append(_Point(label, epoch, 0, False, True, loader.save_state_rank()))
            digests: list[str] = []
            workers: list[int | None] = []
            for item in iterator:
                digests.append(digest(item))
                workers.append(loader.last_worker)
                count += 1
                if count in chosen:
                    label = f"epoch {epoch}, after item {len(digests)} (item {count} overall)"
                    state = loader.save_state_rank()
                    saved.append(_Point(label, epoch, len(digests), False, False, state))
            if len(digests) != length:
                raise ResumeMismatch(
                    f"epoch {epoch} has {len(digests)} items in one run and {length} in "
                    "another: the pipeline is not deterministic for a given seed"
                )
            reference.digests.append(digests)
            reference.workers.append(workers)
            if boundaries:
                label = f"epoch {epoch}, after StopIteration"
                saved.append(_Point(label, epoch, length, True, True, loader.save_state_rank()))
        run = _Run(reference, saved)
        if break_at:
            _break(loader, run, len(lengths), break_at, count)
    finally:
        loader.close()
    return run


def _break(loader: SavableDataLoader[Any], run: _Run, epoch: int, at: int, count: int) -> None:
    run.reference.digests.append([])
    run.reference.workers.append([])
    for item in loader:
        _record(run, epoch, item, loader.last_worker)
        if len(run.reference.digests[epoch]) == at:
            break
    index = len(run.reference.digests[epoch])
    label = f"epoch {epoch}, after item {index} (item {count + index} overall), then a break"
    run.saved.append(_Point(label, epoch, index, False, False, loader.save_state_rank(), True))


def _check_runs(first: _Run, saving: _Run) -> None:
    """Raises if the first pass failed after restoring its own state, or the saving run's
    items of epoch E differ from the first pass's (NOTE [ A peek and a break after the
    last epoch ])."""
    if first.failure is not None:
        label, error = first.failure
        raise ResumeMismatch(
            f'at save point "{label}": the loader that saved there, restored from its own '
            f"state, raised {error!r}",
            point=label,
        ) from error
    if len(saving.reference.digests) <= len(first.reference.digests) - 1 or not first.saved:
        return
    epoch = len(first.reference.digests) - 1
    want, got = first.reference.digests[epoch], saving.reference.digests[epoch]
    at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
    if at is None and len(got) <= len(want):
        return
    at = len(want) if at is None else at
    label = first.saved[0].label
    raise ResumeMismatch(
        f'at save point "{label}": the loader that saved there, restored from its own '
        f"state, goes on otherwise than an uninterrupted run: epoch {epoch} differs at "
        f"item {at + 1}",
        point=label,
        epoch=epoch,
        position=at,
    )
