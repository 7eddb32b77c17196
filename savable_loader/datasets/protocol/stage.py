"""The stage: what a pipeline is, apart from where a reading of it stands.

A :class:`Stage` is a recipe (NOTE [ Stages and cursors ] in ``datasets/protocol/cursor.py``): it
builds cursors, says what identifies it (``config()``) and how it reads (``str()``), and, when
it can, how a saved position moves to another number of workers or ranks
(``reshard``, NOTE [ Elastic resume ] in ``datasets/protocol/elastic.py``). It holds no position, so
two loaders over one stage never disturb each other.

NOTE [ Fluent construction ]
``stage.map(fn)``, ``.filter(...)``, ``.shuffle(...)``, ``.limit(n)``, ``.repeat()`` and
``.blend(...)`` build the transform of that name over the stage. The transforms live in
modules that import this one, so this module does not import them: each registers its
class under its fluent name with :func:`fluent` when its module is imported, which the
package ``savable_loader.datasets`` does for all of them.

NOTE [ States checked at the door ]
A restore checks every worker's pipeline state against the stage tree in the main
process, before any worker starts (``check_state``, called by ``check_compatible`` in
``_resume/compat.py``), so that a malformed state is refused by the restore and not at the
first ``next()``, nor worse read as some other position. The tree is walked from the
root (the loader's ``Batch``) along the state: each of the library's stages builds a
cursor of itself alone over parents that take any state (``checking_cursor``, reading
from :class:`~savable_loader.datasets.protocol.cursor.AnyState`) and restores its part into it,
so the check is the very restore a worker makes (the structure, the stage's ``State``
model, what ``restore_own`` refuses), and nothing is read: no data, none of the user's
code. A user's dataset holds its own position (NOTE [ A dataset is its own position ] in
``datasets/adapt.py``), so its part is opaque and left to its own ``restore_state`` in the worker.
Where a library stage's position must be, a None is refused: such a stage never saves
None, and its cursor would read None as the start of epoch 0, so the worker would start
the epoch over while the loader counts the saved position. (A worker that never started
has no checkpoint at all, which is the legitimate start: ``WorkerState.checkpoint`` is
None then.) A file source's byte offset against its file's size needs the file: it is
checked where the file is opened at the restored offset, and in the restore itself when
the loader has no workers (``ShardedSource.checking_cursor``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar, final

from torch.utils.data import IterableDataset, get_worker_info

from ...config import WorkerContext
from ...errors import SavableLoaderError, StateError, StateFormatError
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
    #: in ``datasets/protocol/elastic.py``), and what to change; stages that can move override
    #: reshard().
    elastic_reason: ClassVar[str] = (
        "its state describes the worker that saved it and cannot be split or merged over "
        "other workers"
    )
    elastic_fix: ClassVar[str] = (
        "restore on the number of workers and ranks it was saved with, or pass "
        "approximate=True to restart the interrupted epoch on the new layout"
    )
    #: A source whose items have a key in the global stream, or a transform that hands on
    #: its parents' items' keys (NOTE [ The cursor contract ] in ``datasets/protocol/cursor.py``).
    keyed: ClassVar[bool] = False

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
        replay ] in ``_resume/compat.py``); None when this stage cannot tell.

        Raises:
            StateError: ``state`` is malformed.
        """
        return None

    def checking_cursor(self, context: WorkerContext) -> Cursor[T] | None:
        """A cursor of this stage alone, over parents that take any state, into which a
        saved state is restored to check it (NOTE [ States checked at the door ]); it
        reads no data and runs none of the user's code. None (the default): this stage's
        state is its dataset's own, which only the dataset can read."""
        return None

    @final
    def check_state(self, state: Any, context: WorkerContext, *, at: str = "state") -> None:
        """Refuses ``state`` where a cursor of this pipeline for ``context`` would refuse
        it or read it as another position (NOTE [ States checked at the door ]).

        Args:
            state: The pipeline state, as a cursor's ``state()`` gave it.
            context: The rank and worker whose state it is.
            at: Where ``state`` stands in the loader state, for messages.

        Raises:
            StateError: ``state`` is malformed; the message names the path, the saved
                value and the fix.
        """
        cursor = self.checking_cursor(context)
        if cursor is None:
            return
        if state is None:
            raise StateFormatError(
                f"invalid loader state: {at} is None where the position of {cursor.name} "
                "must be; that stage never saves None, and a restore would start its "
                "epoch over while the loader counts the saved position. Restore a state "
                "saved by the same pipeline"
            )
        try:
            cursor.restore(state)
        except StateError as error:
            raise type(error)(
                f"invalid loader state: {at}: {error} (saved: {_shown(state)})"
            ) from None
        if not cursor.parents:
            return
        if len(cursor.parents) == 1:
            parts = [(f"{at}.parent", state["parent"])]
        else:  # the restore checked that the state holds one entry per source
            parts = [(f"{at}.sources[{i}]", part) for i, part in enumerate(state["sources"])]
        for child, (path, part) in zip(self.children, parts, strict=True):
            child.check_state(part, context, at=path)

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

    def access(self, context: WorkerContext) -> Any:
        """This stage's items by position (an ``Access``, NOTE [ Pipelines read by
        position ] in ``datasets/global_view.py``) for ``context``'s process, or None (the
        default) when it reads only as a stream."""
        return None

    def reads_by_layout(self) -> bool:
        """Whether this stage, read stream by stream, gives other global batches on
        another layout (a window shuffle, a blend, a limit, a repeat of counted passes):
        the loader then reads the pipeline by position when every stage of it has an
        ``access`` (NOTE [ Pipelines read by position ] in ``datasets/global_view.py``)."""
        return any(child.reads_by_layout() for child in self.children)

    def needs_positions(self) -> str | None:
        """The description of a stage that reads only by position (a file source with
        ``split="global"``), or None: the loader refuses such a pipeline when another
        stage of it reads only as a stream."""
        for child in self.children:
            problem = child.needs_positions()
            if problem is not None:
                return problem
        return None

    def draws_nothing(self) -> bool:
        """Whether this stage's items are known to draw from no global generator
        (``random``, NumPy's, torch's), so that a reader by position skips them without
        reading them. False unless a stage says so: a user's function may draw."""
        return False

    def unkeyed(self) -> str | None:
        """The description of a stage whose items have no key in the global stream (NOTE
        [ The cursor contract ] in ``datasets/protocol/cursor.py``), or None when every item has
        one."""
        if not self.keyed:
            return self.describe()
        for child in self.children:
            problem = child.unkeyed()
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


def _shown(value: Any, limit: int = 160) -> str:
    """``value`` as a message shows a saved value: its repr, cut after ``limit``
    characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
