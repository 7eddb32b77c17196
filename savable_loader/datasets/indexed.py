"""A savable source over any map-style dataset (``__getitem__`` + ``__len__``).

NOTE [ Indexed order and sharding ]
Epoch ``e`` visits every index once, in the order ``perm_e`` (a permutation drawn from
``(seed, e)`` when ``shuffle`` is set, else ``0..n-1``). Rank ``r`` of ``R`` takes the
positions ``r, r+R, r+2R, ...`` of that order, as ``DistributedSampler`` does without
padding. Within a rank, the positions are cut into blocks of ``batch_size`` and worker
``w`` of ``W`` takes blocks ``w, w+W, ...``; since the loader hands batches out in
round-robin worker order, a rank's batches come out in the order of its positions, as
with torch's ``DataLoader`` over a map-style dataset. Position ``k`` of a worker's shard
is computed in O(1), so a state is two integers and ``skip`` moves by arithmetic.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import numpy as np
from pydantic import Field

from ..config import WorkerContext
from ..errors import ConfigError
from ..rng import derive_seed
from .stage import Cursor, Stage, StageState, validate_state

__all__ = ["IndexedDataset"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

_PERMUTATION_PURPOSE = 0x1D


class MapStyle(Protocol[T_co]):
    def __getitem__(self, index: int, /) -> T_co: ...
    def __len__(self) -> int: ...


class _State(StageState):
    """An indexed source's position."""

    epoch: int = Field(ge=0, description="The epoch being read.")
    pos: int = Field(ge=0, description="Items of this worker's shard already read in it.")


class IndexedDataset(Stage[T]):
    """Serves a map-style dataset in a seeded per-epoch order, sharded over ranks and workers.

    Args:
        data: Anything with ``__getitem__(int)`` and ``__len__``.
        shuffle: Visit the indices in a new seeded permutation every epoch.
        seed: Seed of the permutations (``SavableDataLoader`` passes its own ``seed``).
        deterministic_items: Declare that ``data[i]`` draws from no global generator,
            so :meth:`skip` (and a replay after restore) need not fetch skipped items.

    Raises:
        ConfigError: ``data`` has no ``__getitem__`` or ``__len__``.

    State:
        ``{"epoch": e, "pos": k}``: the epoch and the position in this worker's shard
        (NOTE [ Indexed order and sharding ]). Restore is O(1); skipping is O(1) with
        ``deterministic_items``, and fetches the skipped items otherwise so that global
        generators advance exactly as they would. Nothing is replayed beyond what the
        loader asks.
    """

    def __init__(
        self,
        data: MapStyle[T],
        *,
        shuffle: bool = False,
        seed: int = 0,
        deterministic_items: bool = False,
    ) -> None:
        if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
            raise ConfigError(
                f"IndexedDataset needs __getitem__ and __len__; {type(data).__name__} lacks them"
            )
        self.data = data
        self.shuffled = shuffle
        self.seed = seed
        self.deterministic_items = deterministic_items

    def config(self) -> dict[str, Any]:
        return {
            "type": "IndexedDataset",
            "data": f"{type(self.data).__module__}.{type(self.data).__qualname__}",
            "len": len(self.data),
            "shuffle": self.shuffled,
            "seed": self.seed,
        }

    def describe(self) -> str:
        return f"IndexedDataset({len(self.data)} items, shuffle={self.shuffled}, seed={self.seed})"

    def cursor(self, context: WorkerContext) -> IndexedCursor[T]:
        return IndexedCursor(self, context)

    def __len__(self) -> int:
        """Items in this worker's shard of an epoch."""
        return IndexedCursor(self, self._context).shard_length


class IndexedCursor(Cursor[T]):
    """Reads an :class:`IndexedDataset` for one rank and worker."""

    def __init__(self, stage: IndexedDataset[T], context: WorkerContext) -> None:
        super().__init__(context)
        self.stage = stage
        self.epoch = 0
        self.pos = 0
        self.shard_length = shard_length(len(stage.data), context)
        self._order: tuple[int, np.ndarray | None] = (-1, None)

    def __next__(self) -> T:
        pos = self.pos
        if pos >= self.shard_length:
            self.end_epoch()
            raise StopIteration
        index = int(self._indices()[pos])
        self.pos = pos + 1
        return self.stage.data[index]

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def restore(self, state: Any | None) -> None:
        position = _State(epoch=0, pos=0) if state is None else _parse(state)
        self.epoch, self.pos = position.epoch, position.pos

    def end_epoch(self) -> None:
        self.epoch += 1
        self.pos = 0

    def can_skip(self) -> bool:
        return True

    def skip(self, n: int) -> None:
        stop = min(self.pos + n, self.shard_length)
        if not self.stage.deterministic_items:
            for pos in range(self.pos, stop):
                self.stage.data[self.index(pos)]
        self.pos = stop

    def index(self, pos: int) -> int:
        """The dataset index at position ``pos`` of this worker's shard in this epoch."""
        return int(self._indices()[pos])

    def _indices(self) -> np.ndarray:
        """This worker's dataset indices for the current epoch, computed once per epoch
        (one array operation instead of arithmetic per item)."""
        epoch, indices = self._order
        if epoch != self.epoch or indices is None:
            positions = global_position(np.arange(self.shard_length, dtype=np.int64), self.context)
            if self.stage.shuffled:
                seed = derive_seed(self.stage.seed, _PERMUTATION_PURPOSE, self.epoch)
                positions = np.random.default_rng(seed).permutation(len(self.stage.data))[positions]
            indices = positions
            self._order = (self.epoch, indices)
        return indices


def _parse(state: Any) -> _State:
    return validate_state(_State, state, "IndexedDataset")


def _block(context: WorkerContext) -> int:
    return context.batch_size or 1


def shard_length(length: int, context: WorkerContext) -> int:
    """Items of a ``length``-item epoch that fall to ``context``'s worker."""
    block = _block(context)
    rank_length = len(range(context.rank, length, context.world_size))
    workers = max(context.num_workers, 1)
    blocks = -(-rank_length // block)
    mine = len(range(context.worker_id, blocks, workers))
    result = mine * block
    if mine and (blocks - 1) % workers == context.worker_id:
        result -= blocks * block - rank_length
    return result


def global_position(pos: Any, context: WorkerContext) -> Any:
    """The epoch-wide position of item ``pos`` of ``context``'s worker shard (an int, or
    element-wise for an integer array)."""
    block = _block(context)
    workers = max(context.num_workers, 1)
    rank_pos = (context.worker_id + (pos // block) * workers) * block + pos % block
    return context.rank + rank_pos * context.world_size
