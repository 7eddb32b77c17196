"""Restores and comparison: a state sent through the state file encoding, restored into
fresh loaders whose items are compared with the reference run, and the first difference
described.

NOTE [ Divergence detail ]
The reference run keeps a digest of every item (tensors by dtype, shape and bytes) and the
worker that produced it, so the harness holds little memory however long the stream. When
a resumed loader yields an item whose digest differs, the harness knows the resumed item
and its worker (``SavableDataLoader.last_worker``) but not the expected item: it runs the
reference once more up to that position to fetch it, then compares the two structurally
(dict keys, sequence indices, tensor dtype, shape and values). The details ride on
:class:`ResumeMismatch` as attributes, for tools, and in its message, for people.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

from ..loader import SavableDataLoader
from ..state.models import RankState
from .digests import digest
from .divergence import ResumeMismatch, _differences, _short
from .files import roundtrip
from .reference import _Reference

logger = logging.getLogger(__name__)


class _Checker:
    """Restores states into fresh loaders and compares their items with the reference:
    to its end, or over the epoch a loader resumes in and ``later_epochs`` more."""

    def __init__(
        self,
        build: Callable[[], SavableDataLoader[Any]],
        reference: _Reference,
        later_epochs: int | None = None,
    ) -> None:
        self._build = build
        self._reference = reference
        self._later_epochs = later_epochs

    def resume(
        self,
        state: RankState,
        start: tuple[int, int],
        label: str,
        *,
        saves: Collection[int] = (),
    ) -> dict[int, RankState]:
        """Restores ``state`` into a fresh loader; checks it yields the reference from
        ``start`` on. Also saves after each count of ``saves`` items, going on after each
        save; returns those states by count, sent through the state file encoding."""
        loader = self._build()
        try:
            loader.restore_state_rank(state)
            return self._consume(loader, start, label, limit=None, saves=saves)
        finally:
            loader.close()

    def remaining(self, start: tuple[int, int]) -> int:
        """Items of the first epoch a loader resumed at ``start`` still yields."""
        return self._reference.remaining(start)

    def chained(self, state: RankState, start: tuple[int, int], count: int, label: str) -> None:
        """Restores ``state``, saved ``count`` items after a restore at ``start``, into a
        fresh loader and checks it."""
        epoch, position = start
        self.resume(
            state,
            (epoch, position + count),
            f"{label}, then {_plural(count, 'item')}, saved and restored again",
        )

    def chain(self, state: RankState, start: tuple[int, int], count: int, label: str) -> None:
        """Restores, consumes ``count`` items, saves, restores into another loader."""
        first = self._build()
        try:
            first.restore_state_rank(state)
            self._consume(first, start, label, limit=count)
            again = roundtrip(first.save_state_rank())
        finally:
            first.close()
        self.chained(again, start, count, label)

    def _consume(
        self,
        loader: SavableDataLoader[Any],
        start: tuple[int, int],
        label: str,
        limit: int | None,
        saves: Collection[int] = (),
    ) -> dict[int, RankState]:
        digests = self._reference.digests
        epoch, position = start
        end = len(digests)
        if self._later_epochs is not None:
            end = min(end, epoch + 1 + self._later_epochs)
        after = 0
        saved: dict[int, RankState] = {}
        while epoch < end:
            want = digests[epoch]
            for item in loader:
                if position >= len(want) or digest(item) != want[position]:
                    raise self._mismatch(label, epoch, position, after, item, loader.last_worker)
                position += 1
                after += 1
                if after in saves:
                    saved[after] = roundtrip(loader.save_state_rank())
                if after == limit:
                    return saved
            if position < len(want):
                raise self._mismatch(label, epoch, position, after, None, None)
            epoch += 1
            position = 0
        return saved

    def _mismatch(
        self,
        label: str,
        epoch: int,
        position: int,
        after: int,
        got: Any,
        worker: int | None,
    ) -> ResumeMismatch:
        reference = self._reference
        length = len(reference.digests[epoch])
        extra = position >= length
        expected_worker = None if extra else reference.workers[epoch][position]
        expected, note = (None, "") if extra else self._fetch(epoch, position)
        nth = _ordinal(after + 1)
        fields: list[str] = []
        differences: list[str] = []
        if got is None:
            head = (
                f"resumed epoch {epoch} ended early: {position} items, expected {length} "
                f"(item {position + 1}, its {nth} after the restore, is missing)"
            )
        elif extra:
            head = (
                f"resumed epoch {epoch} goes on past its end: more than {length} items, "
                f"expected {length} (item {position + 1}, its {nth} after the restore, from "
                f"{_worker_text(worker, None)})"
            )
        else:
            pairs = _differences(expected, got, "") if expected is not None else []
            fields = [path for path, _ in pairs]
            differences = [f"{path}: {text}" for path, text in pairs]
            head = (
                f"resumed epoch {epoch} differs at item {position + 1} (its {nth} item after "
                f"the restore; {_worker_text(worker, expected_worker)})"
            )
            if fields:
                head += f" in fields {fields}"
        lines = [f'at save point "{label}": {head}']
        lines += [f"  {line}" for line in differences]
        if expected is not None:
            lines.append(f"  expected: {_short(expected)}")
        if got is not None:
            lines.append(f"  got:      {_short(got)}")
        if note:
            lines.append(f"  note: {note}")
        return ResumeMismatch(
            "\n".join(lines),
            point=label,
            epoch=epoch,
            position=position,
            after_restore=after,
            worker=worker,
            expected_worker=expected_worker,
            fields=fields,
            differences=differences,
            expected=expected,
            got=got,
        )

    def _fetch(self, epoch: int, position: int) -> tuple[Any, str]:
        """Runs the reference again to fetch its item at (epoch, position): NOTE [ Divergence
        detail ]. Returns the item (None if it could not be had) and a note."""
        loader = self._build()
        try:
            for current in range(epoch + 1):
                for index, item in enumerate(loader):
                    if current == epoch and index == position:
                        if digest(item) != self._reference.digests[epoch][position]:
                            return item, (
                                "a new uninterrupted run yields another item here: the "
                                "pipeline is not deterministic for a given seed"
                            )
                        return item, ""
        except Exception as error:  # the check failed already; report it without the item
            logger.debug("fetching the expected item failed", exc_info=True)
            return None, f"the expected item could not be fetched again ({error!r})"
        finally:
            loader.close()
        return None, "a new uninterrupted run ended before this item"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _ordinal(number: int) -> str:
    if 10 <= number % 100 <= 20:
        return f"{number}th"
    return f"{number}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(number % 10, 'th') }"


def _worker_text(worker: int | None, expected: int | None) -> str:
    if worker is None and expected is None:
        return "main process"
    if expected is None or worker == expected:
        return f"worker {worker}"
    return f"worker {worker}; worker {expected} in the uninterrupted run"
