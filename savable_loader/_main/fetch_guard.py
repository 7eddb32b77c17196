"""A thread that checks on the workers while the main thread is stuck in torch's iterator.

NOTE [ A fetch stuck on a worker ]
The watchdog (NOTE [ Watchdog ] in ``_main/stream.py``) runs between the main thread's tries at
torch's iterator, each try bounded by the poll interval. One wait inside a try has no
bound: a batch of tensors travels as handles to the worker's shared memory, and with
torch's default sharing strategy (``file_descriptor``) the main process, unpickling the
batch, asks a thread of the worker (multiprocessing's resource sharer) for each file
descriptor and waits for the answer without a timeout. A worker whose batch went out
and which then hangs with the GIL held (a deadlocked C extension, a native call that
never returns) cannot answer, and the main thread waits as long as the worker hangs;
torch's own ``DataLoader`` waits there forever. So a stream starts a :class:`FetchGuard`
with its workers: while the main thread has been in torch's iterator for longer than two
poll intervals, the guard runs the stream's check in its place, once per poll interval.
The check asks every worker for its progress; one that does not answer within
``command_timeout`` is hung as the watchdog would have found it: the stream keeps the
hang and kills the hung workers, which breaks the main thread's wait (the worker's end
of the connection closes), and the main thread raises the kept hang instead of the error
torch raised. The guard and the main thread take turns on the command channel (the
stream's lock), and the guard never acts while the main thread is out of torch's
iterator. With ``pin_memory=True`` torch's pin thread does that unpickling, the main
thread's tries stay bounded, and the watchdog finds the hang itself. Torch 2.4, whose
wait then fails with the worker not yet reaped, opens 10 temporary files to test for a
lack of file descriptors and leaves them to the garbage collector (a ``ResourceWarning``
when they are collected; later torch closes them).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

__all__ = ["FetchGuard"]

_POLLS_BEFORE_A_CHECK = 2


class FetchGuard:
    """Runs ``check`` (under ``lock``) while the main thread is stuck in a fetch.

    Args:
        check: A method checking the workers; returns True once it found what it looks
            for, which ends the guard. Held weakly, so that the guard does not keep its
            stream alive (NOTE [ Workers stop with the loader ] in ``_main/stream.py``); the
            guard ends when the stream is gone.
        poll: The stream's poll interval in seconds.
        lock: The lock the main thread holds while it talks to the workers.
    """

    def __init__(self, check: Callable[[], bool], poll: float, lock: threading.RLock) -> None:
        self._check = weakref.WeakMethod(check)
        self._poll = poll
        self._lock = lock
        #: When the main thread entered its current fetch (None: it is not fetching).
        self._since: float | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="savable_loader-fetch-guard", daemon=True
        )
        self._thread.start()

    def enter(self) -> None:
        """The main thread begins a fetch from torch's iterator."""
        self._since = time.monotonic()

    def leave(self) -> None:
        """The main thread's fetch returned or raised."""
        self._since = None

    def close(self) -> None:
        """Ends the guard; returns once no check runs (bounded by the check's own wait)."""
        self._closed.set()
        if threading.current_thread() is not self._thread:
            with self._lock:  # a check in progress finishes first
                pass
            self._thread.join(timeout=self._poll + 1.0)

    def _run(self) -> None:
        while not self._closed.wait(self._poll):
            since = self._since
            if self._check() is None:  # the stream is gone
                return
            if since is None or time.monotonic() - since < _POLLS_BEFORE_A_CHECK * self._poll:
                continue
            if self._checked(since):
                return

    def _checked(self, since: float) -> bool:
        """Runs the check unless the fetch entered at ``since`` ended; whether it found."""
        with self._lock:
            check = self._check()
            # The main thread may have come back while the lock was taken.
            if check is None or self._closed.is_set() or self._since != since:
                return check is None
            return check()
