"""A pipeline read by global position: the same global batches on every layout.

NOTE [ Pipelines read by position ]
A stage whose position in a stream depends on what that stream read (a window shuffle
reads a window of its own stream's items) gives each layout other global batches. When
every stage of a pipeline can produce the item at any position of an epoch (its
:class:`Access`: a map-style source, a map, a window shuffle over positions, a repeat of
a known number of passes, a limit, a blend that ends), the loader reads the pipeline as
one indexed source over those positions (:class:`GlobalView`): position ``p`` of epoch
``e`` is ``get(e, p)``, and the positions are shared out over ranks and workers exactly
as an ``IndexedDataset``'s (NOTE [ Indexed order and sharding ] in ``datasets/index/indexed.py``).
The global batch of step ``j`` then holds positions ``[j G, (j + 1) G)`` of the epoch
whatever the layout, a state is the view's two integers, and a restore onto another
layout (another number of ranks, workers or another per-rank batch size) continues the
same positions (NOTE [ Elastic indexed order ]).

The view is taken only where a stage's stream reading depends on the layout
(``Stage.reads_by_layout``: a ``Shuffle``, a ``Repeat`` of counted passes, a ``Limit``,
a ``Blend``, a file source with ``split="global"``, NOTE [ File sources by position ] in
``datasets/files/positions.py``); a pipeline without one reads as before,
its global batches already the same on every layout. A state saved by a version that
read such a pipeline stream by stream (its state nests the stages' parts) is continued
by that reading, for the rest of the run (``FRESH`` off reads fresh runs that way too,
as those versions did).

NOTE [ Endless streams by position ]
An endless ``Repeat`` or a ``Blend`` with ``stop="never"`` over stages read by position
has an access too, of one epoch, 0, that never ends (its ``length()`` is None): an
endless repeat's passes follow one another, an endless blend is laid out block by block
(NOTE [ Endless blends by position ] in ``datasets/transforms/blend_positions.py``), a map or window
shuffle over them is endless too. Under a ``Limit`` the limit's epoch ``e`` is the endless
stream's positions ``[e n, (e + 1) n)``. Without one, the view's one epoch is
:data:`ENDLESS` positions long, which no run reaches, so its global batches are the
stream's positions ``[j G, (j + 1) G)`` on every layout, and ``len(loader)`` raises
``TypeError`` as for any endless iterable.

NOTE [ Blend weights by position ]
A blend read by position lays each epoch out from its weights (NOTE [ Blend by
position ] in ``datasets/transforms/blend_positions.py``), and the weights are not in the
fingerprint, so the view's state records them: ``"weights"``, one list per blend, outermost first. A
restore with other weights is refused unless that blend has ``allow_weight_change``;
then the new weights take effect only for a stream that has consumed nothing of its
epoch (a state saved between epochs), since positions already read were laid out with
the old ones; a stream saved mid-epoch is refused, naming the fix. A restore onto
another layout checks every saved stream so.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from ..config import WorkerContext
from ..errors import ConfigError, StateError
from .files.positions import laid_out_for, lanes_of
from .index.indexed import IndexedCursor, IndexedDataset
from .protocol.cursor import Cursor
from .protocol.elastic import OldStream, ReshardPlan
from .protocol.stage import Stage
from .transforms.blend import Blend

__all__ = ["ENDLESS", "FRESH", "Access", "GlobalView", "global_view"]

T = TypeVar("T")

#: The length of the one epoch of an endless pipeline read by position: 2**53 positions,
#: more than a run reads (a year at 10**8 items a second), exact in a float too.
ENDLESS = 2**53

#: Fresh runs read a pipeline with a window shuffle by position (see the NOTE above);
#: off, stream by stream as versions before it did (for their states' tests).
FRESH = True


class Access(Protocol[T]):
    """A stage's items by position (NOTE [ Pipelines read by position ])."""

    def length(self) -> int | None:
        """Items in every epoch; None: an endless stream, whose one epoch, 0, never
        ends (NOTE [ Endless streams by position ])."""
        ...

    def get_many(self, epoch: int, positions: list[int]) -> list[T]:
        """The items at ``positions`` (each below :meth:`length`) of ``epoch``, read in
        that order (a source computes their indices at once)."""
        ...

    def keys(self, epoch: int, positions: list[int]) -> list[tuple[int, ...]]:
        """Those items' keys in the global stream (NOTE [ Keys of the global stream ] in
        ``rng/keys.py``)."""
        ...


def global_view(stage: Stage[T]) -> Stage[T]:
    """``stage`` read by position when its stream reading depends on the layout and every
    stage of it has an :class:`Access`; else ``stage`` itself."""
    if not FRESH or not stage.reads_by_layout():
        return stage
    probe = WorkerContext(0, 1, 0, 0, 0, None)
    if stage.access(probe) is None:
        needs = stage.needs_positions()
        if needs is not None:
            raise ConfigError(
                f"{needs} is read by position (split='global'), which needs every stage "
                f"of {stage.describe()} to read by position too, and one reads only as a "
                "stream (a filter, your own dataset, an endless repeat or blend without a "
                "limit above it); use split='samples' there, or move that stage out of the "
                "pipeline"
            )
        return stage
    return GlobalView(stage)


class _Positions:
    """The view's ``data``: its length; items are read through the access instead."""

    def __init__(self, length: int) -> None:
        self.n = length

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, position: int) -> int:
        return position


class GlobalView(IndexedDataset[T]):
    """Reads ``pipeline`` by position (NOTE [ Pipelines read by position ]).

    Its ``config()`` is the pipeline's, so a state keeps its fingerprint; its state is an
    ``IndexedDataset``'s over the pipeline's positions.

    Args:
        pipeline: A stage with an :class:`Access`.
    """

    def __init__(self, pipeline: Stage[T]) -> None:
        access = pipeline.access(WorkerContext(0, 1, 0, 0, 0, None))
        if access is None:
            raise StateError(f"{pipeline.describe()} cannot be read by position; please report")
        length = access.length()
        #: An endless pipeline: its one epoch is ``ENDLESS`` positions long, never reached
        #: (NOTE [ Endless streams by position ]).
        self.endless = length is None
        super().__init__(
            _Positions(ENDLESS if length is None else length),  # type: ignore[arg-type]
            even=_even(pipeline),
            deterministic_items=pipeline.draws_nothing(),
        )
        self.pipeline = pipeline
        #: The pipeline's blends, outermost first (NOTE [ Blend weights by position ]).
        self.blends = _blends(pipeline)
        #: Whether a state records the global batch size its epoch is laid out for
        #: (NOTE [ File sources by position ] in ``datasets/files/positions.py``).
        self.lanes_kept = pipeline.needs_positions() is not None

    def weights(self) -> list[list[float]]:
        """Each blend's weights: what a state records of them."""
        return [list(blend.weights) for blend in self.blends]

    def own_part(self, state: Any) -> Any:
        """``state`` without the blends' weights, which it checks against the pipeline's
        (NOTE [ Blend weights by position ]).

        Raises:
            StateError: The weights are malformed, or differ where they cannot.
        """
        if not (self.blends or self.lanes_kept) or not isinstance(state, dict):
            return state
        part = {key: value for key, value in state.items() if key not in ("weights", "lanes")}
        if self.lanes_kept:
            lanes = state.get("lanes")
            if not isinstance(lanes, int) or isinstance(lanes, bool) or lanes < 1:
                raise StateError(
                    f"{self.describe()}: malformed state (lanes: expected the global batch "
                    f"size its epoch was laid out for, an int of at least 1, got {lanes!r}); "
                    "restore a state saved by the same pipeline"
                )
        if self.blends:
            self._check_weights(state.get("weights"), part)
        return part

    def saved_lanes(self, state: Any) -> int | None:
        """The global batch size ``state``'s epoch is laid out for, when it records one."""
        if not self.lanes_kept or not isinstance(state, dict):
            return None
        lanes = state.get("lanes")
        return lanes if isinstance(lanes, int) else None

    def extra_state(self, lanes: int) -> dict[str, Any]:
        """What the view adds to its position in a state: the blends' weights, the lanes."""
        extra: dict[str, Any] = {}
        if self.blends:
            extra["weights"] = self.weights()
        if self.lanes_kept:
            extra["lanes"] = lanes
        return extra

    def _check_weights(self, saved: Any, part: dict[str, Any]) -> None:
        """Refuses weights that differ from the pipeline's where they cannot."""
        current = self.weights()
        if not _weights_shaped(saved, current):
            raise StateError(
                f"{self.describe()}: malformed state (weights: expected one list of "
                f"{[len(w) for w in current]} non-negative numbers per blend, got "
                f"{saved!r}); restore a state saved by the same pipeline"
            )
        for blend, before, now in zip(self.blends, saved, current, strict=True):
            if [float(w) for w in before] == now:
                continue
            if not blend.allow_weight_change:
                raise StateError(
                    f"Blend: the state was saved with weights {before} but this Blend has "
                    f"weights {now}; pass allow_weight_change=True to apply the new "
                    "weights from the restored position on"
                )
            if part.get("pos") or part.get("done") or part.get("done_below"):
                raise StateError(
                    f"Blend: the weights changed from {before} to {now} in the middle of "
                    "an epoch, which this pipeline lays out from the weights (it is read "
                    "by position); restore this state with the weights it was saved with, "
                    "and change them in a state saved between epochs"
                )

    def config(self) -> dict[str, Any]:
        return self.pipeline.config()

    @property
    def children(self) -> tuple[Stage[Any], ...]:
        """The pipeline: what holds files and caches (``datasets/files/access.py`` walks them)."""
        return (self.pipeline,)

    def not_elastic(self) -> None:
        """Read by position, the view moves to any layout, whatever its stages would
        say of a reading stream by stream."""
        return None

    def describe(self) -> str:
        return self.pipeline.describe()

    # The view's cursor is not an IndexedCursor: it may continue a state saved stream by
    # stream with the pipeline's own cursors.
    def cursor(self, context: WorkerContext) -> Cursor[T]:  # type: ignore[override]
        return _ViewCursor(self, context, checking=False)

    def checking_cursor(self, context: WorkerContext) -> Cursor[T]:  # type: ignore[override]
        return _ViewCursor(self, context, checking=True)

    def items_left(self, state: Any, context: WorkerContext) -> int | None:
        if _by_stream(state):
            return self.pipeline.items_left(state, context)
        cursor = _ByPosition(self, context)
        cursor.restore(self.own_part(state))
        return cursor.shard_length - cursor.pos

    def reshard(self, plan: ReshardPlan) -> dict[str, Any]:
        if any(_by_stream(stream.state) for stream in plan.old):
            raise StateError(
                f"{self.describe()}: the state was saved by a version that read this "
                "pipeline stream by stream, which cannot move to another layout; restore it "
                "on the number of workers and ranks it was saved with"
            )
        old = tuple(OldStream(stream.context, self.own_part(stream.state)) for stream in plan.old)
        state = super().reshard(ReshardPlan(plan.epoch, old, plan.new, plan.salt, plan.shared))
        return {**state, **self.extra_state(self._resumed_lanes(plan, old))}

    def _resumed_lanes(self, plan: ReshardPlan, parts: tuple[OldStream, ...]) -> int:
        """The global batch size the resumed epoch is laid out for: the saved one once a
        saved stream read some of it, else the new layout's."""
        saved = {
            lanes for stream in plan.old if (lanes := self.saved_lanes(stream.state)) is not None
        }
        if len(saved) > 1:
            raise StateError(
                f"{self.describe()}: the saved streams' epochs are laid out for global batch "
                f"sizes {sorted(saved)}; restore states saved by one job"
            )
        began = any(_began(stream.state, plan.epoch) for stream in parts)
        return saved.pop() if saved and began else lanes_of(plan.new)


def _even(pipeline: Stage[Any]) -> Any:
    """The ``even`` of the pipeline's first source (an ``IndexedDataset``'s, a file
    source's): how the view evens the epoch out over the ranks."""
    even = getattr(pipeline, "even", None)
    if even in ("pad", "drop"):
        return even
    for child in pipeline.children:
        return _even(child)
    return "pad"


def _blends(stage: Stage[Any]) -> list[Blend[Any]]:
    """The blends of a pipeline, each before those of its sources."""
    own = [stage] if isinstance(stage, Blend) else []
    return own + [blend for child in stage.children for blend in _blends(child)]


def _weights_shaped(saved: Any, current: list[list[float]]) -> bool:
    """Whether ``saved`` holds, per blend, as many non-negative numbers as ``current``."""
    return (
        isinstance(saved, list)
        and len(saved) == len(current)
        and all(
            isinstance(weights, list)
            and len(weights) == len(now)
            and all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in weights
            )
            for weights, now in zip(saved, current, strict=False)
        )
    )


def _began(part: Any, epoch: int) -> bool:
    """Whether a stream's position (the view's part of its state) read some of ``epoch``."""
    return (
        isinstance(part, dict)
        and part.get("epoch") == epoch
        and bool(part.get("pos") or part.get("done") or part.get("done_below"))
    )


def _close_access(access: Any) -> None:
    """Closes what an access and the accesses it reads through hold open (the readers of
    a file source by position)."""
    close = getattr(access, "close", None)
    if callable(close):
        close()
    parents = [getattr(access, "parent", None), *getattr(access, "parents", ())]
    for parent in parents:
        if parent is not None:
            _close_access(parent)


def _by_stream(state: Any) -> bool:
    """Whether ``state`` nests the stages' parts: saved by a stream-by-stream reading."""
    return isinstance(state, dict) and ("parent" in state or "sources" in state)


class _ByPosition(IndexedCursor[T]):
    """The view's positions, each item read through the pipeline's access."""

    def __init__(self, stage: GlobalView[T], context: WorkerContext) -> None:
        super().__init__(stage, context)
        self.pipeline = stage.pipeline
        access = stage.pipeline.access(context)
        assert access is not None  # GlobalView checked it
        self.access: Access[T] = access
        #: ``(epoch, lanes, access)`` of an epoch laid out for another global batch size
        #: than this layout's (NOTE [ File sources by position ] in
        #: ``datasets/files/positions.py``).
        self.resumed: tuple[int, int, Access[T]] | None = None

    def lay_out(self, lanes: int | None) -> None:
        """Reads the rest of the restored epoch as laid out for ``lanes``."""
        if self.resumed is not None:
            _close_access(self.resumed[2])
            self.resumed = None
        if lanes is not None and lanes != lanes_of(self.context):
            access = self.pipeline.access(laid_out_for(self.context, lanes))
            assert access is not None  # as the pipeline's own
            self.resumed = (self.epoch, lanes, access)

    def current(self) -> tuple[int, Access[T]]:
        """The lanes of this epoch and the access that reads it."""
        if self.resumed is not None and self.resumed[0] == self.epoch:
            return self.resumed[1], self.resumed[2]
        return lanes_of(self.context), self.access

    def item(self, index: int) -> T:
        (item,) = self.current()[1].get_many(self.epoch, [index])
        return item

    def close_own(self) -> None:
        _close_access(self.access)
        if self.resumed is not None:
            _close_access(self.resumed[2])
        super().close_own()

    def take(self, n: int) -> list[T]:
        """The next ``n`` positions' items, read through the access at once."""
        pos = self.pos
        stop = min(pos + n, self.shard_length)
        self.pos = stop  # before the reads, as a map-style dataset's (NOTE [ Going on ...])
        access = self.current()[1]
        items = access.get_many(self.epoch, self._cached(pos, stop)) if stop > pos else []
        if stop - pos < n:
            self.end_epoch()
        return items

    @property
    def draws_nothing(self) -> bool:
        """Items that draw from no global generator (NOTE [ Items seeded one by one ] in
        ``rng/keys.py``) are skipped without reading them."""
        return self.stage.deterministic_items or self.context.seed_each_item

    def skip_fast(self, n: int) -> int:
        if self.draws_nothing:
            return super().skip_fast(n)
        passed = 0
        while passed < n:  # read, a block at a time, as reading them would
            got = len(self.take(min(n - passed, 1024)))
            passed += got
            if got < min(n - passed + got, 1024):
                break
        return passed

    def goes_on_after_error(self) -> bool:
        """The position moves past an item before it is read, as a map-style dataset's."""
        return True


class _ViewCursor(Cursor[T]):
    """Reads the view by position, or continues a state saved stream by stream with the
    pipeline's own cursors (NOTE [ Pipelines read by position ])."""

    stage_name = "GlobalView"

    def __init__(self, stage: GlobalView[T], context: WorkerContext, *, checking: bool) -> None:
        super().__init__(context)
        self.stage = stage
        self.checking = checking
        self.inner: Cursor[T] = _ByPosition(stage, context)

    @property
    def name(self) -> str:
        return self.inner.name

    def __next__(self) -> T:
        return next(self.inner)

    def own_state(self) -> Any:
        state = self.inner.state()
        if isinstance(self.inner, _ByPosition):
            return {**state, **self.stage.extra_state(self.inner.current()[0])}
        return state

    def restore_own(self, state: Any | None) -> None:
        if _by_stream(state):
            pipeline = self.stage.pipeline
            inner = pipeline.checking_cursor(self.context) if self.checking else None
            if inner is None and self.checking:
                return  # only the pipeline's own cursors read such a state
            self.inner = inner or pipeline.cursor(self.context)
            self.inner.restore(state)
            return
        if not isinstance(self.inner, _ByPosition):
            self.inner.close()
            self.inner = _ByPosition(self.stage, self.context)
        self.inner.restore(self.stage.own_part(state))
        self.inner.lay_out(self.stage.saved_lanes(state))

    def skip_fast(self, n: int) -> int:
        return self.inner.skip(n)

    def take(self, n: int) -> list[T]:
        return self.inner.take(n)

    def take_batch(self, n: int) -> list[T]:
        return self.inner.take_batch(n)

    def skip_batches(self, batches: int, size: int) -> int:
        return self.inner.skip_batches(batches, size)

    def goes_on_after_error(self) -> bool:
        return self.inner.goes_on_after_error()

    def end_epoch(self) -> None:
        self.inner.end_epoch()

    def item_key(self) -> tuple[int, ...] | None:
        return self.inner.item_key()

    def close_own(self) -> None:
        self.inner.close()
