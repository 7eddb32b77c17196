"""What a worker is told before it runs the pipeline: the loader's description of it
(:class:`RuntimeSpec`), where each worker starts (:class:`WorkerStart`), and the seeds of
its global generators per epoch (NOTE [ Generators per epoch ] in ``_worker/runtime.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import rng
from .._channel.commands import CommandChannel
from ..config import WorkerContext
from ..datasets.protocol.stage import Stage
from ..state.models import Checkpoint, RngState

__all__ = ["RuntimeSpec", "WorkerStart", "epoch_rng_state", "epoch_seed"]


@dataclass(frozen=True)
class WorkerStart:
    """How one worker starts: from which checkpoint, to which position.

    Attributes:
        checkpoint: Checkpoint to restore, or None for the pipeline's initial state.
        delivered: Sequence number the consumer wants next (replay up to it).
        skip_epoch: The worker already ended the current epoch: produce nothing in it.
        placeholder: Yield one placeholder first (worker order after a restore).
        new_epoch: The worker starts at the beginning of an epoch (after a restore
            between epochs): seed its generators for it (NOTE [ Generators per epoch ]).
        cut: The loader began a new epoch before this worker ended the current one: it
            replays to ``delivered``, drops the rest of that epoch and counts the cut as
            one event (NOTE [ A new iter() starts an epoch ] in ``_main/iterator.py``).
    """

    checkpoint: Checkpoint | None = None
    delivered: int = 0
    skip_epoch: bool = False
    placeholder: bool = False
    new_epoch: bool = False
    cut: bool = False


@dataclass
class RuntimeSpec:
    """Everything a worker needs to run the pipeline; pickled into each worker.

    Attributes:
        root: The loader's pipeline with its batching (``datasets.batch.Batch``).
        seed: The loader seed.
        rank: This loader's rank.
        world_size: Number of ranks.
        num_workers: Worker processes (0: the pipeline runs in the main process).
        batch_size: Items per batch (sources shard in blocks of it).
        checkpoint_share: NOTE [ Checkpoint policy ] in ``_worker/ring.py``.
        max_lag: How many events the consumer can be behind a worker.
        starts: How each worker starts; empty: every worker from the beginning.
        epoch: The loader epoch the workers start in (NOTE [ Generators per epoch ]).
        channel: The command channel, with workers.
        torch_seeds: The workers' global generators are seeded as torch seeds them, from
            the base seed the loader's ``generator`` gave (NOTE [ Torch's worker seeds ]).
        fresh_seeds: With ``torch_seeds``: torch seeded these workers for the epoch they
            start in (it drew a new base seed), rather than their generators continuing.
        dataset: What the user passed as ``dataset=``, an object of the pipeline above;
            pickled with it, so in a worker it is the very object that worker's pipeline
            reads (NOTE [ The worker's dataset ] in ``_channel/torch_compat.py``).
        seed_each_item: NOTE [ Items seeded one by one ] in ``rng/keys.py``.
    """

    root: Stage[Any]
    seed: int
    rank: int
    world_size: int
    num_workers: int
    batch_size: int | None
    checkpoint_share: float
    max_lag: int
    starts: tuple[WorkerStart, ...] = ()
    epoch: int = 0
    channel: CommandChannel | None = field(default=None)
    torch_seeds: bool = False
    fresh_seeds: bool = True
    dataset: Any = None
    seed_each_item: bool = False

    def context(self, worker_id: int) -> WorkerContext:
        """What worker ``worker_id``'s pipeline is told about where it runs."""
        return WorkerContext(
            rank=self.rank,
            world_size=self.world_size,
            worker_id=worker_id,
            num_workers=self.num_workers,
            seed=self.seed,
            batch_size=self.batch_size,
            seed_each_item=self.seed_each_item,
        )


def epoch_seed(seed: int, rank: int, worker_id: int, epoch: int) -> int:
    """The seed of a worker's global generators at the start of ``epoch``
    (NOTE [ Generators per epoch ])."""
    if epoch == 0:
        return rng.seed_for(rng.Purpose.WORKER_EPOCH, seed, rank, worker_id)
    return rng.seed_for(rng.Purpose.WORKER_EPOCH, seed, rank, worker_id, epoch)


def epoch_rng_state(
    seed: int, rank: int, worker_id: int, epoch: int, salt: int | None = None
) -> RngState:
    """The global generators' state :func:`epoch_seed` gives (with ``salt`` also in the
    key: the rest of an epoch resumed on another layout), without touching this
    process's generators."""
    base = epoch_seed(seed, rank, worker_id, epoch)
    generators = rng.OwnGenerators.seeded(
        base if salt is None else rng.seed_for(rng.Purpose.WORKER_SALT, base, salt)
    )
    return generators.snapshot.to_state()
