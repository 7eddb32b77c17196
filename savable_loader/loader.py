"""``SavableDataLoader``: torch's ``DataLoader`` whose position can be saved and restored.

This module is past 250 lines: it is the one place where the loader's bookkeeping, its
worker lifecycle and its save/restore meet, and splitting them would spread one
invariant (NOTE [ Worker order ]) over several files.

NOTE [ Worker order ]
With ``in_order=True`` torch hands out events in round-robin order over workers,
skipping workers whose epoch ended, and every epoch starts at worker 0. The loader
records, per worker, the events it handed on (``delivered``), whether the worker's epoch
ended, and which worker comes next. After a restore the first event must come from the
saved next worker ``k``, while worker identities (the shards of
``get_worker_info().id``) stay put: in the first resumed epoch each live worker before
``k`` yields one placeholder, which the loader drops, so torch's own round-robin lands on
``k``. Workers whose epoch had ended yield nothing in that epoch. From the next epoch on
nothing differs from an uninterrupted run.

NOTE [ No workers ]
With ``num_workers=0`` the pipeline runs in the main process. Its generator states are
kept apart from the training loop's and swapped in around each event, so draws the
training loop makes from ``random``, ``numpy.random`` or torch between batches change
nothing in the data stream, and a restore is exact without restoring the trainer's
generators. A save captures the pipeline's state on the spot: there is no prefetch.

NOTE [ state_dict for checkpoints ]
``torch.distributed.checkpoint`` loads in place: it asks a fresh loader for its
``state_dict()`` and fills the same keys from the checkpoint, so the key structure must
not depend on where the stream is (a worker's checkpoint is None before it starts).
It also keeps one copy of a non-tensor value per key across ranks, so ranks must not
share a key. Hence one key per data-parallel rank holding the encoded state as bytes:
ranks with the same data-parallel rank (tensor-parallel peers) yield the same stream, so
one copy of their states serves them all.

NOTE [ Iterators continue the stream ]
Every iterator of a loader reads the same stream. ``iter(loader)`` starts a new epoch
only when the previous one ended (StopIteration); an epoch left half-read (a ``break``)
continues where it stopped, so nothing is lost and an uninterrupted run behaves exactly
like a saved and restored one. A restore moves the stream: a live iterator continues
from the restored position (or stops, if the state lies between epochs).

NOTE [ Errors stop the stream ]
When the pipeline raises (an ERROR event, NOTE [ Pipeline errors ] in ``_worker.py``) or
anything else escapes torch's iterator, the loader stops the stream (workers, queues,
command pipes) before the error reaches the user, and keeps its bookkeeping, which stands
exactly after the last item handed on. It first asks the workers for checkpoints at that
position (no request when nothing was handed on since the stream started: the start
checkpoints still hold), so the loader is as if that position had been saved and
restored: the next iteration starts fresh workers that replay up to it and retry the
failing item, ``save_state_rank()`` saves it, and ``restore_state_rank()`` moves
anywhere else. If the position cannot be had (a worker died or hung), the loader is
*broken*: iterating or saving raises an error saying so, until a restore. An error from
the pipeline is raised as :class:`DatasetError` naming the worker and the item, chained
from the original exception (the object itself without workers; with workers a copy of
its type, and the worker's traceback in the message, as torch does); the library's own
errors (StateError, StorageError, ...) keep their type.

NOTE [ Watchdog ]
Torch waits for a worker's next item forever with ``timeout=0``. To report a hung worker
without breaking slow items, the loader gives torch's iterator a short timeout (the
poll interval: at most one second, a quarter of ``command_timeout`` and of
``item_timeout``, and the user's ``timeout`` if smaller) and, each time it expires with
no item, asks every worker's command thread for its progress: its phase (starting,
producing item ``seq``, idle) and the seconds spent in it. Then it asks torch again,
which keeps waiting for the same item (pinned in ``tests/test_torch_compat.py``). A
worker still starting (restoring its checkpoint and replaying) after ``command_timeout``,
producing one item for longer than ``item_timeout`` (60 s by default; None: no limit,
as torch), or not
answering within ``command_timeout`` (a frozen process) is hung: the loader keeps its
position when the workers can still tell it (NOTE [ Errors stop the stream ]), kills the
hung workers (they would not see torch's shutdown request), stops the stream and raises
:class:`WorkerError` naming them. The user's own ``timeout`` keeps torch's meaning: no
item within that many seconds raises (a WorkerError, which is a RuntimeError). Items
that arrive cost nothing more: the progress check runs only after a wait of one poll
interval.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, IterableDataset

from . import _elastic, _torch_compat, distributed
from ._commands import CommandChannel, NoAnswerError
from ._version import __version__
from ._worker import (
    END,
    ERROR,
    PLACEHOLDER,
    PRODUCING,
    STARTING,
    Event,
    Failure,
    RuntimeSpec,
    WorkerStart,
    WorkerWrapper,
)
from .config import WorkerConfig, WorkerContext
from .datasets.base import SavableDataset
from .datasets.indexed import IndexedDataset, shard_length
from .datasets.stateful import StatefulDataset, is_stateful
from .errors import (
    ConfigError,
    DatasetError,
    SavableLoaderError,
    StateFormatError,
    StateMismatchError,
    WorkerError,
)
from .rng import derive_seed
from .state.files import decode_state, encode_state
from .state.fingerprint import fingerprint
from .state.models import FORMAT_VERSION, Checkpoint, RankState, WorkerState, one_save

__all__ = ["SavableDataLoader"]

logger = logging.getLogger(__name__)

_BASE_SEED_PURPOSE = 0xBA5E
_MAX_COUNTER = 2**63 - 1
_DEATH_GRACE_SECONDS = 2.0
_MAX_POLL_SECONDS = 1.0


class _Hang(WorkerError):
    """Workers found hung by the watchdog (NOTE [ Watchdog ]).

    Attributes:
        workers: The hung workers.
        answering: Every hung worker's command thread answers (it hangs in an item), so
            the loader's position can still be asked for.
    """

    def __init__(self, message: str, *, workers: list[int], answering: bool) -> None:
        super().__init__(message)
        self.workers = workers
        self.answering = answering


def _identity(event: Any) -> Any:
    return event


def _state_key(rank: int) -> str:
    """The key of a rank's entry in :meth:`SavableDataLoader.state_dict`."""
    return f"rank_{rank}"


@dataclass
class _Book:
    """What the loader handed on: NOTE [ Worker order ]."""

    epoch: int
    delivered: list[int]
    ended: list[bool]
    next_worker: int

    @classmethod
    def fresh(cls, workers: int) -> _Book:
        return cls(0, [0] * workers, [False] * workers, 0)

    def copy(self) -> _Book:
        return _Book(self.epoch, list(self.delivered), list(self.ended), self.next_worker)

    @classmethod
    def of(cls, state: RankState) -> _Book:
        return cls(
            state.epoch,
            [w.delivered for w in state.workers],
            [w.ended for w in state.workers],
            state.next_worker,
        )

    def all_ended(self) -> bool:
        return all(self.ended)

    def start_epoch(self) -> None:
        self.epoch += 1
        self.ended = [False] * len(self.ended)
        self.next_worker = 0

    def hand_on(self, worker_id: int, seq: int, kind: int) -> None:
        if seq != self.delivered[worker_id] or self.ended[worker_id]:
            raise SavableLoaderError(
                f"internal error: worker {worker_id} sent event {seq} but the loader expected "
                f"{self.delivered[worker_id]} (ended={self.ended[worker_id]}); please report"
            )
        self.delivered[worker_id] = seq + 1
        if kind == END:
            self.ended[worker_id] = True
        workers = len(self.ended)
        for step in range(1, workers + 1):
            candidate = (worker_id + step) % workers
            if not self.ended[candidate]:
                self.next_worker = candidate
                return
        self.next_worker = 0


class SavableDataLoader(DataLoader[Any]):
    """A ``DataLoader`` whose position in the data stream can be saved and restored exactly.

    Arguments keep ``DataLoader``'s names and defaults where they apply. Batching
    (``batch_size``, ``collate_fn``, ``drop_last``) happens inside the workers, so one batch
    never mixes workers. With workers, persistent workers are used.

    Args:
        dataset: A :class:`~savable_loader.SavableDataset`, an iterable with
            ``state_dict()``/``load_state_dict()``, or a map-style dataset
            (``__getitem__`` + ``__len__``), served through
            :class:`~savable_loader.datasets.IndexedDataset`.
        batch_size: Items per batch; None yields items one by one.
        shuffle: For map-style datasets: a new seeded permutation every epoch.
        sampler: Not supported (ConfigError): the order must be savable.
        batch_sampler: Not supported (ConfigError).
        num_workers: Worker processes; 0 runs the pipeline in the main process.
        collate_fn: Merges items into a batch (default: torch's ``default_collate``).
        pin_memory: As in ``DataLoader``.
        drop_last: Drop each worker's last incomplete batch of an epoch.
        timeout: As in ``DataLoader``.
        worker_init_fn: As in ``DataLoader``; runs before the pipeline is restored.
        multiprocessing_context: As in ``DataLoader`` (fork, forkserver, spawn).
        generator: Not supported (ConfigError): ``seed`` drives every random choice.
        prefetch_factor: As in ``DataLoader``.
        persistent_workers: None or True; False with workers is refused.
        pin_memory_device: As in ``DataLoader``.
        in_order: Must be True: out-of-order delivery cannot be resumed exactly.
        seed: Drives the shuffle order and the workers' seeds (with rank and worker id).
        worker_config: Rank, world size, command timeout, checkpoint policy.

    Raises:
        ConfigError: An argument cannot be honoured exactly.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int = 0,
        worker_config: WorkerConfig | None = None,
    ) -> None:
        _check_arguments(
            batch_size=batch_size,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            drop_last=drop_last,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            in_order=in_order,
            seed=seed,
        )
        self.source: SavableDataset[Any] = _as_savable(dataset, shuffle=shuffle, seed=seed)
        self.worker_config = worker_config or WorkerConfig()
        self.rank, self.world_size = self.worker_config.resolve()
        self.seed = seed
        workers = max(num_workers, 1)
        effective_prefetch = (prefetch_factor or 2) if num_workers > 0 else 0
        self._spec = RuntimeSpec(
            dataset=self.source,
            batch_size=batch_size,
            drop_last=drop_last,
            collate_fn=collate_fn,
            seed=seed,
            rank=self.rank,
            world_size=self.world_size,
            num_workers=num_workers,
            checkpoint_share=self.worker_config.checkpoint_share,
            max_lag=effective_prefetch * num_workers + 2,
        )
        self._wrapper = WorkerWrapper(self._spec)
        super().__init__(
            self._wrapper,
            batch_size=None,
            num_workers=num_workers,
            collate_fn=_identity,
            pin_memory=pin_memory,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=torch.Generator().manual_seed(
                derive_seed(seed, self.rank, _BASE_SEED_PURPOSE)
            ),
            prefetch_factor=prefetch_factor,
            persistent_workers=num_workers > 0,
            pin_memory_device=pin_memory_device,
            in_order=True,
        )
        # DataLoader guards these names after __init__; the values torch needs underneath
        # (no batching, no dropping) were passed above, and torch's iterators never read
        # them for an iterable dataset, so they can report what the user asked for.
        object.__setattr__(self, "batch_size", batch_size)
        object.__setattr__(self, "drop_last", drop_last)
        self.fingerprint = self._fingerprint(num_workers)
        self._book = _Book.fresh(workers)
        self._resume: list[Checkpoint | None] = [None] * workers
        self._stream: Any = None
        self._stream_done = False
        self._channel: CommandChannel | None = None
        self._closed = False
        self._last_worker: int | None = None
        #: The book when the stream started: its checkpoints are ``_resume``.
        self._started = self._book.copy()
        #: Why the loader cannot continue until a restore (NOTE [ Errors stop the stream ]).
        self._broken: str | None = None

    def _fingerprint(self, num_workers: int) -> str:
        """The fingerprint of this pipeline and loader with ``num_workers`` workers."""
        return fingerprint(
            {
                "dataset": self.source.config(),
                "loader": {
                    "batch_size": self.batch_size,
                    "drop_last": self.drop_last,
                    "seed": self.seed,
                    "num_workers": num_workers,
                    "collate_fn": _qualname(self._spec.collate_fn),
                },
            }
        )

    # -- iteration --------------------------------------------------------------------

    def __iter__(self) -> _LoaderIterator:  # type: ignore[override]
        """Returns an iterator over the stream (NOTE [ Iterators continue the stream ])."""
        self._check_usable()
        new_epoch = False
        if self._book.all_ended():
            self._book.start_epoch()
            new_epoch = True
            if self._stream is not None:
                self._stream = self._torch_iterator()
                self._stream_done = False
        if self._stream is None:
            self._start_stream(new_epoch=new_epoch)
        return _LoaderIterator(self)

    def _start_stream(self, *, new_epoch: bool = False) -> None:
        book = self._book
        self._spec.starts = tuple(
            WorkerStart(
                checkpoint=self._resume[w],
                delivered=book.delivered[w],
                skip_epoch=book.ended[w],
                placeholder=w < book.next_worker and not book.ended[w],
                new_epoch=new_epoch,
            )
            for w in range(len(book.delivered))
        )
        self._spec.epoch = book.epoch
        if self.num_workers > 0:
            context = self.multiprocessing_context or torch.multiprocessing.get_context()
            self._channel = CommandChannel(context, self.num_workers)
            self._spec.channel = self._channel
        self._wrapper.runtime = None
        self._started = book.copy()
        self._stream = self._torch_iterator()
        self._stream_done = False

    def _torch_iterator(self) -> Any:
        """Torch's iterator, waiting at most a poll interval per try (NOTE [ Watchdog ])."""
        if self.num_workers == 0:
            return super().__iter__()
        timeout = self.timeout
        # Torch reads the loader's timeout once, when it builds the iterator.
        self.timeout = self._poll_seconds()
        try:
            with _torch_compat.deferred_worker_death():
                iterator = super().__iter__()
            _torch_compat.unblock_done_event(iterator)
            return iterator
        except RuntimeError as error:
            # Torch's SIGCHLD handler: a worker died while torch started the workers.
            if self._stream is not None:  # a new epoch of the running workers
                self._raise_if_workers_died(error, "while an epoch started")
                raise
            dead = _torch_compat.drop_unfinished_iterator(self, error)
            self._stop_stream()
            raise WorkerError(
                f"worker(s) {dead} died while the workers started ({error}); the loader "
                "stays where it was: iterating again starts the workers anew"
            ) from error
        finally:
            self.timeout = timeout

    def _poll_seconds(self) -> float:
        config = self.worker_config
        bounds = [_MAX_POLL_SECONDS, config.command_timeout / 4]
        if config.item_timeout is not None:
            bounds.append(config.item_timeout / 4)
        if self.timeout > 0:
            bounds.append(self.timeout)
        return min(bounds)

    def _next_event(self) -> Event:
        """The next event of torch's iterator; reports hung workers (NOTE [ Watchdog ])."""
        stream = self._stream
        if self.num_workers == 0:
            return cast(Event, next(stream))
        began = time.monotonic()
        while True:
            try:
                return cast(Event, next(stream))
            except RuntimeError as error:
                if not _torch_compat.is_timeout(error):
                    raise
            if self.timeout > 0 and time.monotonic() - began >= self.timeout:
                raise WorkerError(
                    f"DataLoader timed out after {self.timeout} seconds: no item arrived "
                    "within the loader's timeout"
                )
            self._watch(stream)

    def _watch(self, stream: Any) -> None:
        """Raises :class:`_Hang` naming the workers stuck beyond their bounds."""
        channel = self._channel
        if channel is None:
            return
        config = self.worker_config
        try:
            answers = channel.request(
                "progress",
                [{} for _ in range(self.num_workers)],
                timeout=config.command_timeout,
                is_alive=lambda w: _torch_compat.worker_alive(stream, w),
            )
        except NoAnswerError as error:
            raise _Hang(str(error), workers=[error.worker_id], answering=False) from None
        hung: list[int] = []
        reasons: list[str] = []
        answering = True
        for worker_id, progress in enumerate(answers):
            phase, seq, seconds = progress["phase"], progress["seq"], progress["for"]
            if phase == STARTING and seconds > config.command_timeout:
                answering = False
                reasons.append(
                    f"worker {worker_id} has been starting (restoring its checkpoint and "
                    f"replaying) for {seconds:.1f} s, beyond WorkerConfig(command_timeout="
                    f"{config.command_timeout:g})"
                )
            elif (
                phase == PRODUCING
                and config.item_timeout is not None
                and seconds > config.item_timeout
            ):
                reasons.append(
                    f"worker {worker_id} has been producing item {seq} for {seconds:.1f} s, "
                    f"beyond WorkerConfig(item_timeout={config.item_timeout:g}); if its "
                    "items legitimately take longer, raise item_timeout (None: no limit)"
                )
            else:
                continue
            hung.append(worker_id)
        if hung:
            raise _Hang(
                "; ".join(reasons) + "; it is hung or slower than allowed",
                workers=hung,
                answering=answering,
            )

    def _next(self) -> Any:
        while True:
            if self._stream is None:
                self._check_usable()
                if self._book.all_ended():
                    raise StopIteration
                self._start_stream()
            if self._stream_done:
                raise StopIteration
            try:
                worker_id, seq, kind, payload = self._next_event()
            except StopIteration:
                self._stream_done = True
                if not self._book.all_ended():
                    raise SavableLoaderError(
                        f"internal error: the epoch ended but workers {self._unended()} did "
                        "not report their end; please report"
                    ) from None
                raise
            except _Hang as hang:
                lost = self._halt(hung=hang.workers, ask=hang.answering)
                then = (
                    f"the loader cannot continue: {lost}"
                    if lost is not None
                    else "the loader stays after the last item handed on: iterating again "
                    "restarts the workers there"
                )
                raise WorkerError(f"{hang}. The loader stopped its workers; {then}.") from None
            except Exception as error:
                # Whatever surfaces when a worker dies (torch's RuntimeError, a reset
                # connection while fetching a tensor it shared) becomes a WorkerError.
                self._raise_if_workers_died(error, "while producing items")
                self._halt()
                raise
            if kind == PLACEHOLDER:
                continue
            if kind == ERROR:
                self._raise_failure(payload)
            self._book.hand_on(worker_id, seq, kind)
            if kind == END:
                continue
            self._last_worker = worker_id if self.num_workers > 0 else None
            return payload

    @property
    def last_worker(self) -> int | None:
        """The worker that produced the last item handed out; None before the first item
        and when ``num_workers`` is 0 (the pipeline runs in the main process)."""
        return self._last_worker

    def _raise_if_workers_died(self, error: BaseException, during: str) -> None:
        """Turns an error into :class:`WorkerError` (stopping the rest) if workers died.

        Torch's SIGCHLD handler raises RuntimeError in the main thread wherever it is when
        a worker dies, so the error may come from any wait, ours included. A broken
        connection can arrive before the dying worker can be reaped (the kernel closes its
        files first), so such an error waits a moment for the death to show.
        """
        dead = self._dead_workers()
        if not dead and isinstance(error, (OSError, EOFError)):
            deadline = time.monotonic() + _DEATH_GRACE_SECONDS
            while not dead and time.monotonic() < deadline:
                with contextlib.suppress(RuntimeError):  # torch's SIGCHLD handler: a death
                    time.sleep(0.02)
                dead = self._dead_workers()
        if not dead:
            return
        self._stop_stream()
        self._broken = (
            f"worker(s) {dead} died {during}, so the loader lost its position; restore a "
            "saved state with restore_state_rank() (or restore_state_rank(None) to start over)"
        )
        raise WorkerError(
            f"worker(s) {dead} died {during}; restore the last saved state "
            f"(restore_state_rank) to resume ({error})"
        ) from error

    def _halt(self, *, hung: Sequence[int] = (), ask: bool = True) -> str | None:
        """Stops the stream after an error, keeping the position (NOTE [ Errors stop the
        stream ]). Returns why the position was lost, or None when it was kept.

        Args:
            hung: Workers to kill first (NOTE [ Watchdog ]), after asking for the position.
            ask: Whether every worker can answer for its position; if not, the position
                is kept only when nothing was handed on since the stream started.
        """
        if self._stream is None:
            return self._broken
        try:
            if self._book != self._started:
                if not ask:
                    raise WorkerError(f"hung worker(s) {list(hung)} cannot answer")
                self._resume = self._current_checkpoints()
        except Exception as error:  # a dead or hung worker: WorkerError, torch's RuntimeError
            self._broken = (
                f"after an error the loader could not get its workers' checkpoints ({error}); "
                "restore a saved state with restore_state_rank() (or restore_state_rank(None) "
                "to start over)"
            )
        self._kill(hung)
        self._stop_stream()
        return self._broken

    def _kill(self, workers: Sequence[int]) -> None:
        """Kills ``workers`` and waits (bounded) until they are gone.

        Torch's SIGCHLD handler raises RuntimeError in the main thread when a worker it
        watches dies; that is expected here, so it is absorbed while waiting.
        """
        stream = self._stream
        if not workers or stream is None:
            return
        for worker_id in workers:
            _torch_compat.kill_worker(stream, worker_id)
        deadline = time.monotonic() + _DEATH_GRACE_SECONDS
        while time.monotonic() < deadline:
            try:
                if not any(_torch_compat.worker_alive(stream, w) for w in workers):
                    time.sleep(0.05)  # torch's SIGCHLD handler runs here, if at all
                    return
                time.sleep(0.02)
            except RuntimeError:
                continue

    def _raise_failure(self, failure: Failure) -> None:
        """Stops the stream and raises the error the pipeline raised in a worker."""
        lost = self._halt()
        original = failure.exception()
        where = f"worker {failure.worker_id}" if self.num_workers > 0 else "the main process"
        doing = (
            f"starting (restoring its checkpoint and replaying up to item {failure.seq})"
            if failure.starting
            else f"producing item {failure.seq}"
        )
        then = (
            f"The loader cannot continue: {lost}."
            if lost is not None
            else "The loader stays just before that item: iterating again retries it, "
            "save_state_rank() saves this position and restore_state_rank() moves to a "
            "saved one."
        )
        message = (
            f"{failure.type_name}: {failure.message} (raised in {where} while {doing}, epoch "
            f"{self._book.epoch}). {then}"
        )
        if failure.error is None:
            message += f"\n\nTraceback in {where}:\n{failure.text}"
        if isinstance(original, SavableLoaderError):
            library_error = type(original)
            try:
                raise library_error(message) from original
            except TypeError:  # a subclass with another constructor
                pass
        raise DatasetError(message, worker_id=failure.worker_id, index=failure.seq) from original

    def _unended(self) -> list[int]:
        return [w for w, ended in enumerate(self._book.ended) if not ended]

    def _dead_workers(self) -> list[int]:
        if self.num_workers == 0 or self._stream is None:
            return []
        count = _torch_compat.worker_count(self._stream)
        return [w for w in range(count) if not _torch_compat.worker_alive(self._stream, w)]

    def __len__(self) -> int:
        """Batches this rank yields per epoch, for map-style datasets (as with torch)."""
        if not isinstance(self.source, IndexedDataset):
            raise TypeError(
                f"{type(self.source).__name__} has no len(); the epoch ends when it does"
            )
        batch = self._spec.batch_size
        total = 0
        for worker in range(max(self.num_workers, 1)):
            items = shard_length(
                len(self.source.data),
                WorkerContext(
                    self.rank, self.world_size, worker, self.num_workers, self.seed, batch
                ),
            )
            if batch is None:
                total += items
            else:
                total += items // batch if self._spec.drop_last else -(-items // batch)
        return total

    # -- save and restore -------------------------------------------------------------

    def save_state_rank(self) -> RankState:
        """Returns this rank's position in the stream; callable at any time.

        Items already prefetched are not part of the state: a restored loader recomputes
        them. Saving never waits for the item a worker is producing.

        Raises:
            WorkerError: A worker is dead or did not answer within its command timeout.
            SavableLoaderError: The loader lost its position after an error and needs a
                restore (NOTE [ Errors stop the stream ]).
        """
        self._check_usable()
        book = self._book
        checkpoints = self._current_checkpoints()
        return RankState(
            format_version=FORMAT_VERSION,
            library_version=__version__,
            fingerprint=self.fingerprint,
            rank=self.rank,
            world_size=self.world_size,
            num_workers=self.num_workers,
            batch_size=self._spec.batch_size,
            seed=self.seed,
            epoch=book.epoch,
            next_worker=0 if book.all_ended() else book.next_worker,
            workers=tuple(
                WorkerState(
                    worker_id=w,
                    delivered=book.delivered[w],
                    ended=book.ended[w],
                    checkpoint=checkpoints[w],
                )
                for w in range(len(book.delivered))
            ),
        )

    def _current_checkpoints(self) -> list[Checkpoint | None]:
        runtime = self._wrapper.runtime
        if self.num_workers == 0:
            if self._stream is None or runtime is None:
                return list(self._resume)
            return [runtime.checkpoint_for(self._book.delivered[0])]
        if self._stream is None or self._channel is None:
            return list(self._resume)
        stream = self._stream
        try:
            answers = self._channel.request(
                "checkpoint",
                [{"delivered": d} for d in self._book.delivered],
                timeout=self.worker_config.command_timeout,
                is_alive=lambda w: _torch_compat.worker_alive(stream, w),
            )
        except (RuntimeError, OSError, EOFError) as error:  # WorkerError included
            # A dead worker stops the stream; a hung one is left to close(), which may
            # need torch's join timeout to end it, so the error comes without delay.
            self._raise_if_workers_died(error, "during a save")
            raise
        return [Checkpoint.model_validate(answer) for answer in answers]

    def worker_stats(self) -> list[dict[str, Any]]:
        """Returns per-worker figures: checkpoints taken, their cost and size, ring entries,
        events replayed at start-up. Empty before the pipeline starts.

        Raises:
            WorkerError: A worker is dead or did not answer within its command timeout.
        """
        self._check_open()
        if self._stream is None:
            return []
        runtime = self._wrapper.runtime
        if self.num_workers == 0:
            return [runtime.stats()] if runtime is not None else []
        if self._channel is None:
            return []
        stream = self._stream
        answers = self._channel.request(
            "stats",
            [{} for _ in range(self.num_workers)],
            timeout=self.worker_config.command_timeout,
            is_alive=lambda w: _torch_compat.worker_alive(stream, w),
        )
        return [dict(answer) for answer in answers]

    def restore_state_rank(
        self,
        state: RankState | dict[str, Any] | Sequence[RankState | dict[str, Any]] | None,
        *,
        approximate: bool = False,
    ) -> None:
        """Moves the stream to ``state`` (None: the start); running workers are stopped.

        ``state`` is this rank's state, or the list of every rank's state of one save (as
        :meth:`save_state_global` or :func:`~savable_loader.load_state` return it), from
        which this rank takes its own. A list saved with another number of workers or
        ranks is resharded onto this loader's (NOTE [ Elastic resume ] in
        ``datasets/elastic.py``); a single state may change the number of workers only
        when it was saved on one rank. ``state`` is never modified. The next item comes
        from the restored position; a state saved after an epoch's end restores to
        between epochs.

        Args:
            state: The state, the list of every rank's state, or None.
            approximate: When the layout changes and the pipeline is not elastic, restart
                the interrupted epoch on the new layout (with an
                :class:`~savable_loader.ApproximateResumeWarning` saying so) instead of
                raising.

        Raises:
            StateError: ``state`` is malformed, or was saved by an incompatible loader
                (another pipeline, batch size or seed; another layout when the pipeline
                is not elastic and ``approximate`` is False).
        """
        self._check_open()
        if state is None:
            self._stop_stream()
            self._book = _Book.fresh(len(self._book.delivered))
            self._resume = [None] * len(self._resume)
            self._broken = None
            return
        state = self._own_state(state, approximate=approximate)
        self._check_compatible(state)
        self._stop_stream()
        self._book = _Book.of(state)
        self._resume = [worker.checkpoint for worker in state.workers]
        self._broken = None

    def _own_state(
        self,
        state: RankState | dict[str, Any] | Sequence[RankState | dict[str, Any]],
        *,
        approximate: bool,
    ) -> RankState:
        """This rank's state from ``state``, resharded if it was saved on another layout."""
        if isinstance(state, (RankState, dict)):
            single = RankState.from_plain(state)
            layout = (self.world_size, self.num_workers)
            if single.world_size != 1 or (1, single.num_workers) == layout:
                return single
            states = [single]
        elif isinstance(state, Sequence) and not isinstance(state, (str, bytes)):
            states = one_save(state)
        else:
            raise StateFormatError(
                "restore_state_rank takes a state, a list of every rank's state, or None; "
                f"got {type(state).__name__}"
            )
        if self._saved_on_this_layout(states):
            return states[self.rank]
        return self.reshard(states, rank=self.rank, approximate=approximate)

    def _saved_on_this_layout(self, states: Sequence[RankState]) -> bool:
        """Whether one save's states (as ``one_save()`` checked them) come from this
        loader's number of ranks and workers, so that no reshard is needed."""
        return len(states) == self.world_size and all(
            state.num_workers == self.num_workers for state in states
        )

    def reshard(
        self,
        states: Sequence[RankState | dict[str, Any]],
        *,
        rank: int,
        approximate: bool = False,
    ) -> RankState:
        """Returns rank ``rank``'s state in this loader's layout from every rank's state of
        a save made with another number of workers or ranks (NOTE [ Elastic resume ] in
        ``datasets/elastic.py``). Nothing is restored; no process is started.

        Raises:
            StateError: As :meth:`restore_state_rank`.
        """
        layout = _elastic.Layout(
            dataset=self._spec.dataset,
            fingerprint=self.fingerprint,
            fingerprint_for=self._fingerprint,
            seed=self.seed,
            batch_size=self._spec.batch_size,
            world_size=self.world_size,
            num_workers=self.num_workers,
        )
        return _elastic.reshard(one_save(states), layout, rank, approximate=approximate)

    def save_state_global(self, global_dst_rank: int = 0) -> list[RankState] | None:
        """Gathers every rank's state on ``global_dst_rank``: a collective, every rank calls it.

        Returns:
            On ``global_dst_rank``, one state per rank of the loader's data-parallel group,
            in rank order; None on the other ranks.

        Raises:
            WorkerError: Saving failed on some rank; every rank raises, naming it.
        """
        return distributed.save_state_global(self, global_dst_rank)

    def restore_state_global(
        self,
        states: Sequence[RankState | dict[str, Any]] | None,
        src_rank: int | None = None,
        *,
        approximate: bool = False,
    ) -> None:
        """Restores every rank from the list :meth:`save_state_global` returned.

        Either every rank passes the full list (``src_rank=None``), or only ``src_rank``
        (a rank within the data-parallel group) does and each rank receives its own entry.
        A list saved with another number of ranks or workers is resharded (NOTE [ Elastic
        resume ] in ``datasets/elastic.py``); ``approximate`` is as in
        :meth:`restore_state_rank`.

        Raises:
            StateError: The list does not fit this job (pipeline, seed, batch size, or a
                layout change on a pipeline that is not elastic); every rank raises.
        """
        distributed.restore_state_global(self, states, src_rank, approximate=approximate)

    def state_dict(self) -> dict[str, bytes]:
        """Returns this rank's state for ``torch.distributed.checkpoint`` or ``torch.save``.

        The result is ``{"rank_<r>": <encoded state>}``: one key per data-parallel rank,
        whose value is :meth:`save_state_rank` encoded as a state file's bytes (msgpack
        behind a checked header). See NOTE [ state_dict for checkpoints ].
        """
        return {_state_key(self.rank): encode_state(self.save_state_rank())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned (or a plain ``RankState`` dict).

        Raises:
            StateError: The state is malformed, holds no entry for this rank, or was
                saved by an incompatible loader.
        """
        if not isinstance(state_dict, dict):
            raise StateFormatError(
                f"load_state_dict takes the dict state_dict() returned, got "
                f"{type(state_dict).__name__}"
            )
        if "format_version" in state_dict or state_dict.keys() & RankState.model_fields.keys():
            self.restore_state_rank(RankState.from_plain(state_dict))
            return
        key = _state_key(self.rank)
        if key not in state_dict:
            saved = sorted(k for k in state_dict if isinstance(k, str) and k.startswith("rank_"))
            raise StateMismatchError(
                f"cannot restore: the state holds {saved or 'no rank entries'} and this loader "
                f"is rank {self.rank} of {self.world_size}; restore each rank from a checkpoint "
                "saved with the same number of ranks"
            )
        state = decode_state(state_dict[key])
        if not isinstance(state, RankState):
            raise StateFormatError(
                f"the entry {key!r} holds a list of rank states; pass such a list to "
                "restore_state_global()"
            )
        self.restore_state_rank(state)

    def _check_compatible(self, state: RankState) -> None:
        _check_plausible(state)
        checks = [
            (
                "world_size",
                state.world_size,
                self.world_size,
                "restore the list of every rank's state (restore_state_global) to reshard it",
            ),
            ("rank", state.rank, self.rank, "restore each rank's own state"),
            (
                "num_workers",
                state.num_workers,
                self.num_workers,
                f"build the loader with num_workers={state.num_workers}, or restore the list "
                "of every rank's state to reshard it onto this layout",
            ),
            (
                "batch_size",
                state.batch_size,
                self._spec.batch_size,
                f"build the loader with batch_size={state.batch_size}",
            ),
            ("seed", state.seed, self.seed, f"build the loader with seed={state.seed}"),
        ]
        for name, saved, current, fix in checks:
            if saved != current:
                raise StateMismatchError(
                    f"cannot restore: {name} was {saved} when the state was saved and is "
                    f"{current} now; {fix}"
                )
        if state.fingerprint != self.fingerprint:
            raise StateMismatchError(
                f"cannot restore: the pipeline fingerprint was {state.fingerprint} when the "
                f"state was saved and is {self.fingerprint} now; the dataset's config() or "
                "the loader arguments drop_last / collate_fn differ. Rebuild the pipeline "
                "exactly as it was when the state was saved"
            )

    # -- lifecycle --------------------------------------------------------------------

    def _stop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None and self.num_workers > 0:
            pids = _torch_compat.worker_pids(stream)
            _torch_compat.drop_persistent_iterator(self, stream)
            _torch_compat.remove_leaked_shared_memory(pids)
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            self._spec.channel = None
        self._wrapper.runtime = None
        self._stream_done = False

    def close(self) -> None:
        """Stops the workers and releases their queues. Idempotent."""
        if self._closed:
            return
        self._stop_stream()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise SavableLoaderError("this SavableDataLoader is closed")

    def _check_usable(self) -> None:
        self._check_open()
        if self._broken is not None:
            raise SavableLoaderError(f"this SavableDataLoader cannot continue: {self._broken}")

    def __enter__(self) -> SavableDataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _LoaderIterator(Iterator[Any]):
    """An iterator over a :class:`SavableDataLoader`'s stream for the current epoch."""

    def __init__(self, loader: SavableDataLoader) -> None:
        self._loader = loader
        self._done = False

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            return self._loader._next()
        except StopIteration:
            self._done = True
            raise


def _as_savable(dataset: Any, *, shuffle: bool | None, seed: int) -> SavableDataset[Any]:
    if isinstance(dataset, SavableDataset) or (
        isinstance(dataset, IterableDataset)
        and callable(getattr(dataset, "save_state", None))
        and callable(getattr(dataset, "restore_state", None))
    ):
        _no_shuffle(dataset, shuffle)
        return cast("SavableDataset[Any]", dataset)
    if is_stateful(dataset):
        _no_shuffle(dataset, shuffle)
        return StatefulDataset(dataset)
    if isinstance(dataset, IterableDataset):
        raise ConfigError(
            f"{type(dataset).__name__} is an IterableDataset without save_state()/"
            "restore_state() or state_dict()/load_state_dict(); subclass "
            "savable_loader.SavableDataset so its position can be saved"
        )
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        return IndexedDataset(dataset, shuffle=bool(shuffle), seed=seed)
    raise ConfigError(
        f"{type(dataset).__name__} is neither a SavableDataset, a Stateful iterable nor a "
        "map-style dataset (__getitem__ and __len__)"
    )


def _no_shuffle(dataset: Any, shuffle: bool | None) -> None:
    if shuffle:
        raise ConfigError(
            f"shuffle=True applies to map-style datasets; {type(dataset).__name__} is "
            "iterable: shuffle inside the pipeline (savable_loader.datasets)"
        )


def _check_arguments(
    *,
    batch_size: int | None,
    sampler: Any,
    batch_sampler: Any,
    num_workers: int,
    drop_last: bool,
    generator: Any,
    prefetch_factor: int | None,
    persistent_workers: bool | None,
    in_order: bool,
    seed: int,
) -> None:
    if sampler is not None or batch_sampler is not None:
        raise ConfigError(
            "sampler and batch_sampler are not supported: their position cannot be saved "
            "exactly; use shuffle=True (map-style datasets) or a savable pipeline"
        )
    if not in_order:
        raise ConfigError(
            "in_order=False delivers batches in the order workers finish them, which a "
            "restore cannot reproduce; use in_order=True"
        )
    if generator is not None:
        raise ConfigError(
            "generator is not supported: the loader's random choices derive from seed=..., "
            "so that a restored loader reproduces them"
        )
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"num_workers must be a non-negative int, got {num_workers!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ConfigError(f"batch_size must be a positive int or None, got {batch_size!r}")
    if batch_size is None and drop_last:
        raise ConfigError("drop_last=True needs a batch_size (it drops incomplete batches)")
    if num_workers == 0 and prefetch_factor is not None:
        raise ConfigError("prefetch_factor applies to worker processes; num_workers is 0")
    if prefetch_factor is not None and (
        not isinstance(prefetch_factor, int) or prefetch_factor < 1
    ):
        raise ConfigError(f"prefetch_factor must be a positive int, got {prefetch_factor!r}")
    if num_workers > 0 and persistent_workers is False:
        raise ConfigError(
            "persistent_workers=False is not supported: worker processes keep the pipeline's "
            "position between epochs; leave it None or True"
        )
    if not isinstance(seed, int):
        raise ConfigError(f"seed must be an int, got {seed!r}")


def _check_plausible(state: RankState) -> None:
    """Refuses counters no run can reach: a hand-edited or corrupted state.

    Raises:
        StateFormatError: A counter is beyond int64, or a worker without a checkpoint
            (one that never started) claims to have delivered events.
    """
    counters = [("epoch", state.epoch)]
    for worker in state.workers:
        at = f"workers[{worker.worker_id}]"
        counters.append((f"{at}.delivered", worker.delivered))
        if worker.checkpoint is not None:
            counters.append((f"{at}.checkpoint.seq", worker.checkpoint.seq))
        elif worker.delivered or worker.ended:
            raise StateFormatError(
                f"invalid loader state: {at} has delivered={worker.delivered}, "
                f"ended={worker.ended} but no checkpoint; a worker without a checkpoint never "
                "started, so it delivered nothing. The state was edited or corrupted"
            )
    for name, value in counters:
        if value > _MAX_COUNTER:
            raise StateFormatError(
                f"invalid loader state: {name} is {value}, beyond any run (at most 2**63-1); "
                "the state was edited or corrupted"
            )


def _qualname(function: Callable[..., Any] | None) -> str | None:
    if function is None:
        return None
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', '?')}"
