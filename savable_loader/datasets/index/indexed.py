"""A savable source over any map-style dataset (``__getitem__`` + ``__len__``).

NOTE [ Indexed order and sharding ]
Epoch ``e`` visits the indices in the order ``perm_e`` (with ``shuffle``, a bijection of
``0..n-1`` keyed by ``(seed, e)`` and computed position by position, NOTE [ Computed
epoch orders ] in ``datasets/index/permutation.py``; else ``0..n-1``), read cyclically: position
``p`` of the epoch is index ``perm_e[p % n]``. A state saved before computed orders (no
``"order": 2``) keeps NumPy's stored permutation of ``(seed, e)`` for its run. On ``R``
ranks a fresh epoch has
``ceil(n/R)*R`` positions with ``even="pad"`` (the first indices come again at the end,
as ``DistributedSampler`` repeats the start of its list) and ``floor(n/R)*R`` with
``even="drop"`` (the tail is left out), so every rank reads as many items; with one rank
both are ``n``. Rank ``r`` of ``R`` takes the positions ``r, r+R, r+2R, ...``. Within a
rank, the positions are cut into blocks of ``batch_size`` and worker
``w`` of ``W`` takes blocks ``w, w+W, ...``; since the loader hands batches out in
round-robin worker order, a rank's batches come out in the order of its positions, as
with torch's ``DataLoader`` over a map-style dataset, and a rank's number of batches
depends only on its number of items: every rank yields as many. Position ``k`` of a
worker's shard is computed in O(1), so a state is two integers and ``skip`` moves by
arithmetic. ``config()`` names ``even`` only when it is not the default, so states saved
before the option existed keep their fingerprint (on one rank they mean the same).

NOTE [ Elastic indexed order ]
``perm_e`` depends on the seed and the epoch only, never on the layout, so the cyclic
positions ``0, 1, 2, ...`` (position ``p`` is index ``perm_e[p % n]``) are the canonical
order of the epoch; a layout reads the positions below its epoch's ``length`` (NOTE
[ Indexed order and sharding ]). A padded position is a position like any other: when it
is consumed, the index it repeats is not, unless its own position was. What a layout
consumed before a save is, per (rank, worker) stream, a prefix of that stream's
positions; their union is recorded for the new layout as ``done_below`` (every position
below it was consumed) plus ``done`` (the consumed positions above it, ascending; a
handful when ranks stood at nearly the same step) and the ``length`` of the positions
read. The rest of the epoch is the remaining positions below ``length`` in canonical
order; so that every new rank reads as many, ``even="pad"`` first extends ``length`` by
the fewest next positions (``length, length+1, ...``, the cyclic order going on) that
make the count a multiple of the new number of ranks, and ``even="drop"`` lowers
``length`` to leave out the fewest last remaining positions. The rest is laid out over
the new ranks and workers exactly as a whole epoch is: element ``k`` of the remaining
list goes to rank ``k % R``, then in batch blocks to workers. A second elastic restore in
that epoch maps the new streams' prefixes back through the remaining list, so resharding
composes. The next epoch is laid out as a fresh run on the new layout lays it out.
None of this builds the epoch (``rest_after`` in ``datasets/index/reshard.py``): the first position
left is the least next position of any saved stream, the consumed ones above it are the
old ``done`` above it and the items each stream took past it, found by binary search, so
a reshard costs what its answer holds, not the epoch's length; a worker finds its ``k``-th
position among the open ones by binary search over ``done`` (``nth_remaining``).

NOTE [ A batch read at once ]
Torch's ``DataLoader`` reads a batch of a map-style dataset with one call of the
dataset's ``__getitems__(indices)`` when it has one (Hugging Face's ``datasets.Dataset``
has: a batch costs about what one row does), else with ``data[i]`` for each index. The
loader's batching reads through ``take_batch``, and an :class:`IndexedCursor` whose
items are ``data[i]`` answers it with one ``__getitems__`` call for the batch's indices,
so the dataset sees torch's calls. A replay must make the same calls, since a
``__getitems__`` may draw from the global generators otherwise than ``data[i]`` would:
``skip_batches`` reads batch by batch through ``take_batch`` again, unless the items are
declared deterministic (then it moves by arithmetic). Only the loader's own batching
calls these; a stage between it and the source reads item by item, both ways. A
``__getitems__`` must return one item per index (a list, as torch expects), or the
loader raises :class:`~savable_loader.ConfigError`.

A state names ``length`` whenever it is not ``n``. A state without it was saved where
padding changes nothing (one rank, or ranks that divide ``n``), or before padding
existed: restored on its own layout it continues as this version reads that layout
(padded), and moved to another layout its epoch is the ``n`` positions the version that
saved it read; the states saved in the rest of that epoch keep not naming it.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from ...config import WorkerContext
from ...errors import ConfigError, StateError
from ...rng import Purpose, seed_for, seed_item
from ...state.names import qualified_name
from ..protocol.cursor import Cursor
from ..protocol.elastic import ReshardPlan
from ..protocol.stage import Stage
from . import reshard as indexed_reshard
from .order import Even, epoch_length, global_position, nth_remaining, rank_batches, shard_length
from .permutation import KeyedPermutation
from .reshard import IndexedState, check_length, parse_done, reshard_indexed

__all__ = ["Even", "IndexedDataset", "read_batch"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

#: Positions whose indices a cursor computes at once (NOTE [ Computed epoch orders ]).
_BLOCK = 1024
#: Blocks of indices a reading by position keeps (``_Access``).
_KEPT_BLOCKS = 8


class MapStyle(Protocol[T_co]):
    def __getitem__(self, index: int, /) -> T_co: ...
    def __len__(self) -> int: ...


class IndexedDataset(Stage[T]):
    """Serves a map-style dataset in a seeded per-epoch order, sharded over ranks and workers.

    Every rank reads as many items per epoch, hence yields as many batches, as with
    ``DistributedSampler``: so that no rank of a distributed job waits in a collective
    for a rank that ran out (NOTE [ Indexed order and sharding ]). With one rank, every
    item is read once per epoch whatever ``even`` says.

    Args:
        data: Anything with ``__getitem__(int)`` and ``__len__``.
        shuffle: Visit the indices in a new seeded permutation every epoch.
        seed: Seed of the permutations (``SavableDataLoader`` passes its own ``seed``).
        deterministic_items: Declare that ``data[i]`` draws from no global generator,
            so :meth:`skip` (and a replay after restore) need not fetch skipped items.
        even: How the ranks get as many items when the ranks do not divide the length:
            ``"pad"`` (the default, as ``DistributedSampler(drop_last=False)``) reads the
            first items of the epoch's order again to fill the last round, so an epoch
            has ``ceil(len/R)*R`` items over ``R`` ranks; ``"drop"`` (as
            ``DistributedSampler(drop_last=True)``) leaves the last ``len % R`` items of
            the epoch's order out, ``floor(len/R)*R`` items.

    Raises:
        ConfigError: ``data`` has no ``__getitem__`` or ``__len__``, or ``even`` is
            neither ``"pad"`` nor ``"drop"``. The loader also raises it when a rank would
            read nothing (an empty dataset, or fewer items than ranks with ``"drop"``).

    State:
        ``{"epoch": e, "pos": k}``: the epoch and the position in this worker's shard
        (NOTE [ Indexed order and sharding ]). After a restore onto another number of
        workers or ranks, the resumed epoch's state also holds ``done_below``, ``done``
        and ``length``: the positions consumed before it and how many the epoch has,
        padded or cut for the new number of ranks (NOTE [ Elastic indexed order ]).
        Restore is O(1); skipping is O(1) with
        ``deterministic_items``, and fetches the skipped items otherwise so that global
        generators advance exactly as they would. Nothing is replayed beyond what the
        loader asks.
    """

    keyed = True

    def __init__(
        self,
        data: MapStyle[T],
        *,
        shuffle: bool = False,
        seed: int = 0,
        deterministic_items: bool = False,
        even: Even = "pad",
    ) -> None:
        if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
            raise ConfigError(
                f"IndexedDataset needs __getitem__ and __len__; {type(data).__name__} lacks them"
            )
        if even not in ("pad", "drop"):
            raise ConfigError(f'IndexedDataset even must be "pad" or "drop", got {even!r}')
        self.data = data
        self.shuffled = shuffle
        self.seed = seed
        self.deterministic_items = deterministic_items
        self.even: Even = even

    def config(self) -> dict[str, Any]:
        config = {
            "type": "IndexedDataset",
            "data": qualified_name(type(self.data)),
            "len": len(self.data),
            "shuffle": self.shuffled,
            "seed": self.seed,
        }
        return self.with_even(config)

    def with_even(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` with ``even`` when it is not the default (NOTE [ Indexed order and
        sharding ])."""
        return config if self.even == "pad" else {**config, "even": self.even}

    def describe(self) -> str:
        even = "" if self.even == "pad" else f", even={self.even!r}"
        return (
            f"IndexedDataset({len(self.data)} items, shuffle={self.shuffled}, "
            f"seed={self.seed}{even})"
        )

    def cursor(self, context: WorkerContext) -> IndexedCursor[T]:
        return IndexedCursor(self, context)

    def reshard(self, plan: ReshardPlan) -> dict[str, Any]:
        return reshard_indexed(self, plan)

    def access(self, context: WorkerContext) -> _Access[T] | None:
        """Items by position, ``data[i]`` (NOTE [ Pipelines read by position ] in
        ``datasets/global_view.py``); token windows and table rows read so too, without the
        prefetching their cursors do."""
        return _Access(self, context)

    def draws_nothing(self) -> bool:
        return self.deterministic_items

    def check_layout(self, context: WorkerContext) -> None:
        """Refuses a layout on which a rank would read nothing of a dataset that has
        items. An empty dataset reads as torch's ``DataLoader`` reads it: no batches.

        Raises:
            ConfigError: The dataset has fewer items than ranks with ``even="drop"``.
        """
        length, ranks = len(self.data), context.world_size
        if length == 0 or epoch_length(length, ranks, self.even) > 0:
            return
        raise ConfigError(
            f"{self.describe()}: rank {context.rank} would read no item: {length} items "
            f"over {ranks} rank{'s' * (ranks != 1)} (even={self.even!r}) leave every rank "
            'with an empty epoch; use even="pad" or fewer ranks'
        )

    def checking_cursor(self, context: WorkerContext) -> IndexedCursor[T]:
        """A cursor to restore a state into (NOTE [ States checked at the door ] in
        ``datasets/protocol/stage.py``): restoring reads nothing."""
        return self.cursor(context)

    def items_left(self, state: Any, context: WorkerContext) -> int | None:
        cursor = self.cursor(context)
        cursor.restore(state)
        return cursor.shard_length - cursor.pos

    def epoch_length(self, world_size: int) -> int:
        """Items of a fresh epoch over ``world_size`` ranks, padding included."""
        return epoch_length(len(self.data), world_size, self.even)

    def rank_batches(self, contexts: list[WorkerContext], *, drop_last: bool) -> int:
        """Batches a rank yields in a fresh epoch over its workers' ``contexts`` (items
        when ``batch_size`` is None), as with torch's ``DataLoader``; the same on every
        rank."""
        length = self.epoch_length(contexts[0].world_size)
        return rank_batches(length, contexts, drop_last=drop_last)

    def __len__(self) -> int:
        """Items in an epoch (of every rank and worker together, on one rank)."""
        return len(self.data)


class _Access(Generic[T]):
    """An :class:`IndexedDataset`'s items by position of an epoch."""

    def __init__(self, stage: IndexedDataset[T], context: WorkerContext) -> None:
        self.stage = stage
        self.seeds_items = context.seed_each_item
        self.seed = context.seed
        self._order: tuple[int, Any] = (-1, None)
        #: The indices of the last blocks of positions read, by (epoch, block): computing
        #: a block at once costs what a few positions alone do, and a stream's positions
        #: gather in a few blocks at a time (NOTE [ Computed epoch orders ]).
        self._blocks: dict[tuple[int, int], list[int]] = {}

    def length(self) -> int:
        return len(self.stage.data)

    def _index(self, epoch: int, position: int) -> int:
        block, offset = divmod(position, _BLOCK)
        indices = self._blocks.get((epoch, block))
        if indices is None:
            cached, permutation = self._order
            if cached != epoch:
                key = seed_for(Purpose.PERMUTATION, self.stage.seed, epoch)
                permutation = KeyedPermutation(len(self.stage.data), key)
                self._order = (epoch, permutation)
            stop = min((block + 1) * _BLOCK, len(self.stage.data))
            indices = permutation(np.arange(block * _BLOCK, stop, dtype=np.int64)).tolist()
            if len(self._blocks) >= _KEPT_BLOCKS:
                del self._blocks[next(iter(self._blocks))]
            self._blocks[epoch, block] = indices
        return indices[offset]

    def get_many(self, epoch: int, positions: list[int]) -> list[T]:
        indices = [self._index(epoch, p) for p in positions] if self.stage.shuffled else positions
        data = self.stage.data
        if not self.seeds_items:
            return [data[index] for index in indices]
        items = []
        for position, index in zip(positions, indices, strict=True):
            seed_item(Purpose.ITEM_GLOBALS, self.seed, epoch, position)
            items.append(data[index])
        return items

    def keys(self, epoch: int, positions: list[int]) -> list[tuple[int, ...]]:
        """The items' keys in the global stream: as :meth:`IndexedCursor.item_key`."""
        return [(epoch, position) for position in positions]


def read_batch(data: Any, indices: list[Any]) -> list[Any]:
    """The items at ``indices`` as torch's ``DataLoader`` reads a batch: one call of
    ``data.__getitems__`` when it has one, else ``data[i]`` for each (NOTE [ A batch read
    at once ]).

    Raises:
        ConfigError: ``__getitems__`` returned another number of items than indices.
    """
    getitems = getattr(data, "__getitems__", None)
    if not getitems:
        return [data[index] for index in indices]
    items = list(getitems(indices))
    if len(items) != len(indices):
        raise ConfigError(
            f"{type(data).__name__}.__getitems__ returned {len(items)} items for "
            f"{len(indices)} indices; it must return one item per index"
        )
    return items


class IndexedCursor(Cursor[T]):
    """Reads an :class:`IndexedDataset` for one rank and worker."""

    State = IndexedState
    stage_name = "IndexedDataset"

    def __init__(self, stage: IndexedDataset[T], context: WorkerContext) -> None:
        super().__init__(context)
        self.stage = stage
        self.epoch = 0
        self.pos = 0
        #: Positions of a fresh epoch on this layout, padded or cut for the ranks.
        self.fresh_length = stage.epoch_length(context.world_size)
        #: Positions of epoch ``self.epoch`` as its state names them; None: not named
        #: (:attr:`epoch_positions`, NOTE [ Elastic indexed order ]).
        self.length = self._named(self.fresh_length)
        #: ``(done_below, done)``: positions consumed before an elastic restore, in epoch
        #: ``self.epoch`` only.
        self.done: tuple[int, np.ndarray] | None = None
        self._full_length = shard_length(self.fresh_length, context)
        #: 2: computed orders; 1: the stored permutation of a state saved before them.
        self.order = indexed_reshard.FRESH_ORDER  # read when used: the golden tests set it
        self._order: tuple[int, int, Any] = (-1, 0, None)  # (epoch, order, perm)
        self._block: tuple[int, int, np.ndarray] = (-1, -1, np.empty(0, dtype=np.int64))
        #: ``(epoch, pos, done)`` of the item ``next()`` last returned (:meth:`item_key`).
        self._last: tuple[int, int, tuple[int, np.ndarray] | None] | None = None
        #: ``(epoch, start, done, positions)``: a block of positions after an elastic
        #: restore, for the keys (:meth:`_position`).
        self._spots: tuple[int, int, Any, np.ndarray] = (-1, -1, None, np.empty(0, np.int64))
        #: Seed the global generators before each ``data[i]``: a source that reads its own
        #: items draws nothing (NOTE [ Items seeded one by one ] in ``rng/keys.py``).
        self.seeds_items = context.seed_each_item and type(self).item is IndexedCursor.item

    def _named(self, length: int) -> int | None:
        return None if length == len(self.stage.data) else length

    @property
    def epoch_positions(self) -> int:
        """Positions of the current epoch: a state that does not name them reads the
        dataset's length after an elastic restore, and this layout's otherwise."""
        if self.length is not None:
            return self.length
        return len(self.stage.data) if self.done is not None else self.fresh_length

    @property
    def shard_length(self) -> int:
        """Items of this worker's shard in the current epoch."""
        if self.done is None:
            return self._full_length
        below, done = self.done
        return shard_length(self.epoch_positions - below - len(done), self.context)

    def __next__(self) -> T:
        pos = self.pos
        if pos >= self.shard_length:
            self.end_epoch()
            raise StopIteration
        index = self.index(pos)
        self.pos = pos + 1
        self._last = (self.epoch, pos, self.done)
        if self.seeds_items:
            self._seed(pos)
        return self.item(index)

    def item_key(self) -> tuple[int, ...] | None:
        """``(epoch, position)``: the position of the epoch's canonical order (NOTE
        [ Elastic indexed order ]), padded positions counted on past the dataset's length."""
        if self._last is None:
            return None
        epoch, pos, done = self._last
        return (epoch, self._position(epoch, pos, done))

    def _position(self, epoch: int, pos: int, done: tuple[int, np.ndarray] | None) -> int:
        """The epoch's position at ``pos`` of this worker's shard: arithmetic, or after
        an elastic restore a lookup in the block of positions it falls in."""
        if done is None:
            return int(global_position(pos, self.context))
        start = pos - pos % _BLOCK
        cached_epoch, first, cached_done, spots = self._spots
        if (cached_epoch, first) != (epoch, start) or cached_done is not done:
            spots = self.positions(start, min(start + _BLOCK, self.shard_length), done)
            self._spots = (epoch, start, done, spots)
        return int(spots[pos - start])

    def _seed(self, pos: int) -> None:
        """Seeds the global generators for the item at ``pos`` (NOTE [ Items seeded one
        by one ] in ``rng/keys.py``)."""
        position = self._position(self.epoch, pos, self.done)
        seed_item(Purpose.ITEM_GLOBALS, self.context.seed, self.epoch, position)

    def take(self, n: int) -> list[T]:
        pos = self.pos
        stop = min(pos + n, self.shard_length)
        self.pos = stop  # before the reads: NOTE [ Going on after an error ]
        if self.seeds_items:
            items = []
            for at, index in enumerate(self._cached(pos, stop), start=pos):
                self._seed(at)
                items.append(self.item(index))
        else:
            items = [self.item(index) for index in self._cached(pos, stop)]
        if stop - pos < n:
            self.end_epoch()
        return items

    def take_batch(self, n: int) -> list[T]:
        """One ``__getitems__`` call for the batch (NOTE [ A batch read at once ])."""
        if self._getitems() is None:
            return self.take(n)
        pos = self.pos
        stop = min(pos + n, self.shard_length)
        self.pos = stop
        if self.seeds_items and stop > pos:
            self._seed(pos)  # one call reads the batch: seeded by its first item
        items = read_batch(self.stage.data, self._cached(pos, stop)) if stop > pos else []
        if stop - pos < n:
            self.end_epoch()
        return items

    def skip_batches(self, batches: int, size: int) -> int:
        """Reads the batches again when they are read at once and may draw (NOTE [ A
        batch read at once ])."""
        if self._getitems() is None or self.draws_nothing:
            return self.skip(batches * size)
        passed = 0
        for _ in range(batches):
            got = len(self.take_batch(size))
            passed += got
            if got < size:
                break
        return passed

    @property
    def draws_nothing(self) -> bool:
        """Whether passing an item without reading it leaves the global generators as
        reading it would for what follows: declared ``deterministic_items``, or items
        seeded one by one (each reseeds before it draws)."""
        return self.stage.deterministic_items or self.seeds_items

    def goes_on_after_error(self) -> bool:
        """Reading ``data[i]`` of a map-style dataset moves past the indices first
        (NOTE [ Going on after an error ] in ``_worker/runtime.py``); a source that reads
        otherwise (``TableSource``) retries."""
        return type(self).item is IndexedCursor.item

    def _getitems(self) -> Any:
        """The dataset's ``__getitems__`` when this cursor's items are ``data[i]``."""
        if type(self).item is not IndexedCursor.item:
            return None
        return getattr(self.stage.data, "__getitems__", None) or None

    def own_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "pos": self.pos}
        if self.order == 2 and self.stage.shuffled:  # NOTE [ Computed epoch orders ]
            state["order"] = 2
        if self.done is not None:
            below, done = self.done
            state.update(done_below=below, done=done.tolist())
        if self.length is not None:
            state["length"] = self.length
        return state

    def restore_own(self, state: Any | None) -> None:
        position = state if isinstance(state, IndexedState) else IndexedState(epoch=0, pos=0)
        self.epoch, self.pos = position.epoch, position.pos
        self._last = None
        self.done = parse_done(position)
        # The initial state is a fresh epoch; a saved one names its length or not.
        self.length = position.length if state is not None else self._named(self.fresh_length)
        self.order = indexed_reshard.FRESH_ORDER if state is None else (position.order or 1)
        self._order = (-1, 0, None)
        self._block = (-1, -1, np.empty(0, dtype=np.int64))
        length = self.epoch_positions
        check_length(position, length, len(self.stage.data))
        if self.done is None and length != self.fresh_length:
            raise StateError(
                f"IndexedDataset: the state's epoch has {length} positions, this "
                f"layout's {self.fresh_length} ({len(self.stage.data)} items over "
                f"{self.context.world_size} ranks, even={self.stage.even!r}); restore a "
                "state saved by the same pipeline on the same number of ranks"
            )
        if self.pos > self.shard_length:
            raise StateError(
                f"IndexedDataset: position {self.pos} is past this worker's shard of "
                f"{self.shard_length} items; restore a state saved by the same pipeline"
            )

    def end_epoch(self) -> None:
        self.epoch += 1
        self.pos = 0
        self.done = None
        self.length = self._named(self.fresh_length)

    def skip_fast(self, n: int) -> int:
        length = self.shard_length
        stop = min(self.pos + n, length)
        if not self.draws_nothing:
            for pos in range(self.pos, stop):
                self.item(self.index(pos))
        passed, self.pos = stop - self.pos, stop
        if passed < n:
            self.end_epoch()
        return passed

    def item(self, index: int) -> T:
        """Reads item ``index`` of the dataset: the hook a source overrides to read
        differently (``TableSource`` takes files fetched ahead)."""
        return self.stage.data[index]

    def upcoming(self, n: int, *, after: int = 0) -> list[int]:
        """The dataset indices at this worker's next ``n`` positions in this epoch but the
        first ``after`` (fewer near its end), without moving: what a source may read
        ahead."""
        stop = min(self.pos + n, self.shard_length)
        return self._cached(min(self.pos + after, stop), stop)

    def index(self, pos: int) -> int:
        """The dataset index at position ``pos`` of this worker's shard in this epoch."""
        start = pos - pos % _BLOCK
        return int(self._block_at(start)[pos - start])

    def _block_at(self, start: int) -> np.ndarray:
        """The indices of the block of ``_BLOCK`` positions from ``start``, computed once."""
        epoch, first, indices = self._block
        if epoch != self.epoch or first != start:
            indices = self.indices(start, min(start + _BLOCK, self.shard_length))
            self._block = (self.epoch, start, indices)
        return indices

    def _cached(self, pos: int, stop: int) -> list[int]:
        """The indices at positions ``[pos, stop)``, through the block of each."""
        out: list[int] = []
        while pos < stop:
            start = pos - pos % _BLOCK
            end = min(stop, start + _BLOCK)
            out += self._block_at(start)[pos - start : end - start].tolist()
            pos = end
        return out

    def indices(self, start: int, stop: int) -> np.ndarray:
        """The dataset indices at positions ``[start, stop)`` of this worker's shard in
        this epoch, computed (NOTE [ Computed epoch orders ] in
        ``datasets/index/permutation.py``)."""
        items = len(self.stage.data)
        positions = self.positions(start, stop, self.done) % max(items, 1)
        if not self.stage.shuffled:
            return positions
        indices: np.ndarray = self._permutation(items)(positions)
        return indices

    def positions(self, start: int, stop: int, done: tuple[int, np.ndarray] | None) -> np.ndarray:
        """The epoch's positions at ``[start, stop)`` of this worker's shard, ``done``
        being the positions consumed before an elastic restore (NOTE [ Elastic indexed
        order ])."""
        positions = global_position(np.arange(start, stop, dtype=np.int64), self.context)
        if done is not None:
            below, consumed = done
            positions = nth_remaining(positions, below, consumed)
        return np.asarray(positions, dtype=np.int64)

    def _permutation(self, items: int) -> Any:
        """The shuffled order of this epoch: a computed bijection, or for a state saved
        before those (order 1) the stored permutation of that version."""
        epoch, order, permutation = self._order
        if epoch != self.epoch or order != self.order:
            seed = seed_for(Purpose.PERMUTATION, self.stage.seed, self.epoch)
            if self.order == 2:
                permutation = KeyedPermutation(items, seed)
            else:
                stored = np.random.default_rng(seed).permutation(items)
                permutation = stored.__getitem__
            self._order = (self.epoch, self.order, permutation)
        return permutation
