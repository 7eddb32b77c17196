"""The check of a user's factory: :func:`verify` runs the harness on the datasets or
loaders a factory builds, with dense checkpoints, behind ``savable-loader verify
MODULE:FACTORY``, and returns a :class:`VerifyReport`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader

from ..config import WorkerConfig
from ..errors import ConfigError
from ..loader import SavableDataLoader
from .harness import Progress, assert_resumes_exactly

logger = logging.getLogger(__name__)

_VERIFY_WORKERS = 2


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

    def build() -> SavableDataLoader[Any]:
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
