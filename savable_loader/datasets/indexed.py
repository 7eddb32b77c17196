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

NOTE [ Elastic indexed order ]
``perm_e`` depends on the seed and the epoch only, never on the layout, so its positions
are the canonical order of the epoch. What a layout consumed before a save is, per
(rank, worker) stream, a prefix of that stream's positions; their union is recorded for
the new layout as ``done_below`` (every position below it was consumed) plus ``done``
(the consumed positions above it, ascending; a handful when ranks stood at nearly the
same step). The rest of the epoch is the remaining positions in canonical order, laid
out over the new ranks and workers exactly as a whole epoch is: element ``k`` of the
remaining list goes to rank ``k % R``, then in batch blocks to workers. A second elastic
restore in that epoch maps the new streams' prefixes back through the remaining list,
so resharding composes. The next epoch is laid out as a fresh run on the new layout
lays it out.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol, TypeVar

import numpy as np
from pydantic import Field

from ..config import WorkerContext
from ..errors import ConfigError, StateError
from ..rng import derive_seed
from .cursor import Cursor, StageState, validate_state
from .elastic import ReshardPlan
from .stage import Stage

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
    done_below: int | None = Field(
        default=None,
        ge=0,
        description="After an elastic restore: every position of the epoch below this one "
        "was consumed before it (NOTE [ Elastic indexed order ]).",
    )
    done: list[int] | None = Field(
        default=None, description="After an elastic restore: consumed positions above done_below."
    )


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
        (NOTE [ Indexed order and sharding ]). After a restore onto another number of
        workers or ranks, the resumed epoch's state also holds ``done_below`` and
        ``done``, the positions consumed before it (NOTE [ Elastic indexed order ]).
        Restore is O(1); skipping is O(1) with
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

    def reshard(self, plan: ReshardPlan) -> dict[str, Any]:
        return reshard_indexed(self, plan)

    def __len__(self) -> int:
        """Items in an epoch (of every rank and worker together)."""
        return len(self.data)


class IndexedCursor(Cursor[T]):
    """Reads an :class:`IndexedDataset` for one rank and worker."""

    State = _State
    stage_name = "IndexedDataset"

    def __init__(self, stage: IndexedDataset[T], context: WorkerContext) -> None:
        super().__init__(context)
        self.stage = stage
        self.epoch = 0
        self.pos = 0
        #: Positions consumed before an elastic restore, in epoch ``self.epoch`` only.
        self.done: tuple[int, np.ndarray] | None = None
        self._full_length = shard_length(len(stage.data), context)
        self._order: tuple[int, np.ndarray | None] = (-1, None)

    @property
    def shard_length(self) -> int:
        """Items of this worker's shard in the current epoch."""
        if self.done is None:
            return self._full_length
        return len(self._indices())

    def __next__(self) -> T:
        pos = self.pos
        if pos >= self.shard_length:
            self.end_epoch()
            raise StopIteration
        index = int(self._indices()[pos])
        self.pos = pos + 1
        return self.stage.data[index]

    def take(self, n: int) -> list[T]:
        pos = self.pos
        stop = min(pos + n, self.shard_length)
        data = self.stage.data
        items = [data[index] for index in self._indices()[pos:stop].tolist()]
        self.pos = stop
        if stop - pos < n:
            self.end_epoch()
        return items

    def own_state(self) -> dict[str, Any]:
        if self.done is None:
            return {"epoch": self.epoch, "pos": self.pos}
        below, done = self.done
        return {"epoch": self.epoch, "pos": self.pos, "done_below": below, "done": done.tolist()}

    def restore_own(self, state: Any | None) -> None:
        position = state if isinstance(state, _State) else _State(epoch=0, pos=0)
        self.epoch, self.pos = position.epoch, position.pos
        self.done = _done(position, len(self.stage.data))
        self._order = (-1, None)
        if self.pos > self.shard_length:
            raise StateError(
                f"IndexedDataset: position {self.pos} is past this worker's shard of "
                f"{self.shard_length} items; restore a state saved by the same pipeline"
            )

    def end_epoch(self) -> None:
        self.epoch += 1
        self.pos = 0
        self.done = None

    def skip_fast(self, n: int) -> int:
        length = self.shard_length
        stop = min(self.pos + n, length)
        if not self.stage.deterministic_items:
            for pos in range(self.pos, stop):
                self.stage.data[self.index(pos)]
        passed, self.pos = stop - self.pos, stop
        if passed < n:
            self.end_epoch()
        return passed

    def index(self, pos: int) -> int:
        """The dataset index at position ``pos`` of this worker's shard in this epoch."""
        return int(self._indices()[pos])

    def _indices(self) -> np.ndarray:
        """This worker's dataset indices for the current epoch, computed once per epoch
        (one array operation instead of arithmetic per item)."""
        epoch, indices = self._order
        if epoch != self.epoch or indices is None:
            length = len(self.stage.data)
            remaining = None if self.done is None else _remaining(length, *self.done)
            count = shard_length(length if remaining is None else len(remaining), self.context)
            positions = global_position(np.arange(count, dtype=np.int64), self.context)
            if remaining is not None:
                positions = remaining[positions]
            if self.stage.shuffled:
                seed = derive_seed(self.stage.seed, _PERMUTATION_PURPOSE, self.epoch)
                positions = np.random.default_rng(seed).permutation(len(self.stage.data))[positions]
            indices = positions
            self._order = (self.epoch, indices)
        return indices


def _parse(state: Any) -> _State:
    return validate_state(_State, state, "IndexedDataset")


def _done(position: _State, length: int) -> tuple[int, np.ndarray] | None:
    """The consumed positions a state records, checked (NOTE [ Elastic indexed order ])."""
    if position.done_below is None and position.done is None:
        return None
    if position.done_below is None or position.done is None:
        raise StateError(
            "IndexedDataset: malformed state (done_below and done come together); restore "
            "a state saved by the same pipeline"
        )
    done = np.asarray(position.done, dtype=np.int64)
    below = position.done_below
    if below > length or (
        len(done) and (done[0] <= below or done[-1] >= length or np.any(np.diff(done) <= 0))
    ):
        raise StateError(
            f"IndexedDataset: malformed state (done_below {below} and done must be ascending "
            f"positions of an epoch of {length} items); restore a state saved by the same "
            "pipeline"
        )
    return below, done


def _remaining(length: int, below: int, done: np.ndarray) -> np.ndarray:
    """The positions of the epoch not consumed, ascending."""
    open_ = np.ones(length - below, dtype=bool)
    open_[done - below] = False
    return np.flatnonzero(open_) + below


#: The last reshard's (length, epoch, old streams) and answer: every new stream of one
#: restore gets the same answer, which costs O(length) to compute.
_last_reshard: list[tuple[tuple[int, int, Any], dict[str, Any]]] = []


def reshard_indexed(stage: IndexedDataset[Any], plan: ReshardPlan) -> dict[str, Any]:
    """The state of ``plan.new``'s stream (NOTE [ Elastic indexed order ]).

    The answer depends on the epoch's length and the old streams only, not on the new
    stream, so the last one is kept for the other new streams of the same restore.
    """
    key = (len(stage.data), plan.epoch, plan.old)
    if _last_reshard and _last_reshard[0][0] == key:
        return copy.deepcopy(_last_reshard[0][1])
    answer = _reshard(len(stage.data), plan)
    _last_reshard[:] = [(key, copy.deepcopy(answer))]
    return answer


def _reshard(length: int, plan: ReshardPlan) -> dict[str, Any]:
    finished: list[WorkerContext] = []
    reading: list[tuple[WorkerContext, int]] = []
    records: set[tuple[int, tuple[int, ...]] | None] = set()
    done: tuple[int, np.ndarray] | None = None
    for stream in plan.old:
        position = _State(epoch=0, pos=0) if stream.state is None else _parse(stream.state)
        if position.epoch == plan.epoch + 1 and position.pos == 0 and position.done is None:
            finished.append(stream.context)
            continue
        if position.epoch != plan.epoch:
            raise StateError(
                f"IndexedDataset: a saved stream stands in epoch {position.epoch} while the "
                f"loader resumes epoch {plan.epoch}; restore a state saved by the same pipeline"
            )
        done = _done(position, length)
        records.add(None if done is None else (done[0], tuple(done[1].tolist())))
        reading.append((stream.context, position.pos))
    if len(records) > 1:
        raise StateError(
            "IndexedDataset: the saved streams disagree on what was consumed before their "
            "own restore; restore the states of one save together"
        )
    if not reading:
        # Every stream finished the epoch: nothing of it is left.
        return {"epoch": plan.epoch, "pos": 0, "done_below": length, "done": []}
    remaining = np.arange(length, dtype=np.int64) if done is None else _remaining(length, *done)
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
        return {"epoch": plan.epoch, "pos": 0}
    open_positions = np.flatnonzero(~consumed)
    below = int(open_positions[0]) if len(open_positions) else length
    above = np.flatnonzero(consumed[below:]) + below
    return {"epoch": plan.epoch, "pos": 0, "done_below": below, "done": above.tolist()}


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
