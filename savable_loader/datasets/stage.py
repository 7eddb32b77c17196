"""The building blocks' base: a stage (what a pipeline is) and its cursor (where it stands).

NOTE [ Stages and cursors ]
A :class:`Stage` is a recipe: fixed at construction, picklable, described by
``config()`` and ``str()``. Reading it goes through a :class:`Cursor`, built with
``stage.cursor(context)`` for one process (a worker knows its rank and worker id only
once it runs), which holds the position: ``next()`` returns the next item or raises
StopIteration at the end of an epoch, after which the cursor stands at the start of the
next epoch; ``state()`` returns the position as plain data and ``restore(state)`` takes
it back. Two cursors of one stage never disturb each other.

A stage is also a :class:`SavableDataset`, so ``SavableDataLoader`` takes it as it is:
the dataset protocol's methods act on the stage's own cursor, built on first use in the
process that reads it and never pickled.

NOTE [ Transform state ]
A transform's state is ``{"parent": <the parent's state>, **what it adds}``. The base
class builds that dict and takes it apart; a subclass reports and restores only what it
adds (``own_state`` / ``restore_own``) and declares its shape as a pydantic model, so a
malformed state fails at the door with the stage's name and the field. Map and filter
add nothing, so their state is their parent's.

NOTE [ Skipping ]
``skip(n)`` lets the loader's replay after a restore move ``n`` items without producing
them. It must leave the cursor exactly where reading would have: at most at the end of
the epoch, never past it (the next ``next()`` then ends the epoch), with the same draws
from the global generators. Only cursors whose ``can_skip()`` says so are asked; a
cursor that cannot skip is replayed by reading, which is always exact.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ..config import WorkerContext
from ..errors import StateError
from .base import SavableDataset

if TYPE_CHECKING:
    from .blend import Blend
    from .elastic import ReshardPlan
    from .filter import Filter
    from .limit import Limit
    from .map import Map
    from .repeat import Repeat
    from .shuffle import Shuffle

__all__ = ["Cursor", "Stage", "StageState", "Transform", "TransformCursor", "as_stage"]

T = TypeVar("T")
U = TypeVar("U")
M = TypeVar("M", bound=BaseModel)

_DEFAULT_CONTEXT = WorkerContext(0, 1, 0, 0, 0, None)


class StageState(BaseModel):
    """Base of the models that describe what a stage adds to its state."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


def validate_state(model: type[M], state: Any, stage: str) -> M:
    """Returns ``state`` as ``model``, or raises :class:`StateError` naming the stage."""
    try:
        return model.model_validate(state)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'state'}: {e['msg']}" for e in error.errors()
        )
        raise StateError(
            f"{stage}: malformed state ({problems}); restore a state saved by the same pipeline"
        ) from None


class Cursor(Iterator[T], abc.ABC):
    """Where one reading of a stage stands (NOTE [ Stages and cursors ]).

    Args:
        context: The rank and worker this cursor reads for.
    """

    def __init__(self, context: WorkerContext) -> None:
        self.context = context

    def __iter__(self) -> Cursor[T]:
        return self

    @abc.abstractmethod
    def __next__(self) -> T:
        """Returns the next item; at the end of an epoch raises StopIteration and moves
        to the start of the next one."""

    @abc.abstractmethod
    def state(self) -> Any:
        """Returns the position as small plain data."""

    @abc.abstractmethod
    def restore(self, state: Any | None) -> None:
        """Returns to ``state`` (as :meth:`state` gave it), or to the start if None.

        Raises:
            StateError: ``state`` is malformed.
        """

    def end_epoch(self) -> None:
        """Moves to the start of the next epoch, dropping the rest of this one.

        The default reads the rest of the epoch; sources do it without reading.
        """
        for _ in self:
            pass

    def can_skip(self) -> bool:
        """Whether :meth:`skip` is exact and cheaper than reading (NOTE [ Skipping ])."""
        return False

    def skip(self, n: int) -> None:
        """Advances by ``n`` items or to the end of the epoch, as reading would."""
        raise NotImplementedError(f"{type(self).__name__} cannot skip; read instead")


class Stage(SavableDataset[T]):
    """A savable pipeline stage: a recipe whose reading is done by cursors.

    Subclasses implement :meth:`cursor` and :meth:`config`; this class provides the
    :class:`SavableDataset` protocol and the fluent methods (``.map(...)`` and so on).
    """

    _context: WorkerContext = _DEFAULT_CONTEXT
    _live_cursor: Cursor[T] | None = None
    #: Why this stage's position cannot move to another layout (NOTE [ Elastic resume ]
    #: in ``elastic.py``), and what to change; stages that can move override reshard().
    elastic_reason: ClassVar[str] = (
        "its state describes the worker that saved it and cannot be split or merged over "
        "other workers"
    )
    elastic_fix: ClassVar[str] = (
        "restore on the number of workers and ranks it was saved with, or pass "
        "approximate=True to restart the interrupted epoch on the new layout"
    )

    @abc.abstractmethod
    def cursor(self, context: WorkerContext) -> Cursor[T]:
        """Returns a new cursor at the start, reading for ``context``."""

    @abc.abstractmethod
    def config(self) -> dict[str, Any]:
        """Returns plain data identifying this stage and its sources."""

    def describe(self) -> str:
        """Returns a one-line description; ``str(stage)`` shows it."""
        return type(self).__name__

    def reshard(self, plan: ReshardPlan) -> Any:
        """Returns the state of the new stream ``plan.new`` (NOTE [ Elastic resume ]).

        Raises:
            NotElastic: This stage's position cannot move to another layout.
        """
        from .elastic import NotElastic

        raise NotElastic(self.describe(), self.elastic_reason, self.elastic_fix)

    def __str__(self) -> str:
        return self.describe()

    # -- the SavableDataset protocol, on this stage's own cursor -------------------------

    def setup(self, context: WorkerContext) -> None:
        self._context = context
        self._live_cursor = None

    def _cursor(self) -> Cursor[T]:
        if self._live_cursor is None:
            self._live_cursor = self.cursor(self._context)
        return self._live_cursor

    def __iter__(self) -> Iterator[T]:
        return _epoch(self._cursor())

    def save_state(self) -> Any:
        return self._cursor().state()

    def restore_state(self, state: Any | None) -> None:
        self._cursor().restore(state)

    def can_skip(self) -> bool:
        return self._cursor().can_skip()

    def skip(self, n: int) -> None:
        self._cursor().skip(n)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_live_cursor", None)
        return state

    # -- fluent construction ------------------------------------------------------------

    def map(self, fn: Callable[..., U], *, seed: int | None = None) -> Map[U]:
        """Returns ``Map(self, fn, seed=seed)``."""
        from .map import Map

        return Map(self, fn, seed=seed)

    def filter(self, predicate: Callable[[T], bool]) -> Filter[T]:
        """Returns ``Filter(self, predicate)``."""
        from .filter import Filter

        return Filter(self, predicate)

    def shuffle(self, *, buffer_size: int, seed: int) -> Shuffle[T]:
        """Returns ``Shuffle(self, buffer_size=buffer_size, seed=seed)``."""
        from .shuffle import Shuffle

        return Shuffle(self, buffer_size=buffer_size, seed=seed)

    def limit(self, n: int) -> Limit[T]:
        """Returns ``Limit(self, n)``."""
        from .limit import Limit

        return Limit(self, n)

    def repeat(self, times: int | None = None) -> Repeat[T]:
        """Returns ``Repeat(self, times)``."""
        from .repeat import Repeat

        return Repeat(self, times)

    def blend(self, others: Sequence[Any], *, weights: Sequence[float], seed: int) -> Blend[T]:
        """Returns ``Blend([self, *others], weights=weights, seed=seed)``."""
        from .blend import Blend

        return Blend([self, *others], weights=weights, seed=seed)


def _epoch(cursor: Cursor[T]) -> Iterator[T]:
    while True:
        try:
            item = next(cursor)
        except StopIteration:
            return
        yield item


class Transform(Stage[T]):
    """A stage reading one parent stage.

    Args:
        source: The parent: a stage, any :class:`SavableDataset`, a Stateful iterable
            or a map-style dataset (see :func:`as_stage`).
    """

    def __init__(self, source: Any) -> None:
        self.source: Stage[Any] = as_stage(source)

    def describe(self) -> str:
        return f"{self.source.describe()}.{self.describe_own()}"

    def describe_own(self) -> str:
        """Describes this stage alone, as the fluent call that adds it."""
        return f"{type(self).__name__.lower()}()"


class TransformCursor(Cursor[T]):
    """A cursor over a parent cursor; its state is NOTE [ Transform state ].

    Subclasses set ``State`` to the model of what they add (None: nothing) and
    implement :meth:`own_state` and :meth:`restore_own` accordingly.
    """

    State: ClassVar[type[StageState] | None] = None
    #: The stage's name in error messages (default: the class name without "Cursor").
    stage_name: ClassVar[str] = ""

    def __init__(self, parent: Cursor[Any], context: WorkerContext) -> None:
        super().__init__(context)
        self.parent = parent

    def own_state(self) -> dict[str, Any]:
        """What this stage adds to its parent's state (plain data)."""
        return {}

    def restore_own(self, state: Any | None) -> None:
        """Takes back what :meth:`own_state` gave (validated as ``State``); None: start."""

    def state(self) -> dict[str, Any]:
        own = self.own_state()
        if "parent" in own:
            raise StateError(f"{type(self).__name__}.own_state() must not use the key 'parent'")
        return {"parent": self.parent.state(), **own}

    def restore(self, state: Any | None) -> None:
        name = self.stage_name or type(self).__name__.lstrip("_").removesuffix("Cursor")
        if state is None:
            self.parent.restore(None)
            self.restore_own(None)
            return
        if not isinstance(state, dict) or "parent" not in state:
            raise StateError(
                f"{name}: malformed state (expected a dict with a 'parent' entry, got "
                f"{type(state).__name__}); restore a state saved by the same pipeline"
            )
        own = {key: value for key, value in state.items() if key != "parent"}
        if self.State is None:
            if own:
                raise StateError(
                    f"{name}: malformed state (unexpected fields {sorted(own)}); restore a "
                    "state saved by the same pipeline"
                )
            self.parent.restore(state["parent"])
            self.restore_own(None)
            return
        validated = validate_state(self.State, own, name)
        self.parent.restore(state["parent"])
        self.restore_own(validated)


class DatasetStage(Stage[T]):
    """A stage over a user's :class:`SavableDataset` (each cursor reads its own copy).

    State:
        The dataset's own ``save_state()``, unchanged.
    """

    elastic_reason = (
        "its state is your dataset's own save_state(), which only your dataset can read"
    )
    elastic_fix = (
        "restore on the number of workers and ranks it was saved with, build the pipeline "
        "from IndexedDataset (or a map-style dataset), JsonLinesSource, TokenSource or "
        "TarSource, or pass approximate=True to restart the interrupted epoch on the new "
        "layout"
    )

    def __init__(self, dataset: SavableDataset[T]) -> None:
        self.dataset = dataset

    def config(self) -> dict[str, Any]:
        return self.dataset.config()

    def describe(self) -> str:
        return type(self.dataset).__name__

    def cursor(self, context: WorkerContext) -> Cursor[T]:
        return _DatasetCursor(copy.deepcopy(self.dataset), context)


class _DatasetCursor(Cursor[T]):
    def __init__(self, dataset: SavableDataset[T], context: WorkerContext) -> None:
        super().__init__(context)
        self.dataset = dataset
        dataset.setup(context)
        self._items: Iterator[T] | None = None

    def __next__(self) -> T:
        if self._items is None:
            self._items = iter(self.dataset)
        try:
            return next(self._items)
        except StopIteration:
            self._items = None
            raise

    def state(self) -> Any:
        return self.dataset.save_state()

    def restore(self, state: Any | None) -> None:
        self._items = None
        self.dataset.restore_state(copy.deepcopy(state))

    def can_skip(self) -> bool:
        return self._items is None and callable(getattr(self.dataset, "skip", None))

    def skip(self, n: int) -> None:
        self.dataset.skip(n)  # type: ignore[attr-defined]


def as_stage(obj: Any) -> Stage[Any]:
    """Returns ``obj`` as a stage: stages as they are, a :class:`SavableDataset` through
    :class:`DatasetStage`, a Stateful iterable through ``from_stateful``, a map-style
    dataset through ``IndexedDataset``.

    Raises:
        ConfigError: ``obj`` is none of these.
    """
    if isinstance(obj, Stage):
        return obj
    from ..loader import _as_savable

    savable = _as_savable(obj, shuffle=None, seed=0)
    return savable if isinstance(savable, Stage) else DatasetStage(savable)
