"""Adapts objects that save their own position: Hugging Face datasets, torchdata nodes, yours.

NOTE [ Two resume modes ]
"state": the object's ``state_dict()`` is an exact position; the adapter saves it and
loads it back, and the worker's checkpoints cover the object's draws from the global
generators. "replay": the object's state is not exact (a Hugging Face dataset with a
shuffle buffer drops the buffer on resume), so the adapter saves a restore point (the
object's state at the epoch start) and the count of items read since, and a restore
reads them again: O(items since the epoch start). ``resume="auto"`` picks replay for a
Hugging Face dataset with a shuffle buffer (or whose pipeline it cannot inspect).

NOTE [ The object's own generators in replay mode ]
A replay must make the draws from the global generators that the first reading made,
although the worker drew in between (a collate function masking tokens, say). So in
replay mode the object reads under its own states of ``random``, ``numpy.random`` and
torch's generator, swapped in around each item (about 20 us) and seeded at each epoch
start from (loader seed, rank, worker, epoch). A replay reseeds them and reads again.

NOTE [ Epochs of the adapted objects ]
Each epoch opens on its first item: ``obj.set_epoch(epoch)`` when the object has it, then
``iter(obj)``. A Hugging Face dataset loads a state only into an iteration of that
state's epoch, so a new epoch starts afresh in its own shuffle order; it reports a
loaded position only once it iterates, so until then the adapter reports the position it
last loaded or reached. A torchdata node is rewound with ``reset()`` at the end of an
epoch and restored with ``reset(state)``; other objects must stand at their next epoch
after a full iteration: their next epoch begins with ``iter(obj)`` on the object as the
last pass left it, and a state saved there holds None for the object, for which a restore
loads nothing (a fresh object's ``iter()`` begins the pass a pass-worn one's begins,
while loading the state a pass ended in would make an object that goes on from a loaded
position go on from the end, and yield nothing). Hugging Face keeps its epoch in a
shared-memory tensor that ``set_epoch`` reads then adds to, which forked workers would
race on, so each worker uses its own deep copy (``datasets`` shares the immutable Arrow
tables between copies).

NOTE [ Objects that are their own iterator ]
An object whose ``__iter__`` returns itself (its class has ``__next__``) commonly resets
its position there: ``iter(obj)`` starts a new pass. Its position is then what
``state_dict()`` reports once it iterates, and a position loads into an iteration already
begun: the adapter calls ``iter(obj)`` first, then ``load_state_dict``, as torchdata's
``StatefulDataLoader`` does for such an object. Loading first would be undone by the
``iter()``, and the stream would restart from its first item. Nor does the adapter read
``state_dict()`` before the first ``iter()`` (such an object may only build its position
there): to save an epoch not begun it calls ``iter(obj)`` first, as torch's fetcher
calls it when an epoch's iteration is made, and saves the position that gives, so a
second loader over the same object, restored from a state saved before any item,
starts where the first one stood rather than wherever the object was left.
Other objects (a Hugging Face dataset, whose ``__iter__`` returns a generator) load a
state before ``iter()``, and their state at construction is where epoch 0 starts. When
``iter(obj)`` is an object of its own with ``state_dict()`` and ``load_state_dict()``
(the position lives there), the adapter saves its state beside the object's and loads it
into the next ``iter(obj)``, as ``StatefulDataLoader`` does too.

NOTE [ A position kept by the iterator ]
An ``IterableDataset`` may have no state itself and return from ``__iter__`` an iterator
that has ``state_dict()`` and ``load_state_dict()``; torchdata's ``StatefulDataLoader``
saves that iterator's state, and so does this adapter: the object's state is then None,
and each epoch's ``iter(obj)`` gets the saved iterator state loaded into it. Only
``iter()`` tells which kind a dataset is, and torch's ``DataLoader`` calls it in the
workers, never in the main process, where a dataset may shard itself differently (no
worker information) or edit its own attributes. So the loader asks once, where it is
built, of a shallow copy: an ``__iter__`` that rebinds attributes (``self.x = ...``)
leaves the dataset it was given as it was. A generator function, a class with
``__next__`` and an ``__iter__`` that raises there are not asked or count as no state
(the last raises again in the workers, where torch would raise it). A worker whose
``iter(obj)`` returns an iterator without state after all raises ``ConfigError``.

NOTE [ A torchdata Loader is refused ]
``torchdata.nodes.Loader`` wraps a root node for a training loop; it has ``state_dict()``
and ``load_state_dict()`` but is not a position this adapter can restore. Reading its
``state_dict()`` before its first ``iter()`` creates its iterator and marks it as made for
that read, and the next ``iter()`` then returns it as it is, ignoring a
``load_state_dict()`` in between: a restore restarted from item 0. That iterator, made in
the main process where no worker information exists, was also copied into every worker,
so with workers each one read the whole source (every item once per worker). The adapter
therefore refuses a ``Loader`` and names what to pass instead: its root node
(``loader.root``), a ``BaseNode`` it restores exactly with ``reset(state)``; the
``SavableDataLoader`` plays the ``Loader``'s part.

NOTE [ Finding a Hugging Face shuffle buffer ]
``datasets`` cannot say whether a dataset shuffles through a buffer, so the adapter walks
the private ``_ex_iterable`` chain for a ``BufferShuffledExamplesIterable``; without that
chain it replays, which is exact for any object. A test pins both outcomes.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable, Iterator
from typing import Any, Literal, TypeVar

from pydantic import Field
from torch.utils.data import get_worker_info

from ... import rng
from ...config import WorkerContext
from ...errors import ConfigError, StateError
from ..protocol.cursor import Cursor, StageState
from ..protocol.stage import Stage
from .stateful_values import decode, encode

__all__ = ["StatefulDataset", "from_stateful", "is_stateful", "iterator_is_stateful"]

T = TypeVar("T")
Resume = Literal["auto", "state", "replay"]


class _State(StageState):
    """The adapter's state (see the ``State:`` section of :class:`StatefulDataset`)."""

    resume: Literal["state", "replay"]
    epoch: int = Field(ge=0)
    obj: Any
    consumed: int = Field(ge=0)
    iterator: Any = Field(
        default=None,
        description="The state of iter(obj), when that is an object of its own with "
        "state_dict() (NOTE [ Objects that are their own iterator ]); None otherwise.",
    )


class StatefulDataset(Stage[T]):
    """A savable view of an iterable that saves its own position.

    Args:
        obj: A Hugging Face ``datasets.IterableDataset``, a torchdata node
            (``torchdata.nodes.BaseNode``: ``state_dict()`` and ``reset(state)``; not a
            ``torchdata.nodes.Loader``, whose root node is what to pass) or any
            iterable with ``state_dict()`` and ``load_state_dict()``, or whose
            ``__iter__`` returns an iterator that has them (NOTE [ A position kept by
            the iterator ]); the values of those states are written as plain data
            (NOTE [ Values of a Stateful object's state ] in
            ``datasets/adapters/stateful_values.py``). It shards itself
            over workers, as with torch's ``DataLoader``; its cursor reads this object
            itself (NOTE [ A dataset is its own position ] in ``datasets/adapt.py``).
        resume: "state", "replay" or "auto" (NOTE [ Two resume modes ]).

    Raises:
        ConfigError: ``obj`` cannot save and load its position, is a torchdata ``Loader``
            (NOTE [ A torchdata Loader is refused ]), or ``resume`` is unknown.

    State:
        ``{"resume", "epoch", "obj", "consumed"}``. In "state" mode ``obj`` is
        ``obj.state_dict()`` and ``consumed`` 0. In "replay" mode ``obj`` is the
        object's state at the start of the epoch and ``consumed`` the items read since,
        which a restore reads again under the epoch's seeded generators.
    """

    def __init__(self, obj: Any, *, resume: Resume = "auto") -> None:
        if _has_base(obj, "torchdata.nodes", "Loader"):
            raise ConfigError(
                f"{type(obj).__name__} is a torchdata.nodes.Loader, which cannot be resumed "
                "exactly: it ignores a load_state_dict() once its state_dict() was read "
                "before its first iter() (a restore would restart from item 0), and with "
                "workers every worker would read its whole source; pass its root node "
                "instead (Loader(root).root, a torchdata BaseNode), which resumes exactly: "
                "SavableDataLoader(loader.root, ...) (NOTE [ A torchdata Loader is refused ])"
            )
        self.obj: Any = obj
        self.node = _has_base(obj, "torchdata.nodes", "BaseNode")
        self.hf = _has_base(obj, "datasets.iterable_dataset", "IterableDataset")
        #: Whether the object saves a state of its own; if not, its iterator does
        #: (NOTE [ A position kept by the iterator ]).
        self.saves_obj = is_stateful(obj)
        if not isinstance(obj, Iterable) or not (self.saves_obj or iterator_is_stateful(obj)):
            raise ConfigError(
                f"{type(obj).__name__} is not an iterable with state_dict() and "
                "load_state_dict(), nor is what its __iter__ returns"
            )
        if resume not in ("auto", "state", "replay"):
            raise ConfigError(f"resume must be 'auto', 'state' or 'replay', got {resume!r}")
        if resume == "auto":
            resume = "replay" if self.hf and _hf_may_shuffle(obj) else "state"
        self.resume: Literal["state", "replay"] = resume
        #: ``iter(obj)`` is ``obj`` (NOTE [ Objects that are their own iterator ]).
        self.own_iterator = not self.node and callable(getattr(type(obj), "__next__", None))
        #: The object's state at construction: where epoch 0 starts (None for a node,
        #: which starts from reset(), and for its own iterator, from iter()).
        fresh = self.node or self.own_iterator or not self.saves_obj
        self.initial = None if fresh else copy.deepcopy(self.obj.state_dict())

    def config(self) -> dict[str, Any]:
        return {"type": "StatefulDataset", "of": type(self.obj).__qualname__, "resume": self.resume}

    def describe(self) -> str:
        return f"from_stateful({type(self.obj).__name__}, resume={self.resume!r})"

    def cursor(self, context: WorkerContext) -> Cursor[T]:
        return _StatefulCursor(self, context)


class _StatefulCursor(Cursor[T]):
    State = _State
    stage_name = "from_stateful"

    def __init__(self, stage: StatefulDataset[T], context: WorkerContext) -> None:
        super().__init__(context)
        self.stage = stage
        self.obj: Any = stage.obj
        if stage.hf and context.num_workers > 0:
            self.obj = copy.deepcopy(stage.obj)  # NOTE [ Epochs of the adapted objects ]
        self._keys = (context.seed, context.rank, context.worker_id)
        self._generators: rng.OwnGenerators | None = None
        self._iterator: Iterator[T] | None = None
        #: The state ``iter(obj)`` loads once made, when it is an object of its own.
        self._resting_iterator: Any = None
        #: Where epoch 0 starts: in a worker, the object as ``worker_init_fn`` left it
        #: (NOTE [ Fresh workers ] in ``_worker/runtime.py``), not as the main process had it.
        self._initial = stage.initial
        if stage.initial is not None and get_worker_info() is not None:
            self._initial = copy.deepcopy(self.obj.state_dict())
        self._restart(self._initial if self._kept_at_start() else None, epoch=0, load=False)

    def __next__(self) -> T:
        iterator = self._iterator or self._open()
        item = self._read(iterator)
        if item is not _END:
            self._consumed += 1
            return item  # type: ignore[no-any-return]
        self._restart(self._next_start(), epoch=self._epoch + 1, load=False)
        raise StopIteration

    def end_epoch(self) -> None:
        """Drops the rest of the epoch without reading it: the next one begins with a new
        ``iter(obj)``, from where the object stands, as torch's ``DataLoader`` begins a
        new iteration (NOTE [ A new iter() starts an epoch ] in ``_main/iterator.py``)."""
        if self._iterator is None and self.stage.resume == "state":
            # The epoch's iter(obj) began before it was cut, as torch's worker began it:
            # a state loaded for that iteration (a restore) is used up by it, not by the
            # next epoch's.
            self._open()
        self._restart(self._next_start(), epoch=self._epoch + 1, load=False)

    def _next_start(self) -> Any:
        """Where the next epoch starts, as saved (NOTE [ Epochs of the adapted objects ]):
        a node's state after ``reset()``, a Hugging Face dataset's state, and None for
        any other object."""
        if self.stage.node:
            self.obj.reset()
        return self.obj.state_dict() if self._kept_at_start() else None

    def _kept_at_start(self) -> bool:
        """Whether an epoch's start is saved as the object's state: a node's, a Hugging
        Face dataset's, a replay's restore point. Any other object's start is saved as
        None: ``iter(obj)`` on the object as it stands (NOTE [ Epochs of the adapted
        objects ])."""
        stage = self.stage
        kept = stage.node or stage.hf or stage.resume == "replay"
        return stage.saves_obj and not stage.own_iterator and kept

    def own_state(self) -> dict[str, Any]:
        stage, unopened = self.stage, self._iterator is None and self._pending is None
        if stage.own_iterator and stage.resume == "state" and unopened and self._resting is None:
            self._open()  # NOTE [ Objects that are their own iterator ]
        live = self.stage.resume == "state" and self._iterator is not None
        saves = self.stage.saves_obj
        state = {
            "resume": self.stage.resume,
            "epoch": self._epoch,
            "obj": encode(self.obj.state_dict() if live and saves else self._resting),
            "consumed": self._consumed if self.stage.resume == "replay" else 0,
        }
        iterator = self._iterator_state() if live else self._resting_iterator
        if iterator is not None:
            state["iterator"] = encode(iterator)
        return state

    def _iterator_state(self) -> Any:
        """The state of ``iter(obj)`` when it is a stateful object of its own, as
        torchdata's ``StatefulDataLoader`` saves it too (None otherwise)."""
        iterator = self._iterator
        if iterator is self.obj or not is_stateful(iterator):
            return None
        return iterator.state_dict()  # type: ignore[union-attr]

    def restore_own(self, state: Any | None) -> None:
        """Returns to ``state`` (None: the object's state at construction, epoch 0).

        Raises:
            StateError: ``state`` was saved in the other mode, or the object refuses it.
        """
        if not isinstance(state, _State):
            self._restart(self._initial, epoch=0)  # a reused object starts over
            if not self._kept_at_start():
                self._resting = None
            return
        if state.resume != self.stage.resume:
            raise StateError(
                f"from_stateful: the state was saved with resume={state.resume!r}, this "
                f"adapter resumes with {self.stage.resume!r}; build it with "
                f"resume={state.resume!r}"
            )
        if state.obj is not None and not self.stage.saves_obj:
            raise StateError(
                f"from_stateful: {type(self.obj).__name__} saves no state of its own (its "
                "iterator does), but the state holds one; restore a state of this pipeline"
            )
        self._restart(decode(state.obj), epoch=state.epoch)
        self._consumed = state.consumed
        self._resting_iterator = decode(state.iterator)

    def _restart(self, obj_state: Any, *, epoch: int, load: bool = True) -> None:
        """Stands at ``obj_state``, not opened; ``load`` gives the object a copy to edit."""
        self._resting = copy.deepcopy(obj_state)
        self._resting_iterator = None
        #: A state its own iterator loads once ``iter()`` began.
        #: NOTE [ Objects that are their own iterator ]
        self._pending = None
        if load and self.stage.own_iterator:
            self._pending = copy.deepcopy(obj_state)
        elif load and self.stage.saves_obj and obj_state is not None:
            self._load(obj_state)
        self._epoch, self._consumed = epoch, 0
        self._iterator = self._generators = None

    def _load(self, obj_state: Any, *, into: Any = None) -> None:
        """Loads ``obj_state`` into the object, or ``into`` its iterator."""
        target = self.obj if into is None else into
        try:
            if _has_base(target, "torchdata.nodes", "BaseNode"):
                target.reset(copy.deepcopy(obj_state))
            else:
                target.load_state_dict(copy.deepcopy(obj_state))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise StateError(
                f"from_stateful: {type(target).__name__} refused the saved state "
                f"({type(error).__name__}: {error}); restore a state of the same pipeline"
            ) from error

    def _open(self) -> Iterator[T]:
        """Starts the epoch's iteration; in replay mode, reads ``consumed`` items again."""
        set_epoch = getattr(self.obj, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self._epoch)
        if self.stage.resume == "replay":
            seed = rng.seed_for(rng.Purpose.STATEFUL_STREAM, *self._keys, self._epoch)
            self._generators = rng.OwnGenerators.seeded(seed)
        iterator: Iterator[T] = self._read(self.obj, first=True)
        if not self.stage.saves_obj and not is_stateful(iterator):
            raise ConfigError(
                f"iter({type(self.obj).__name__}) returned a {type(iterator).__name__}, which "
                "has no state_dict() and load_state_dict(), in a worker; it returned one "
                "where the loader was built, so the loader saves the position of its "
                "iterators (NOTE [ A position kept by the iterator ])"
            )
        if self._pending is not None:
            self._load(self._pending)
            self._pending = None
        if self._resting_iterator is not None:
            self._load(copy.deepcopy(self._resting_iterator), into=iterator)
            self._resting_iterator = None
        self._iterator = iterator
        for read in range(self._consumed):
            if self._read(iterator) is _END:
                raise StateError(
                    f"from_stateful: {type(self.obj).__name__} ended after {read} of the "
                    f"{self._consumed} items to replay; it does not reproduce its stream"
                )
        return iterator

    def _read(self, source: Any, *, first: bool = False) -> Any:
        """``iter(source)`` if ``first`` else the next item or _END, under the object's
        own generators in replay mode (NOTE [ The object's own generators in replay
        mode ])."""
        generators = self._generators
        if generators is None:
            return iter(source) if first else next(source, _END)
        with generators:
            return iter(source) if first else next(source, _END)


_END: Any = object()


def is_stateful(obj: Any) -> bool:
    """Whether :func:`from_stateful` adapts ``obj``: ``state_dict()`` and either
    ``load_state_dict()`` or, for a torchdata node, ``reset(state)``."""
    return callable(getattr(obj, "state_dict", None)) and (
        callable(getattr(obj, "load_state_dict", None))
        or _has_base(obj, "torchdata.nodes", "BaseNode")
    )


def iterator_is_stateful(obj: Any) -> bool:
    """Whether ``iter(obj)`` is an object of its own that saves its position, asked of a
    shallow copy of ``obj`` (NOTE [ A position kept by the iterator ])."""
    kind = type(obj)
    if callable(getattr(kind, "__next__", None)):
        return False
    if inspect.isgeneratorfunction(getattr(kind, "__iter__", None)):
        return False
    try:
        iterator = iter(copy.copy(obj))
    except Exception:  # the workers will raise it, as torch's would
        return False
    return is_stateful(iterator)


def _has_base(obj: Any, module: str, name: str) -> bool:
    return any(c.__module__.startswith(module) and c.__name__ == name for c in type(obj).__mro__)


def _hf_may_shuffle(obj: Any) -> bool:
    """Whether a Hugging Face dataset shuffles through a buffer (NOTE [ Finding a Hugging
    Face shuffle buffer ])."""
    root = getattr(obj, "_ex_iterable", None)
    stack = [root]
    while root is not None and stack:
        node = stack.pop()
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return True
        inner = [getattr(node, "ex_iterable", None), *(getattr(node, "ex_iterables", None) or [])]
        stack += [child for child in inner if child is not None]
    return root is None


def from_stateful(obj: Any, *, resume: Resume = "auto") -> StatefulDataset[Any]:
    """Wraps ``obj`` as a savable stage that resumes exactly.

    Args:
        obj: A Hugging Face ``IterableDataset``, a torchdata node, or any iterable with
            ``state_dict()`` and ``load_state_dict()``.
        resume: "state" (the object's state is exact), "replay" (restore point plus
            items to read again; exact for any object) or "auto" (replay for a Hugging
            Face dataset with a shuffle buffer, state otherwise).

    Returns:
        The adapter, a :class:`StatefulDataset` stage.

    Raises:
        ConfigError: ``obj`` cannot save and load its position, is a torchdata ``Loader``
            (pass its root node, ``loader.root``), or ``resume`` is unknown.
    """
    return StatefulDataset(obj, resume=resume)
