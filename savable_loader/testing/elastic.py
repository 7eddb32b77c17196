"""The check of elastic determinism: one global stream on every layout of a global batch.

:func:`assert_elastic` runs a pipeline on several layouts (ranks x workers x per-rank
batch size) of the same global batch size, the ranks simulated in one process with
``WorkerConfig(rank=r, world_size=R)`` loaders stepped together, and compares the global
batch of every step (every rank's batch of that step, as a multiset of items) across the
layouts. It then saves every rank of one layout at chosen steps and restores the list of
states onto each other layout, which must go on with the global batches the saving
layout produced next, through the end of the epoch and in the later epochs. Chains (a
restore onto a second layout, a save there, a restore onto a third) are checked too.

Items are compared by :func:`~savable_loader.testing.digest` after a batch is split
into its items (:func:`split_batch`: tensors and arrays along their first dimension,
dicts and tuples field by field); build the loaders with ``collate_fn=list`` when your
batches are something else.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..config import WorkerConfig
from ..errors import ConfigError
from ..loader import SavableDataLoader
from ..state.models import RankState
from .digests import digest

__all__ = [
    "ElasticMismatch",
    "ElasticReport",
    "Shape",
    "assert_elastic",
    "elastic_builder",
    "split_batch",
]

#: ``build(rank, world_size, num_workers, batch_size)``: a fresh loader of that rank.
Build = Callable[[int, int, int, int], SavableDataLoader[Any]]
#: The global batches of a run: per epoch, per step, the items' digests, sorted.
Steps = list[list[tuple[str, ...]]]
#: Splits a batch into its items.
Items = Callable[[Any], list[Any]]


@dataclass(frozen=True)
class Shape:
    """One layout of a job: ranks, workers per rank and per-rank batch size."""

    ranks: int
    num_workers: int
    batch_size: int

    @property
    def global_batch(self) -> int:
        """Items per global step."""
        return self.ranks * self.batch_size

    def __str__(self) -> str:
        ranks, workers = self.ranks, self.num_workers
        return (
            f"{ranks} rank{'s' * (ranks != 1)} x {workers} worker{'s' * (workers != 1)} x "
            f"batch {self.batch_size}"
        )


class ElasticMismatch(AssertionError):
    """Two layouts of one global batch size gave different global batches.

    Attributes:
        layout: The layout whose global batch differs.
        reference: The layout it was compared with.
        epoch: The epoch of the step.
        step: The step within that epoch (from 0).
        restored_from: For a restore, where the state was saved (layout and global step
            of the epoch); None for uninterrupted runs.
    """

    def __init__(
        self,
        layout: Shape,
        reference: Shape,
        epoch: int,
        step: int,
        detail: str,
        restored_from: str | None = None,
    ) -> None:
        where = f" after a restore of a state saved on {restored_from}" if restored_from else ""
        super().__init__(
            f"{layout}{where}: the global batch of epoch {epoch} step {step} differs from "
            f"{reference}'s: {detail}"
        )
        self.layout = layout
        self.reference = reference
        self.epoch = epoch
        self.step = step
        self.restored_from = restored_from


@dataclass(frozen=True)
class ElasticReport:
    """What :func:`assert_elastic` compared; every global batch was the same.

    Attributes:
        layouts: The layouts run.
        steps: Global steps of each epoch.
        restores: Restores onto another layout compared (chains count each restore).
    """

    layouts: tuple[Shape, ...]
    steps: tuple[int, ...]
    restores: int


def elastic_builder(dataset: Callable[[], Any], **loader: Any) -> Build:
    """The ``build`` of :func:`assert_elastic` for a dataset: each call makes
    ``SavableDataLoader(dataset(), batch_size=..., num_workers=..., worker_config=
    WorkerConfig(rank=..., world_size=...), **loader)``.

    Args:
        dataset: Makes a fresh dataset or pipeline (not a loader) per call.
        **loader: Any other ``SavableDataLoader`` argument (``seed``, ``collate_fn``...).

    Raises:
        ConfigError: ``dataset()`` returned a loader (from the returned ``build``).
    """

    def build(rank: int, world_size: int, num_workers: int, batch_size: int) -> Any:
        made = dataset()
        if isinstance(made, SavableDataLoader):
            made.close()
            raise ConfigError(
                "the elastic check builds the loaders of every layout itself: give a "
                "factory that returns a dataset, not a loader"
            )
        return SavableDataLoader(
            made,
            batch_size=batch_size,
            num_workers=num_workers,
            worker_config=WorkerConfig(rank=rank, world_size=world_size),
            **loader,
        )

    return build


def split_batch(batch: Any) -> list[Any]:
    """The items of a batch ``default_collate`` made: tensors and arrays along their first
    dimension, dicts key by key, and a list or tuple of fields (a tuple item collated: at
    least one tensor or array, the other fields tensors, dicts, or lists of strings or
    numbers) field by field; any other list is a list of items (``collate_fn=list``). A
    list of tensors of one length is read as fields: pass ``items=list`` to
    :func:`assert_elastic` when your batches are lists of such items."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return list(batch)
    if isinstance(batch, Mapping):
        columns = {key: split_batch(value) for key, value in batch.items()}
        counts = {len(column) for column in columns.values()}
        if len(counts) != 1:
            raise ValueError("a dict batch whose fields hold different numbers of items")
        (count,) = counts
        return [{key: column[i] for key, column in columns.items()} for i in range(count)]
    if isinstance(batch, (list, tuple)):
        if _are_fields(batch):
            columns_ = [split_batch(field) for field in batch]
            if len({len(column) for column in columns_}) == 1:
                count = len(columns_[0])
                return [type(batch)(column[i] for column in columns_) for i in range(count)]
        return list(batch)
    raise ValueError(f"cannot split a batch of type {type(batch).__name__} into items")


_LEAVES = (str, bytes, int, float, bool)


def _are_fields(values: Sequence[Any]) -> bool:
    """Whether ``values`` are the fields of collated tuple items: a tensor or array among
    them, and every one a field."""
    has_tensor = any(isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim > 0 for v in values)
    return has_tensor and all(_is_field(value) for value in values)


def _is_field(value: Any) -> bool:
    """Whether ``value`` is one field of a collated batch: a tensor or array of the batch's
    items, a dict of fields, a list of strings or numbers (``default_collate`` keeps
    strings as a list), or a list or tuple of fields (a nested tuple)."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim > 0
    if isinstance(value, Mapping):
        return bool(value) and all(_is_field(element) for element in value.values())
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(element, _LEAVES) for element in value):
            return True
        return _are_fields(value)
    return False


def _step_items(batches: Sequence[Any], items: Items) -> tuple[str, ...]:
    return tuple(sorted(digest(item) for batch in batches for item in items(batch)))


class _Job:
    """The loaders of every rank of one layout, stepped together."""

    def __init__(self, build: Build, shape: Shape, items: Items) -> None:
        self.shape = shape
        self.items = items
        self.loaders = [
            build(rank, shape.ranks, shape.num_workers, shape.batch_size)
            for rank in range(shape.ranks)
        ]
        self._iterators: list[Iterator[Any]] | None = None

    def restore(self, states: list[RankState]) -> None:
        for loader in self.loaders:
            loader.restore_state_rank(states)

    def save(self) -> list[RankState]:
        return [loader.save_state_rank() for loader in self.loaders]

    def step(self) -> tuple[str, ...] | None:
        """The next global batch; None when every rank ended the epoch."""
        if self._iterators is None:
            self._iterators = [iter(loader) for loader in self.loaders]
        batches, ended = [], 0
        for iterator in self._iterators:
            try:
                batches.append(next(iterator))
            except StopIteration:
                ended += 1
        if ended:
            if ended != len(self._iterators):
                raise AssertionError(
                    f"{self.shape}: {ended} of {len(self._iterators)} ranks ended the epoch "
                    "at the same step; every rank must yield as many batches"
                )
            self._iterators = None
            return None
        return _step_items(batches, self.items)

    def epoch(self) -> list[tuple[str, ...]]:
        steps = []
        while (step := self.step()) is not None:
            steps.append(step)
        return steps

    def close(self) -> None:
        for loader in self.loaders:
            loader.close()


def _compare(
    got: list[tuple[str, ...]],
    want: list[tuple[str, ...]],
    layout: Shape,
    reference: Shape,
    epoch: int,
    first_step: int = 0,
    restored_from: str | None = None,
) -> None:
    for offset, (mine, theirs) in enumerate(zip(got, want, strict=False)):
        if mine != theirs:
            extra = Counter(mine) - Counter(theirs)
            missing = Counter(theirs) - Counter(mine)
            detail = f"{sum(extra.values())} item(s) not in it, {sum(missing.values())} missing"
            raise ElasticMismatch(
                layout, reference, epoch, first_step + offset, detail, restored_from
            )
    if len(got) != len(want):
        raise ElasticMismatch(
            layout,
            reference,
            epoch,
            first_step + min(len(got), len(want)),
            f"{len(got)} steps where {len(want)} were expected",
            restored_from,
        )


def _run(build: Build, shape: Shape, epochs: int, items: Items) -> Steps:
    job = _Job(build, shape, items)
    try:
        return [job.epoch() for _ in range(epochs)]
    finally:
        job.close()


def assert_elastic(
    build: Build,
    layouts: Sequence[Shape | tuple[int, int, int]],
    *,
    epochs: int = 2,
    save_steps: Sequence[int] | None = None,
    chains: bool = True,
    items: Items = split_batch,
) -> ElasticReport:
    """Asserts that every layout gives the same global batches, and that a state saved
    on one continues the same global stream on every other.

    Args:
        build: ``build(rank, world_size, num_workers, batch_size)`` returns a fresh
            loader of that rank, built with ``worker_config=WorkerConfig(rank=rank,
            world_size=world_size)`` and the same pipeline and seed on every call.
        layouts: ``Shape`` or ``(ranks, num_workers, batch_size)`` tuples of one global
            batch size; the first is the reference and the layout states are saved on.
        epochs: Epochs of every run.
        save_steps: Global steps (counted over the epochs, from 0) after which the first
            layout saves; by default the middle of the first epoch, its last step, and
            the first step of the second epoch.
        chains: Also restore each save onto the second layout, take one more step, save
            there and restore onto the last layout.
        items: Splits a batch into its items (:func:`split_batch` by default).

    Raises:
        ElasticMismatch: A layout's global batch differs from the reference's.
        ValueError: The layouts do not share one global batch size.
    """
    shapes = tuple(s if isinstance(s, Shape) else Shape(*s) for s in layouts)
    if len({shape.global_batch for shape in shapes}) != 1:
        raise ValueError(
            "assert_elastic compares layouts of one global batch size (ranks x batch_size); "
            f"got {[str(shape) for shape in shapes]}"
        )
    reference = _run(build, shapes[0], epochs, items)
    for shape in shapes[1:]:
        got = _run(build, shape, epochs, items)
        for epoch, (mine, theirs) in enumerate(zip(got, reference, strict=True)):
            _compare(mine, theirs, shape, shapes[0], epoch)
    flat = [(epoch, step) for epoch, steps in enumerate(reference) for step in range(len(steps))]
    if save_steps is None:
        first = len(reference[0])
        save_steps = sorted({first // 2, first - 1, first})
    restores = 0
    for save in save_steps:
        if not 0 <= save < len(flat) - 1:
            continue
        states = _states_after(build, shapes[0], save + 1, items)
        epoch, step = flat[save]
        label = f"{shapes[0]} after epoch {epoch} step {step}"
        for shape in shapes[1:]:
            _check_continuation(
                build, shape, states, reference, flat, save + 1, shapes[0], label, items
            )
            restores += 1
        if chains and len(shapes) > 2 and save + 2 < len(flat):
            states = _restore_step_save(build, shapes[1], states, items)
            epoch, step = flat[save + 1]
            label = f"{shapes[1]} after epoch {epoch} step {step} (restored from {label})"
            _check_continuation(
                build, shapes[-1], states, reference, flat, save + 2, shapes[0], label, items
            )
            restores += 2
    return ElasticReport(shapes, tuple(len(steps) for steps in reference), restores)


def _states_after(build: Build, shape: Shape, steps: int, items: Items) -> list[RankState]:
    """Every rank's state after ``steps`` global steps (epoch ends are not steps)."""
    job = _Job(build, shape, items)
    try:
        taken = 0
        while taken < steps:
            if job.step() is not None:
                taken += 1
        return job.save()
    finally:
        job.close()


def _restore_step_save(
    build: Build, shape: Shape, states: list[RankState], items: Items
) -> list[RankState]:
    job = _Job(build, shape, items)
    try:
        job.restore(states)
        while job.step() is None:
            pass
        return job.save()
    finally:
        job.close()


def _check_continuation(
    build: Build,
    shape: Shape,
    states: list[RankState],
    reference: Steps,
    flat: list[tuple[int, int]],
    start: int,
    reference_shape: Shape,
    label: str,
    items: Items,
) -> None:
    """Restores ``states`` onto ``shape`` and compares what follows with the reference
    from global step ``start`` on, through the last epoch."""
    job = _Job(build, shape, items)
    try:
        job.restore(states)
        epoch, step = flat[start]
        rest = job.epoch()
        if step == 0 and not rest:
            rest = job.epoch()  # saved after the last step: the end of the epoch comes first
        _compare(rest, reference[epoch][step:], shape, reference_shape, epoch, step, label)
        for later in range(epoch + 1, len(reference)):
            _compare(job.epoch(), reference[later], shape, reference_shape, later, 0, label)
    finally:
        job.close()
