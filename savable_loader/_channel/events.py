"""What a worker sends the loader: events, failures, and what it is doing now.

NOTE [ Events ]
Torch's ``DataLoader`` runs underneath with ``batch_size=None`` over the worker wrapper
(``_worker/wrapper.py``), which yields ``(worker_id, seq, kind, payload)`` tuples. ``kind`` is
ITEM (a batch, collated in the worker), END (this worker's epoch ended; it still takes a
turn in torch's round-robin, then the worker stops), PLACEHOLDER (one per worker before
the saved next worker, in the first epoch after a restore; see NOTE [ Worker order ] in
``_main/book.py``) or ERROR (the pipeline raised; see NOTE [ Pipeline errors ]). The loader
drops END and PLACEHOLDER and counts the rest.

NOTE [ Pipeline errors ]
An exception raised by the pipeline (the dataset, a stage, collate, a restore or replay
at start-up) does not escape the worker: it becomes one ERROR event carrying a
:class:`Failure` (worker id, the sequence number being produced, the formatted traceback,
the exception's type and plain arguments), and the worker's iteration ends. The event
takes the failing item's turn in torch's round-robin, so when the loader sees it every
earlier item was handed on and its bookkeeping stands exactly before the failing item.
Letting the exception escape instead would leave torch to re-raise a copy that names no
item, and would end the worker's iteration early, which the loader cannot tell apart
from an end of epoch. The exception object itself never crosses processes (a user's
exception type need not pickle); only its type's name and plain arguments do, and the
runtime is marked failed so that no checkpoint is ever taken of the broken state. A
map-style read is the exception: its cursor already stands past the failed batch, so the
worker goes on, and its ERROR event is counted like an item
(NOTE [ Going on after an error ] in ``_worker/runtime.py``).

NOTE [ Checkpoint faults ]
A checkpoint runs the pipeline's ``save_state()`` (every stage's ``state()``) in the
worker's main thread, after an item or after the end of an epoch, before that event is
sent. When it raises, the worker sends an ERROR event in the event's place (NOTE
[ Pipeline errors ]) whose :class:`Failure` names the item (or the end) the checkpoint
followed: the loader stands just before that event, and a retry recomputes it from an
earlier checkpoint. While it runs, the worker reports the CHECKPOINTING phase, which the
watchdog bounds by ``command_timeout`` (NOTE [ Watchdog ] in ``_main/stream.py``): a
checkpoint is the library's work, not an item's, so ``item_timeout=None`` does not lift
the bound. Checkpoints taken at start-up are part of the STARTING phase, bounded alike.

NOTE [ worker_init_fn errors ]
Torch calls ``worker_init_fn`` before it first iterates the wrapper, and when it raises,
torch starts no iteration in that worker: no command thread, so the loader's watchdog
would wait ``command_timeout`` for an answer. The loader's own ``worker_init_fn``
(``WorkerInit`` in ``_worker/wrapper.py``) therefore catches the user's exception and keeps it
as a :class:`Failure` with ``in_init`` set; the wrapper then starts its command thread
as usual (answering a save with the worker's start checkpoint: it produced nothing) and
yields the failure as its first event. The loader raises it as torch does: an exception
of the original type whose message is "Caught <Type> in DataLoader worker process <id>."
followed by the worker's traceback, and keeps its position (NOTE [ Errors stop the
stream ] in ``_main/iterator.py``), so the next next() starts the workers, and their
``worker_init_fn``, anew.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import DatasetError, SavableLoaderError

__all__ = [
    "CHECKPOINTING",
    "END",
    "ERROR",
    "FAILED_INIT",
    "IDLE",
    "ITEM",
    "PLACEHOLDER",
    "PRODUCING",
    "STARTING",
    "Event",
    "Failure",
    "Progress",
]

logger = logging.getLogger(__name__)

ITEM, END, PLACEHOLDER, ERROR = 0, 1, 2, 3
STARTING, PRODUCING, CHECKPOINTING, IDLE = "starting", "producing", "checkpointing", "idle"
_PLAIN_ARGS = (str, int, float, bool, bytes, type(None))

Event = tuple[int, int, int, Any]


#: The key of a worker's answer to a checkpoint request when its ``worker_init_fn``
#: raised and it could not make the cut it was started for (``_worker/wrapper.py``).
FAILED_INIT = "failed_init"


@dataclass(frozen=True)
class Failure:
    """An exception the pipeline raised, in a form that crosses processes.

    Attributes:
        worker_id: The worker that raised (0 without workers).
        seq: Sequence number of the event the worker was producing (starting: the one it
            was to produce first).
        starting: Raised while the worker started (restoring its checkpoint, replaying, or
            beginning an epoch) rather than while producing event ``seq``.
        type_module: Module of the exception's type.
        type_name: Qualified name of the exception's type.
        args: The exception's arguments when all are plain scalars, else its ``str``.
        message: ``str()`` of the exception.
        text: The formatted traceback, causes included.
        error: The exception itself when it was raised in this process; None in a worker.
        in_init: Raised by the user's ``worker_init_fn`` (NOTE [ worker_init_fn errors ]).
        checkpoint: Raised while the worker took the checkpoint that follows event ``seq``
            (the pipeline's ``save_state()``): "item" after an item, "end" after the end
            of its epoch; None otherwise.
        goes_on: The event is counted like an item and the stream goes on after it
            (NOTE [ Going on after an error ] in ``_worker/runtime.py``).
    """

    worker_id: int
    seq: int
    starting: bool
    type_module: str
    type_name: str
    args: tuple[Any, ...]
    message: str
    text: str
    error: BaseException | None = None
    in_init: bool = False
    checkpoint: Literal["item", "end"] | None = None
    goes_on: bool = False

    @classmethod
    def of(
        cls,
        error: Exception,
        worker_id: int,
        seq: int,
        *,
        starting: bool,
        in_main: bool,
        in_init: bool = False,
        checkpoint: Literal["item", "end"] | None = None,
        goes_on: bool = False,
    ) -> Failure:
        kind = type(error)
        args = error.args if all(isinstance(a, _PLAIN_ARGS) for a in error.args) else (str(error),)
        return cls(
            worker_id=worker_id,
            seq=seq,
            starting=starting,
            type_module=kind.__module__,
            type_name=kind.__qualname__,
            args=tuple(args),
            message=str(error),
            text="".join(traceback.format_exception(error)),
            error=error if in_main else None,
            in_init=in_init,
            checkpoint=checkpoint,
            goes_on=goes_on,
        )

    def event(self) -> Event:
        """The ERROR event carrying this failure."""
        return (self.worker_id, self.seq, ERROR, self)

    def raised(self, *, in_worker: bool, epoch: int, lost: str | None) -> BaseException:
        """The error the loader raises for this failure (NOTE [ Errors stop the stream ] in
        ``_main/iterator.py``): a :class:`~savable_loader.DatasetError` naming the worker and the
        item, chained from the original, or the library's own error type.

        Args:
            in_worker: The pipeline ran in a worker process (not the main process).
            epoch: The loader's epoch.
            lost: Why the loader lost its position, or None when it kept it.
        """
        if self.in_init:
            return self._as_torch_raises(lost)
        original = self.exception()
        where = f"worker {self.worker_id}" if in_worker else "the main process"
        doing = f"producing item {self.seq}"
        if self.starting:
            doing = f"starting (restoring its checkpoint and replaying up to item {self.seq})"
        elif self.checkpoint is not None:
            after = f"item {self.seq}"
            if self.checkpoint == "end":
                after = f"event {self.seq}, the end of its epoch"
            doing = f"taking a checkpoint (the pipeline's save_state()) after {after}"
        then = (
            f"The loader cannot continue: {lost}."
            if lost is not None
            else "The loader stays just before that item: the same iterator's next() retries it, "
            "save_state_rank() saves this position and restore_state_rank() moves to a "
            "saved one."
        )
        if self.goes_on:
            then = (
                "The batch is dropped and the loader goes on with the next one, as torch's "
                "DataLoader does."
            )
        message = (
            f"{self.type_name}: {self.message} (raised in {where} while {doing}, epoch "
            f"{epoch}). {then}"
        )
        if self.error is None:
            message += f"\n\nTraceback in {where}:\n{self.text}"
        error: BaseException = DatasetError(message, worker_id=self.worker_id, index=self.seq)
        if self.goes_on and not isinstance(original, SavableLoaderError):
            error = as_original_type(original, message, self.worker_id, self.seq)
        if isinstance(original, SavableLoaderError):
            with contextlib.suppress(TypeError):  # a subclass with another constructor
                error = type(original)(message)
        error.__cause__ = original  # as ``raise error from original`` sets it
        error.__suppress_context__ = True
        return error

    def _as_torch_raises(self, lost: str | None) -> BaseException:
        """The original type with torch's message (NOTE [ worker_init_fn errors ])."""
        message = (
            f"Caught {self.type_name.rpartition('.')[2]} in DataLoader worker process "
            f"{self.worker_id}.\nOriginal {self.text}"
        )
        if lost is not None:
            message += f"\nThe loader cannot continue: {lost}."
        kind = self._type()
        if kind is not None and issubclass(kind, KeyError):
            # KeyError's str() is the repr of its argument; keep the lines readable.
            message = _KeyErrorMessage(message)
        if kind is not None:
            try:
                return kind(message)
            except Exception:  # a constructor with another signature
                logger.debug("cannot build %s(message)", self.type_name)
        return RuntimeError(message)

    def _type(self) -> type[Exception] | None:
        """The exception's type among modules already imported (never importing one)."""
        kind: Any = sys.modules.get(self.type_module)
        for part in self.type_name.split("."):
            kind = getattr(kind, part, None)
        return kind if isinstance(kind, type) and issubclass(kind, Exception) else None

    def exception(self) -> BaseException:
        """Returns the exception: itself in the main process, else a copy of its type.

        The copy is built from the type (looked up among modules already imported, never
        importing one) and the plain arguments; a RuntimeError naming the type stands in
        when that fails.
        """
        if self.error is not None:
            return self.error
        kind = self._type()
        if kind is not None:
            try:
                return kind(*self.args)
            except Exception:  # a constructor with another signature
                logger.debug("cannot rebuild %s%r", self.type_name, self.args)
        return RuntimeError(f"{self.type_name}: {self.message}")


def as_original_type(
    original: BaseException, message: str, worker_id: int, index: int
) -> BaseException:
    """A :class:`~savable_loader.DatasetError` that is also of ``original``'s type, as
    torch re-raises a worker's exception with its own type
    (NOTE [ Going on after an error ] in ``_worker/runtime.py``); a plain ``DatasetError`` when
    no such class can be built (a layout conflict, a constructor that refuses one
    message) or for ``StopIteration``, which would end the training loop's ``for``
    without a word."""
    kind = type(original)
    if issubclass(kind, StopIteration | StopAsyncIteration):
        return DatasetError(message, worker_id=worker_id, index=index)
    try:
        both = _both(kind)
        error = both(_KeyErrorMessage(message) if issubclass(kind, KeyError) else message)
    except Exception:  # any type torch could re-raise: ours stands in
        logger.debug("cannot build a DatasetError of type %s", kind.__qualname__)
        return DatasetError(message, worker_id=worker_id, index=index)
    error.worker_id, error.index = worker_id, index
    return error


def _both(kind: type[BaseException]) -> type[DatasetError]:
    """The class that is ``DatasetError`` and ``kind``, named as ``kind`` (one per type)."""
    both = _BOTH.get(kind)
    if both is not None:
        return both
    both = _BOTH[kind] = type(
        kind.__name__,
        (DatasetError, kind),
        {
            "__module__": kind.__module__,
            "__qualname__": kind.__qualname__,
            "__init__": _init_both,
            "__reduce__": _reduce_both,
            "__str__": _str_both,
            "original_type": kind,
        },
    )
    return both


_BOTH: dict[type[BaseException], type[DatasetError]] = {}


def _init_both(self: DatasetError, message: str) -> None:
    BaseException.__init__(self, message)
    self.worker_id = self.index = None


def _str_both(self: DatasetError) -> str:
    return str(self.args[0]) if self.args else ""


def _reduce_both(self: DatasetError) -> tuple[Any, ...]:
    kind = getattr(type(self), "original_type")  # noqa: B009 - set by _both
    return _rebuild_both, (kind, str(self), self.worker_id, self.index)


def _rebuild_both(
    kind: type[BaseException], message: str, worker_id: int | None, index: int | None
) -> BaseException:
    error = _both(kind)(message)
    error.worker_id, error.index = worker_id, index
    return error


class _KeyErrorMessage(str):
    """A message whose repr is itself, so that ``str(KeyError(message))`` shows it as is."""

    def __repr__(self) -> str:
        return str(self)


class Progress:
    """What a worker is doing, read by its command thread (NOTE [ Watchdog ] in
    ``_main/stream.py``).

    The phase is STARTING (restoring a checkpoint and replaying, up to the first event),
    PRODUCING (item ``seq``), CHECKPOINTING (taking the checkpoint that follows event
    ``seq``: NOTE [ Checkpoint faults ]) or IDLE (waiting for torch to ask for the next
    event). One
    tuple is swapped in as a whole, so the command thread never reads a torn value.
    """

    __slots__ = ("_now",)

    def __init__(self) -> None:
        self._now: tuple[str, int, float, bool] = (IDLE, 0, time.monotonic(), False)

    def enter(self, phase: str, seq: int, *, end: bool = False) -> None:
        """Enters ``phase`` at event ``seq``; ``end``: that event ends the epoch."""
        self._now = (phase, seq, time.monotonic(), end)

    def report(self) -> dict[str, Any]:
        """Returns the phase, the sequence number, the seconds spent in the phase and
        whether the event ends the epoch."""
        phase, seq, since, end = self._now
        return {"phase": phase, "seq": seq, "for": time.monotonic() - since, "end": end}
