"""``Limit``: the first ``n`` items of every epoch of a source.

NOTE [ Limit epochs ]
A limited epoch is the first ``n`` items of the source's epoch. After the ``n``-th item
the next ``next()`` calls the parent's ``end_epoch()``, so the source moves to its next
epoch without reading the rest (an indexed source moves by arithmetic), and raises
StopIteration. If the source's epoch ends first, the limited epoch ends with it. Read stream
by stream, a Limit counts the items of its own cursor: one per rank and worker, before
batching, so with ``W`` workers a rank's epoch has up to ``n * max(W, 1)`` items; read by
position, an epoch has ``n`` items in all (NOTE [ Limit by position ]).

Over ``Repeat(source)`` (endless), ``end_epoch()`` leaves the endless stream where it
stands (NOTE [ Ending an endless epoch ] in ``datasets/transforms/repeat.py``), so
``.repeat().limit(k)`` cuts one endless stream into consecutive epochs of ``k`` items.

NOTE [ Limit by position ]
When the loader reads the pipeline by position (NOTE [ Pipelines read by position ] in
``datasets/global_view.py``: every stage below the Limit can produce the item at any position of
an epoch, as an ``IndexedDataset``, a map-style dataset, a token or table source, a map,
a window shuffle, a counted repeat or a blend of such do), a limited epoch is the first
``n`` positions of the source's epoch, shared out over ranks and workers as an
``IndexedDataset``'s positions are: ``n`` items an epoch in all, whatever the layout, and
the same global batches on every layout of one global batch size. A pipeline read stream
by stream (over a ``Filter`` or a file source) counts ``n`` per stream, as NOTE [ Limit
epochs ] says.

NOTE [ Skipping a limit ]
``skip(k)`` passes ``m = min(k, n - count)`` items through the parent's ``skip``, which
says how many it passed (NOTE [ The cursor contract ] in ``datasets/protocol/cursor.py``). Fewer
than ``m`` means the parent's epoch ended, and so did the limited one. Otherwise, if ``k`` is
more than ``m``, reading would have reached the limit and ended the epoch, so the skip
ends it too. A user's dataset whose ``skip`` cannot tell where its epoch ended reports
all ``m``: ``count`` may then be larger than reading would make it, but the stream is the
same, since from the end of the parent's epoch both paths move the parent to its next
epoch, reset ``count`` and end the limited epoch.

NOTE [ Elastic limit ]
On a restore onto another layout (NOTE [ Elastic resume ] in ``datasets/protocol/elastic.py``), what
the saved streams still had to yield in the resumed epoch (``n - count`` for each stream
still in it, 0 for a stream that finished it) is summed and split over the new streams
as evenly as possible, lower shard indices taking the extra items; each new stream keeps
its share as ``quota``, its limit for the rest of that epoch. The items themselves come
from the parent's resharded rest of the epoch, so nothing consumed before the save comes
again, and the resumed epoch yields as many items as the saved layout had left (fewer
only if the parent runs out first). The next epoch has ``n`` per stream again. When no
saved stream consumed anything of the resumed epoch (a save between epochs), the loader
starts the epoch as a fresh run does instead, without a quota (``_resume/elastic.py``).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from pydantic import Field

from ...config import WorkerContext
from ...errors import ConfigError, StateError
from ..protocol.cursor import Cursor, StageState, TransformCursor, validate_state
from ..protocol.elastic import ReshardPlan
from ..protocol.stage import fluent
from .transform import Transform

__all__ = ["Limit"]

T = TypeVar("T")


@fluent("limit")
class Limit(Transform[T]):
    """Yields the first ``n`` items of every epoch of ``source`` (NOTE [ Limit epochs ]).

    Args:
        source: The stage (or dataset) to limit.
        n: Items per epoch, at least 0: in all when the pipeline is read by position,
            else of each stream (rank and worker) (NOTE [ Limit by position ]).

    Raises:
        ConfigError: ``n`` is not an int of at least 0.

    State:
        ``{"parent": ..., "count": c}``: the parent's state and ``c``, the items this
        epoch has yielded (0 to ``n``). Restore is O(1) on top of the parent's and
        replays nothing; ``skip`` is as cheap as the parent's (NOTE [ Skipping a limit ]).
        After a restore onto another layout, the resumed epoch's state also holds
        ``quota``, this stream's limit for the rest of it (NOTE [ Elastic limit ]).
    """

    keyed = True

    def __init__(self, source: Any, n: int) -> None:
        super().__init__(source)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"Limit needs an int n >= 0, got {n!r}")
        self.n = n

    def config(self) -> dict[str, Any]:
        return {"type": "Limit", "n": self.n, "source": self.source.config()}

    def describe_own(self) -> str:
        return f"limit({self.n})"

    def cursor_over(self, parent: Cursor[Any], context: WorkerContext) -> Cursor[T]:
        return _LimitCursor(self.n, parent, context)

    def access(self, context: WorkerContext) -> _Head[T] | None:
        """The first ``n`` positions of every epoch of a source read by position
        (NOTE [ Limit by position ])."""
        parent = self.source.access(context)
        return None if parent is None else _Head(self.n, parent)

    def reads_by_layout(self) -> bool:
        """Read stream by stream, each stream takes ``n`` items."""
        return True

    def draws_nothing(self) -> bool:
        return self.source.draws_nothing()

    def items_left(self, state: Any, context: WorkerContext) -> int | None:
        if not isinstance(state, dict) or "parent" not in state:
            return None
        own = validate_state(_Count, {k: v for k, v in state.items() if k != "parent"}, "Limit")
        mine = max(0, (self.n if own.quota is None else own.quota) - own.count)
        parent = self.source.items_left(state["parent"], context)
        return mine if parent is None else min(mine, parent)

    def reshard(self, plan: ReshardPlan) -> dict[str, Any]:
        """Splits what the saved streams had left over the new ones (NOTE [ Elastic limit ])."""
        parent = self.source.reshard(plan.parents())
        left = 0
        for stream in plan.old:
            if stream.state is None:
                left += self.n
                continue
            own = validate_state(
                _Count, {k: v for k, v in stream.state.items() if k != "parent"}, "Limit"
            )
            if _epoch_of(stream.state["parent"]) == plan.epoch:
                left += max(0, (self.n if own.quota is None else own.quota) - own.count)
        streams, index = plan.new.num_shards, plan.new.shard_index
        quota = left // streams + (1 if index < left % streams else 0)
        return {"parent": parent, "count": 0, "quota": quota}


class _Head(Generic[T]):
    """A limit's items by position: its source's first ``n`` (NOTE [ Limit by position ])."""

    def __init__(self, n: int, parent: Any) -> None:
        self.n, self.parent = n, parent

    def length(self) -> int:
        size = self.parent.length()
        return self.n if size is None else min(self.n, int(size))

    def _source(self, epoch: int, positions: list[int]) -> tuple[int, list[int]]:
        """Epoch ``e`` of an endless source is its positions ``[e n, (e + 1) n)``."""
        if self.parent.length() is None:
            return 0, [epoch * self.n + position for position in positions]
        return epoch, positions

    def get_many(self, epoch: int, positions: list[int]) -> list[T]:
        items: list[T] = self.parent.get_many(*self._source(epoch, positions))
        return items

    def keys(self, epoch: int, positions: list[int]) -> list[tuple[int, ...]]:
        keys: list[tuple[int, ...]] = self.parent.keys(*self._source(epoch, positions))
        return keys


def _epoch_of(state: Any) -> int | None:
    """The epoch a transform chain's state stands in, read from its innermost stage."""
    while isinstance(state, dict):
        if "epoch" in state:
            epoch = state["epoch"]
            return epoch if isinstance(epoch, int) else None
        state = state.get("parent")
    return None


class _Count(StageState):
    count: int = Field(ge=0, description="Items yielded in this epoch.")
    quota: int | None = Field(
        default=None, ge=0, description="This epoch's limit after an elastic restore."
    )


class _LimitCursor(TransformCursor[T]):
    passes_keys = True
    State = _Count

    def __init__(self, n: int, parent: Cursor[T], context: WorkerContext) -> None:
        super().__init__(parent, context)
        self.n = n
        self.count = 0
        #: This epoch's limit after an elastic restore (NOTE [ Elastic limit ]).
        self.quota: int | None = None

    @property
    def limit(self) -> int:
        return self.n if self.quota is None else self.quota

    def __next__(self) -> T:
        if self.count >= self.limit:
            self.end_epoch()
            raise StopIteration
        try:
            item: T = next(self.parent)
        except StopIteration:
            self.count, self.quota = 0, None
            raise
        self.count += 1
        return item

    def own_state(self) -> dict[str, Any]:
        if self.quota is None:
            return {"count": self.count}
        return {"count": self.count, "quota": self.quota}

    def restore_own(self, state: Any | None) -> None:
        count = state.count if isinstance(state, _Count) else 0
        self.quota = state.quota if isinstance(state, _Count) else None
        if count > self.limit:
            bound = f"n={self.n}" if self.quota is None else f"its quota {self.quota}"
            raise StateError(
                f"Limit: count {count} in the state exceeds {bound}; restore a state saved "
                "by the same pipeline"
            )
        self.count = count

    def end_epoch(self) -> None:
        self.parent.end_epoch()
        self.count, self.quota = 0, None

    def skip_fast(self, n: int) -> int:
        """Skips through the parent (NOTE [ Skipping a limit ])."""
        wanted = max(0, min(n, self.limit - self.count))
        passed = self.parent.skip(wanted)
        if passed < wanted:
            self.count, self.quota = 0, None
            return passed
        self.count += passed
        if passed < n:
            self.end_epoch()
        return passed
