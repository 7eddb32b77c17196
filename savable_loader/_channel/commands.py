"""The command channel between the loader and its worker processes.

NOTE [ Command channel ]
Each worker gets two one-way pipes, one for commands and one for answers, created from
the loader's multiprocessing context before the workers start (so fork, forkserver and
spawn all work: the pipes travel with the dataset wrapper). A worker runs a daemon
thread, :class:`CommandServer`, that answers requests while the worker's main thread
produces items; handlers take only short locks, so an answer never waits for the item
in progress. Pipes rather than queues: the command thread writes its answer itself,
where a queue would hand it to a feeder thread, a second wait for the GIL in a worker
whose main thread is busy with Python code. For the same reason a worker lowers its GIL
switch interval to 1 ms (from Python's 5 ms): it only matters when another thread asks
for the GIL, which the command thread does only to answer. Requests carry ids; the
loader discards answers to requests it gave up on.
Every wait in :meth:`CommandChannel.request` has a deadline and checks, a few times a
second, that the worker is alive: a dead or hung worker raises :class:`WorkerError`
naming it, never hangs. The commands are :class:`Command`'s members, each named once on
each side: the loader sends ``Command.X``; a worker answers it with the method ``x`` of
its :class:`Answers` (``_worker/wrapper.py``), through the one table :data:`HANDLERS`.
A new command is a member, a method of :class:`Answers`, and a row of the table.

NOTE [ Stacks of a hung worker ]
A worker that does not answer, or hangs in an item, is killed; what it was doing is the
one thing its user needs to fix it, and a worker stuck with the GIL held cannot say it
in Python. So each worker also gets a third pipe. The first thing the loader's code
does in a worker (:func:`register_stacks`, from the loader's ``worker_init_fn``, before
the user's) is to register :mod:`faulthandler` for ``SIGUSR2`` on the pipe's write end
(non-blocking, so a dump larger than the pipe is cut instead of blocking the worker) and
write a marker byte. Before the loader kills a hung worker, :meth:`CommandChannel.stacks`
checks the marker, sends the signal and reads what faulthandler writes from the signal
handler, in C, without the GIL: every thread's Python stack, which the loader's error
then carries. A worker whose ``SIGUSR2`` is someone else's (a handler the process had,
or one the user's ``worker_init_fn`` installs) writes another marker and is not
signalled. A worker that wrote no marker at all hung before the loader's code ran in it,
in torch's worker start-up: NOTE [ Workers that never started ] in ``_main/iterator.py``. Torch's
workers use no ``SIGUSR2`` of their own.
"""

from __future__ import annotations

import enum
import faulthandler
import itertools
import logging
import os
import select
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..errors import WorkerError

__all__ = [
    "HANDLERS",
    "Answers",
    "Command",
    "CommandChannel",
    "CommandServer",
    "NoAnswerError",
    "check_stacks_signal",
    "register_stacks",
]

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.05
#: NOTE [ Stacks of a hung worker ]: the signal, the marker, how long a dump may take to
#: arrive, and the most of it an error carries.
_STACKS_SIGNAL = getattr(signal, "SIGUSR2", None)
_STACKS_MARKER = b"\0"  # registered
_STACKS_TAKEN = b"\1"  # not registered: the user's code holds SIGUSR2
_STACKS_SECONDS = 1.0
_STACKS_MAX_BYTES = 32 * 1024
#: The stacks pipes this worker process registered with faulthandler.
_REGISTERED: list[Any] = []


class Command(enum.Enum):
    """What the loader asks a worker (NOTE [ Command channel ])."""

    #: The newest checkpoint at or before the position the loader handed on
    #: (argument ``delivered``), as a plain dict: every save asks it.
    CHECKPOINT = "checkpoint"
    #: The worker's figures (its pid, position, what its sources read).
    STATS = "stats"
    #: What the worker is doing now and for how long: the watchdog asks it.
    PROGRESS = "progress"

    @property
    def immediate(self) -> bool:
        """Answered at once, even while the worker starts: it reads nothing the start-up
        builds."""
        return self is Command.PROGRESS


class Answers(Protocol):
    """A worker's answers, one method per :class:`Command`, named as its value."""

    def checkpoint(self, delivered: int) -> Any: ...

    def stats(self) -> Any: ...

    def progress(self) -> Any: ...


#: How a worker answers each command: the one table between a request and its answer.
HANDLERS: dict[Command, Callable[[Answers, dict[str, Any]], Any]] = {
    Command.CHECKPOINT: lambda answers, arguments: answers.checkpoint(arguments["delivered"]),
    Command.STATS: lambda answers, arguments: answers.stats(),
    Command.PROGRESS: lambda answers, arguments: answers.progress(),
}


class NoAnswerError(WorkerError):
    """A worker did not answer a command in time: its process is alive but unresponsive.

    Attributes:
        worker_id: The worker that did not answer.
    """

    def __init__(self, message: str, *, worker_id: int) -> None:
        super().__init__(message)
        self.worker_id = worker_id


class CommandChannel:
    """The loader's end: one (command, result) queue pair per worker.

    Args:
        context: The multiprocessing context the workers are started with.
        num_workers: Number of workers.
    """

    def __init__(self, context: Any, num_workers: int) -> None:
        commands = [context.Pipe(duplex=False) for _ in range(num_workers)]
        results = [context.Pipe(duplex=False) for _ in range(num_workers)]
        #: Per worker: (the worker's end to read commands, the loader's end to send them).
        self.commands: list[tuple[Any, Any]] = commands
        #: Per worker: (the loader's end to read answers, the worker's end to send them).
        self.results: list[tuple[Any, Any]] = results
        #: Per worker: (the loader's end to read stacks, the worker's end faulthandler
        #: writes to) (NOTE [ Stacks of a hung worker ]).
        self.stack_pipes: list[tuple[Any, Any]] = [
            context.Pipe(duplex=False) for _ in range(num_workers)
        ]
        self._dumps = [_Dump() for _ in range(num_workers)]
        self._ids = itertools.count(1)
        self._closed = False

    def request(
        self,
        command: Command,
        arguments: Sequence[dict[str, Any] | None],
        *,
        timeout: float,
        is_alive: Callable[[int], bool],
    ) -> list[Any]:
        """Sends ``command`` to the workers and returns their answers in worker order.

        Args:
            command: The command.
            arguments: One argument dict per worker; None: that worker is not asked,
                and its answer is None.
            timeout: Seconds to wait for all answers together.
            is_alive: Tells whether worker ``i``'s process is still running.

        Raises:
            WorkerError: A worker died, did not answer in time, or failed the command.
        """
        name = command.value
        if self._closed:
            raise WorkerError(f"cannot send {name!r}: the workers' command channel is closed")
        request_id = next(self._ids)
        asked = [w for w, args in enumerate(arguments) if args is not None]
        for (_, send), args in zip(self.commands, arguments, strict=True):
            if args is not None:
                send.send((request_id, name, args))
        deadline = time.monotonic() + timeout
        answers: list[Any] = [None] * len(arguments)
        for worker_id in asked:
            answers[worker_id] = self._await(
                worker_id, request_id, name, deadline, timeout, is_alive
            )
        return answers

    def _await(
        self,
        worker_id: int,
        request_id: int,
        name: str,
        deadline: float,
        timeout: float,
        is_alive: Callable[[int], bool],
    ) -> Any:
        results = self.results[worker_id][0]
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoAnswerError(
                    f"worker {worker_id} did not answer {name!r} within {timeout:g} s; it may "
                    "be hung (raise WorkerConfig(command_timeout=...) if it is only slow)",
                    worker_id=worker_id,
                )
            try:
                ready = results.poll(min(_POLL_SECONDS, remaining))
                answer = results.recv() if ready else None
            except (EOFError, OSError) as error:
                raise WorkerError(
                    f"worker {worker_id}'s command channel broke before it answered {name!r} "
                    f"({error!r}); the worker probably died"
                ) from error
            if answer is not None:
                answer_id, ok, payload = answer
            else:
                if not is_alive(worker_id):
                    raise WorkerError(
                        f"worker {worker_id} died before answering {name!r}"
                    ) from None
                continue
            if answer_id != request_id:
                logger.debug("dropping stale answer %s from worker %d", answer_id, worker_id)
                continue
            if not ok:
                raise WorkerError(f"worker {worker_id} failed {name!r}:\n{payload}")
            return payload

    def reached(self, worker_id: int) -> bool:
        """Whether the loader's code ran in worker ``worker_id`` (its first marker came)."""
        dump = self._dumps[worker_id]
        if not (self._closed or dump.armed or dump.taken):
            dump.read(self.stack_pipes[worker_id][0].fileno(), 0.0)
        return dump.armed or dump.taken

    def stacks(self, worker_id: int, pid: int | None) -> str:
        """Worker ``worker_id``'s threads' stacks, as faulthandler writes them when the
        worker (process ``pid``) gets ``SIGUSR2``, or why they are unavailable (NOTE
        [ Stacks of a hung worker ]). Waits at most about a second."""
        if _STACKS_SIGNAL is None:
            return "(unavailable: this platform has no SIGUSR2)"
        if self._closed or pid is None:
            return "(unavailable: the worker is gone)"
        dump = self._dumps[worker_id]
        fd = self.stack_pipes[worker_id][0].fileno()
        dump.read(fd, 0.0)
        if dump.taken:
            return "(unavailable: the worker's SIGUSR2 has another handler)"
        if not dump.armed:
            return (
                "(unavailable: the worker had not reached the loader's code: it hung in "
                "torch's worker start-up, before worker_init_fn)"
            )
        dump.text.clear()
        try:
            os.kill(pid, _STACKS_SIGNAL)
        except OSError as error:
            return f"(unavailable: {error})"
        deadline = time.monotonic() + _STACKS_SECONDS
        while time.monotonic() < deadline and dump.read(fd, deadline - time.monotonic()):
            deadline = min(deadline, time.monotonic() + 0.1)  # the rest follows at once
        text = bytes(dump.text[:_STACKS_MAX_BYTES]).decode(errors="replace").rstrip()
        if not text:
            return f"(unavailable: none arrived within {_STACKS_SECONDS:g} s)"
        return text + ("\n(cut)" if len(dump.text) > _STACKS_MAX_BYTES else "")

    def close(self) -> None:
        """Closes the loader's end of every queue. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for pair in (*self.commands, *self.results, *self.stack_pipes):
            for connection in pair:
                connection.close()


def register_stacks(channel: CommandChannel, worker_id: int) -> None:
    """In worker ``worker_id``: lets the loader ask for its stacks (NOTE [ Stacks of a
    hung worker ]); unless ``SIGUSR2`` has a handler already, which the marker says."""
    pipe = channel.stack_pipes[worker_id][1]
    fd = pipe.fileno()
    if _STACKS_SIGNAL is None or signal.getsignal(_STACKS_SIGNAL) != signal.SIG_DFL:
        os.write(fd, _STACKS_TAKEN)  # the loader's code ran, but there is no dump to ask
        return
    os.set_blocking(fd, False)
    faulthandler.register(_STACKS_SIGNAL, file=fd, all_threads=True)
    _REGISTERED.append(pipe)  # faulthandler holds the fd: keep it open
    os.write(fd, _STACKS_MARKER)


def check_stacks_signal(channel: CommandChannel, worker_id: int) -> None:
    """In worker ``worker_id``, after the user's ``worker_init_fn``: tells the loader not
    to signal it if that function took ``SIGUSR2`` (a Python handler replaces
    faulthandler's)."""
    if _STACKS_SIGNAL is None or not _REGISTERED:
        return
    if signal.getsignal(_STACKS_SIGNAL) != signal.SIG_DFL:
        os.write(channel.stack_pipes[worker_id][1].fileno(), _STACKS_TAKEN)


class _Dump:
    """What the loader read so far from one worker's stacks pipe."""

    def __init__(self) -> None:
        self.armed = False  # the worker registered its stacks
        self.taken = False  # the worker found SIGUSR2 taken
        self.text = bytearray()

    def read(self, fd: int, timeout: float) -> bool:
        """Reads what is there within ``timeout`` seconds; whether anything was."""
        if not select.select([fd], [], [], max(timeout, 0.0))[0]:
            return False
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return False
        while not self.text and chunk[:1] in (_STACKS_MARKER, _STACKS_TAKEN):
            self.armed |= chunk[:1] == _STACKS_MARKER
            self.taken |= chunk[:1] == _STACKS_TAKEN
            chunk = chunk[1:]
        self.text += chunk
        return bool(chunk)


class CommandServer:
    """The worker's end: a daemon thread answering commands with ``answers``.

    Requests that arrive before :meth:`ready` (the worker is still restoring) wait for
    it; if the worker failed to start, :meth:`fail` makes every request answer with
    that failure. An immediate command (``Command.immediate``) is answered at once.
    """

    def __init__(self, channel: CommandChannel, worker_id: int, answers: Answers) -> None:
        self._commands = channel.commands[worker_id][0]
        self._results = channel.results[worker_id][1]
        self._answers = answers
        self._ready = threading.Event()
        self._failure: str | None = None
        self._thread = threading.Thread(
            target=self._serve, name="savable_loader-commands", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def ready(self) -> None:
        self._ready.set()

    def fail(self, failure: str) -> None:
        self._failure = failure
        self._ready.set()

    def _serve(self) -> None:
        while True:
            try:
                request = self._commands.recv()
            except (EOFError, OSError):
                return
            if request is None:
                return
            request_id, name, arguments = request
            try:
                answer = (request_id, True, self._answer(name, arguments))
            except Exception:
                answer = (request_id, False, traceback.format_exc())
            try:
                self._results.send(answer)
            except (BrokenPipeError, OSError):
                return

    def _answer(self, name: str, arguments: dict[str, Any]) -> Any:
        command = Command(name)  # a ValueError names an unknown one
        if not command.immediate:
            self._ready.wait()
            if self._failure is not None:
                raise RuntimeError(f"the worker failed to start:\n{self._failure}")
        return HANDLERS[command](self._answers, arguments)
