"""The cursor-level resume check: a stage resumes exactly, in one process, in a second.

:func:`assert_cursor_resumes_exactly` reads a stage through one cursor for a few epochs
and takes its state at every position: before the first item, after every item, and
after every epoch's end. Each state goes through the state file's encoding (plain data,
msgpack behind the checked header) into a fresh cursor of a fresh copy of the stage,
which must then read exactly the rest of the reference stream, later epochs included;
the restored cursor's ``state()`` must give the state back. From every position it also
skips (``skip(k)`` must pass what reading passes, and the stream must go on as after
reading) and chains (restore, read a few items, save, restore again). The global
generators (``random``, ``numpy.random``, torch) are part of every saved position, as
the loader's checkpoints make them, so stages whose items draw from them are checked
too. The loader-level harness (:func:`assert_resumes_exactly`) adds workers, batching,
prefetch and the file round trip of a whole loader; this check is what a stage author
runs while writing the stage.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import rng, serialization
from ..config import WorkerContext
from ..datasets.adapt import as_stage
from ..datasets.protocol.cursor import Cursor
from ..datasets.protocol.stage import Stage
from ..plain import plain_copy
from .digests import digest
from .divergence import ResumeMismatch

__all__ = ["CursorReport", "assert_cursor_resumes_exactly"]

_END = "<end of epoch>"
_DEFAULT_CONTEXTS = (WorkerContext(0, 1, 0, 0, 0, None),)


@dataclass
class CursorReport:
    """What :func:`assert_cursor_resumes_exactly` checked.

    Attributes:
        items_per_epoch: Per context checked, the items of each epoch of the reference.
        restores: Fresh cursors restored and compared (skips and chains included).
    """

    items_per_epoch: list[list[int]] = field(default_factory=list)
    restores: int = 0


@dataclass(frozen=True)
class _Point:
    """A position of the reference reading: what came before it, what it saved."""

    index: int
    epoch: int
    state: Any
    generators: rng.RngSnapshot


def assert_cursor_resumes_exactly(
    stage: Any,
    contexts: Sequence[WorkerContext] = _DEFAULT_CONTEXTS,
    *,
    epochs: int = 3,
    skips: Sequence[int] = (1, 2, 5, 1000),
    chain_items: Sequence[int] = (1, 3),
    seed: int = 0,
) -> CursorReport:
    """Asserts that ``stage`` resumes exactly from every position of a few epochs.

    Args:
        stage: A stage (or anything :func:`~savable_loader.datasets.as_stage` takes). It
            is deep-copied for every cursor, so a dataset that holds its own position is
            never read by two cursors at once.
        contexts: The ranks and workers to read for (each checked on its own).
        epochs: Epochs of the reference reading.
        skips: From every position, also skip this many items and compare.
        chain_items: From every position, also read this many items after the restore,
            save again and restore into another cursor.
        seed: Seed of the global generators at the start of the reference reading.

    Returns:
        What was checked.

    Raises:
        ResumeMismatch: A restored cursor diverged, or gave another state back, or a
            skip passed another number of items than reading; the message names the
            context, the position and what differs.
    """
    report = CursorReport()
    pipeline = as_stage(stage)
    for context in contexts:
        checker = _Checker(pipeline, context, epochs, seed)
        report.items_per_epoch.append(checker.lengths)
        for point in checker.points:
            checker.resume(point)
            for k in skips:
                checker.skip(point, k)
            for count in chain_items:
                checker.chain(point, count)
        report.restores += checker.restores
    return report


class _Checker:
    def __init__(self, stage: Stage[Any], context: WorkerContext, epochs: int, seed: int) -> None:
        self.stage = stage
        self.context = context
        self.epochs = epochs
        self.restores = 0
        self.stream: list[str] = []
        self.points: list[_Point] = []
        self.lengths: list[int] = []
        cursor = self._fresh()
        generators = rng.OwnGenerators.seeded(seed)
        with generators:
            cursor.restore(None)
        for epoch in range(epochs):
            self.points.append(self._point(cursor, generators, epoch))
            count = 0
            while True:
                with generators:
                    item = next(cursor, _END)
                if item is _END:
                    self.stream.append(_END)
                    break
                self.stream.append(digest(item))
                count += 1
                self.points.append(self._point(cursor, generators, epoch))
            self.lengths.append(count)
        cursor.close()

    def _fresh(self) -> Cursor[Any]:
        stage: Stage[Any] = copy.deepcopy(self.stage)
        return stage.cursor(self.context)

    def _point(self, cursor: Cursor[Any], generators: rng.OwnGenerators, epoch: int) -> _Point:
        state = _through_a_file(plain_copy(cursor.state()))
        return _Point(len(self.stream), epoch, state, generators.snapshot)

    def _where(self, point: _Point, what: str) -> str:
        ctx = self.context
        return (
            f"rank {ctx.rank} worker {ctx.worker_id} of {ctx.world_size} x "
            f"{max(ctx.num_workers, 1)}, epoch {point.epoch}, after {point.index} events of "
            f"the reading ({what})"
        )

    def _restored(self, point: _Point) -> tuple[Cursor[Any], rng.OwnGenerators]:
        cursor = self._fresh()
        generators = rng.OwnGenerators(point.generators)
        with generators:
            cursor.restore(copy.deepcopy(point.state))
        self.restores += 1
        given = _through_a_file(plain_copy(cursor.state()))
        if given != point.state:
            raise ResumeMismatch(
                f"{self._where(point, 'restore')}: state() after restore(state) differs "
                f"from the state: {given!r} != {point.state!r}"
            )
        return cursor, generators

    def _compare(
        self, cursor: Cursor[Any], generators: rng.OwnGenerators, start: int, what: str
    ) -> None:
        epochs_left = self.stream[start:].count(_END)
        got: list[str] = []
        ends = 0
        # The cursor's generators stay in place for the whole comparison: nothing between
        # two items draws (a digest does not), and swapping them per item cost most of a
        # check of a cheap stage.
        with generators:
            while ends < epochs_left:
                item = next(cursor, _END)
                ends += item is _END
                got.append(_END if item is _END else digest(item))
                if len(got) > len(self.stream) - start:
                    break
        cursor.close()
        want = self.stream[start:]
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
            at = min(len(got), len(want)) if at is None else at
            raise ResumeMismatch(
                f"{what}: the restored cursor diverges {at} events after its start: got "
                f"{_event(got, at)}, expected {_event(want, at)}"
            )

    def resume(self, point: _Point) -> None:
        cursor, generators = self._restored(point)
        self._compare(cursor, generators, point.index, self._where(point, "restored"))

    def skip(self, point: _Point, k: int) -> None:
        cursor, generators = self._restored(point)
        with generators:
            passed = cursor.skip(k)
        rest = self.stream[point.index :]
        end = rest.index(_END) if _END in rest else len(rest)
        expected = min(k, end)
        if passed != expected:
            raise ResumeMismatch(
                f"{self._where(point, f'skip({k})')}: skip passed {passed} items, reading "
                f"passes {expected}"
            )
        crossed = 1 if k > end else 0  # fewer than k: the epoch's end was crossed too
        self._compare(
            cursor, generators, point.index + passed + crossed, self._where(point, f"skip({k})")
        )

    def chain(self, point: _Point, count: int) -> None:
        rest = self.stream[point.index :]
        if count >= (rest.index(_END) if _END in rest else len(rest)):
            return
        cursor, generators = self._restored(point)
        for _ in range(count):
            with generators:
                next(cursor)
        again = _Point(
            point.index + count,
            point.epoch,
            _through_a_file(plain_copy(cursor.state())),
            generators.snapshot,
        )
        cursor.close()
        self.resume(again)


def _through_a_file(state: Any) -> Any:
    """``state`` after the state file's encoding and decoding."""
    loaded = serialization.loads(serialization.dumps({"state": state}))
    assert isinstance(loaded, dict)
    return loaded["state"]


def _event(events: list[str], index: int) -> str:
    if index >= len(events):
        return "nothing (the reading ended)"
    return "the end of the epoch" if events[index] == _END else f"an item ({events[index]})"
