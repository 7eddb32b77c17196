"""``Blend``: weighted mixing of several stages, with position-keyed draws.

NOTE [ Blend draws ]
Which source serves item ``p`` of epoch ``e`` comes from a uniform number ``u`` drawn
from a generator keyed by ``(seed, rank, worker, epoch, p // 256)`` (one generator per
block of 256 positions, for speed), looked up against the cumulative weights of the
sources still in play. The draw is a function of where the Blend stands, so no generator
state is saved. A source that drops out (``stop="all_exhausted"``) is removed from the
lookup and the same ``u`` is looked up again among the rest, renormalized. Every source
shards itself over ranks and workers, being a stage.

NOTE [ Blend epochs ]
``stop`` decides what a source's epoch end does:

- ``"first_exhausted"``: the Blend's epoch ends with the first chosen source whose
  epoch ends; every other source is then moved to its next epoch with ``end_epoch()``,
  so each Blend epoch starts every source afresh (their unread items are dropped).
- ``"all_exhausted"``: an exhausted source drops out and has moved to its next epoch by
  itself; the epoch ends when no source with a positive weight is left, so every item
  of every such source comes out exactly once per epoch. Sources of weight 0 are never
  read; they are moved to their next epoch with ``end_epoch()`` too.
- ``"never"``: an exhausted source starts its next epoch at once and the Blend's epoch
  never ends. A source whose epoch is empty right after restarting raises
  :class:`ConfigError` rather than spinning.

``end_epoch()`` moves every source not yet exhausted to its next epoch, so the next Blend
epoch starts every source afresh. With ``"never"`` it leaves everything where it stands,
as an endless ``Repeat`` does (NOTE [ Ending an endless epoch ] in
``datasets/transforms/repeat.py``): dropping the sources' epochs would make ``.limit(k)`` lose their
tails every ``k`` items, whereas this way ``.limit(k)`` cuts one endless stream into epochs of ``k``
items.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Generic, Literal, NoReturn, TypeVar, get_args

import numpy as np
from pydantic import Field

from ...config import WorkerContext
from ...errors import ConfigError, StateError
from ...rng import Purpose, generator_for
from ..adapt import as_stage
from ..protocol.cursor import AnyState, Cursor, StageState
from ..protocol.stage import Stage, fluent
from .blend_positions import BLOCK, BlendOrder, Segment, block_counts, segments

__all__ = ["Blend", "EndlessMixed", "Mixed"]

T = TypeVar("T")

Stop = Literal["first_exhausted", "all_exhausted", "never"]
_BLOCK = 256


class _State(StageState):
    """What a Blend adds to its sources' states (which sit in ``sources``, by position)."""

    epoch: int = Field(ge=0, description="The Blend's epoch.")
    position: int = Field(ge=0, description="Items the Blend emitted in this epoch.")
    exhausted: list[bool] = Field(description="Which sources ended this epoch (all_exhausted).")
    weights: list[float] = Field(description="The weights the state was saved with.")


@fluent("blend")
class Blend(Stage[T]):
    """Mixes ``sources``: each item comes from a source drawn with ``weights``.

    Args:
        sources: The stages to mix (or anything :func:`as_stage` accepts).
        weights: One non-negative finite weight per source, with a positive sum; they
            are normalized. Kept out of ``config()``, so changing them keeps the
            pipeline's fingerprint; a restore refuses a state saved with other weights
            unless ``allow_weight_change``.
        seed: Seed of the draws (NOTE [ Blend draws ]).
        stop: What a source's epoch end does: ``"first_exhausted"``, ``"all_exhausted"``
            or ``"never"`` (NOTE [ Blend epochs ]).
        allow_weight_change: Accept a state saved with other weights; the new weights
            then apply from the restored position on.

    Raises:
        ConfigError: No source, weights of another length, a negative, non-finite or
            all-zero weight, a seed that is not an int, or an unknown ``stop``.

    State:
        ``{"sources": [each source's state], "epoch": e, "position": p, "exhausted":
        [bool, ...], "weights": [w, ...]}``. The draws are keyed by position, so no
        generator state is saved; restore restores each source and replays nothing.
    """

    keyed = True

    elastic_reason = (
        "its generator chose which source each of a worker's items came from, and that "
        "sequence cannot be split over other workers"
    )
    elastic_fix = (
        "restore on the number of workers and ranks it was saved with, or pass "
        "approximate=True to restart the interrupted epoch on the new layout"
    )

    def __init__(
        self,
        sources: Sequence[Any],
        *,
        weights: Sequence[float],
        seed: int,
        stop: Stop = "first_exhausted",
        allow_weight_change: bool = False,
    ) -> None:
        if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence) or not sources:
            raise ConfigError(f"Blend needs a non-empty list of sources, got {sources!r}")
        self.sources: list[Stage[Any]] = [as_stage(source) for source in sources]
        self.weights = _weights(weights, len(self.sources))
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"Blend seed must be an int, got {seed!r}")
        if stop not in get_args(Stop):
            raise ConfigError(f"Blend stop must be one of {get_args(Stop)}; got {stop!r}")
        self.seed = seed
        self.stop: Stop = stop
        self.allow_weight_change = bool(allow_weight_change)

    def config(self) -> dict[str, Any]:
        return {
            "type": "Blend",
            "seed": self.seed,
            "stop": self.stop,
            "sources": [source.config() for source in self.sources],
        }

    def describe(self) -> str:
        stop = "" if self.stop == "first_exhausted" else f", stop={self.stop!r}"
        sources = ", ".join(source.describe() for source in self.sources)
        return f"Blend([{sources}], weights={self.weights}{stop})"

    @property
    def children(self) -> tuple[Stage[Any], ...]:
        return tuple(self.sources)

    def cursor(self, context: WorkerContext) -> Cursor[T]:
        return _BlendCursor(self, context, [source.cursor(context) for source in self.sources])

    def access(self, context: WorkerContext) -> Mixed[T] | EndlessMixed[T] | None:
        """Items by position when every source has them and the epoch ends (NOTE
        [ Blend by position ] in ``datasets/transforms/blend_positions.py``)."""
        return self.access_weighted(context, self.weights)

    def access_weighted(
        self, context: WorkerContext, weights: list[float]
    ) -> Mixed[T] | EndlessMixed[T] | None:
        """:meth:`access` with ``weights`` instead of the Blend's own."""
        parents = [source.access(context) for source in self.sources]
        if any(parent is None or parent.length() is None for parent in parents):
            return None
        if self.stop == "never":
            return EndlessMixed(self.seed, weights, parents)
        layout = segments([parent.length() for parent in parents], weights, self.stop)
        return Mixed(self.seed, layout, parents)

    def reads_by_layout(self) -> bool:
        """Read stream by stream, each stream draws its own sources."""
        return True

    def draws_nothing(self) -> bool:
        return all(source.draws_nothing() for source in self.sources)

    def checking_cursor(self, context: WorkerContext) -> Cursor[T]:
        """A Blend over sources that take any state (NOTE [ States checked at the door ]
        in ``datasets/protocol/stage.py``)."""
        return _BlendCursor(self, context, [AnyState(context) for _ in self.sources])


def _weights(weights: Sequence[float], count: int) -> list[float]:
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise ConfigError(f"Blend weights must be a list of numbers, got {weights!r}")
    if len(weights) != count:
        raise ConfigError(f"Blend has {count} sources but {len(weights)} weights")
    if not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights):
        raise ConfigError(f"Blend weights must be numbers, got {list(weights)!r}")
    values = [float(w) for w in weights]
    if not all(math.isfinite(w) and w >= 0 for w in values) or not sum(values) > 0:
        raise ConfigError(
            f"Blend weights must be finite, non-negative and not all zero, got {values}"
        )
    return values


class _Sources(Generic[T]):
    """A blend's items by position, read from the sources that serve them."""

    parents: list[Any]

    def runs(self, epoch: int, positions: list[int]) -> list[tuple[int, int, Any, list[int]]]:
        """``(source, its epoch, where in positions, its positions)`` per run of one
        source's epoch."""
        raise NotImplementedError

    def get_many(self, epoch: int, positions: list[int]) -> list[T]:
        out: list[Any] = [None] * len(positions)
        for source, source_epoch, where, places in self.runs(epoch, positions):
            items = self.parents[source].get_many(source_epoch, places)
            for n, item in zip(where, items, strict=True):
                out[n] = item
        return out

    def keys(self, epoch: int, positions: list[int]) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = [()] * len(positions)
        for source, source_epoch, where, places in self.runs(epoch, positions):
            for n, key in zip(where, self.parents[source].keys(source_epoch, places), strict=True):
                out[n] = (source, *key)
        return out


class Mixed(_Sources[T]):
    """A blend's items by position (NOTE [ Blend by position ] in
    ``datasets/transforms/blend_positions.py``)."""

    def __init__(self, seed: int, layout: list[Segment], parents: list[Any]) -> None:
        self.order = BlendOrder(seed, layout)
        self.parents = parents

    def length(self) -> int:
        return self.order.length

    def runs(self, epoch: int, positions: list[int]) -> list[tuple[int, int, Any, list[int]]]:
        sources, places = self.order.locate(epoch, positions)
        found = []
        for source in np.unique(sources).tolist():
            where = np.flatnonzero(sources == source)
            found.append((source, epoch, where, places[where].tolist()))
        return found


class EndlessMixed(_Sources[T]):
    """An endless blend's items by position (NOTE [ Endless blends by position ] in
    ``datasets/transforms/blend_positions.py``): one epoch, 0, that never ends."""

    def __init__(self, seed: int, weights: list[float], parents: list[Any]) -> None:
        self.counts = block_counts(weights)
        self.order = BlendOrder(seed, [Segment(0, self.counts, (0,) * len(weights))])
        self.parents = parents
        self.sizes = [int(parent.length()) for parent in parents]

    def length(self) -> None:
        return None

    def runs(self, epoch: int, positions: list[int]) -> list[tuple[int, int, Any, list[int]]]:
        blocks: dict[int, list[int]] = {}  # the block's index stands in the epoch's place
        for n, position in enumerate(positions):
            blocks.setdefault(position // BLOCK, []).append(n)
        found: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        for block, indices in blocks.items():
            offsets = [positions[n] - block * BLOCK for n in indices]
            sources, places = self.order.locate(block, offsets)
            for n, source, place in zip(indices, sources.tolist(), places.tolist(), strict=True):
                draw = block * self.counts[source] + place
                source_epoch, at = divmod(draw, self.sizes[source])
                where, run = found.setdefault((source, source_epoch), ([], []))
                where.append(n)
                run.append(at)
        return [(s, e, where, run) for (s, e), (where, run) in found.items()]


class _BlendCursor(Cursor[T]):
    State = _State
    stage_name = "Blend"

    def __init__(self, stage: Blend[T], context: WorkerContext, sources: list[Cursor[Any]]) -> None:
        super().__init__(context, *sources)
        self.stage = stage
        self.sources = self.parents
        self.weights = list(stage.weights)
        self._reset(epoch=0)
        self._uniforms: tuple[int, int, list[float]] = (-1, -1, [])

    def _reset(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0
        self.exhausted = [False] * len(self.sources)
        #: The source the last item came from (:meth:`item_key`).
        self._last: int | None = None

    def __next__(self) -> T:
        u = self._uniform(self.position)
        while True:
            index = self._choose(u)
            if index is None:
                self._end(skip=None)
            try:
                item: T = next(self.sources[index])
            except StopIteration:
                if self.stage.stop == "first_exhausted":
                    self._end(skip=index)
                if self.stage.stop == "all_exhausted":
                    self.exhausted[index] = True
                    continue
                item = self._restart(index)
            self.position += 1
            self._last = index
            return item

    def item_key(self) -> tuple[int, ...] | None:
        """``(source index, *that source's key)`` of the last item (NOTE [ Keys of the
        global stream ] in ``rng/keys.py``); None when that source's items have none."""
        if self._last is None:
            return None
        key = self.sources[self._last].item_key()
        return None if key is None else (self._last, *key)

    def _restart(self, index: int) -> T:
        try:
            item: T = next(self.sources[index])
        except StopIteration:
            raise ConfigError(
                f"Blend source {index} ({self.stage.sources[index].describe()}) has an empty "
                "epoch for this worker; stop='never' needs every source to yield items"
            ) from None
        return item

    def _end(self, skip: int | None) -> NoReturn:
        for index, source in enumerate(self.sources):
            if index != skip and not self.exhausted[index]:
                source.end_epoch()
        self._reset(epoch=self.epoch + 1)
        raise StopIteration

    def _uniform(self, position: int) -> float:
        block = position // _BLOCK
        epoch, cached, values = self._uniforms
        if (epoch, cached) != (self.epoch, block):
            ctx = self.context
            generator = generator_for(
                Purpose.BLEND_DRAW, self.stage.seed, ctx.rank, ctx.worker_id, self.epoch, block
            )
            values = generator.random(_BLOCK).tolist()
            self._uniforms = (self.epoch, block, values)
        return values[position % _BLOCK]

    def _choose(self, u: float) -> int | None:
        """The source whose share of the remaining weights holds ``u``; None: none left."""
        live = [(i, w) for i, w in enumerate(self.weights) if w > 0 and not self.exhausted[i]]
        target, total = u * sum(w for _, w in live), 0.0
        for index, weight in live:
            total += weight
            if target < total:
                return index
        return live[-1][0] if live else None

    def own_state(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "exhausted": list(self.exhausted),
            "weights": list(self.weights),
        }

    def restore_own(self, state: Any | None) -> None:
        if not isinstance(state, _State):
            self._reset(epoch=0)
            return
        count = len(self.sources)
        for field in ("exhausted", "weights"):
            if len(getattr(state, field)) != count:
                raise StateError(
                    f"Blend: the state's {field} has {len(getattr(state, field))} entries but "
                    f"this Blend has {count} sources; restore a state saved by the same pipeline"
                )
        if state.weights != self.weights and not self.stage.allow_weight_change:
            raise StateError(
                f"Blend: the state was saved with weights {state.weights} but this Blend has "
                f"weights {self.weights}; pass allow_weight_change=True to apply the new "
                "weights from the restored position on"
            )
        self.epoch, self.position = state.epoch, state.position
        self.exhausted = list(state.exhausted)

    def end_epoch(self) -> None:
        if self.stage.stop == "never":
            return
        for index, source in enumerate(self.sources):
            if not self.exhausted[index]:
                source.end_epoch()
        self._reset(epoch=self.epoch + 1)
