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
``skip(k)`` passes items of the source's epoch by a counted skip (NOTE [ Counted skips ]
in ``_skips.py``); if more are to be skipped, it crosses to the next source epoch with
``end_epoch()`` (at the end of an epoch that is what the StopIteration of ``next()`` does)
and counts the pass, until ``k`` items are passed or the last pass stands at its end.
Reading would stop right after the last item, before crossing into passes that turn out
empty, so when the epoch runs out the skip returns to that point (the parent's state,
taken before the first crossing without items since, is restored).
It is offered only when the parent can skip and count, so it matches reading exactly,
state included; otherwise the loader replays by reading.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import Field

from ..config import WorkerContext
from ..errors import ConfigError, StateError
from ._skips import counts_skips, skip_counted
from .stage import Cursor, StageState, Transform, TransformCursor

__all__ = ["Repeat"]

T = TypeVar("T")


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
        replays nothing; ``skip`` crosses source epochs exactly when the parent can
        skip and count (NOTE [ Skipping a repeat ]), and the loader reads otherwise.
    """

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

    def cursor(self, context: WorkerContext) -> Cursor[T]:
        return _RepeatCursor(self.times, self.source.cursor(context), context)


class _Passes(StageState):
    passes: int = Field(ge=0, description="Source epochs completed in this Repeat epoch.")


class _RepeatCursor(TransformCursor[T]):
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

    def can_skip(self) -> bool:
        return self.parent.can_skip() and counts_skips(self.parent)

    def counts_skips(self) -> bool:
        return counts_skips(self.parent)

    def skip(self, n: int) -> None:
        self.skip_counted(n)

    def skip_counted(self, n: int) -> int:
        """Skips like :meth:`skip`; returns the items passed (NOTE [ Skipping a repeat ])."""
        if not counts_skips(self.parent):
            raise NotImplementedError("Repeat: the source cannot count its skips; read instead")
        total = 0
        mark: tuple[Any, int, bool] | None = None  # where reading would have stopped
        while True:
            passed = skip_counted(self.parent, n - total) or 0
            if passed:
                self._fresh, mark = False, None
            total += passed
            if total >= n:
                return total
            if self.times is not None and self.passes == self.times - 1:
                if mark is not None:
                    self.parent.restore(mark[0])
                    self.passes, self._fresh = mark[1], mark[2]
                return total
            if mark is None:
                mark = (self.parent.state(), self.passes, self._fresh)
            self.parent.end_epoch()
            self._finish_pass()
