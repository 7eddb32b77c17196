"""Check that a pipeline resumes exactly: the resume-equivalence harness.

:func:`assert_resumes_exactly` runs a loader uninterrupted over several epochs and saves
its state at many points on the way: before ``iter()``, right after ``iter()`` before any
item, after chosen items, after the last item of an epoch and after its StopIteration.
Each state goes through the state file encoding (msgpack with header and checksum) and
into a fresh loader, which must then yield exactly what the uninterrupted run yielded
from that point on, later epochs included. Optionally each resumed run consumes a few
items, saves again and is restored into yet another loader (a chain), and the first
state is restored twice to check that restoring neither changes the state nor depends
on the loader it goes into. Items are compared through a digest of their content
(tensors by dtype, shape and bytes), so the harness holds little memory.

Use it on your own pipeline::

    from savable_loader.testing import assert_resumes_exactly
    assert_resumes_exactly(lambda: SavableDataLoader(MyDataset(), batch_size=8, num_workers=2))
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import serialization
from .loader import SavableDataLoader
from .state.files import state_from_payload
from .state.models import RankState

__all__ = ["ResumeMismatch", "ResumeReport", "assert_resumes_exactly", "digest", "roundtrip"]


class ResumeMismatch(AssertionError):
    """A restored loader did not continue the uninterrupted stream exactly."""


@dataclass
class ResumeReport:
    """What :func:`assert_resumes_exactly` checked.

    Attributes:
        items_per_epoch: Items of each epoch of the uninterrupted run.
        save_points: Labels of the save points restored and checked.
        chains: Number of save-restore-save-restore chains checked.
    """

    items_per_epoch: list[int]
    save_points: list[str] = field(default_factory=list)
    chains: int = 0


@dataclass(frozen=True)
class _Point:
    label: str
    epoch: int
    index: int
    between: bool
    state: RankState


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

    Returns:
        A report of what was checked.

    Raises:
        ResumeMismatch: A restored loader diverged; the message names the save point,
            the epoch and the position of the first differing item.
    """
    if epochs < 1:
        raise ValueError("epochs must be at least 1")
    reference, saved = _reference_run(build, epochs, points, num_points, seed, boundaries)
    report = ResumeReport(items_per_epoch=[len(items) for items in reference])
    for number, point in enumerate(saved):
        plain_before = point.state.to_plain()
        state = roundtrip(point.state)
        expected = _expected_after(reference, point)
        _resume(build, state, expected, point.label)
        if number == 0:
            _resume(build, state, expected, f"{point.label} (same state restored again)")
        if state.to_plain() != plain_before or point.state.to_plain() != plain_before:
            raise ResumeMismatch(f"{point.label}: restoring changed the state object")
        report.save_points.append(point.label)
        for count in chain_items:
            if _check_chain(build, state, expected, count, point.label):
                report.chains += 1
    return report


def _reference_run(
    build: Callable[[], SavableDataLoader],
    epochs: int,
    points: Iterable[int] | None,
    num_points: int,
    seed: int,
    boundaries: bool,
) -> tuple[list[list[str]], list[_Point]]:
    # A first pass learns the epoch lengths, to choose save points that fall inside them.
    loader = build()
    try:
        lengths = [sum(1 for _ in loader) for _ in range(epochs)]
    finally:
        loader.close()
    total = sum(lengths)
    if points is None:
        rng = random.Random(seed)
        starts = [sum(lengths[:e]) for e in range(epochs)]
        chosen = set(rng.sample(range(1, total + 1), min(num_points, total))) if total else set()
        chosen.update(start + 1 for start, length in zip(starts, lengths, strict=True) if length)
    else:
        chosen = set(points)
    loader = build()
    reference: list[list[str]] = []
    saved: list[_Point] = []
    if boundaries:
        saved.append(_Point("before iter()", 0, 0, False, loader.save_state_rank()))
    count = 0
    try:
        for epoch in range(epochs):
            iterator = iter(loader)
            if boundaries:
                label = f"epoch {epoch}, after iter()"
                saved.append(_Point(label, epoch, 0, False, loader.save_state_rank()))
            items: list[str] = []
            for item in iterator:
                items.append(digest(item))
                count += 1
                if count in chosen:
                    label = f"epoch {epoch}, after item {len(items)} (item {count} overall)"
                    saved.append(_Point(label, epoch, len(items), False, loader.save_state_rank()))
            if len(items) != lengths[epoch]:
                raise ResumeMismatch(
                    f"epoch {epoch} has {len(items)} items in one run and {lengths[epoch]} in "
                    "another: the pipeline is not deterministic for a given seed"
                )
            reference.append(items)
            if boundaries:
                label = f"epoch {epoch}, after StopIteration"
                saved.append(_Point(label, epoch, len(items), True, loader.save_state_rank()))
    finally:
        loader.close()
    return reference, saved


def _expected_after(reference: list[list[str]], point: _Point) -> list[list[str]]:
    if point.between:
        return [list(items) for items in reference[point.epoch + 1 :]]
    rest = reference[point.epoch][point.index :]
    return [rest] + [list(items) for items in reference[point.epoch + 1 :]]


def _resume(
    build: Callable[[], SavableDataLoader],
    state: RankState,
    expected: list[list[str]],
    label: str,
) -> None:
    """Restores ``state`` into a fresh loader and checks it yields ``expected``."""
    loader = build()
    try:
        loader.restore_state_rank(state)
        _consume(loader, expected, label)
    finally:
        loader.close()


def _consume(loader: SavableDataLoader, expected: list[list[str]], label: str) -> None:
    for epoch_number, want in enumerate(expected):
        _compare(want, [digest(item) for item in loader], label, epoch_number)


def _compare(want: list[str], got: list[str], label: str, epoch_number: int) -> None:
    if want == got:
        return
    for position, (a, b) in enumerate(zip(want, got, strict=False)):
        if a != b:
            raise ResumeMismatch(
                f"{label}: resumed epoch {epoch_number} differs at item {position} "
                f"(expected digest {a}, got {b})"
            )
    raise ResumeMismatch(
        f"{label}: resumed epoch {epoch_number} has {len(got)} items, expected {len(want)}"
    )


def _check_chain(
    build: Callable[[], SavableDataLoader],
    state: RankState,
    expected: list[list[str]],
    count: int,
    label: str,
) -> bool:
    """Restores, consumes ``count`` items of the first resumed epoch, saves, restores again."""
    if not expected or len(expected[0]) <= count:
        return False
    first = build()
    try:
        first.restore_state_rank(state)
        iterator = iter(first)
        for position in range(count):
            _compare(expected[0][position : position + 1], [digest(next(iterator))], label, 0)
        again = roundtrip(first.save_state_rank())
    finally:
        first.close()
    tail = [expected[0][count:], *expected[1:]]
    _resume(build, again, tail, f"{label}, then {count} items, saved and restored again")
    return True


def _feed(hasher: Any, item: Any) -> None:
    if isinstance(item, torch.Tensor):
        tensor = item.detach().cpu().contiguous().reshape(-1)
        hasher.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
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
