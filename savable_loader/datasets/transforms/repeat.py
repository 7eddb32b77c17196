"""``Repeat``: several epochs of a source as one epoch, or one endless epoch.

NOTE [ Repeat epochs ]
One Repeat epoch is ``times`` consecutive epochs of the source (passes); ``times=None``
makes one endless epoch. When the source's epoch ends (its cursor then stands at the
start of the next one) the pass is counted and reading goes on, until ``times`` passes
are done: then the Repeat epoch ends. A full source epoch that yields nothing would make
an endless Repeat spin forever, so with ``times=None`` it raises :class:`ConfigError`
(detected within two source epochs after a restore, at once otherwise); with a finite
``times`` an empty pass is simply counted, as an empty worker shard is legitimate.

NOTE [ Ending an endless epoch ]
``end_epoch()`` drops the rest of the Repeat epoch: with a finite ``times`` it calls the
source's ``end_epoch()`` (the next Repeat epoch starts at the source's next epoch) and
resets ``passes``. An endless epoch has no rest to drop that anyone could reach, and
dropping the rest of the current source epoch would make ``.repeat().limit(k)`` lose the
tail of every source epoch; so with ``times=None``, ``end_epoch()`` leaves the source
where it stands and the next endless epoch continues the same stream. ``.repeat().limit(k)``
is therefore one endless stream cut into epochs of ``k`` items.

NOTE [ Skipping a repeat ]
``skip(k)`` passes items through the source's ``skip``, which says how many it passed
(NOTE [ The cursor contract ] in ``datasets/protocol/cursor.py``). Fewer than asked means the
source's epoch ended and the source stands at its next one, exactly as after the StopIteration
that reading meets there: the pass is counted as reading counts it, and the skip goes on
in the next pass, until ``k`` items are passed or the last pass ends (then the Repeat
epoch has ended too, as reading past its last item would end it).

NOTE [ Repeat by position ]
Read as a stream, a worker's passes follow one another in that worker: the last batch of
a pass takes the first items of the next pass of that worker's shard, so which items
share a global step depends on the layout. When the source can be read by position
(NOTE [ Pipelines read by position ] in ``datasets/global_view.py``) and ``times`` is set, epoch
``e`` of the repeat is the source's epochs ``e * times`` to ``e * times + times - 1``,
their positions one after the other; the loader reads the whole pipeline by position,
and every layout gets the same global batches.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from pydantic import Field

from ...config import WorkerContext
from ...errors import ConfigError, StateError
from ..protocol.cursor import Cursor, StageState, TransformCursor
from ..protocol.stage import fluent
from .transform import Transform

__all__ = ["Repeat"]

T = TypeVar("T")


@fluent("repeat")
class Repeat(Transform[T]):
    """Reads ``times`` epochs of ``source`` as one epoch (NOTE [ Repeat epochs ]).

    Args:
        source: The stage (or dataset) to repeat.
        times: Source epochs per Repeat epoch, at least 1; None repeats forever in one
            endless epoch (cut it into epochs with ``.limit(k)``, NOTE [ Ending an
            endless epoch ]).

    Raises:
        ConfigError: ``times`` is neither None nor an int of at least 1; while reading,
            with ``times=None``, a full source epoch yields nothing.

    State:
        ``{"parent": ..., "passes": p}``: the parent's state and ``p``, the source epochs
        completed in this Repeat epoch. Restore is O(1) on top of the parent's and
        replays nothing; ``skip`` crosses source epochs through the source's own ``skip``
        (NOTE [ Skipping a repeat ]).
    """

    keyed = True

    elastic_reason = "its passes count one worker's passes over its own shard"
    elastic_fix = (
        "restore on the number of workers and ranks it was saved with, or pass "
        "approximate=True to restart the interrupted epoch on the new layout"
    )

    def __init__(self, source: Any, times: int | None = None) -> None:
        super().__init__(source)
        if times is not None and (not isinstance(times, int) or isinstance(times, bool)):
            raise ConfigError(f"Repeat needs times to be an int >= 1 or None, got {times!r}")
        if times is not None and times < 1:
            raise ConfigError(f"Repeat needs times to be an int >= 1 or None, got {times!r}")
        self.times = times

    def config(self) -> dict[str, Any]:
        return {"type": "Repeat", "times": self.times, "source": self.source.config()}

    def describe_own(self) -> str:
        return "repeat()" if self.times is None else f"repeat({self.times})"

    def cursor_over(self, parent: Cursor[Any], context: WorkerContext) -> Cursor[T]:
        return _RepeatCursor(self.times, parent, context)

    def access(self, context: WorkerContext) -> _Rounds[T] | None:
        """Items by position when the source has them and the passes are counted: epoch
        ``e`` is the source's epochs ``e * times`` to ``e * times + times - 1`` one after
        the other (NOTE [ Repeat by position ])."""
        parent = self.source.access(context)
        return None if parent is None else _Rounds(self.times, parent)

    def reads_by_layout(self) -> bool:
        """Read stream by stream, the passes are each stream's over its own shard."""
        return True

    def draws_nothing(self) -> bool:
        return self.source.draws_nothing()


class _Passes(StageState):
    passes: int = Field(ge=0, description="Source epochs completed in this Repeat epoch.")


class _Rounds(Generic[T]):
    """A repeat's items by position (NOTE [ Repeat by position ])."""

    def __init__(self, times: int | None, parent: Any) -> None:
        self.times, self.parent = times, parent

    def length(self) -> int | None:
        """None: endless (NOTE [ Endless streams by position ] in ``datasets/global_view.py``)."""
        size = self.parent.length()
        return None if size is None or self.times is None else self.times * int(size)

    def _groups(self, epoch: int, positions: list[int]) -> list[tuple[int, list[int]]]:
        """The positions as (source epoch, source positions) runs, in order."""
        size = self.parent.length()
        if size is None:  # a repeat of an endless stream is that stream
            return [(epoch, positions)]
        groups: list[tuple[int, list[int]]] = []
        for position in positions:
            # An endless repeat has one epoch, 0: its passes one after the other.
            source_epoch = epoch * (self.times or 0) + position // size
            if not groups or groups[-1][0] != source_epoch:
                groups.append((source_epoch, []))
            groups[-1][1].append(position % size)
        return groups

    def get_many(self, epoch: int, positions: list[int]) -> list[T]:
        items: list[T] = []
        for source_epoch, run in self._groups(epoch, positions):
            items += self.parent.get_many(source_epoch, run)
        return items

    def keys(self, epoch: int, positions: list[int]) -> list[tuple[int, ...]]:
        keys: list[tuple[int, ...]] = []
        for source_epoch, run in self._groups(epoch, positions):
            keys += self.parent.keys(source_epoch, run)
        return keys


class _RepeatCursor(TransformCursor[T]):
    passes_keys = True
    State = _Passes

    def __init__(self, times: int | None, parent: Cursor[T], context: WorkerContext) -> None:
        super().__init__(parent, context)
        self.times = times
        self.passes = 0
        # Whether the parent entered its epoch by a crossing and nothing was read since.
        self._fresh = True

    def __next__(self) -> T:
        while True:
            try:
                item: T = next(self.parent)
            except StopIteration:
                if self._finish_pass():
                    raise
                continue
            self._fresh = False
            return item

    def _finish_pass(self) -> bool:
        """Counts a pass whose source epoch just ended; returns whether this epoch ends."""
        if self._fresh and self.times is None:
            ctx = self.context
            raise ConfigError(
                f"Repeat: a full source epoch yielded nothing for rank {ctx.rank} worker "
                f"{ctx.worker_id}, so repeating it forever would never yield; give every "
                "worker at least one item (a longer source, fewer workers or ranks)"
            ) from None
        self._fresh = True
        self.passes += 1
        if self.times is not None and self.passes >= self.times:
            self.passes = 0
            return True
        return False

    def own_state(self) -> dict[str, Any]:
        return {"passes": self.passes}

    def restore_own(self, state: Any | None) -> None:
        passes = state.passes if isinstance(state, _Passes) else 0
        if self.times is not None and passes >= self.times:
            raise StateError(
                f"Repeat: passes {passes} in the state is not below times={self.times}; "
                "restore a state saved by the same pipeline"
            )
        self.passes = passes
        self._fresh = state is None

    def end_epoch(self) -> None:
        if self.times is not None:
            self.parent.end_epoch()
            self._fresh = True
        self.passes = 0

    def skip_fast(self, n: int) -> int:
        """Skips through the source, pass by pass (NOTE [ Skipping a repeat ])."""
        total = 0
        while total < n:
            wanted = n - total
            passed = self.parent.skip(wanted)
            total += passed
            if passed:
                self._fresh = False
            if passed == wanted:
                break
            if self._finish_pass():
                break
        return total
