"""The fetch threads of a ``TableSource``: a small pool that reads files ahead of the rows.

What they fetch and when is NOTE [ Fetching files ahead ] in ``datasets/files/table.py``.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future

__all__ = ["Fetcher"]

#: Seconds a fetch thread waits for work before it exits (NOTE [ Fetching files ahead ]).
_IDLE_SECONDS = 1.0


class Fetcher:
    """Up to ``threads`` daemon threads that run ``fetch(url)`` for the requests handed to
    :meth:`submit`, in order (NOTE [ Fetching files ahead ])."""

    def __init__(self, threads: int, fetch: Callable[[str], bytes]) -> None:
        self.threads = threads
        self.fetch = fetch
        self.jobs: collections.deque[tuple[str, Future[bytes]]] = collections.deque()
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.running = 0
        self.waiting = 0
        self.closed = False

    def submit(self, url: str) -> Future[bytes]:
        """A future of ``fetch(url)``; cancelled if the fetcher closes before it runs."""
        future: Future[bytes] = Future()
        with self.lock:
            if self.closed:
                future.cancel()
                return future
            self.jobs.append((url, future))
            self.wake.notify()
            if len(self.jobs) > self.waiting and self.running < self.threads:
                self.running += 1
                thread = threading.Thread(target=self._work, name="table-fetch", daemon=True)
                thread.start()
        return future

    def _work(self) -> None:
        while True:
            with self.lock:
                while not self.jobs and not self.closed:
                    self.waiting += 1
                    woken = self.wake.wait(_IDLE_SECONDS)
                    self.waiting -= 1
                    if not woken and not self.jobs:
                        break
                if self.closed or not self.jobs:
                    self.running -= 1
                    return
                url, future = self.jobs.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.fetch(url))
            except BaseException as error:
                future.set_exception(error)

    def close(self) -> None:
        """Cancels the requests not started and lets the threads exit; idempotent."""
        with self.lock:
            self.closed = True
            jobs, self.jobs = self.jobs, collections.deque()
            self.wake.notify_all()
        for _, future in jobs:
            future.cancel()
