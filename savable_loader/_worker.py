"""The per-worker driver of a pipeline: events, checkpoint ring, replay, placeholders.

This module is past 250 lines because its parts share one invariant (the event
numbering of NOTE [ Sequence numbers ] in ``state/models.py``) and split badly.

NOTE [ Events ]
Torch's ``DataLoader`` runs underneath with ``batch_size=None`` over :class:`WorkerWrapper`,
which yields ``(worker_id, seq, kind, payload)`` tuples. ``kind`` is ITEM (a batch,
collated in the worker), END (this worker's epoch ended; it still takes a turn in
torch's round-robin, then the worker stops), PLACEHOLDER (one per worker before the
saved next worker, in the first epoch after a restore; see NOTE [ Worker order ] in
``loader.py``) or ERROR (the pipeline raised; see NOTE [ Pipeline errors ]). The loader
drops END and PLACEHOLDER and counts the rest.

NOTE [ Pipeline errors ]
An exception raised by the pipeline (the dataset, a stage, collate, a restore or replay
at start-up) does not escape the worker: it becomes one ERROR event carrying a
:class:`Failure` (worker id, the sequence number being produced, the formatted traceback,
the exception's type and plain arguments), and the worker's generator ends. The event
takes the failing item's turn in torch's round-robin, so when the loader sees it every
earlier item was handed on and its bookkeeping stands exactly before the failing item.
Letting the exception escape instead would leave torch to re-raise a copy that names no
item, and would end the worker's iteration early, which the loader cannot tell apart
from an end of epoch. The exception object itself never crosses processes (a user's
exception type need not pickle); only its type's name and plain arguments do, and the
runtime is marked failed so that no checkpoint is ever taken of the broken state.

NOTE [ Generators per epoch ]
A worker's global generators (``random``, ``numpy.random``, torch) are seeded from
``(seed, rank, worker id, epoch)`` for every epoch: at start-up for epoch 0, and right
after a worker ends an epoch for the next one, before the checkpoint that follows the
END, so a restore from that checkpoint starts the next epoch from the same seed. A
worker restored between epochs seeds its generators again as the epoch begins, which
changes nothing for its own states and gives states saved before this rule existed the
same next epoch as a run today. An epoch's draws
therefore depend only on the layout and the epoch, not on what earlier epochs drew, so
after a restore onto another layout (NOTE [ Elastic resume ] in ``datasets/elastic.py``)
the next epochs draw exactly what a fresh run on that layout draws. Epoch 0 keeps the
seed it always had.

NOTE [ Checkpoint policy ]
After producing an event, the worker may record a checkpoint (dataset state and its
three global generators) in a ring. It measures what a checkpoint costs and earns a
budget of ``checkpoint_share`` of its wall time between events (producing the event,
handing the previous one to torch, waiting for the task); it records one
whenever the budget covers the cost (measured in the thread's CPU time, so waits for the
GIL do not count). Expensive items are therefore all checkpointed
(a restore recomputes nothing) and cheap items are checkpointed every few
milliseconds (a restore recomputes a few milliseconds of work). A checkpoint is always
recorded at start-up and after an END. Retention is by sequence number: a worker
produces an event only for a task, and torch keeps at most ``prefetch_factor *
num_workers`` tasks in flight (the item in the user's hand is already counted as
delivered), so the consumer is at most that many events behind a worker. The ring keeps
every checkpoint within ``prefetch_factor * num_workers + 2`` events (a margin of two) of
the newest, plus the newest one before that window. Should a save ever ask for an older
position, the worker answers with an error, never with an approximate checkpoint. The
ring's lock is held only to append or pick an entry, never while the dataset produces an
item, so the command thread answers a save within an IPC round trip.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
from torch.utils.data import IterableDataset, default_collate, default_convert

from . import rng
from ._commands import CommandChannel, CommandServer
from .config import WorkerContext
from .datasets.base import SavableDataset
from .errors import StateError, WorkerError
from .state.models import Checkpoint, RngState

__all__ = [
    "END",
    "ERROR",
    "ITEM",
    "PLACEHOLDER",
    "Failure",
    "PipelineRuntime",
    "Progress",
    "RuntimeSpec",
    "WorkerStart",
]

logger = logging.getLogger(__name__)

ITEM, END, PLACEHOLDER, ERROR = 0, 1, 2, 3
_SEED_PURPOSE = 0x5EED
_MAX_BUDGET_CHECKPOINTS = 4
_COST_WINDOW = 9
_WORKER_SWITCH_INTERVAL = 0.001
_PLAIN_ARGS = (str, int, float, bool, bytes, type(None))

Event = tuple[int, int, int, Any]


@dataclass(frozen=True)
class WorkerStart:
    """How one worker starts: from which checkpoint, to which position.

    Attributes:
        checkpoint: Checkpoint to restore, or None for the dataset's initial state.
        delivered: Sequence number the consumer wants next (replay up to it).
        skip_epoch: The worker already ended the current epoch: produce nothing in it.
        placeholder: Yield one placeholder first (worker order after a restore).
        new_epoch: The worker starts at the beginning of an epoch (after a restore
            between epochs): seed its generators for it (NOTE [ Generators per epoch ]).
    """

    checkpoint: Checkpoint | None = None
    delivered: int = 0
    skip_epoch: bool = False
    placeholder: bool = False
    new_epoch: bool = False


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

    @classmethod
    def of(
        cls, error: Exception, worker_id: int, seq: int, *, starting: bool, in_main: bool
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
        )

    def exception(self) -> BaseException:
        """Returns the exception: itself in the main process, else a copy of its type.

        The copy is built from the type (looked up among modules already imported, never
        importing one) and the plain arguments; a RuntimeError naming the type stands in
        when that fails.
        """
        if self.error is not None:
            return self.error
        kind: Any = sys.modules.get(self.type_module)
        for part in self.type_name.split("."):
            kind = getattr(kind, part, None)
        if isinstance(kind, type) and issubclass(kind, Exception):
            try:
                return kind(*self.args)
            except Exception:  # a constructor with another signature
                logger.debug("cannot rebuild %s%r", self.type_name, self.args)
        return RuntimeError(f"{self.type_name}: {self.message}")


STARTING, PRODUCING, IDLE = "starting", "producing", "idle"


class Progress:
    """What a worker is doing, read by its command thread (NOTE [ Watchdog ] in
    ``loader.py``).

    The phase is STARTING (restoring a checkpoint and replaying, up to the first event),
    PRODUCING (item ``seq``) or IDLE (waiting for torch to ask for the next event). One
    tuple is swapped in as a whole, so the command thread never reads a torn value.
    """

    __slots__ = ("_now",)

    def __init__(self) -> None:
        self._now: tuple[str, int, float] = (IDLE, 0, time.monotonic())

    def enter(self, phase: str, seq: int) -> None:
        self._now = (phase, seq, time.monotonic())

    def report(self) -> dict[str, Any]:
        """Returns the phase, the sequence number and the seconds spent in the phase."""
        phase, seq, since = self._now
        return {"phase": phase, "seq": seq, "for": time.monotonic() - since}


@dataclass
class RuntimeSpec:
    """Everything a worker needs to run the pipeline; pickled into each worker."""

    dataset: SavableDataset[Any]
    batch_size: int | None
    drop_last: bool
    collate_fn: Callable[[Any], Any] | None
    seed: int
    rank: int
    world_size: int
    num_workers: int
    checkpoint_share: float
    max_lag: int
    starts: tuple[WorkerStart, ...] = ()
    #: The loader epoch the workers start in (NOTE [ Generators per epoch ]).
    epoch: int = 0
    channel: CommandChannel | None = field(default=None)


@dataclass(frozen=True)
class _Entry:
    """A ring entry: a checkpoint kept as in-process objects until a save asks for it."""

    seq: int
    exhausted: bool
    dataset_state: bytes
    rng: rng.RngSnapshot | RngState

    def to_checkpoint(self) -> Checkpoint:
        state = self.rng if isinstance(self.rng, RngState) else self.rng.to_state()
        return Checkpoint(
            seq=self.seq, exhausted=self.exhausted, dataset_state=self.dataset_state, rng=state
        )


def epoch_seed(seed: int, rank: int, worker_id: int, epoch: int) -> int:
    """The seed of a worker's global generators at the start of ``epoch``
    (NOTE [ Generators per epoch ])."""
    if epoch == 0:
        return rng.derive_seed(seed, rank, worker_id, _SEED_PURPOSE)
    return rng.derive_seed(seed, rank, worker_id, _SEED_PURPOSE, epoch)


def epoch_rng_state(
    seed: int, rank: int, worker_id: int, epoch: int, salt: int | None = None
) -> RngState:
    """The global generators' state :func:`epoch_seed` gives (with ``salt`` also in the
    key: the rest of an epoch resumed on another layout), without touching this
    process's generators."""
    outer = rng.capture()
    try:
        base = epoch_seed(seed, rank, worker_id, epoch)
        rng.seed_globals(base if salt is None else rng.derive_seed(base, salt))
        return rng.capture().to_state()
    finally:
        rng.apply(outer)


def encode_dataset_state(dataset: SavableDataset[Any]) -> bytes:
    """Encodes ``dataset.save_state()`` with msgpack; tuples come back as lists."""
    state = dataset.save_state()
    try:
        return msgpack.packb(state, use_bin_type=True)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError) as error:
        raise StateError(
            f"{type(dataset).__name__}.save_state() returned something that is not plain "
            f"data ({error}); return dict, list, str, int, float, bool, None or bytes "
            "(convert numpy scalars with int() or float())"
        ) from error


def decode_dataset_state(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class PipelineRuntime:
    """Drives one worker's copy of the pipeline (or the main process's, without workers).

    Args:
        spec: The loader's description of the pipeline and of every worker's start.
        worker_id: This worker's id (0 without workers).
        in_main: True without workers: the pipeline then runs under its own generator
            states, swapped in around each event (NOTE [ No workers ] in ``loader.py``).
    """

    def __init__(
        self,
        spec: RuntimeSpec,
        worker_id: int,
        *,
        in_main: bool,
        progress: Progress | None = None,
    ) -> None:
        self.spec = spec
        self.worker_id = worker_id
        self.in_main = in_main
        self.progress = progress or Progress()
        self.dataset = spec.dataset
        self._lock = threading.Lock()
        self._ring: collections.deque[_Entry] = collections.deque()
        self._costs: collections.deque[float] = collections.deque(maxlen=_COST_WINDOW)
        self._cost = 0.0
        self._budget = 0.0
        self._first_epoch = True
        self._exhausted = False
        #: The pipeline raised (NOTE [ Pipeline errors ]): its state is no checkpoint.
        self.failed = False
        self.checkpoints_taken = 0
        self.replayed = 0
        start = spec.starts[worker_id] if spec.starts else WorkerStart()
        self._start = start
        self.dataset.setup(
            WorkerContext(
                rank=spec.rank,
                world_size=spec.world_size,
                worker_id=worker_id,
                num_workers=spec.num_workers,
                seed=spec.seed,
                batch_size=spec.batch_size,
            )
        )
        self.seq = start.checkpoint.seq if start.checkpoint is not None else 0
        #: The loader epoch of the last epoch() call; the first call is spec.epoch.
        self._epoch = spec.epoch - 1
        outer = rng.capture() if in_main else None
        try:
            if start.checkpoint is None:
                self.dataset.restore_state(None)
                rng.seed_globals(epoch_seed(spec.seed, spec.rank, worker_id, 0))
            else:
                checkpoint = start.checkpoint
                self.dataset.restore_state(decode_dataset_state(checkpoint.dataset_state))
                rng.apply(rng.RngSnapshot.from_state(checkpoint.rng))
                self._exhausted = checkpoint.exhausted
                self._record(
                    _Entry(
                        checkpoint.seq,
                        checkpoint.exhausted,
                        checkpoint.dataset_state,
                        checkpoint.rng,
                    )
                )
            self.rng = rng.capture()
        finally:
            if outer is not None:
                rng.apply(outer)
        # The ring holds a checkpoint before the command server reports ready. The first
        # capture runs cold (first calls, caches), so a second one measures the cost.
        self._checkpoint_now()
        self._costs.clear()
        self._checkpoint_now()
        if start.delivered < self.seq:
            raise StateError(
                f"worker {worker_id}: delivered {start.delivered} is before its checkpoint "
                f"{self.seq}"
            )
        self._replay_target = start.delivered
        self._skip = getattr(self.dataset, "skip", None)

    # -- events ---------------------------------------------------------------------

    def epoch(self) -> Iterator[Event]:
        """Starts an epoch: returns the generator of this worker's events for it."""
        first, self._first_epoch = self._first_epoch, False
        self._epoch += 1
        replay = self._replay_target - self.seq if first else 0
        if first and self._start.skip_epoch:
            if replay:
                raise StateError(
                    f"worker {self.worker_id} ended its epoch but would replay {replay} events"
                )
            self.progress.enter(IDLE, self.seq)
            return iter(())
        if first and self._start.new_epoch:
            self._seed_epoch(self._epoch)
        skip = self._skip
        fast = (
            replay > 0
            and skip is not None
            and self.spec.collate_fn is None
            and _can_skip(self.dataset)
        )
        if fast and skip is not None:
            self._advance(replay, lambda: skip(replay * (self.spec.batch_size or 1)))
        if self._exhausted:
            source: Iterator[Any] = iter(())
        else:
            with self._generators():
                source = self._batches(iter(self.dataset))
        if replay > 0 and not fast:
            self._advance(replay, lambda: self._produce(source, replay))
        if replay > 0:
            self._checkpoint_now()
        return self._run(source, placeholder=first and self._start.placeholder)

    def _run(self, source: Iterator[Any], *, placeholder: bool) -> Iterator[Event]:
        progress = self.progress
        if placeholder:
            progress.enter(IDLE, self.seq)
            yield (self.worker_id, -1, PLACEHOLDER, None)
        mark = time.perf_counter()
        while True:
            progress.enter(PRODUCING, self.seq)
            try:
                with self._generators():
                    item = next(source, _END_OF_SOURCE)
            except Exception as error:
                self.failed = True
                progress.enter(IDLE, self.seq)
                yield self.failure(error, starting=False)
                return
            progress.enter(IDLE, self.seq + 1)
            now = time.perf_counter()
            # Worker time since the previous event: producing this one, plus torch
            # sending the previous one and waiting for this task.
            elapsed, mark = now - mark, now
            seq = self.seq
            self.seq += 1
            if item is _END_OF_SOURCE:
                self._exhausted = False
                self._seed_epoch(self._epoch + 1)
                self._checkpoint_now()
                yield (self.worker_id, seq, END, None)
                return
            if not self.in_main:
                self._maybe_checkpoint(elapsed)
            yield (self.worker_id, seq, ITEM, item)

    def _seed_epoch(self, epoch: int) -> None:
        """Seeds the pipeline's global generators for ``epoch`` (NOTE [ Generators per epoch ])."""
        outer = rng.capture() if self.in_main else None
        rng.seed_globals(epoch_seed(self.spec.seed, self.spec.rank, self.worker_id, epoch))
        if outer is not None:
            self.rng = rng.capture()
            rng.apply(outer)

    def failure(self, error: Exception, *, starting: bool) -> Event:
        """The ERROR event for ``error`` (NOTE [ Pipeline errors ])."""
        failure = Failure.of(
            error, self.worker_id, self.seq, starting=starting, in_main=self.in_main
        )
        return (self.worker_id, self.seq, ERROR, failure)

    def _batches(self, items: Iterator[Any]) -> Iterator[Any]:
        spec = self.spec
        if spec.batch_size is None:
            convert = spec.collate_fn or default_convert
            for item in items:
                yield convert(item)
            return
        collate = spec.collate_fn or default_collate
        while True:
            batch = []
            for item in items:
                batch.append(item)
                if len(batch) == spec.batch_size:
                    break
            else:
                # The source ended while filling this batch: remember it, since the
                # dataset's own state already points at the next epoch.
                self._exhausted = True
            if not batch or (spec.drop_last and len(batch) < spec.batch_size):
                return
            yield collate(batch)
            if self._exhausted:
                return

    def _advance(self, events: int, step: Callable[[], None]) -> None:
        """Replays ``events`` events with ``step`` under the pipeline's generators."""
        began = time.perf_counter()
        with self._generators():
            step()
        self.seq += events
        self.replayed += events
        logger.debug(
            "worker %d replayed %d events in %.1f ms",
            self.worker_id,
            events,
            (time.perf_counter() - began) * 1e3,
        )

    def _produce(self, source: Iterator[Any], events: int) -> None:
        for _ in range(events):
            if next(source, _END_OF_SOURCE) is _END_OF_SOURCE:
                raise StateError(
                    f"worker {self.worker_id}: the dataset ended during replay; the "
                    "pipeline does not reproduce the stream it saved"
                )

    # -- checkpoints ----------------------------------------------------------------

    def _generators(self) -> _GeneratorScope:
        return _GeneratorScope(self)

    def _capture(self) -> _Entry:
        return _Entry(
            self.seq,
            self._exhausted,
            encode_dataset_state(self.dataset),
            self.rng if self.in_main else rng.capture(),
        )

    def _checkpoint_now(self) -> None:
        # CPU time of this thread: wall time would count waits for the GIL held by
        # torch's queue feeder thread, which pickles the previous batch meanwhile.
        began = time.thread_time()
        self._record(self._capture())
        self._costs.append(time.thread_time() - began)
        costs = sorted(self._costs)
        self._cost = costs[len(costs) // 2]
        self.checkpoints_taken += 1

    def _maybe_checkpoint(self, elapsed: float) -> None:
        self._budget = min(
            self._budget + elapsed * self.spec.checkpoint_share,
            _MAX_BUDGET_CHECKPOINTS * self._cost,
        )
        if self._budget >= self._cost:
            self._checkpoint_now()
            self._budget -= self._cost

    def _record(self, entry: _Entry) -> None:
        with self._lock:
            if self._ring and self._ring[-1].seq == entry.seq:
                self._ring.pop()
            self._ring.append(entry)
            bound = entry.seq - self.spec.max_lag
            while len(self._ring) >= 2 and self._ring[1].seq <= bound:
                self._ring.popleft()

    def checkpoint_for(self, delivered: int) -> Checkpoint:
        """Returns the newest checkpoint at or before sequence number ``delivered``.

        Raises:
            WorkerError: ``delivered`` lies outside what the ring can answer.
        """
        if self.in_main and delivered == self.seq and not self.failed:
            self._checkpoint_now()
        with self._lock:
            entry = next((e for e in reversed(self._ring) if e.seq <= delivered), None)
            oldest = self._ring[0].seq if self._ring else None
        if entry is None or delivered > max(self.seq, self._replay_target):
            raise WorkerError(
                f"worker {self.worker_id} holds no checkpoint for position {delivered} "
                f"(oldest kept: {oldest}, produced: {self.seq})"
            )
        return entry.to_checkpoint()

    def stats(self) -> dict[str, Any]:
        """Figures for benchmarks and debugging."""
        with self._lock:
            ring = list(self._ring)
        return {
            "pid": os.getpid(),
            "seq": self.seq,
            "ring_entries": len(ring),
            "checkpoint_cost_s": self._cost,
            "checkpoints_taken": self.checkpoints_taken,
            "replayed": self.replayed,
            "checkpoint_bytes": (
                len(msgpack.packb(ring[-1].to_checkpoint().model_dump(), use_bin_type=True))
                if ring
                else 0
            ),
        }


_END_OF_SOURCE = object()


class _GeneratorScope:
    """Swaps the pipeline's generator states in around a step, when running in main."""

    __slots__ = ("_outer", "_runtime")

    def __init__(self, runtime: PipelineRuntime) -> None:
        self._runtime = runtime
        self._outer: rng.RngSnapshot | None = None

    def __enter__(self) -> None:
        if self._runtime.in_main:
            self._outer = rng.capture()
            rng.apply(self._runtime.rng)

    def __exit__(self, *exc: object) -> None:
        if self._outer is not None:
            self._runtime.rng = rng.capture()
            rng.apply(self._outer)


class WorkerWrapper(IterableDataset[Event]):
    """What torch's ``DataLoader`` iterates: starts a :class:`PipelineRuntime` per process.

    The loader sets :attr:`spec` before torch starts the workers, so every start method
    carries it (and the command queues) into the worker.
    """

    def __init__(self, spec: RuntimeSpec) -> None:
        self.spec = spec
        self.runtime: PipelineRuntime | None = None
        self.progress = Progress()

    def __iter__(self) -> Iterator[Event]:
        try:
            if self.runtime is None:
                self.progress.enter(STARTING, 0)
                self.runtime = self._start()
            else:
                # Beginning an epoch counts as producing its first event.
                self.progress.enter(PRODUCING, self.runtime.seq)
            return self.runtime.epoch()
        except Exception as error:
            # NOTE [ Pipeline errors ]: a start that failed is one ERROR event too.
            self.progress.enter(IDLE, 0)
            if self.runtime is not None:
                self.runtime.failed = True
                return iter((self.runtime.failure(error, starting=True),))
            return iter((self._start_failure(error),))

    def _start_failure(self, error: Exception) -> Event:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker_id = info.id if info is not None else 0
        starts = self.spec.starts
        seq = starts[worker_id].delivered if starts else 0
        failure = Failure.of(error, worker_id, seq, starting=True, in_main=info is None)
        return (worker_id, seq, ERROR, failure)

    def _start(self) -> PipelineRuntime:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is None:
            return PipelineRuntime(self.spec, 0, in_main=True)
        progress = self.progress = Progress()
        progress.enter(STARTING, 0)
        channel = self.spec.channel
        if channel is None:
            return PipelineRuntime(self.spec, info.id, in_main=False, progress=progress)
        # NOTE [ Command channel ] in _commands.py: a command thread waits for the GIL at
        # most this long while the worker runs Python code (default 5 ms).
        sys.setswitchinterval(min(sys.getswitchinterval(), _WORKER_SWITCH_INTERVAL))
        holder: list[PipelineRuntime] = []
        server = CommandServer(
            channel.commands[info.id],
            channel.results[info.id],
            {
                "checkpoint": lambda args: holder[0].checkpoint_for(args["delivered"]).model_dump(),
                "stats": lambda args: holder[0].stats(),
            },
            immediate={"progress": lambda args: progress.report()},
        )
        server.start()
        try:
            holder.append(PipelineRuntime(self.spec, info.id, in_main=False, progress=progress))
        except BaseException:
            server.fail(traceback.format_exc())
            raise
        server.ready()
        return holder[0]


def _can_skip(dataset: Any) -> bool:
    """Whether ``dataset.skip`` may replay now (stages say so through ``can_skip()``)."""
    can_skip = getattr(dataset, "can_skip", None)
    return not callable(can_skip) or bool(can_skip())
