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
naming it, never hangs. Commands are a name plus plain arguments, so the set is open:
``checkpoint``, ``stats`` and ``progress`` today.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .errors import WorkerError

__all__ = ["CommandChannel", "CommandServer", "NoAnswerError"]

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.05
Handler = Callable[[dict[str, Any]], Any]


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
        self._ids = itertools.count(1)
        self._closed = False

    def request(
        self,
        name: str,
        arguments: Sequence[dict[str, Any]],
        *,
        timeout: float,
        is_alive: Callable[[int], bool],
    ) -> list[Any]:
        """Sends command ``name`` to every worker and returns their answers in worker order.

        Args:
            name: The command.
            arguments: One argument dict per worker.
            timeout: Seconds to wait for all answers together.
            is_alive: Tells whether worker ``i``'s process is still running.

        Raises:
            WorkerError: A worker died, did not answer in time, or failed the command.
        """
        if self._closed:
            raise WorkerError(f"cannot send {name!r}: the workers' command channel is closed")
        request_id = next(self._ids)
        for (_, send), args in zip(self.commands, arguments, strict=True):
            send.send((request_id, name, args))
        deadline = time.monotonic() + timeout
        return [
            self._await(worker_id, request_id, name, deadline, timeout, is_alive)
            for worker_id in range(len(self.commands))
        ]

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

    def close(self) -> None:
        """Closes the loader's end of every queue. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for pair in (*self.commands, *self.results):
            for connection in pair:
                connection.close()


class CommandServer:
    """The worker's end: a daemon thread answering commands with ``handlers``.

    Requests that arrive before :meth:`ready` (the worker is still restoring) wait for
    it; if the worker failed to start, :meth:`fail` makes every request answer with
    that failure. Commands in ``immediate`` (``progress``) are answered at once, even
    while the worker starts: they read nothing the start-up builds.
    """

    def __init__(
        self,
        commands: Any,
        results: Any,
        handlers: dict[str, Handler],
        immediate: dict[str, Handler] | None = None,
    ) -> None:
        self._commands = commands[0]
        self._results = results[1]
        self._handlers = handlers
        self._immediate = immediate or {}
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
        immediate = self._immediate.get(name)
        if immediate is not None:
            return immediate(arguments)
        self._ready.wait()
        if self._failure is not None:
            raise RuntimeError(f"the worker failed to start:\n{self._failure}")
        handler = self._handlers.get(name)
        if handler is None:
            raise KeyError(f"unknown command {name!r}")
        return handler(arguments)
