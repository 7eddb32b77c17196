"""The uninterrupted reference run: epoch lengths, the choice of save points, the runs
the check will make, and the digest and producing worker of every item with the states
saved on the way.
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


@dataclass(frozen=True)
class _Point:
    label: str
    epoch: int
    index: int
    between: bool
    boundary: bool
    state: RankState

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


def _epoch_lengths(build: Callable[[], SavableDataLoader[Any]], epochs: int) -> list[int]:
    # A first pass learns the epoch lengths, to choose save points that fall inside them.
    loader = build()
    try:
        return [sum(1 for _ in loader) for _ in range(epochs)]
    finally:
        loader.close()


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


def _planned_runs(
    lengths: list[int], chosen: set[int], chain_items: Sequence[int], boundaries: bool
) -> int:
    """Loader runs the check makes: two reference passes, restores and chains."""
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
    return runs


def _reference_run(
    build: Callable[[], SavableDataLoader[Any]],
    lengths: list[int],
    chosen: set[int],
    boundaries: bool,
) -> tuple[_Reference, list[_Point]]:
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
    finally:
        loader.close()
    return reference, saved
