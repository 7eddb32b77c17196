"""The stage: what a pipeline is, apart from where a reading of it stands.

A :class:`Stage` is a recipe (NOTE [ Stages and cursors ] in ``cursor.py``): it builds
cursors, says what identifies it (``config()``) and how it reads (``str()``), and, when
it can, how a saved position moves to another number of workers or ranks
(``reshard``, NOTE [ Elastic resume ] in ``elastic.py``). It holds no position, so two
loaders over one stage never disturb each other.

NOTE [ Fluent construction ]
``stage.map(fn)``, ``.filter(...)``, ``.shuffle(...)``, ``.limit(n)``, ``.repeat()`` and
``.blend(...)`` build the transform of that name over the stage. The transforms live in
modules that import this one, so this module does not import them: each registers its
class under its fluent name with :func:`fluent` when its module is imported, which the
package ``savable_loader.datasets`` does for all of them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

from torch.utils.data import IterableDataset, get_worker_info

from ..config import WorkerContext
from ..errors import SavableLoaderError
from .cursor import Cursor
from .elastic import NotElastic, ReshardPlan

__all__ = ["Stage", "fluent"]

T = TypeVar("T")
S = TypeVar("S", bound="type[Stage[Any]]")

_FLUENT: dict[str, Callable[..., Stage[Any]]] = {}


def fluent(name: str) -> Callable[[S], S]:
    """Registers a stage class as what ``Stage.<name>(...)`` builds (NOTE [ Fluent
    construction ])."""

    def register(cls: S) -> S:
        _FLUENT[name] = cls
        return cls

    return register


def _built(name: str, *args: Any, **kwargs: Any) -> Stage[Any]:
    try:
        build = _FLUENT[name]
    except KeyError:
        raise SavableLoaderError(
            f"no stage is registered for .{name}(); import savable_loader.datasets"
        ) from None
    return build(*args, **kwargs)


class Stage(IterableDataset[T], abc.ABC):
    """A savable pipeline stage: a recipe whose readings are cursors.

    Subclasses implement :meth:`cursor` and :meth:`config`. Iterating a stage directly
    reads epoch 0 from the start through a new cursor (for the torch worker it runs in,
    if any); the loader reads it through cursors that it saves and restores.
    """

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
        """Returns a new cursor at the start of epoch 0, reading for ``context``."""

    @abc.abstractmethod
    def config(self) -> dict[str, Any]:
        """Returns plain data identifying this stage and its sources."""

    @property
    def children(self) -> tuple[Stage[Any], ...]:
        """The stages this one reads (none for a source)."""
        return ()

    def describe(self) -> str:
        """Returns a one-line description; ``str(stage)`` shows it."""
        return type(self).__name__

    def __str__(self) -> str:
        return self.describe()

    def reshard(self, plan: ReshardPlan) -> Any:
        """Returns the state of the new stream ``plan.new`` (NOTE [ Elastic resume ]).

        Raises:
            NotElastic: This stage's position cannot move to another layout.
        """
        raise NotElastic(self.describe(), self.elastic_reason, self.elastic_fix)

    def items_left(self, state: Any, context: WorkerContext) -> int | None:
        """At most how many items a cursor for ``context`` restored to ``state`` yields
        before its epoch ends, worked out without reading any data (NOTE [ Checking a
        replay ] in ``_compat.py``); None when this stage cannot tell.

        Raises:
            StateError: ``state`` is malformed.
        """
        return None

    def check_layout(self, context: WorkerContext) -> None:
        """Refuses a layout on which some stream would get no data at all, which would
        leave its rank without steps while the others wait for it in a collective. The
        loader calls it when it is built; this checks every stage the pipeline reads.

        Args:
            context: Worker 0 of the loader's rank: its ``world_size`` and
                ``num_workers`` give the job's layout.

        Raises:
            ConfigError: A stream would get no data; the message names it and the fix.
        """
        for child in self.children:
            child.check_layout(context)

    def not_elastic(self) -> NotElastic | None:
        """Why this pipeline's position cannot move to another layout, or None when every
        stage of it can (it overrides :meth:`reshard`)."""
        if type(self).reshard is Stage.reshard:
            return NotElastic(self.describe(), self.elastic_reason, self.elastic_fix)
        for child in self.children:
            problem = child.not_elastic()
            if problem is not None:
                return problem
        return None

    def not_savable(self) -> str | None:
        """Why a position in this pipeline cannot be saved (naming the dataset and what
        to add to it), or None when every stage of it can save its position."""
        for child in self.children:
            problem = child.not_savable()
            if problem is not None:
                return problem
        return None

    def __iter__(self) -> Iterator[T]:
        info = get_worker_info()
        worker_id, workers = (info.id, info.num_workers) if info is not None else (0, 0)
        cursor = self.cursor(WorkerContext(0, 1, worker_id, workers, 0, None))
        try:
            yield from cursor
        finally:
            cursor.close()

    # -- fluent construction (NOTE [ Fluent construction ]) -------------------------------

    def map(self, fn: Callable[..., Any], *, seed: int | None = None) -> Stage[Any]:
        """Returns ``Map(self, fn, seed=seed)``."""
        return _built("map", self, fn, seed=seed)

    def filter(self, predicate: Callable[[T], bool]) -> Stage[T]:
        """Returns ``Filter(self, predicate)``."""
        return _built("filter", self, predicate)

    def shuffle(self, *, buffer_size: int, seed: int) -> Stage[T]:
        """Returns ``Shuffle(self, buffer_size=buffer_size, seed=seed)``."""
        return _built("shuffle", self, buffer_size=buffer_size, seed=seed)

    def limit(self, n: int) -> Stage[T]:
        """Returns ``Limit(self, n)``."""
        return _built("limit", self, n)

    def repeat(self, times: int | None = None) -> Stage[T]:
        """Returns ``Repeat(self, times)``."""
        return _built("repeat", self, times)

    def blend(self, others: Sequence[Any], *, weights: Sequence[float], seed: int) -> Stage[Any]:
        """Returns ``Blend([self, *others], weights=weights, seed=seed)``."""
        return _built("blend", [self, *others], weights=weights, seed=seed)
