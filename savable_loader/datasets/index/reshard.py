"""An indexed source's state, checked, and how it moves to another layout (NOTE [ Elastic
indexed order ] in ``datasets/index/indexed.py``)."""

from __future__ import annotations

import copy
from typing import Any, Protocol

import numpy as np
from pydantic import Field

from ...config import WorkerContext
from ...errors import StateError
from ..protocol.cursor import StageState, validate_state
from ..protocol.elastic import ReshardPlan
from .order import Even, global_position, nth_remaining, shard_length


class IndexedStage(Protocol):
    """What a reshard asks of an ``IndexedDataset``."""

    data: Any
    even: Even
    shuffled: bool


__all__ = ["FRESH_ORDER", "IndexedState", "check_length", "parse_done", "reshard_indexed"]

#: The order of a fresh run: 2, computed (NOTE [ Computed epoch orders ] in
#: ``datasets/index/permutation.py``); 1, the stored permutation of earlier versions, which their
#: states keep.
FRESH_ORDER = 2


class IndexedState(StageState):
    """An indexed source's position."""

    epoch: int = Field(ge=0, description="The epoch being read.")
    pos: int = Field(ge=0, description="Items of this worker's shard already read in it.")
    done_below: int | None = Field(
        default=None,
        ge=0,
        description="After an elastic restore: every position of the epoch below this one "
        "was consumed before it (NOTE [ Elastic indexed order ]).",
    )
    done: list[int] | None = Field(
        default=None, description="After an elastic restore: consumed positions above done_below."
    )
    length: int | None = Field(
        default=None,
        ge=0,
        description="Positions of the epoch, consumed or not, when they are not the "
        "dataset's length: padded or cut for the ranks, or after an elastic restore "
        "(NOTE [ Elastic indexed order ]).",
    )
    order: int | None = Field(
        default=None,
        ge=2,
        le=2,
        description="2: the shuffled order is computed (NOTE [ Computed epoch orders ] in "
        "permutation.py); absent: the stored permutation of earlier versions.",
    )


def _parse(state: Any) -> IndexedState:
    return validate_state(IndexedState, state, "IndexedDataset")


def parse_done(position: IndexedState) -> tuple[int, np.ndarray] | None:
    """The ``(done_below, done)`` a state records (NOTE [ Elastic indexed order ])."""
    if position.done_below is None and position.done is None:
        return None
    if position.done_below is None or position.done is None:
        raise StateError(
            "IndexedDataset: malformed state (done_below and done come together); restore "
            "a state saved by the same pipeline"
        )
    return position.done_below, np.asarray(position.done, dtype=np.int64)


def check_length(position: IndexedState, length: int, items: int) -> None:
    """Refuses consumed positions outside an epoch of ``length`` positions."""
    below, done = position.done_below or 0, position.done or []
    if (
        (items == 0 and length > 0)
        or below > length
        or (done and (done[0] <= below or done[-1] >= length))
        or bool(np.any(np.diff(np.asarray(done, dtype=np.int64)) <= 0))
    ):
        raise StateError(
            f"IndexedDataset: malformed state (done_below {below} and done must be ascending "
            f"positions of an epoch of {length} positions of {items} items); restore a "
            "state saved by the same pipeline"
        )


def _old_rest(position: IndexedState, items: int) -> tuple[int, int, tuple[int, ...]]:
    """``(length, done_below, done)`` of a saved stream's epoch: a state without
    ``length`` was read over the dataset's length by the version that saved it."""
    length = items if position.length is None else position.length
    check_length(position, length, items)
    return length, position.done_below or 0, tuple(position.done or ())


def reshard_indexed(stage: IndexedStage, plan: ReshardPlan) -> dict[str, Any]:
    """The state of ``plan.new``'s stream (NOTE [ Elastic indexed order ]).

    The answer depends on the epoch's length, ``even``, the old streams and the new
    number of ranks only, not on the new stream, so it is computed once per restore
    (NOTE [ One answer per restore ] in ``datasets/protocol/elastic.py``).
    """
    return copy.deepcopy(plan.once(("indexed", id(stage)), lambda: _reshard(stage, plan)))


def _reshard(stage: IndexedStage, plan: ReshardPlan) -> dict[str, Any]:
    items = len(stage.data)
    finished: list[WorkerContext] = []
    reading: list[tuple[WorkerContext, int]] = []
    records: set[tuple[int, int, tuple[int, ...]]] = set()
    orders: set[int | None] = set()
    for stream in plan.old:
        position = IndexedState(epoch=0, pos=0) if stream.state is None else _parse(stream.state)
        if stream.state is not None:
            orders.add(position.order)
        if position.epoch == plan.epoch + 1 and position.pos == 0 and position.done is None:
            finished.append(stream.context)
            continue
        if position.epoch != plan.epoch:
            raise StateError(
                f"IndexedDataset: a saved stream stands in epoch {position.epoch} while the "
                f"loader resumes epoch {plan.epoch}; restore a state saved by the same pipeline"
            )
        parse_done(position)
        records.add(_old_rest(position, items))
        reading.append((stream.context, position.pos))
    if len(orders) > 1:
        raise StateError(
            "IndexedDataset: the saved streams were saved with different orders (some "
            "before computed orders existed); restore the states of one save together"
        )
    fresh = orders in ({2}, set()) and FRESH_ORDER == 2
    order = {"order": 2} if fresh and stage.shuffled else {}
    if len(records) > 1:
        raise StateError(
            "IndexedDataset: the saved streams disagree on the positions of the epoch or on "
            "what was consumed before their own restore; restore the states of one save "
            "together"
        )
    if not reading:
        # Every stream finished the epoch: nothing of it is left.
        return {"epoch": plan.epoch, "pos": 0, "done_below": 0, "done": [], "length": 0, **order}
    (length, below, done), *_ = records
    open_before = length - below - len(done)
    streams = [(context, shard_length(open_before, context)) for context in finished]
    for context, pos in reading:
        count = shard_length(open_before, context)
        if pos > count:
            raise StateError(
                f"IndexedDataset: position {pos} is past the shard of {count} items of rank "
                f"{context.rank} worker {context.worker_id}"
            )
        streams.append((context, pos))
    rest = rest_after(
        length, below, np.asarray(done, dtype=np.int64), streams, plan.new.world_size, stage.even
    )
    if rest is None:
        return {"epoch": plan.epoch, "pos": 0, **order}
    length, below, above = rest
    return {
        "epoch": plan.epoch,
        "pos": 0,
        "done_below": below,
        "done": above.tolist(),
        "length": length,
        **order,
    }


def rest_after(
    length: int,
    below: int,
    done: np.ndarray,
    streams: list[tuple[WorkerContext, int]],
    ranks: int,
    even: Even,
) -> tuple[int, int, np.ndarray] | None:
    """What is left of an epoch once ``streams`` took their first items: the new
    ``(length, done_below, done)``, evened for ``ranks`` (NOTE [ Elastic indexed order ]),
    or None when nothing of the epoch was consumed.

    The epoch's open positions before the streams read are those from ``below`` on that
    ``done`` does not hold; stream ``s`` took the first ``taken`` of its shard of them,
    whose ``k``-th is open position ``global_position(k)``, increasing in ``k``. Nothing
    of size ``length`` is built: the first position left is the least next position of
    any stream, the consumed ones above it are the old ``done`` above it and, per stream,
    the few items it took past that position, found by binary search.
    """
    open_before = length - below - len(done)
    taken = sum(count for _, count in streams)
    if below == 0 and not len(done) and not taken:
        return None
    counts = [shard_length(open_before, context) for context, _ in streams]
    nexts = [
        int(global_position(count, context))
        for (context, count), total in zip(streams, counts, strict=True)
        if count < total
    ]
    first_open = min(nexts, default=open_before)  # an index among the open positions
    open_left = open_before - taken
    new_length = length
    if even == "pad":
        new_length += -open_left % ranks
    elif open_left % ranks:
        kept = open_left - open_left % ranks  # the open positions kept: the first ones
        new_length = _position(_kth_left(kept, streams, counts, open_before), below, done)
    new_below = _position(first_open, below, done) if first_open < open_before else length
    new_below = min(new_below, new_length)
    parts = [done[(done > new_below) & (done < new_length)]]
    for context, count in streams:
        start = _first_past(first_open, context, count)
        if start < count:
            indices = global_position(np.arange(start, count, dtype=np.int64), context)
            positions = _position(indices, below, done)
            parts.append(positions[positions < new_length])
    above = np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
    return new_length, int(new_below), above.astype(np.int64)


def _position(index: Any, below: int, done: np.ndarray) -> Any:
    """The position of the ``index``-th open position (an int or an array)."""
    found = nth_remaining(np.asarray(index, dtype=np.int64), below, done)
    return int(found) if np.ndim(found) == 0 else found


def _first_past(index: int, context: WorkerContext, count: int) -> int:
    """The least ``k < count`` whose open position index exceeds ``index`` (``count``
    if none): ``global_position`` increases with ``k``."""
    low, high = 0, count
    while low < high:
        middle = (low + high) // 2
        if int(global_position(middle, context)) > index:
            high = middle
        else:
            low = middle + 1
    return low


def _kth_left(
    kept: int, streams: list[tuple[WorkerContext, int]], counts: list[int], total: int
) -> int:
    """The open position index of the ``kept``-th (from 0) index no stream took."""
    low, high = 0, total - 1
    while low < high:  # the least v with more than ``kept`` untaken indices up to v
        middle = (low + high) // 2
        untaken = 0
        for (context, count), size in zip(streams, counts, strict=True):
            upto = _first_past(middle, context, size)  # shard items at indices <= middle
            untaken += upto - min(count, upto)
        if untaken > kept:
            high = middle
        else:
            low = middle + 1
    return low
