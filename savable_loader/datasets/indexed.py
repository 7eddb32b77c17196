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

from collections.abc import Iterator
from typing import Any, Protocol, TypeVar

import numpy as np

from ..config import WorkerContext
from ..errors import ConfigError, StateError
from ..rng import derive_seed
from .base import SavableDataset

__all__ = ["IndexedDataset"]

T_co = TypeVar("T_co", covariant=True)

_PERMUTATION_PURPOSE = 0x1D


class MapStyle(Protocol[T_co]):
    def __getitem__(self, index: int, /) -> T_co: ...
    def __len__(self) -> int: ...


class IndexedDataset(SavableDataset[T_co]):
    """Serves a map-style dataset in a seeded per-epoch order, sharded over ranks and workers.

    Args:
        data: Anything with ``__getitem__(int)`` and ``__len__``.
        shuffle: Visit the indices in a new seeded permutation every epoch.
        seed: Seed of the permutations (``SavableDataLoader`` passes its own ``seed``).
        deterministic_items: Declare that ``data[i]`` draws from no global generator,
            so :meth:`skip` (and a replay after restore) need not fetch skipped items.

    State:
        ``{"epoch": e, "pos": k}``: the epoch and the position in this worker's shard.
        Restore is O(1); :meth:`skip` is O(1) with ``deterministic_items``, and fetches
        the skipped items otherwise so global generators advance exactly as they would.
    """

    def __init__(
        self,
        data: MapStyle[T_co],
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
        self.shuffle = shuffle
        self.seed = seed
        self.deterministic_items = deterministic_items
        self._context = WorkerContext(0, 1, 0, 0, seed, None)
        self._epoch = 0
        self._pos = 0
        self._order: tuple[int, np.ndarray | None] = (-1, None)

    def config(self) -> dict[str, Any]:
        return {
            "type": "IndexedDataset",
            "data": f"{type(self.data).__module__}.{type(self.data).__qualname__}",
            "len": len(self.data),
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def setup(self, context: WorkerContext) -> None:
        self._context = context

    def save_state(self) -> dict[str, int]:
        return {"epoch": self._epoch, "pos": self._pos}

    def restore_state(self, state: Any | None) -> None:
        if state is None:
            self._epoch, self._pos = 0, 0
            return
        if not (
            isinstance(state, dict)
            and set(state) == {"epoch", "pos"}
            and all(isinstance(v, int) and v >= 0 for v in state.values())
        ):
            raise StateError(
                f"IndexedDataset state must be {{'epoch': int >= 0, 'pos': int >= 0}}, "
                f"got {state!r}"
            )
        self._epoch, self._pos = state["epoch"], state["pos"]

    def __len__(self) -> int:
        """Items in this worker's shard of an epoch."""
        return self._shard_length()

    def __iter__(self) -> Iterator[T_co]:
        length = self._shard_length()
        while self._pos < length:
            index = self._index(self._pos)
            self._pos += 1
            yield self.data[index]
        self._epoch += 1
        self._pos = 0

    def skip(self, n: int) -> None:
        """Advances by ``n`` items or to the end of the epoch, as iterating would."""
        stop = min(self._pos + n, self._shard_length())
        if not self.deterministic_items:
            for pos in range(self._pos, stop):
                self.data[self._index(pos)]
        self._pos = stop

    def _block(self) -> int:
        return self._context.batch_size or 1

    def _rank_length(self) -> int:
        ctx = self._context
        return len(range(ctx.rank, len(self.data), ctx.world_size))

    def _shard_length(self) -> int:
        ctx, block = self._context, self._block()
        rank_length = self._rank_length()
        workers = max(ctx.num_workers, 1)
        blocks = -(-rank_length // block)
        mine = len(range(ctx.worker_id, blocks, workers))
        length = mine * block
        last_block = blocks - 1
        if mine and last_block % workers == ctx.worker_id:
            length -= blocks * block - rank_length
        return length

    def _index(self, pos: int) -> int:
        ctx, block = self._context, self._block()
        workers = max(ctx.num_workers, 1)
        rank_pos = (ctx.worker_id + (pos // block) * workers) * block + pos % block
        global_pos = ctx.rank + rank_pos * ctx.world_size
        return int(self._permutation()[global_pos]) if self.shuffle else global_pos

    def _permutation(self) -> np.ndarray:
        epoch, order = self._order
        if epoch != self._epoch or order is None:
            seed = derive_seed(self.seed, _PERMUTATION_PURPOSE, self._epoch)
            order = np.random.default_rng(seed).permutation(len(self.data))
            self._order = (self._epoch, order)
        return order
