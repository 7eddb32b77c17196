"""One run of the pipeline's workers: torch's iterator, the command channel, the watchdog.

A :class:`Stream` lives from the moment the loader starts its workers until it stops
them (a restore, an error, ``close()``); with persistent workers it spans epochs, each
epoch one torch iterator over the same workers. Without workers the pipeline runs in the
main process and the stream is torch's single-process iterator.

NOTE [ Watchdog ]
Torch waits for a worker's next item forever with ``timeout=0``. To report a hung worker
without breaking slow items, the stream gives torch's iterator a short timeout (the poll
interval: at most one second, a quarter of ``command_timeout`` and of ``item_timeout``,
and the user's ``timeout`` if smaller) and, each time it expires with no item, asks
every worker's command thread for its progress: its phase (starting, producing item
``seq``, idle) and the seconds spent in it. Then it asks torch again, which keeps waiting
for the same item (pinned in ``tests/processes/test_torch_compat.py``). A worker still starting
(restoring its checkpoint and replaying) after ``command_timeout``, producing one item
for longer than ``item_timeout`` (60 s by default; None: no limit, as torch), or not
answering within ``command_timeout`` (a frozen process) is hung: :class:`Hang` names it,
and the loader keeps its position when the workers can still tell it (NOTE [ Errors stop
the stream ] in ``_main/iterator.py``), kills the hung workers (they would not see torch's
shutdown request), stops the stream and raises :class:`~savable_loader.WorkerError`. The
user's own ``timeout`` keeps torch's meaning: no item within that many seconds raises (a
WorkerError, which is a RuntimeError). Items that arrive cost nothing more: the progress
check runs only after a wait of one poll interval. One wait inside a try has no bound of
its own, the main thread taking a batch's shared memory from a hung worker; a thread of
the stream runs the same check then (NOTE [ A fetch stuck on a worker ] in
``_main/fetch_guard.py``).

NOTE [ Workers given up on ]
A worker that does not answer a command within ``command_timeout`` (a save, the
watchdog's progress check, ``worker_stats()``) is frozen or stuck with the GIL held: its
process may never run torch's request to stop, and a stopped process ignores the
SIGTERM torch sends after its join timeout. So the stream notes every worker it gave up
on, and :meth:`Stream.stop` kills those (SIGKILL ends even a stopped process) before it
stops the rest: ``close()``, a restore and an error stop the stream promptly and leave no
process behind. A save that a worker did not answer stops the stream at once, as a hang
found by the watchdog does (NOTE [ Errors stop the stream ] in ``_main/iterator.py``).

NOTE [ Workers stop with the loader ]
Torch's workers stop when the last reference to their loader (and its iterator) goes:
the iterator's ``__del__`` shuts them down at once. The loader owns its stream, and the
stream holds the loader only weakly (a proxy), so no reference cycle keeps a dropped
loader, its torch iterator and its workers alive until the next garbage collection: a
loader built inside a function and left mid-epoch stops its workers when the function
returns, as torch's does. ``close()`` stops them explicitly, whatever refers to it.

NOTE [ Worker deaths are found where they are asked about ]
Torch watches its workers with a SIGCHLD handler that raises RuntimeError in the main
thread wherever it is when one dies: in a save, between two lines of the training step,
or on the way into ``next()``, outside anything that could turn it into the loader's
error. Once torch's iterator is built (a death while it starts is still torch's error,
held back until the constructor returns: ``deferred_worker_death``), the stream takes
its workers off that watch. A death is found where the loader waits on the workers:
torch's iterator, polled at least once a second (NOTE [ Watchdog ]), sees the dead
process, and a command's wait checks the workers are alive; either raises WorkerError
naming the worker, from the next ``next()``, save or restore.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch.utils.data import DataLoader

from .._channel import torch_compat as _torch_compat
from .._channel.commands import Command, CommandChannel, NoAnswerError
from .._channel.events import CHECKPOINTING, FAILED_INIT, PRODUCING, STARTING, Event, Failure
from .._worker.wrapper import WorkerInit, WorkerWrapper
from ..config import WorkerConfig
from ..errors import WorkerError
from ..state.models import Checkpoint
from .fetch_guard import FetchGuard

__all__ = ["Hang", "Stream"]

logger = logging.getLogger(__name__)

_DEATH_GRACE_SECONDS = 2.0
_MAX_POLL_SECONDS = 1.0


class Hang(WorkerError):
    """Workers found hung by the watchdog (NOTE [ Watchdog ]).

    Attributes:
        workers: The hung workers.
        answering: Every hung worker's command thread answers (it hangs in an item), so
            the loader's position can still be asked for.
    """

    def __init__(
        self,
        message: str,
        *,
        workers: list[int],
        answering: bool,
        stacks: str = "",
        unstarted: Sequence[int] = (),
    ) -> None:
        super().__init__(message + stacks)
        self.reason = message
        self.workers = workers
        self.answering = answering
        #: The hung workers the loader's code never ran in: they handed nothing on
        #: (NOTE [ Workers that never started ] in ``_main/iterator.py``).
        self.unstarted = list(unstarted)
        #: The hung workers' stacks, a paragraph each (NOTE [ Stacks of a hung worker ]).
        self.stacks = stacks

    def restarts(self, lost: str | None, retries: int) -> bool:
        """Whether the loader starts its workers again after this hang, which it then
        logs: every hung worker never started, the position was kept and ``retries``
        are left (NOTE [ Workers that never started ] in ``_main/iterator.py``)."""
        if lost is not None or not retries or not set(self.workers) <= set(self.unstarted):
            return False
        logger.warning("%s; the loader starts its workers again", self.reason)
        return True

    def stopped(self, lost: str | None) -> WorkerError:
        """The error to raise once the loader stopped its workers after this hang;
        ``lost`` says why the loader lost its position (None: it kept it)."""
        then = (
            f"the loader cannot continue: {lost}"
            if lost is not None
            else "the loader stays after the last item handed on: the next next() "
            "restarts the workers there"
        )
        return WorkerError(f"{self.reason}. The loader stopped its workers; {then}.{self.stacks}")


def _identity(event: Any) -> Any:
    return event


class Stream:
    """The workers of one run and the ways to talk to them.

    Args:
        loader: The loader whose ``DataLoader.__iter__`` builds torch's iterators.
        wrapper: What torch iterates (its spec says how every worker starts).
        config: Timeouts and the rest of the loader's worker settings.
    """

    def __init__(self, loader: DataLoader[Any], wrapper: WorkerWrapper, config: WorkerConfig):
        # Weakly: NOTE [ Workers stop with the loader ].
        self.loader = weakref.proxy(loader)
        self.wrapper = wrapper
        self.config = config
        self.num_workers = loader.num_workers
        #: The user's timeout (torch's meaning); torch's iterators get the poll interval.
        self.timeout = loader.timeout
        self.channel: CommandChannel | None = None
        #: Torch's iterator for the current epoch raised StopIteration.
        self.done = False
        wrapper.runtime = None
        if self.num_workers > 0:
            context = loader.multiprocessing_context or torch.multiprocessing.get_context()
            self.channel = CommandChannel(context, self.num_workers)
        wrapper.spec.channel = self.channel
        self.iterator: Any = None
        #: Workers that did not answer a command in time (NOTE [ Workers given up on ]).
        self.given_up: set[int] = set()
        #: Held while the main thread or the guard talks to the workers.
        self._lock = threading.RLock()
        #: A hang the guard found (NOTE [ A fetch stuck on a worker ] in _fetch_guard.py).
        self._found: Hang | None = None
        self._guard: FetchGuard | None = None
        self.iterator = self._torch_iterator(first=True)
        if self.num_workers > 0:
            self._guard = FetchGuard(self._check_stuck_fetch, self._poll_seconds(), self._lock)

    def next_epoch(self) -> None:
        """Starts the next epoch on the same workers (persistent workers)."""
        self.iterator = self._torch_iterator(first=False)
        self.done = False

    def _torch_iterator(self, *, first: bool) -> Any:
        """Torch's iterator, waiting at most a poll interval per try (NOTE [ Watchdog ]),
        handing on the wrapper's events as they are and starting workers with the loader's
        ``WorkerInit`` (NOTE [ What the loader shows of its arguments ] in
        ``_main/shown.py``)."""
        shown = self.loader.__dict__
        for_torch = {
            **shown["_for_torch"],
            "collate_fn": _identity,
            "worker_init_fn": WorkerInit(shown["worker_init_fn"]),
        }
        users = {name: shown[name] for name in for_torch}
        shown.update(for_torch)
        try:
            return self._build_torch_iterator(first=first)
        finally:
            shown.update(users)

    def _build_torch_iterator(self, *, first: bool) -> Any:
        if self.num_workers == 0:
            return DataLoader.__iter__(self.loader)
        loader = self.loader
        _torch_compat.import_tensor_pickling()  # NOTE [ A worker's first tensor ]
        # Torch reads the loader's timeout once, when it builds the iterator.
        loader.timeout = self._poll_seconds()
        try:
            with _torch_compat.deferred_worker_death():
                iterator = DataLoader.__iter__(loader)
            _torch_compat.unwatch_workers(iterator)  # see the NOTE on worker deaths above
            _torch_compat.unblock_done_event(iterator)
            return iterator
        except RuntimeError as error:
            # Torch's SIGCHLD handler: a worker died while torch started the workers.
            if not first:  # a new epoch of the running workers: the loader reports it
                raise
            dead = _torch_compat.drop_unfinished_iterator(loader, error)
            self.stop()
            raise WorkerError(
                f"worker(s) {dead} died while the workers started ({error}); the loader "
                "stays where it was: the next next() starts the workers anew"
            ) from error
        finally:
            loader.timeout = self.timeout

    def _poll_seconds(self) -> float:
        config = self.config
        bounds = [_MAX_POLL_SECONDS, config.command_timeout / 4]
        if config.item_timeout is not None:
            bounds.append(config.item_timeout / 4)
        if self.timeout > 0:
            bounds.append(self.timeout)
        return min(bounds)

    # -- events -----------------------------------------------------------------------

    def next_event(self) -> Event:
        """The next event of torch's iterator; reports hung workers (NOTE [ Watchdog ]).

        Raises:
            StopIteration: The epoch's events are all out.
            Hang: A worker hung.
            WorkerError: No item arrived within the user's ``timeout``.
        """
        iterator, guard = self.iterator, self._guard
        if guard is None:
            return cast(Event, next(iterator))
        began = time.monotonic()
        while True:
            self._raise_found()
            guard.enter()
            try:
                return cast(Event, next(iterator))
            except Exception as error:
                self._raise_found()
                if not _torch_compat.is_timeout(error):
                    raise
            finally:
                guard.leave()
            if self.timeout > 0 and time.monotonic() - began >= self.timeout:
                raise WorkerError(
                    f"DataLoader timed out after {self.timeout} seconds: no item arrived "
                    "within the loader's timeout"
                )
            self._watch()

    def _check_stuck_fetch(self) -> bool:
        """The guard's check (NOTE [ A fetch stuck on a worker ] in ``_main/fetch_guard.py``):
        a worker that does not answer is hung; the stream keeps the hang, then kills the
        worker so that the main thread's wait ends. Returns whether it found one."""
        try:
            self._request(Command.PROGRESS, [{} for _ in range(self.num_workers)])
        except Hang as hang:
            self._found = hang
            self.kill(hang.workers)
            return True
        except Exception as error:  # a death (a broken pipe too): torch's iterator tells
            # the main thread, and the guard's thread must not end on it
            logger.debug("the fetch guard's check failed: %r", error)
        return False

    def _raise_found(self) -> None:
        """Raises the hang the guard found, once."""
        found, self._found = self._found, None
        if found is not None:
            raise found

    def _watch(self) -> None:
        """Raises :class:`Hang` naming the workers stuck beyond their bounds."""
        config = self.config
        answers = self._request(Command.PROGRESS, [{} for _ in range(self.num_workers)])
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
            elif phase == CHECKPOINTING and seconds > config.command_timeout:
                # NOTE [ Checkpoint faults ] in _events.py; the ring still answers saves.
                after = f"event {seq}, the end of its epoch" if progress["end"] else f"item {seq}"
                reasons.append(
                    f"worker {worker_id} has been taking a checkpoint (the pipeline's "
                    f"save_state()) after {after}, for {seconds:.1f} s, beyond "
                    f"WorkerConfig(command_timeout={config.command_timeout:g})"
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
            raise Hang(
                "; ".join(reasons) + "; it is hung or slower than allowed",
                workers=hung,
                answering=answering,
                stacks=self.stacks(hung),
            )

    # -- commands ---------------------------------------------------------------------

    def _request(self, command: Command, arguments: Sequence[dict[str, Any] | None]) -> list[Any]:
        """Sends a command to every worker (NOTE [ Command channel ] in ``_channel/commands.py``).

        Raises:
            Hang: A worker did not answer in time (NOTE [ Workers given up on ]).
            WorkerError: A worker died or failed the command.
        """
        with self._lock:
            self._raise_found()  # the worker it names is killed: it would not answer
            return self._request_locked(command, arguments)

    def _request_locked(
        self, command: Command, arguments: Sequence[dict[str, Any] | None]
    ) -> list[Any]:
        if self.channel is None:
            raise WorkerError(f"cannot send {command.value!r}: the stream has no command channel")
        iterator = self.iterator
        try:
            return self.channel.request(
                command,
                arguments,
                timeout=self.config.command_timeout,
                is_alive=lambda w: _torch_compat.worker_alive(iterator, w),
            )
        except NoAnswerError as error:
            worker_id = error.worker_id
            self.given_up.add(worker_id)
            reached = self.channel.reached(worker_id)
            raise Hang(
                str(error),
                workers=[worker_id],
                answering=False,
                stacks=self.stacks([worker_id]),
                unstarted=() if reached else [worker_id],
            ) from None

    def stacks(self, workers: Sequence[int]) -> str:
        """The ``workers``' threads' stacks, a paragraph each after a blank line (NOTE
        [ Stacks of a hung worker ] in ``_channel/commands.py``)."""
        channel = self.channel
        if channel is None:
            return ""
        return "".join(
            f"\n\nWorker {w}'s threads when the loader gave up on it (most recent call "
            f"first):\n{channel.stacks(w, _torch_compat.worker_pid(self.iterator, w))}"
            for w in workers
        )

    def checkpoints(
        self, delivered: Sequence[int], known: Mapping[int, Checkpoint | None] | None = None
    ) -> list[Checkpoint | None]:
        """Every worker's newest checkpoint at or before its ``delivered`` position (None:
        the pipeline's initial state, from a worker whose ``worker_init_fn`` raised); the
        workers in ``known`` are not asked: theirs is given.

        Raises:
            WorkerError: A worker is dead or did not answer within its command timeout.
        """
        if self.num_workers == 0:
            runtime = self.wrapper.runtime
            if runtime is None:
                raise WorkerError("internal error: the pipeline has not started; please report")
            return [runtime.checkpoint_for(delivered[0])]
        known = known or {}
        answers = self._request(
            Command.CHECKPOINT,
            [None if w in known else {"delivered": d} for w, d in enumerate(delivered)],
        )
        for answer in answers:
            if isinstance(answer, dict) and FAILED_INIT in answer:
                raise Failure(**answer[FAILED_INIT]).raised(in_worker=True, epoch=0, lost=None)
        return [
            known[w] if w in known else None if a is None else Checkpoint.model_validate(a)
            for w, a in enumerate(answers)
        ]

    def stats(self) -> list[dict[str, Any]]:
        """Every worker's figures (``PipelineRuntime.stats``)."""
        if self.num_workers == 0:
            runtime = self.wrapper.runtime
            return [runtime.stats()] if runtime is not None else []
        return [dict(answer) for answer in self._request(Command.STATS, [{}] * self.num_workers)]

    @property
    def started(self) -> bool:
        """Whether the pipeline runs (without workers it starts on the first item)."""
        return self.num_workers > 0 or self.wrapper.runtime is not None

    # -- faults -----------------------------------------------------------------------

    def dead_workers(self, error: BaseException | None = None) -> list[int]:
        """The workers that died. Torch's SIGCHLD handler raises RuntimeError in the main
        thread wherever it is when a worker dies, so ``error`` may come from any wait; a
        broken connection can arrive before the dying worker can be reaped (the kernel
        closes its files first), so such an error waits a moment for the death to show."""
        if self.num_workers == 0:
            return []
        dead = self._dead()
        if not dead and isinstance(error, (OSError, EOFError)):
            deadline = time.monotonic() + _DEATH_GRACE_SECONDS
            while not dead and time.monotonic() < deadline:
                with contextlib.suppress(RuntimeError):  # torch's SIGCHLD handler: a death
                    time.sleep(0.02)
                dead = self._dead()
        return dead

    def how_they_died(self, dead: Sequence[int]) -> str:
        """How the ``dead`` workers ended (a signal, an exit code), as torch says it, in
        parentheses after a space; empty when that is not known."""
        ends = " ".join(filter(None, (_torch_compat.worker_exit(self.iterator, w) for w in dead)))
        return f" ({ends})" if ends else ""

    def _dead(self) -> list[int]:
        count = _torch_compat.worker_count(self.iterator)
        return [w for w in range(count) if not _torch_compat.worker_alive(self.iterator, w)]

    def kill(self, workers: Sequence[int]) -> None:
        """Kills ``workers`` and waits (bounded) until they are gone.

        Torch's SIGCHLD handler raises RuntimeError in the main thread when a worker it
        watches dies; that is expected here, so it is absorbed while waiting.
        """
        iterator = self.iterator
        if not workers or self.num_workers == 0:
            return
        for worker_id in workers:
            _torch_compat.kill_worker(iterator, worker_id)
        _wait(lambda: not any(_torch_compat.worker_alive(iterator, w) for w in workers))

    def stop(self) -> None:
        """Stops the workers, closes the command channel and the pipeline. Idempotent."""
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        self.kill(sorted(self.given_up))  # NOTE [ Workers given up on ]
        self.given_up.clear()
        iterator, self.iterator = self.iterator, None
        if iterator is not None and self.num_workers > 0:
            pids = _torch_compat.worker_pids(iterator)
            _torch_compat.drop_persistent_iterator(self.loader, iterator)
            _torch_compat.remove_leaked_shared_memory(pids)
        if self.channel is not None:
            self.channel.close()
            self.channel = None
            self.wrapper.spec.channel = None
        self.wrapper.close()


def _wait(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + _DEATH_GRACE_SECONDS
    while time.monotonic() < deadline:
        try:
            if condition():
                time.sleep(0.05)  # torch's SIGCHLD handler runs here, if at all
                return
            time.sleep(0.02)
        except RuntimeError:
            continue
