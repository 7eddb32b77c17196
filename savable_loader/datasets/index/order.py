"""Where the positions of an indexed epoch fall over ranks and workers (NOTE [ Indexed
order and sharding ] and NOTE [ Elastic indexed order ] in ``datasets/index/indexed.py``):
arithmetic only, O(1) per position or one array operation per epoch."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from ...config import WorkerContext

__all__ = [
    "Even",
    "epoch_length",
    "global_position",
    "nth_remaining",
    "rank_batches",
    "remaining_positions",
    "shard_length",
]

#: How an epoch gives every rank as many items (NOTE [ Indexed order and sharding ]).
Even = Literal["pad", "drop"]


def epoch_length(items: int, world_size: int, even: Even) -> int:
    """Positions of a fresh epoch of ``items`` items over ``world_size`` ranks (NOTE
    [ Indexed order and sharding ])."""
    if even == "pad":
        return -(-items // world_size) * world_size
    return items // world_size * world_size


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


def rank_batches(length: int, contexts: list[WorkerContext], *, drop_last: bool) -> int:
    """Batches a rank yields in an epoch of ``length`` items over its workers'
    ``contexts`` (items when ``batch_size`` is None), as with torch's ``DataLoader``."""
    total = 0
    for context in contexts:
        items = shard_length(length, context)
        batch = context.batch_size
        if batch is None:
            total += items
        else:
            total += items // batch if drop_last else -(-items // batch)
    return total


def global_position(pos: Any, context: WorkerContext) -> Any:
    """The epoch-wide position of item ``pos`` of ``context``'s worker shard (an int, or
    element-wise for an integer array)."""
    block = _block(context)
    workers = max(context.num_workers, 1)
    rank_pos = (context.worker_id + (pos // block) * workers) * block + pos % block
    return context.rank + rank_pos * context.world_size


def remaining_positions(length: int, below: int, done: np.ndarray) -> np.ndarray:
    """The positions of the epoch not consumed, ascending."""
    open_ = np.ones(length - below, dtype=bool)
    open_[done - below] = False
    return np.flatnonzero(open_) + below


def nth_remaining(k: np.ndarray, below: int, done: np.ndarray) -> np.ndarray:
    """The ``k``-th positions (element-wise, from 0) of an epoch's positions not consumed:
    those from ``below`` on that ``done`` (ascending, above ``below``) does not hold.

    O(log len(done)) per position, in no memory beyond ``done``: the ``i``-th consumed
    position has ``done[i] - below - i`` open positions before it, so the ``k``-th open
    one lies past as many consumed ones as those counts at most ``k``.
    """
    before = done - below - np.arange(len(done), dtype=np.int64)
    return below + k + np.searchsorted(before, k, side="right")
