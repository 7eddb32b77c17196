"""The cursor: where one reading of a pipeline stands, and the contract every cursor keeps.

NOTE [ Stages and cursors ]
A stage (:class:`~savable_loader.datasets.Stage`) is a recipe: fixed at construction,
picklable, described by ``config()`` and ``str()``, holding no position. Reading it goes
through a :class:`Cursor`, built with ``stage.cursor(context)`` for one rank and worker,
which holds the position. A pipeline is a tree of stages, and reading it a tree of
cursors: a transform's cursor reads its parents' cursors. Everything the loader is given
(your ``SavableDataset``, a Stateful object, a map-style dataset, a building block) becomes
such a tree through one entry point (``as_stage`` in ``datasets/adapt.py``), and batching is its
root (``Batch`` in ``datasets/transforms/batch.py``).

NOTE [ The cursor contract ]
The base class owns the public methods; a subclass fills in hooks.

- ``next(cursor)`` (hook ``__next__``) returns the next item, or raises StopIteration at
  the end of an epoch, after which the cursor stands at the start of the next epoch.
- ``state()`` returns the position as plain data: a source's own state (hook
  ``own_state``); a transform's ``{"parent": <its parent's state>, **what it adds}``, or
  ``{"sources": [<each parent's state>], **what it adds}`` with several parents.
  ``restore(state)`` takes that apart, checks what the stage adds against its pydantic
  model ``State`` (a malformed state fails at the door, naming the stage and the field),
  restores the parents and hands the stage its part (hook ``restore_own``); None is the
  start of epoch 0 everywhere. Restoring a state and taking it again gives it back.
- ``skip(n)`` passes up to ``n`` items exactly as reading them would (same position,
  same draws from the global generators) and returns how many it passed. Fewer than
  ``n`` means the epoch ended: the cursor then stands at the start of the next epoch,
  as after the StopIteration of ``next()``. A cursor that can pass items without
  producing them does so in the hook ``skip_fast``; otherwise the base class reads them.
  So a stage that counts its parent's items (a limit, a repeat, a batch) skips through
  its parent and always knows how far it went.
- ``take(n)`` reads up to ``n`` items at once, as ``next()`` would one by one (fewer:
  the epoch ended, and the cursor stands at the next one); batching reads through it, and
  a cursor that can read a run of items faster (a dataset's own iterator, an index
  array) overrides it.
- ``take_batch(n)`` and ``skip_batches(batches, size)`` are what the loader's batching
  reads and skips through: ``take`` and ``skip`` unless the stage reads a whole batch
  at once (NOTE [ A batch read at once ] in ``datasets/index/indexed.py``).
- ``goes_on_after_error()`` says whether, when ``next()`` raised, the cursor already
  stands past the failed item, so that reading can go on with the next one as torch's
  ``DataLoader`` does (NOTE [ Going on after an error ] in ``_worker/runtime.py``). False by
  default: a raise leaves the position where it was, and the loader retries the item.
- ``end_epoch()`` drops the rest of the epoch and stands at the start of the next one;
  the default reads the rest, sources and most transforms do it without reading.
- ``close()`` releases what the cursor and its parents hold open (files), through the
  hook ``close_own``, which may run any number of times. The position is kept: reading
  again reopens what it needs.
- ``item_key()`` names the item ``next()`` last returned by its place in the global
  stream, a tuple of ints that depends on neither the rank nor the worker that read it
  (NOTE [ Keys of the global stream ] in ``rng/keys.py``): a source's epoch and the
  item's position in that epoch's canonical order. None when the stage cannot say (your
  own iterable dataset, a Stateful object). A transform that hands on its parent's items
  one for one (``passes_keys``) hands on their keys.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Iterator
from typing import Any, ClassVar, TypeVar, final

from pydantic import BaseModel, ConfigDict, ValidationError

from ...config import WorkerContext
from ...errors import SavableLoaderError, StateError

__all__ = ["AnyState", "Cursor", "StageState", "TransformCursor", "validate_state"]

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


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
    """Where one reading of a stage stands (NOTE [ The cursor contract ]).

    Args:
        context: The rank and worker this cursor reads for.
        parents: The cursors this one reads from (none for a source).
    """

    #: The model of what this stage adds to its parents' states (for a source: of its
    #: whole state); None: a transform adds nothing, a source's state is not checked.
    State: ClassVar[type[StageState] | None] = None
    #: The stage's name in error messages (default: the class name without "Cursor").
    stage_name: ClassVar[str] = ""
    #: A transform whose items are its parent's, one for one: its items' keys are the
    #: parent's (:meth:`item_key`).
    passes_keys: ClassVar[bool] = False

    def __init__(self, context: WorkerContext, *parents: Cursor[Any]) -> None:
        self.context = context
        self.parents: tuple[Cursor[Any], ...] = parents

    @property
    def name(self) -> str:
        """The stage's name in messages."""
        return self.stage_name or type(self).__name__.lstrip("_").removesuffix("Cursor")

    @property
    def parent(self) -> Cursor[Any]:
        """The one parent of a transform's cursor."""
        if len(self.parents) != 1:
            raise SavableLoaderError(
                f"{self.name} has {len(self.parents)} parents; it has no single 'parent'"
            )
        return self.parents[0]

    def __iter__(self) -> Cursor[T]:
        return self

    # -- hooks --------------------------------------------------------------------------

    @abc.abstractmethod
    def __next__(self) -> T:
        """Returns the next item; at the end of an epoch raises StopIteration and moves
        to the start of the next one."""

    def own_state(self) -> Any:
        """What this stage adds to its parents' states (a source: its whole state), as
        plain data; a transform returns a dict (empty when it adds nothing)."""
        return {}

    def restore_own(self, state: Any | None) -> None:
        """Takes back what :meth:`own_state` gave, validated as ``State`` when the stage
        declares one; None: the start of epoch 0. The parents are restored already."""

    def parent_states(self) -> list[Any]:
        """The parents' states to save with this one; by default where they stand now
        (a window shuffle saves where its window began instead)."""
        return [parent.state() for parent in self.parents]

    def skip_fast(self, n: int) -> int | None:
        """Passes up to ``n`` items without producing them, as :meth:`skip` says; returns
        how many, or None to have the base class read them."""
        return None

    def goes_on_after_error(self) -> bool:
        """Whether a raise of ``next()`` leaves the cursor past the failed item, its state
        a position to go on from (NOTE [ The cursor contract ])."""
        return False

    def take(self, n: int) -> list[T]:
        """Reads up to ``n`` items as ``next()`` would; fewer means the epoch ended."""
        return list(itertools.islice(self, n))

    def take_batch(self, n: int) -> list[T]:
        """Reads up to ``n`` items as one batch of the loader's; :meth:`take` unless the
        stage reads a batch at once (NOTE [ A batch read at once ] in
        ``datasets/index/indexed.py``)."""
        return self.take(n)

    def skip_batches(self, batches: int, size: int) -> int:
        """Passes up to ``batches`` batches of ``size`` items as :meth:`take_batch` reads
        them, as :meth:`skip` passes items; returns the items passed."""
        return self.skip(batches * size)

    def end_epoch(self) -> None:
        """Drops the rest of the epoch; the cursor then stands at the next one's start.

        The default reads the rest; sources and most transforms override it.
        """
        for _ in self:
            pass

    def close_own(self) -> None:
        """Releases what this cursor holds open; may run any number of times."""

    def item_key(self) -> tuple[int, ...] | None:
        """The key of the item ``next()`` last returned in the global stream (NOTE [ The
        cursor contract ]); None: the stage cannot say, or no item was returned."""
        if self.passes_keys:
            return self.parent.item_key()
        return None

    # -- the contract -------------------------------------------------------------------

    @final
    def state(self) -> Any:
        """Returns the position as plain data (NOTE [ The cursor contract ])."""
        own = self.own_state()
        if not self.parents:
            return own
        if not isinstance(own, dict) or "parent" in own or "sources" in own:
            raise SavableLoaderError(
                f"{self.name}.own_state() must return a dict without the keys 'parent' and "
                f"'sources', got {type(own).__name__}"
            )
        states = self.parent_states()
        if len(self.parents) == 1:
            return {"parent": states[0], **own}
        return {"sources": states, **own}

    @final
    def restore(self, state: Any | None) -> None:
        """Returns to ``state`` (as :meth:`state` gave it), or to the start if None.

        Raises:
            StateError: ``state`` is malformed.
        """
        if state is None:
            for parent in self.parents:
                parent.restore(None)
            self.restore_own(None)
            return
        if not self.parents:
            model = self.State
            self.restore_own(state if model is None else validate_state(model, state, self.name))
            return
        key = "parent" if len(self.parents) == 1 else "sources"
        if not isinstance(state, dict) or key not in state:
            raise StateError(
                f"{self.name}: malformed state (expected a dict with a {key!r} entry, got "
                f"{type(state).__name__}); restore a state saved by the same pipeline"
            )
        own = {name: value for name, value in state.items() if name != key}
        parents = [state[key]] if key == "parent" else state[key]
        if not isinstance(parents, list) or len(parents) != len(self.parents):
            count = len(parents) if isinstance(parents, list) else type(parents).__name__
            raise StateError(
                f"{self.name}: the state's {key} has {count} entries but this {self.name} has "
                f"{len(self.parents)} sources; restore a state saved by the same pipeline"
            )
        validated: Any = None
        if self.State is not None:
            validated = validate_state(self.State, own, self.name)
        elif own:
            raise StateError(
                f"{self.name}: malformed state (unexpected fields {sorted(own)}); restore a "
                "state saved by the same pipeline"
            )
        for parent, parent_state in zip(self.parents, parents, strict=True):
            parent.restore(parent_state)
        self.restore_own(validated)

    @final
    def skip(self, n: int) -> int:
        """Passes up to ``n`` items as reading them would; returns how many it passed.

        Fewer than ``n`` means the epoch ended and the cursor stands at the start of the
        next one (NOTE [ The cursor contract ]).

        Raises:
            ValueError: ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"cannot skip {n} items")
        if n == 0:
            return 0
        passed = self.skip_fast(n)
        if passed is None:
            passed = 0
            while passed < n:
                try:
                    next(self)
                except StopIteration:
                    break
                passed += 1
        elif not 0 <= passed <= n:
            raise SavableLoaderError(
                f"{self.name}.skip_fast({n}) returned {passed}, outside 0..{n}; please report"
            )
        return passed

    @final
    def close(self) -> None:
        """Releases what this cursor and its parents hold open; the position is kept."""
        try:
            self.close_own()
        finally:
            for parent in self.parents:
                parent.close()


class TransformCursor(Cursor[T]):
    """A cursor over one parent cursor; its state is ``{"parent": ..., **own}``.

    Subclasses set ``State`` to the model of what they add (None: nothing) and implement
    :meth:`own_state` and :meth:`restore_own` accordingly.

    Args:
        parent: The parent's cursor.
        context: The rank and worker this cursor reads for.
    """

    def __init__(self, parent: Cursor[Any], context: WorkerContext) -> None:
        super().__init__(context, parent)


class AnyState(Cursor[Any]):
    """A parent that takes any state and is never read: what a stage's checking cursor
    reads from, so that restoring it checks that stage's own part of a state alone (NOTE
    [ States checked at the door ] in ``datasets/protocol/stage.py``).

    Args:
        context: The rank and worker the checking cursor reads for.
    """

    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        self.held: Any = None

    def __next__(self) -> Any:
        raise SavableLoaderError("a cursor that checks a state was read; please report")

    def own_state(self) -> Any:
        return self.held

    def restore_own(self, state: Any | None) -> None:
        self.held = state
