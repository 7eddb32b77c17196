"""Loader-wide settings (:class:`WorkerConfig`) and what a pipeline learns about its worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = ["WorkerConfig", "WorkerContext"]


@dataclass(frozen=True)
class WorkerConfig:
    """Where this loader stands in a job, and how it talks to its workers.

    Args:
        rank: This process's rank; by default ``torch.distributed``'s rank when it is
            initialized, else 0.
        world_size: Number of ranks; by default ``torch.distributed``'s world size when
            initialized, else 1.
        data_parallel_group: A ``torch.distributed`` process group whose ranks share
            this loader's data stream layout (the default group when None).
        command_timeout: Seconds a save waits for every worker's answer (worker start-up
            included) before raising :class:`~savable_loader.WorkerError`. It also bounds a
            worker's start-up while iterating (restoring its checkpoint and replaying to
            the saved position): a worker still starting after this long is reported as
            hung (NOTE [ Watchdog ] in ``_main/stream.py``).
        item_timeout: Seconds a worker may spend producing one item (one batch) before
            the loader reports it as hung with a :class:`~savable_loader.WorkerError`
            naming it, and stops it; 60 by default, like ``command_timeout``, so no wait
            is unbounded. Raise it for pipelines whose items legitimately take longer, or
            pass None to wait forever, as torch's ``DataLoader(timeout=0)`` does. The
            report comes within ``item_timeout`` plus a poll interval (at most a quarter
            of it, and at most one second).
        checkpoint_share: Largest share of a worker's production time spent taking
            checkpoints (NOTE [ Checkpoint policy ] in ``_worker/ring.py``).

    Raises:
        ConfigError: A value is out of range, or ``rank`` or ``world_size`` is not an int
            (a bool included: the saved state records them).
    """

    rank: int | None = None
    world_size: int | None = None
    data_parallel_group: Any = None
    command_timeout: float = 60.0
    checkpoint_share: float = 0.01
    item_timeout: float | None = 60.0

    def __post_init__(self) -> None:
        # Saved in every state as strict ints (NOTE [ Arguments the state must carry ] in
        # ``_main/arguments.py``): refused here rather than at the first save.
        for name in ("rank", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool):
                raise ConfigError(
                    f"{name} must be an int, not a bool ({value}); pass {name}={int(value)}"
                )
            if value is not None and not isinstance(value, int):
                raise ConfigError(f"{name} must be an int or None, got {value!r}")
        if self.world_size is not None and self.world_size < 1:
            raise ConfigError(f"world_size must be at least 1, got {self.world_size}")
        if self.rank is not None and self.rank < 0:
            raise ConfigError(f"rank must be non-negative, got {self.rank}")
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise ConfigError(f"rank {self.rank} is not below world_size {self.world_size}")
        if not self.command_timeout > 0:
            raise ConfigError(f"command_timeout must be positive, got {self.command_timeout}")
        if self.item_timeout is not None and not self.item_timeout > 0:
            raise ConfigError(f"item_timeout must be positive or None, got {self.item_timeout}")
        if not 0 < self.checkpoint_share <= 1:
            raise ConfigError(f"checkpoint_share must be in (0, 1], got {self.checkpoint_share}")

    def resolve(self) -> tuple[int, int]:
        """Returns (rank, world_size), asking ``torch.distributed`` for what is unset."""
        rank, world_size = self.rank, self.world_size
        if rank is None or world_size is None:
            import torch.distributed as dist

            initialized = dist.is_available() and dist.is_initialized()
            if rank is None:
                rank = dist.get_rank(self.data_parallel_group) if initialized else 0
            if world_size is None:
                world_size = dist.get_world_size(self.data_parallel_group) if initialized else 1
        if rank >= world_size:
            raise ConfigError(f"rank {rank} is not below world_size {world_size}")
        return rank, world_size


@dataclass(frozen=True)
class WorkerContext:
    """What a pipeline is told about the process it runs in, before it is restored.

    Passed to ``SavableDataset.setup(context)`` in every worker (and in the main process
    when ``num_workers`` is 0). Sources use it to pick their shard.

    Attributes:
        rank: The rank of this loader.
        world_size: Number of ranks.
        worker_id: This worker's id (0 without workers).
        num_workers: Number of workers of the loader (0 without workers).
        seed: The loader seed.
        batch_size: Items per batch (None when the loader does not batch).
        seed_each_item: The loader's ``seed_each_item``: a source seeds the global
            generators before it produces each item, from the item's key in the global
            stream (NOTE [ Items seeded one by one ] in ``rng/keys.py``).
    """

    rank: int
    world_size: int
    worker_id: int
    num_workers: int
    seed: int
    batch_size: int | None
    seed_each_item: bool = False

    @property
    def num_shards(self) -> int:
        """Number of (rank, worker) streams in the job."""
        return self.world_size * max(self.num_workers, 1)

    @property
    def shard_index(self) -> int:
        """Index of this (rank, worker) stream among :attr:`num_shards`."""
        return self.rank * max(self.num_workers, 1) + self.worker_id
