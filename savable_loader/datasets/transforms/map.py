"""``Map``: applies a function to every item, optionally with a per-item generator.

NOTE [ Per-item generators ]
With a ``seed``, ``fn(item, rng)`` receives a ``numpy.random.Generator`` keyed by the
item's place in the global stream: ``(seed, item key)``, the key the source gives the
item (NOTE [ Keys of the global stream ] in ``rng/keys.py``). The generator is a function
of the item alone, so nothing about it needs saving, a restored pipeline hands every item
the generator it had, and so does a run on another number of ranks or workers, or one
restored onto another layout. An item whose source gives no key (your own iterable
dataset, a Stateful object) gets a generator keyed by where it stands in this stream:
``(seed, rank, worker, epoch, position)``, ``position`` counting this stage's items in
the epoch (plus, for the rest of an epoch resumed on another layout, a salt drawn from
the saved states: NOTE [ Elastic resume ] in ``datasets/protocol/elastic.py``). Without a seed,
``fn(item)`` may still draw from the global ``random``, ``numpy.random`` and torch generators; the
loader captures those in its checkpoints, or seeds them per item (``seed_each_item``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from pydantic import Field

from ...config import WorkerContext
from ...errors import ConfigError
from ...rng import Purpose, generator_for, seed_item
from ...state.fingerprint import fingerprint
from ...state.names import qualified_name
from ..protocol.cursor import Cursor, StageState, TransformCursor
from ..protocol.elastic import ReshardPlan
from ..protocol.stage import fluent
from .transform import Transform

__all__ = ["Map"]

T = TypeVar("T")
U = TypeVar("U")


@fluent("map")
class Map(Transform[U]):
    """Applies ``fn`` to every item of ``source``.

    Args:
        source: The stage (or dataset) whose items are mapped.
        fn: ``fn(item)``, or ``fn(item, rng)`` when ``seed`` is given.
        seed: Gives ``fn`` a per-item ``numpy.random.Generator`` (NOTE [ Per-item
            generators ]).

    Raises:
        ConfigError: ``fn`` is not callable or ``seed`` is not an int.

    State:
        Without a seed, the parent's state: Map adds nothing. With a seed, also
        ``{"epoch": e, "position": p}``, this stream's count of items in the epoch (the
        key of an item whose source gives none). Restore replays nothing. Elastic when its
        source is: items keyed by the source get the same generators on every layout; the
        others, after a restore onto another layout, are keyed by the new streams'
        positions plus a ``salt`` drawn from the saved states (so no draw of the saved run
        repeats) for the rest of the epoch, and as a fresh run on that layout after it.
    """

    keyed = True

    bounded_by_parent = True

    def __init__(self, source: Any, fn: Callable[..., U], *, seed: int | None = None) -> None:
        super().__init__(source)
        if not callable(fn):
            raise ConfigError(f"Map needs a callable, got {type(fn).__name__}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ConfigError(f"Map seed must be an int or None, got {seed!r}")
        self.fn = fn
        self.seed = seed

    def config(self) -> dict[str, Any]:
        return {
            "type": "Map",
            "fn": qualified_name(self.fn),
            "seed": self.seed,
            "source": self.source.config(),
        }

    def describe_own(self) -> str:
        seed = "" if self.seed is None else f", seed={self.seed}"
        return f"map({getattr(self.fn, '__name__', type(self.fn).__name__)}{seed})"

    def reshard(self, plan: ReshardPlan) -> dict[str, Any]:
        """Elastic when the source is (NOTE [ Elastic resume ]); a seeded map's new
        streams count their positions from 0 in the resumed epoch."""
        parent = {"parent": self.source.reshard(plan.parents())}
        if self.seed is None:
            return parent
        return {**parent, "epoch": plan.epoch, "position": 0, "salt": plan.salt}

    def access(self, context: WorkerContext) -> _Access[U] | None:
        """Items by position when the source has them (NOTE [ Pipelines read by
        position ] in ``datasets/global_view.py``), with the same generators as a cursor's."""
        parent = self.source.access(context)
        return None if parent is None else _Access(self, parent, context)

    def cursor_over(self, parent: Cursor[Any], context: WorkerContext) -> Cursor[U]:
        if self.seed is None:
            return _MapCursor(self, parent, context)
        return _SeededMapCursor(self, parent, context)


class _MapCursor(TransformCursor[U]):
    passes_keys = True

    def __init__(self, stage: Map[U], parent: Cursor[Any], context: WorkerContext) -> None:
        super().__init__(parent, context)
        self.fn = stage.fn
        #: NOTE [ Items seeded one by one ] in ``rng/keys.py``: this map's part of the key.
        self.stage_key = _stage_key(stage) if context.seed_each_item else None

    def __next__(self) -> U:
        item = next(self.parent)
        if self.stage_key is not None:
            _seed_item(self, self.stage_key)
        return self.fn(item)

    def end_epoch(self) -> None:
        self.parent.end_epoch()


class _Access(Generic[U]):
    """A map's items by position: its function on its source's item, with the item's
    generator (NOTE [ Per-item generators ])."""

    def __init__(self, stage: Map[U], parent: Any, context: WorkerContext) -> None:
        self.fn, self.seed, self.parent = stage.fn, stage.seed, parent
        self.stage_key = _stage_key(stage) if context.seed_each_item else None
        self.loader_seed = context.seed

    def length(self) -> int | None:
        length: int | None = self.parent.length()
        return length

    def keys(self, epoch: int, positions: list[int]) -> list[tuple[int, ...]]:
        keys: list[tuple[int, ...]] = self.parent.keys(epoch, positions)
        return keys

    def get_many(self, epoch: int, positions: list[int]) -> list[U]:
        items = self.parent.get_many(epoch, positions)
        if self.stage_key is None and self.seed is None:
            return [self.fn(item) for item in items]
        out = []
        for item, key in zip(items, self.keys(epoch, positions), strict=True):
            if self.stage_key is not None:
                seed_item(Purpose.MAP_GLOBALS, self.loader_seed, self.stage_key, *key)
            if self.seed is None:
                out.append(self.fn(item))
            else:
                out.append(self.fn(item, generator_for(Purpose.MAP_ITEM, self.seed, *key)))
        return out


def _stage_key(stage: Map[Any]) -> int:
    """A number that tells this map from the others of the pipeline: its config's hash
    (which holds its function's name and everything below it)."""
    return int(fingerprint(stage.config()), 16) >> 1


def _seed_item(cursor: Cursor[Any], stage_key: int) -> None:
    """Seeds the global generators for the item the map's parent just returned."""
    key = cursor.parent.item_key()
    if key is None:  # the loader refuses seed_each_item over items without keys
        raise ConfigError("seed_each_item: an item came without its key; please report")
    seed_item(Purpose.MAP_GLOBALS, cursor.context.seed, stage_key, *key)


class _Position(StageState):
    epoch: int = Field(ge=0, description="The epoch of the next item.")
    position: int = Field(ge=0, description="This stage's items already mapped in it.")
    salt: int | None = Field(
        default=None,
        ge=0,
        description="After an elastic restore: added to the keys for the rest of the epoch.",
    )


class _SeededMapCursor(TransformCursor[U]):
    passes_keys = True
    State = _Position
    stage_name = "Map"

    def __init__(self, stage: Map[U], parent: Cursor[Any], context: WorkerContext) -> None:
        super().__init__(parent, context)
        self.fn = stage.fn
        self.seed = stage.seed or 0
        self.epoch = 0
        self.position = 0
        self.salt: int | None = None
        self.stage_key = _stage_key(stage) if context.seed_each_item else None

    def __next__(self) -> U:
        try:
            item = next(self.parent)
        except StopIteration:
            self.epoch, self.position, self.salt = self.epoch + 1, 0, None
            raise
        if self.stage_key is not None:
            _seed_item(self, self.stage_key)
        key = self.parent.item_key()
        if key is not None:
            rng = generator_for(Purpose.MAP_ITEM, self.seed, *key)
        else:
            ctx = self.context
            stream = [ctx.rank, ctx.worker_id, self.epoch, self.position]
            salt = [] if self.salt is None else [self.salt]
            rng = generator_for(Purpose.MAP_STREAM_ITEM, self.seed, *stream, *salt)
        self.position += 1
        return self.fn(item, rng)

    def own_state(self) -> dict[str, Any]:
        if self.salt is None:
            return {"epoch": self.epoch, "position": self.position}
        return {"epoch": self.epoch, "position": self.position, "salt": self.salt}

    def restore_own(self, state: Any | None) -> None:
        position = state if isinstance(state, _Position) else _Position(epoch=0, position=0)
        self.epoch, self.position, self.salt = position.epoch, position.position, position.salt

    def end_epoch(self) -> None:
        self.parent.end_epoch()
        self.epoch, self.position, self.salt = self.epoch + 1, 0, None
