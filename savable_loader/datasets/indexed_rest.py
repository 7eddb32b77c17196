"""An indexed source's state, checked, and how it moves to another layout (NOTE [ Elastic
indexed order ] in ``indexed.py``)."""

from __future__ import annotations

import copy
from typing import Any, Protocol

import numpy as np
from pydantic import Field

from ..config import WorkerContext
from ..errors import StateError
from .cursor import StageState, validate_state
from .elastic import ReshardPlan
from .index_order import Even, global_position, remaining_positions, shard_length


class IndexedStage(Protocol):
    """What a reshard asks of an ``IndexedDataset``."""

    data: Any
    even: Even
    shuffled: bool


__all__ = ["FRESH_ORDER", "IndexedState", "check_length", "parse_done", "reshard_indexed"]

#: The order of a fresh run: 2, computed (NOTE [ Computed epoch orders ] in
#: ``permutation.py``); 1, the stored permutation of earlier versions, which their states
#: keep.
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


#: The last reshard's (stage config, epoch, old streams, new world size) and answer: every
#: new stream of one restore gets the same answer, which costs O(length) to compute.
_last_reshard: list[tuple[tuple[Any, ...], dict[str, Any]]] = []


def reshard_indexed(stage: IndexedStage, plan: ReshardPlan) -> dict[str, Any]:
    """The state of ``plan.new``'s stream (NOTE [ Elastic indexed order ]).

    The answer depends on the epoch's length, ``even``, the old streams and the new
    number of ranks only, not on the new stream, so the last one is kept for the other
    new streams of the same restore.
    """
    key = (len(stage.data), stage.even, plan.epoch, plan.old, plan.new.world_size)
    if _last_reshard and _last_reshard[0][0] == key:
        return copy.deepcopy(_last_reshard[0][1])
    answer = _reshard(stage, plan)
    _last_reshard[:] = [(key, copy.deepcopy(answer))]
    return answer


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
    remaining = remaining_positions(length, below, np.asarray(done, dtype=np.int64))
    consumed = np.ones(length, dtype=bool)
    consumed[remaining] = False
    streams = [(context, shard_length(len(remaining), context)) for context in finished]
    for context, pos in reading:
        count = shard_length(len(remaining), context)
        if pos > count:
            raise StateError(
                f"IndexedDataset: position {pos} is past the shard of {count} items of rank "
                f"{context.rank} worker {context.worker_id}"
            )
        streams.append((context, pos))
    for context, count in streams:
        consumed[remaining[global_position(np.arange(count, dtype=np.int64), context)]] = True
    if not consumed.any():
        return {"epoch": plan.epoch, "pos": 0, **order}
    consumed = _even_rest(consumed, plan.new.world_size, stage.even)
    length = len(consumed)
    open_positions = np.flatnonzero(~consumed)
    below = int(open_positions[0]) if len(open_positions) else length
    above = np.flatnonzero(consumed[below:]) + below
    return {
        "epoch": plan.epoch,
        "pos": 0,
        "done_below": below,
        "done": above.tolist(),
        "length": length,
        **order,
    }


def _even_rest(consumed: np.ndarray, ranks: int, even: Even) -> np.ndarray:
    """``consumed`` (one flag per position of the epoch) padded with open positions, or
    cut before its last open ones, so that the open positions fill whole rounds of
    ``ranks`` (NOTE [ Elastic indexed order ])."""
    open_positions = np.flatnonzero(~consumed)
    if even == "pad":
        return np.concatenate([consumed, np.zeros(-len(open_positions) % ranks, dtype=bool)])
    cut = len(open_positions) % ranks
    return consumed[: open_positions[-cut]] if cut else consumed
