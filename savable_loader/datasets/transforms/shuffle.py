"""``Shuffle``: a window shuffle whose state is a restore point, never the buffered items.

NOTE [ Window shuffle ]
The cursor reads ``buffer_size`` items of its parent into a window and emits them in a
permutation drawn from ``(seed, rank, worker, epoch, window index)``, then reads the next
window. The epoch's last window may be shorter; the parent's epoch end ends the
shuffle's epoch. An item therefore moves only within its window: a shuffle quality that
grows with ``buffer_size``, as with Grain's window shuffle (a sliding shuffle buffer
mixes further but must save its buffered samples or drop them on resume).

NOTE [ Window shuffle by position ]
When the whole pipeline can be read by position (NOTE [ Pipelines read by position ] in
``datasets/global_view.py``), the windows are over the epoch's positions instead of a stream's
items: window ``w`` holds positions ``[w B, (w + 1) B)`` of the source's epoch (``B`` the
buffer size, the last window shorter), emitted in a permutation drawn from ``(seed,
epoch, w)``. Nothing depends on which rank or worker reads a position, so every layout
gets the same global batches and a restore onto another layout goes on with them; the
state is the view's position, with no restore point and no generators.

NOTE [ Shuffle restore point ]
The state is the parent's state when the current window was read (the restore point),
the global generators' states at that moment, the window index and how many of its items
were emitted. Restore only restores the parent to the restore point: it reads nothing,
because the loader applies the checkpoint's global generators right after
``restore_state``. The first ``next()`` then captures the generators as they are (the
checkpoint's), applies the window-start states, re-reads the window (so an upstream
stage drawing from the global generators draws exactly what it drew the first time),
applies the captured states back and drops the items already emitted. A restore re-reads
at most ``buffer_size`` parent items (plus the parent's end-of-epoch signal when the
window was the epoch's last). Capturing the generators costs a few microseconds per
window. They weigh ~10 KB in a saved state, unless they were still as the loader seeded
them for an epoch (nothing drew from them): the state then names that epoch
(``seeded_epoch``) and a restore seeds them again (NOTE [ Seeded windows ] in
``rng/generators.py``).
"""

from __future__ import annotations

import copy
from typing import Any, Generic, NoReturn, TypeVar

from pydantic import Field

from ... import rng
from ...config import WorkerContext
from ...errors import ConfigError, StateError
from ...state.models import RngState
from ..protocol.cursor import Cursor, StageState, TransformCursor, validate_state
from ..protocol.stage import fluent
from .transform import Transform

__all__ = ["Shuffle"]

T = TypeVar("T")


class _State(StageState):
    """What a shuffle adds to its parent's restore point (NOTE [ Shuffle restore point ])."""

    epoch: int = Field(ge=0, description="The epoch being read.")
    window: int = Field(ge=0, description="Index of the current window in the epoch.")
    emitted: int = Field(ge=0, description="Items of the current window already emitted.")
    rng: RngState | None = Field(
        description="Global generators at the window start; None: no window read yet, "
        "or seeded_epoch says what they were."
    )
    seeded_epoch: int | None = Field(
        default=None,
        ge=0,
        description="The generators at the window start were as the loader seeded them "
        "for this epoch (NOTE [ Seeded windows ]); None: rng holds them.",
    )


@fluent("shuffle")
class Shuffle(Transform[T]):
    """Shuffles ``source`` window by window (NOTE [ Window shuffle ]).

    Args:
        source: The stage (or dataset) to shuffle.
        buffer_size: Items per window: every item moves at most within its window.
        seed: Seed of the per-window permutations.

    Raises:
        ConfigError: ``buffer_size`` is not an int of at least 1, or ``seed`` not an int.

    State:
        ``{"parent": <the parent's state at the start of the current window>, "epoch": e,
        "window": w, "emitted": k, "rng": <the global generators at the window start, as
        bytes> or None}``: never a sample, so its size does not depend on item size
        (about 10 KB, the generators). Restore reads nothing; the first ``next()`` re-reads
        at most ``buffer_size`` parent items under the window-start generators (NOTE
        [ Shuffle restore point ]). No fast skip.
    """

    keyed = True

    elastic_reason = (
        "its buffer holds items one worker read, and its generator continues that worker's "
        "draws, so they cannot be split over other workers"
    )
    elastic_fix = (
        "restore on the number of workers and ranks it was saved with, shuffle at the source "
        "instead (IndexedDataset(shuffle=True) or shuffle_shards=True), or pass "
        "approximate=True to restart the interrupted epoch on the new layout"
    )

    def __init__(self, source: Any, *, buffer_size: int, seed: int) -> None:
        super().__init__(source)
        if not isinstance(buffer_size, int) or isinstance(buffer_size, bool) or buffer_size < 1:
            raise ConfigError(f"Shuffle buffer_size must be an int >= 1, got {buffer_size!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"Shuffle seed must be an int, got {seed!r}")
        self.buffer_size = buffer_size
        self.seed = seed

    def config(self) -> dict[str, Any]:
        return {
            "type": "Shuffle",
            "buffer_size": self.buffer_size,
            "seed": self.seed,
            "source": self.source.config(),
        }

    def describe_own(self) -> str:
        return f"shuffle(buffer_size={self.buffer_size}, seed={self.seed})"

    def cursor_over(self, parent: Cursor[Any], context: WorkerContext) -> Cursor[T]:
        return _ShuffleCursor(self, parent, context)

    def access(self, context: WorkerContext) -> _Windows[T] | None:
        """Items by position when the source has them: windows of ``buffer_size``
        consecutive positions of the epoch, each in its own order (NOTE [ Window shuffle
        by position ])."""
        parent = self.source.access(context)
        return None if parent is None else _Windows(self, parent)

    def reads_by_layout(self) -> bool:
        """A stream's windows hold what that stream read."""
        return True

    def draws_nothing(self) -> bool:
        return self.source.draws_nothing()

    def items_left(self, state: Any, context: WorkerContext) -> int | None:
        """What the parent has left from the restore point, less the items of its window
        already emitted (NOTE [ Checking a replay ] in ``_resume/compat.py``): every item the
        parent yields from there is emitted once, in its window."""
        if not isinstance(state, dict) or "parent" not in state:
            return None
        own = validate_state(_State, {k: v for k, v in state.items() if k != "parent"}, "Shuffle")
        parent = self.source.items_left(state["parent"], context)
        return None if parent is None else max(0, parent - own.emitted)


class _Windows(Generic[T]):
    """A window shuffle's items by position (NOTE [ Window shuffle by position ])."""

    def __init__(self, stage: Shuffle[T], parent: Any) -> None:
        self.size, self.seed, self.parent = stage.buffer_size, stage.seed, parent
        self._order: tuple[int, int, list[int]] = (-1, -1, [])

    def length(self) -> int | None:
        length: int | None = self.parent.length()
        return length

    def _source(self, epoch: int, position: int) -> int:
        window, offset = divmod(position, self.size)
        cached_epoch, cached, order = self._order
        if (cached_epoch, cached) != (epoch, window):
            length = self.length()  # None: endless, every window full
            items = self.size if length is None else min(self.size, length - window * self.size)
            generator = rng.generator_for(rng.Purpose.WINDOW_POSITIONS, self.seed, epoch, window)
            order = generator.permutation(items).tolist()
            self._order = (epoch, window, order)
        return window * self.size + order[offset]

    def keys(self, epoch: int, positions: list[int]) -> list[tuple[int, ...]]:
        sources = [self._source(epoch, position) for position in positions]
        keys: list[tuple[int, ...]] = self.parent.keys(epoch, sources)
        return keys

    def get_many(self, epoch: int, positions: list[int]) -> list[T]:
        sources = [self._source(epoch, position) for position in positions]
        items: list[T] = self.parent.get_many(epoch, sources)
        return items


class _ShuffleCursor(TransformCursor[T]):
    State = _State
    stage_name = "Shuffle"

    def __init__(self, stage: Shuffle[T], parent: Cursor[T], context: WorkerContext) -> None:
        super().__init__(parent, context)
        self.buffer_size = stage.buffer_size
        self.seed = stage.seed
        self._reset(epoch=0)

    def _reset(self, epoch: int) -> None:
        self.epoch, self.window, self.emitted = epoch, 0, 0
        self._start: Any = None  # the restore point; None: no window read in this epoch
        # The generators at the window start; converted to RngState when a state asks,
        # or the epoch they were seeded for (NOTE [ Seeded windows ] in rng/generators.py).
        self._rng: rng.RngSnapshot | RngState | int | None = None
        self._items: list[T] = []
        #: The items' keys in the global stream (:meth:`item_key`), read with them.
        self._keys: list[tuple[int, ...] | None] = []
        self._last: tuple[int, ...] | None = None
        self._order: list[int] = []
        self._parent_ended = False
        self._pending = False

    def __next__(self) -> T:
        if self._pending:
            self._resume()
        if self._start is not None and self.emitted < len(self._items):
            return self._emit()
        if self._start is not None:
            if self._parent_ended:
                self._end()
            self.window += 1
        snapshot = rng.capture()
        seeded = rng.seeded_epoch_of(snapshot)
        self._rng = snapshot if seeded is None else seeded
        self._start = copy.deepcopy(self.parent.state())
        self.emitted = 0
        self._read()
        if not self._items:
            self._end()
        return self._emit()

    def _emit(self) -> T:
        place = self._order[self.emitted]
        self._last = self._keys[place]
        self.emitted += 1
        return self._items[place]

    def item_key(self) -> tuple[int, ...] | None:
        """The parent's key of the item, read with it into the window."""
        return self._last

    def _end(self) -> NoReturn:
        self._reset(epoch=self.epoch + 1)
        raise StopIteration

    def _read(self) -> None:
        items: list[T] = []
        keys: list[tuple[int, ...] | None] = []
        self._parent_ended = False
        while len(items) < self.buffer_size:
            try:
                items.append(next(self.parent))
                keys.append(self.parent.item_key())
            except StopIteration:
                self._parent_ended = True
                break
        ctx = self.context
        generator = rng.generator_for(
            rng.Purpose.WINDOW, self.seed, ctx.rank, ctx.worker_id, self.epoch, self.window
        )
        self._order = generator.permutation(len(items)).tolist()
        self._items, self._keys = items, keys

    def _resume(self) -> None:
        """Re-reads the restored window under its start generators (NOTE [ Shuffle
        restore point ]); the parent already stands at the restore point."""
        self._pending = False
        start = self._rng
        if isinstance(start, int):
            seeded = rng.seeded_for(start)
            if seeded is None:
                raise StateError(
                    f"Shuffle: the state names the generators as seeded for epoch {start}; "
                    "only a loader's worker can seed them again: restore it into the loader"
                )
            start = seeded
        if start is None:
            self._read()
        else:
            if isinstance(start, RngState):
                start = rng.RngSnapshot.from_state(start)
            with rng.OwnGenerators(start):
                self._read()
        if self.emitted > len(self._items):
            raise StateError(
                f"Shuffle: the restored window {self.window} has {len(self._items)} items "
                f"but {self.emitted} were emitted; the parent does not reproduce its stream"
            )

    def parent_states(self) -> list[Any]:
        if self._start is None:
            return [self.parent.state()]
        return [copy.deepcopy(self._start)]

    def own_state(self) -> dict[str, Any]:
        if self._start is None:
            return {"epoch": self.epoch, "window": 0, "emitted": 0, "rng": None}
        if isinstance(self._rng, rng.RngSnapshot):
            self._rng = self._rng.to_state()
        state: dict[str, Any] = {"epoch": self.epoch, "window": self.window}
        state["emitted"] = self.emitted
        if isinstance(self._rng, int):
            state.update(rng=None, seeded_epoch=self._rng)
        else:
            state["rng"] = None if self._rng is None else self._rng.model_dump()
        return state

    def restore_own(self, state: Any | None) -> None:
        if not isinstance(state, _State):
            self._reset(epoch=0)
            return
        if state.rng is not None and state.seeded_epoch is not None:
            raise StateError("Shuffle: malformed state (both rng and seeded_epoch are set)")
        generators = state.rng if state.seeded_epoch is None else state.seeded_epoch
        if generators is None and (state.window or state.emitted):
            raise StateError("Shuffle: malformed state (a window without its generators)")
        if state.emitted > self.buffer_size:
            raise StateError(
                f"Shuffle: the state emitted {state.emitted} items of a window but buffer_size "
                f"is {self.buffer_size}; restore with the buffer_size it was saved with"
            )
        self._reset(epoch=state.epoch)
        if generators is not None:
            # The parent was just restored to the window's start: that is the restore point.
            self._start = self.parent.state()
            self.window, self.emitted, self._rng = state.window, state.emitted, generators
            self._pending = True

    def end_epoch(self) -> None:
        if self._pending:
            self._resume()
        if not (self._start is not None and self._parent_ended):
            self.parent.end_epoch()
        self._reset(epoch=self.epoch + 1)
