"""Check that a pipeline resumes exactly: the resume-equivalence harness and ``verify``.

:func:`assert_resumes_exactly` runs a loader uninterrupted over several epochs and saves
its state at many points on the way: before ``iter()``, right after ``iter()`` before any
item, after chosen items (optionally after the last item of every epoch) and after each
StopIteration. Each state goes through the state file encoding (msgpack with header and
checksum) and into a fresh loader, which must then yield exactly what the uninterrupted
run yielded from that point on, later epochs included. Optionally each resumed run
consumes a few items, saves again and is restored into yet another loader (a chain), and
the first state is restored twice to check that restoring neither changes the state nor
depends on the loader it goes into.

:func:`verify` is the same check for a user's factory (of a dataset or of a loader) with
dense checkpoints, behind ``savable-loader verify MODULE:FACTORY``.

Use it on your own pipeline::

    from savable_loader.testing import assert_resumes_exactly, verify
    assert_resumes_exactly(lambda: SavableDataLoader(MyDataset(), batch_size=8, num_workers=2))
    verify(MyDataset, num_workers=2)

This module is past 400 lines: besides the harness it describes a divergence (which
fields of which item differ), and the two are one tool.

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

import hashlib
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from . import serialization
from .config import WorkerConfig
from .errors import ConfigError
from .loader import SavableDataLoader
from .state.files import state_from_payload
from .state.models import RankState

__all__ = [
    "Progress",
    "ResumeMismatch",
    "ResumeReport",
    "VerifyReport",
    "assert_resumes_exactly",
    "digest",
    "roundtrip",
    "verify",
]

logger = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
"""Called as ``progress(done, total)`` as the check advances (runs of a loader)."""

_VERIFY_WORKERS = 2
_SHORT = 160


class ResumeMismatch(AssertionError):
    """A restored loader did not continue the uninterrupted stream exactly.

    Messages count items from 1, as the save point labels do ("after item 7" is followed
    by item 8); :attr:`position` is 0-based. Attributes other than the message are None
    (or empty) when they do not apply, e.g. for a pipeline that is not deterministic.

    Attributes:
        point: Label of the save point whose restore diverged.
        epoch: Epoch (of the uninterrupted run) of the first differing item.
        position: Its 0-based index within that epoch.
        after_restore: Items the resumed loader yielded before it (0: its first).
        worker: Worker that produced the resumed loader's item; None without workers,
            or when the resumed loader ended early.
        expected_worker: Worker that produced the item in the uninterrupted run.
        fields: Paths of the fields that differ (``"index"``, ``"image.pixels"``,
            ``"[1]"``; ``"<item>"`` for the item itself).
        differences: One line per differing field saying how it differs.
        expected: The uninterrupted run's item (None if the resumed loader yielded an
            item too many, or the item could not be fetched again).
        got: The resumed loader's item (None if it ended early).
    """

    def __init__(
        self,
        message: str,
        *,
        point: str | None = None,
        epoch: int | None = None,
        position: int | None = None,
        after_restore: int | None = None,
        worker: int | None = None,
        expected_worker: int | None = None,
        fields: Sequence[str] = (),
        differences: Sequence[str] = (),
        expected: Any = None,
        got: Any = None,
    ) -> None:
        super().__init__(message)
        self.point = point
        self.epoch = epoch
        self.position = position
        self.after_restore = after_restore
        self.worker = worker
        self.expected_worker = expected_worker
        self.fields = list(fields)
        self.differences = list(differences)
        self.expected = expected
        self.got = got


@dataclass
class ResumeReport:
    """What :func:`assert_resumes_exactly` checked.

    Attributes:
        items_per_epoch: Items of each epoch of the uninterrupted run.
        save_points: Labels of the save points restored and checked.
        chains: Number of save-restore-save-restore chains checked.
        boundary_points: How many of ``save_points`` are boundaries (before ``iter()``,
            after ``iter()``, after StopIteration) rather than after an item.
        restores: Fresh loaders restored and compared, chains included.
    """

    items_per_epoch: list[int]
    save_points: list[str] = field(default_factory=list)
    chains: int = 0
    boundary_points: int = 0
    restores: int = 0


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` checked; every restore continued the stream exactly.

    Attributes:
        pipeline: What the factory returned (type name) and how it was run.
        from_loader: True when the factory returned a loader, used as given.
        num_workers: Worker processes of the loaders checked.
        batch_size: Their batch size (None: items one by one).
        checkpoint_share: Their ``WorkerConfig.checkpoint_share`` (1.0: every item is
            checkpointed, so a restore replays nothing).
        epochs: Epochs of the uninterrupted reference run.
        items_per_epoch: Items (batches, with a batch size) of each epoch.
        save_points: Labels of the save points checked, boundaries included.
        boundary_points: How many of them are boundaries.
        chains: Save-restore-save-restore chains checked.
        restores: Fresh loaders restored and compared.
        seconds: Wall time of the check.
    """

    pipeline: str
    from_loader: bool
    num_workers: int
    batch_size: int | None
    checkpoint_share: float
    epochs: int
    items_per_epoch: list[int]
    save_points: list[str]
    boundary_points: int
    chains: int
    restores: int
    seconds: float


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


def digest(item: Any) -> str:
    """Returns a hex digest of an item's content: equal items give equal digests."""
    hasher = hashlib.blake2b(digest_size=16)
    _feed(hasher, item)
    return hasher.hexdigest()


def roundtrip(state: RankState) -> RankState:
    """Sends ``state`` through the state file encoding and back."""
    payload = serialization.loads(serialization.dumps({"kind": "rank", "state": state.to_plain()}))
    restored = state_from_payload(payload)
    if not isinstance(restored, RankState):
        raise ResumeMismatch("the state came back as a list of rank states")
    return restored


def assert_resumes_exactly(
    build: Callable[[], SavableDataLoader],
    *,
    epochs: int = 2,
    points: Iterable[int] | None = None,
    num_points: int = 6,
    chain_items: Sequence[int] = (1, 3),
    seed: int = 0,
    boundaries: bool = True,
    last_items: bool = False,
    progress: Progress | None = None,
) -> ResumeReport:
    """Asserts that ``build()``'s stream resumes exactly from many save points.

    Args:
        build: Returns a fresh loader; every call must build the same pipeline.
        epochs: Epochs of the uninterrupted reference run (at least 1).
        points: Item counts (over all epochs) after which to save; by default
            ``num_points`` random ones plus the first item of every epoch.
        num_points: Random save points when ``points`` is None.
        chain_items: For each resumed run, also consume this many items, save, restore
            into another fresh loader and check that (chains; empty to skip).
        seed: Seed of the random choice of save points.
        boundaries: Also save before ``iter()``, right after each ``iter()`` and after
            each StopIteration (on by default; off for a quick check of ``points`` only).
        last_items: When ``points`` is None, also save after the last item of every
            epoch (before its StopIteration).
        progress: Called as ``progress(done, total)`` after each run of a loader (the
            two reference passes, then every restore); ``total`` is known after the
            first pass.

    Returns:
        A report of what was checked.

    Raises:
        ResumeMismatch: A restored loader diverged; the message and the attributes name
            the save point, the epoch and position of the first differing item, the
            worker that produced it and the fields that differ.
    """
    if epochs < 1:
        raise ValueError("epochs must be at least 1")
    lengths = _epoch_lengths(build, epochs)
    chosen = _choose_points(lengths, points, num_points, seed, last_items)
    planned = _planned_runs(lengths, chosen, chain_items, boundaries)
    done = 0

    def advance() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, max(planned, done))

    advance()
    reference, saved = _reference_run(build, lengths, chosen, boundaries)
    advance()
    checker = _Checker(build, reference)
    report = ResumeReport(items_per_epoch=list(lengths))
    for number, point in enumerate(saved):
        plain_before = point.state.to_plain()
        state = roundtrip(point.state)
        checker.resume(state, point.start(), point.label)
        report.restores += 1
        advance()
        if number == 0:
            checker.resume(state, point.start(), f"{point.label} (same state restored again)")
            report.restores += 1
            advance()
        if state.to_plain() != plain_before or point.state.to_plain() != plain_before:
            raise ResumeMismatch(
                f"{point.label}: restoring changed the state object", point=point.label
            )
        report.save_points.append(point.label)
        report.boundary_points += point.boundary
        for count in chain_items:
            if reference.remaining(point.start()) > count:
                checker.chain(state, point.start(), count, point.label)
                report.chains += 1
                report.restores += 2
                advance()
    return report


def verify(
    factory: Callable[[], Any],
    *,
    num_workers: int | None = None,
    batch_size: int | None = None,
    points: int = 6,
    epochs: int = 2,
    seed: int = 0,
    chain_items: Sequence[int] = (1, 3),
    progress: Progress | None = None,
) -> VerifyReport:
    """Checks that the pipeline ``factory()`` builds resumes exactly.

    ``factory`` returns a dataset (anything :class:`~savable_loader.SavableDataLoader`
    accepts) or a loader, a new one on every call. A dataset is run in loaders with
    ``WorkerConfig(checkpoint_share=1.0)``: every item is checkpointed, so a restore
    replays nothing and a dataset that forgets part of its state (its position, a
    generator of its own) cannot hide behind a replay from an older checkpoint. A loader
    is used as given; with a smaller ``checkpoint_share`` a warning is logged, since
    replays may then mask such a dataset.

    Save points: ``points`` random items, the first and last item of every epoch, before
    ``iter()``, after each ``iter()`` and after each StopIteration; plus chains (restore,
    consume ``chain_items`` items, save, restore again) and a second restore of the first
    state. See :func:`assert_resumes_exactly`.

    Args:
        factory: Returns a new dataset or :class:`~savable_loader.SavableDataLoader` on
            every call, always the same pipeline.
        num_workers: Worker processes (default 2); only when ``factory`` returns a dataset.
        batch_size: Items per batch (default None: items one by one); only when
            ``factory`` returns a dataset.
        points: Random save points (0 or more), besides the fixed ones.
        epochs: Epochs of the uninterrupted reference run (at least 1).
        seed: Seed of the random choice of save points.
        chain_items: Items consumed between the restore and the save of each chain.
        progress: Called as ``progress(done, total)`` as the check advances.

    Returns:
        What was checked.

    Raises:
        ResumeMismatch: A restored loader diverged (see its attributes).
        ConfigError: Bad options, ``num_workers`` or ``batch_size`` given for a factory
            that returns a loader, the factory returned the same object twice or
            something no loader accepts.
    """
    if epochs < 1:
        raise ConfigError(f"epochs must be at least 1, got {epochs}")
    if points < 0:
        raise ConfigError(f"points must be 0 or more, got {points}")
    began = time.perf_counter()
    probe = factory()
    from_loader = isinstance(probe, SavableDataLoader)
    if from_loader:
        given = [
            name
            for name, value in (("num_workers", num_workers), ("batch_size", batch_size))
            if value is not None
        ]
        if given:
            pronoun = "them" if len(given) > 1 else "it"
            raise ConfigError(
                f"{' and '.join(given)} cannot be given when the factory returns a "
                f"SavableDataLoader: the loader is used as built; set {pronoun} in the factory"
            )
        probe.close()
        pipeline = f"{type(probe.source).__name__} in the factory's SavableDataLoader"
        workers, batch = probe.num_workers, probe.batch_size
        share = probe.worker_config.checkpoint_share
        if share < 1:
            logger.warning(
                "the factory's loader has checkpoint_share=%g: restores may replay items from "
                "an older checkpoint, which can hide a dataset that forgets part of its state; "
                "build it with worker_config=WorkerConfig(checkpoint_share=1.0) for a strict "
                "check",
                share,
            )
    else:
        _check_dataset(probe)
        pipeline = type(probe).__name__
        workers = _VERIFY_WORKERS if num_workers is None else num_workers
        batch, share = batch_size, 1.0
    previous: list[Any] = [probe]

    def build() -> SavableDataLoader:
        made = factory()
        if any(made is earlier for earlier in previous):
            raise ConfigError(
                f"the factory returned the same {type(made).__name__} object twice; it must "
                "build a new one on every call (verify restores into fresh loaders)"
            )
        previous[:] = [made]
        if isinstance(made, SavableDataLoader) != from_loader:
            raise ConfigError("the factory returned a loader on one call and not on another")
        if isinstance(made, SavableDataLoader):
            return made
        return SavableDataLoader(
            made,
            batch_size=batch,
            num_workers=workers,
            worker_config=WorkerConfig(checkpoint_share=1.0),
        )

    build().close()  # refuses what no loader accepts before the check starts
    report = assert_resumes_exactly(
        build,
        epochs=epochs,
        num_points=points,
        chain_items=chain_items,
        seed=seed,
        last_items=True,
        progress=progress,
    )
    return VerifyReport(
        pipeline=pipeline,
        from_loader=from_loader,
        num_workers=workers,
        batch_size=batch,
        checkpoint_share=share,
        epochs=epochs,
        items_per_epoch=report.items_per_epoch,
        save_points=report.save_points,
        boundary_points=report.boundary_points,
        chains=report.chains,
        restores=report.restores,
        seconds=time.perf_counter() - began,
    )


def _check_dataset(dataset: Any) -> None:
    if isinstance(dataset, DataLoader):
        raise ConfigError(
            f"the factory returned a torch {type(dataset).__name__}, whose position cannot "
            "be saved; return its dataset, or a savable_loader.SavableDataLoader"
        )


# -- the reference run ----------------------------------------------------------------


def _epoch_lengths(build: Callable[[], SavableDataLoader], epochs: int) -> list[int]:
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
    build: Callable[[], SavableDataLoader],
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


# -- restores and comparison ----------------------------------------------------------


class _Checker:
    """Restores states into fresh loaders and compares their items with the reference."""

    def __init__(self, build: Callable[[], SavableDataLoader], reference: _Reference) -> None:
        self._build = build
        self._reference = reference

    def resume(self, state: RankState, start: tuple[int, int], label: str) -> None:
        """Restores ``state`` into a fresh loader; checks it yields the reference from
        ``start`` on."""
        loader = self._build()
        try:
            loader.restore_state_rank(state)
            self._consume(loader, start, label, limit=None)
        finally:
            loader.close()

    def chain(self, state: RankState, start: tuple[int, int], count: int, label: str) -> None:
        """Restores, consumes ``count`` items, saves, restores into another loader."""
        first = self._build()
        try:
            first.restore_state_rank(state)
            self._consume(first, start, label, limit=count)
            again = roundtrip(first.save_state_rank())
        finally:
            first.close()
        epoch, position = start
        self.resume(
            again,
            (epoch, position + count),
            f"{label}, then {_plural(count, 'item')}, saved and restored again",
        )

    def _consume(
        self, loader: SavableDataLoader, start: tuple[int, int], label: str, limit: int | None
    ) -> None:
        digests = self._reference.digests
        epoch, position = start
        after = 0
        while epoch < len(digests):
            want = digests[epoch]
            for item in loader:
                if position >= len(want) or digest(item) != want[position]:
                    raise self._mismatch(label, epoch, position, after, item, loader.last_worker)
                position += 1
                after += 1
                if after == limit:
                    return
            if position < len(want):
                raise self._mismatch(label, epoch, position, after, None, None)
            epoch += 1
            position = 0

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


# -- structural comparison ------------------------------------------------------------


def _differences(want: Any, got: Any, path: str) -> list[tuple[str, str]]:
    """Paths of the fields that differ between two items, with how they differ."""
    name = path or "<item>"
    if isinstance(want, dict) and isinstance(got, dict):
        found: list[tuple[str, str]] = []
        keys = list(want) + [key for key in got if key not in want]
        for key in keys:
            sub = _key_path(path, key)
            if key not in got:
                found.append((sub, "missing from the resumed item"))
            elif key not in want:
                found.append((sub, "not in the expected item"))
            else:
                found += _differences(want[key], got[key], sub)
        return found
    if isinstance(want, (list, tuple)) and type(want) is type(got):
        if len(want) != len(got):
            return [(name, f"length {len(got)}, expected {len(want)}")]
        found = []
        for index, (a, b) in enumerate(zip(want, got, strict=True)):
            found += _differences(a, b, f"{path}[{index}]")
        return found
    if type(want) is not type(got):
        return [(name, f"a {type(got).__name__}, expected a {type(want).__name__}")]
    if digest(want) == digest(got):
        return []
    if isinstance(want, (torch.Tensor, np.ndarray)):
        return [(name, _array_difference(want, got))]
    return [(name, f"{_short(got)}, expected {_short(want)}")]


def _key_path(path: str, key: Any) -> str:
    if isinstance(key, str) and key.isidentifier():
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def _array_difference(want: Any, got: Any) -> str:
    if want.dtype != got.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if tuple(want.shape) != tuple(got.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    a, b = _as_numpy(want), _as_numpy(got)
    differ = a != b
    if a.dtype.kind in "fc":
        differ &= ~(np.isnan(a) & np.isnan(b))
    count = int(np.count_nonzero(differ))
    if count == 0:
        return "values equal but their bytes differ (e.g. -0.0 and 0.0, or NaN payloads)"
    first = tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(differ)[0]), a.shape))
    return (
        f"{count} of {a.size} values differ; first at {list(first)}: "
        f"{_scalar(b[first])}, expected {_scalar(a[first])}"
    )


def _as_numpy(value: Any) -> np.ndarray[Any, Any]:
    if isinstance(value, np.ndarray):
        return value
    tensor = value.detach().cpu()
    try:
        array: np.ndarray[Any, Any] = tensor.numpy()
    except TypeError:  # bfloat16 and other dtypes numpy lacks
        array = tensor.to(torch.float64).numpy()
    return array


def _scalar(value: Any) -> str:
    if isinstance(value, (float, np.floating)):
        return f"{float(value):.6g}"
    return repr(value.item() if isinstance(value, np.generic) else value)


def _short(value: Any, width: int = _SHORT) -> str:
    """A one-line repr of an item, cut to about ``width`` characters."""
    text = _compact(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _compact(value: Any) -> str:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        kind = "tensor" if isinstance(value, torch.Tensor) else "array"
        flat = _as_numpy(value).reshape(-1)
        shown = ", ".join(_scalar(x) for x in flat[:6]) + (", ..." if flat.size > 6 else "")
        if value.ndim == 1 and flat.size <= 6:
            return f"{kind}([{shown}])"
        return f"{kind}({value.dtype}, shape {tuple(value.shape)}, [{shown}])"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_compact(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_compact(v) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + ", ".join(_compact(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, float):
        return f"{value:.6g}"
    return repr(value)


def _feed(hasher: Any, item: Any) -> None:
    if isinstance(item, torch.Tensor):
        shape = tuple(item.shape)
        tensor = item.detach().cpu().contiguous().reshape(-1)
        hasher.update(f"T{tensor.dtype}{shape}".encode())
        hasher.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(item, np.ndarray):
        array = np.ascontiguousarray(item)
        hasher.update(f"N{array.dtype}{array.shape}".encode())
        hasher.update(array.tobytes())
    elif isinstance(item, dict):
        hasher.update(b"D%d" % len(item))
        for key in sorted(item, key=repr):
            _feed(hasher, key)
            _feed(hasher, item[key])
    elif isinstance(item, (list, tuple)):
        hasher.update(b"L%d" % len(item))
        for element in item:
            _feed(hasher, element)
    elif isinstance(item, (bytes, bytearray)):
        hasher.update(b"B" + bytes(item))
    else:
        hasher.update(f"{type(item).__name__}:{item!r}".encode())
