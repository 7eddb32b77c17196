"""The resume-equivalence harness: :func:`assert_resumes_exactly` and its report.

It runs the reference (``reference.py``), then restores every saved state into fresh
loaders and compares (``restores.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..loader import SavableDataLoader
from .divergence import ResumeMismatch
from .files import roundtrip
from .reference import (
    _break_at,
    _check_runs,
    _choose_points,
    _first_pass,
    _planned_runs,
    _Point,
    _Reference,
    _reference_run,
)
from .restores import _Checker

Progress = Callable[[int, int], None]
"""Called as ``progress(done, total)`` as the check advances (runs of a loader)."""


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
        interruption_points: How many of ``save_points`` were saved right after a peek
            or a ``break`` (``interruptions``).
    """

    items_per_epoch: list[int]
    save_points: list[str] = field(default_factory=list)
    chains: int = 0
    boundary_points: int = 0
    restores: int = 0
    interruption_points: int = 0


def assert_resumes_exactly(
    build: Callable[[], SavableDataLoader[Any]],
    *,
    epochs: int = 2,
    points: Iterable[int] | None = None,
    num_points: int = 6,
    chain_items: Sequence[int] = (1, 3),
    seed: int = 0,
    boundaries: bool = True,
    last_items: bool = False,
    inline_chains: bool = False,
    later_epochs: int | None = None,
    interruptions: bool = True,
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
        inline_chains: Take each chain's save from the resumed loader itself, which goes
            on after it, instead of from a loader restored for that chain alone: one
            fresh loader a chain instead of two, and the resumed loader is also checked
            across the saves. Off by default.
        later_epochs: Compare a restored loader over the epoch it resumes in and at most
            this many epochs after it (at least 1, so that the next epoch is always
            checked); by default over every epoch left of the reference run.
        interruptions: After their ``epochs``, both reference runs begin one more epoch
            as a training loop may leave it (on by default): the first peeks
            (``next(iter(loader))``, the iterator dropped), saves, restores the state
            into itself and reads the rest of the epoch; the second leaves a ``for`` loop
            with ``break`` a few items in and saves. Fresh loaders restored from the two
            states (save points labelled "a peek" and "then a break") must yield the rest
            of that epoch as the first run read it. Costs one epoch and a few items more.
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
    if later_epochs is not None and later_epochs < 1:
        raise ValueError("later_epochs must be at least 1 (the next epoch is always checked)")
    first = _first_pass(build, epochs, interruptions)
    lengths = [len(digests) for digests in first.reference.digests[:epochs]]
    tail = len(first.reference.digests[epochs]) if first.saved else 0
    break_at = _break_at(tail) if tail else 0
    chosen = _choose_points(lengths, points, num_points, seed, last_items)
    starts = [(1, tail), (break_at, tail)] if tail else []
    planned = _planned_runs(lengths, chosen, chain_items, boundaries, starts)
    done = 0

    def advance() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, max(planned, done))

    advance()
    saving = _reference_run(build, lengths, chosen, boundaries, break_at)
    advance()
    digests, workers = saving.reference.digests, saving.reference.workers
    reference = _Reference(digests[:epochs], workers[:epochs])
    report = ResumeReport(items_per_epoch=list(lengths))
    checker = _Checker(build, reference, later_epochs)
    normal = [point for point in saving.saved if not point.interruption]
    for number, point in enumerate(normal):
        _check_point(checker, point, number == 0, chain_items, inline_chains, report, advance)
    # NOTE [ A peek and a break after the last epoch ] in reference.py
    _check_runs(first, saving)
    if tail:
        extended = _Reference(
            reference.digests + first.reference.digests[epochs:],
            reference.workers + first.reference.workers[epochs:],
        )
        checker = _Checker(build, extended, later_epochs)
        for point in first.saved + [point for point in saving.saved if point.interruption]:
            _check_point(checker, point, False, chain_items, inline_chains, report, advance)
    return report


def _check_point(
    checker: _Checker,
    point: _Point,
    twice: bool,
    chain_items: Sequence[int],
    inline_chains: bool,
    report: ResumeReport,
    advance: Callable[[], None],
) -> None:
    """Restores ``point``'s state into fresh loaders (``twice``: a second time too) and
    chains from it, calling ``advance()`` after each run of a loader."""
    plain_before = point.state.to_plain()
    state = roundtrip(point.state)
    counts = [n for n in chain_items if checker.remaining(point.start()) > n]
    again = checker.resume(state, point.start(), point.label, saves=counts if inline_chains else ())
    report.restores += 1
    advance()
    if twice:
        checker.resume(state, point.start(), f"{point.label} (same state restored again)")
        report.restores += 1
        advance()
    if state.to_plain() != plain_before or point.state.to_plain() != plain_before:
        raise ResumeMismatch(
            f"{point.label}: restoring changed the state object", point=point.label
        )
    report.save_points.append(point.label)
    report.boundary_points += point.boundary
    report.interruption_points += point.interruption
    for count in counts:
        if inline_chains:
            checker.chained(again[count], point.start(), count, point.label)
        else:
            checker.chain(state, point.start(), count, point.label)
        report.chains += 1
        report.restores += 1 if inline_chains else 2
        advance()
