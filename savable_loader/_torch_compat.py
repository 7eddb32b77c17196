"""The few private names of torch's ``DataLoader`` this library relies on, in one place.

NOTE [ Private torch names ]
Everything else extends ``DataLoader`` through public seams (``__init__``, the dataset
it iterates, ``__iter__``). Two things have no public seam: stopping a persistent
iterator's workers before the loader is garbage collected (needed by a restore on a
running loader and by ``close()``), and seeing the worker processes to tell a dead worker
from a slow one while waiting on a command, or to stop one that hung. One behaviour is
relied on without a private name: an iterator whose ``timeout`` expired raises
RuntimeError("DataLoader timed out after ...") and, asked again, keeps waiting for the
same item, losing nothing (NOTE [ Watchdog ] in ``loader.py``).
``tests/test_torch_compat.py`` pins each behaviour used here, so a torch upgrade that
changes one fails there first.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

__all__ = [
    "deferred_worker_death",
    "drop_persistent_iterator",
    "drop_unfinished_iterator",
    "is_timeout",
    "kill_worker",
    "worker_alive",
    "worker_count",
]

_TIMEOUT_MESSAGE = "DataLoader timed out after "


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a multi-process iterator's "no item within ``timeout``"."""
    return isinstance(error, RuntimeError) and str(error).startswith(_TIMEOUT_MESSAGE)


def kill_worker(iterator: Any, worker_id: int) -> None:
    """Kills worker ``worker_id`` of a multi-process iterator (SIGKILL on POSIX)."""
    workers = getattr(iterator, "_workers", None)
    if workers is not None and worker_id < len(workers) and workers[worker_id].is_alive():
        workers[worker_id].kill()


def worker_alive(iterator: Any, worker_id: int) -> bool:
    """Whether worker ``worker_id`` of a multi-process iterator is still running."""
    workers = getattr(iterator, "_workers", None)
    if workers is None or worker_id >= len(workers):
        return False
    return bool(workers[worker_id].is_alive())


def worker_count(iterator: Any) -> int:
    """Number of worker processes a multi-process iterator started."""
    return len(getattr(iterator, "_workers", ()))


def drop_persistent_iterator(loader: DataLoader[Any], iterator: Any) -> None:
    """Stops ``iterator``'s workers and makes ``loader`` forget it.

    The next ``DataLoader.__iter__`` then starts fresh workers (torch keeps a persistent
    iterator in ``loader._iterator`` and would otherwise only ``_reset`` it).
    """
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    if getattr(loader, "_iterator", None) is iterator:
        loader._iterator = None


def drop_unfinished_iterator(loader: DataLoader[Any], error: BaseException) -> list[int]:
    """Stops the workers of an iterator whose construction raised ``error``.

    The iterator was never returned: it is the ``self`` of a frame in the traceback, or,
    when the error came just after the constructor, the loader's persistent iterator.

    Returns:
        The workers that had died (empty when no iterator was found).
    """
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    iterator = getattr(loader, "_iterator", None)
    traceback = error.__traceback__
    while traceback is not None:
        candidate = traceback.tb_frame.f_locals.get("self")
        if isinstance(candidate, _MultiProcessingDataLoaderIter):
            iterator = candidate
            break
        traceback = traceback.tb_next
    if iterator is None:
        return []
    dead = [w for w in range(worker_count(iterator)) if not worker_alive(iterator, w)]
    drop_persistent_iterator(loader, iterator)
    return dead


class _Deferred:
    """A SIGCHLD handler that only notes the signal while active, then passes it on."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.active = True
        self.pending = False

    def __call__(self, signum: int, frame: Any) -> None:
        if self.active:
            self.pending = True
        elif callable(self.previous):
            self.previous(signum, frame)


@contextlib.contextmanager
def deferred_worker_death() -> Iterator[None]:
    """Holds back torch's SIGCHLD handler (which raises RuntimeError in the main thread
    when a worker dies, wherever the thread is) while torch builds an iterator, and runs
    it at the end, where its error is expected.

    An exception raised asynchronously inside torch's constructor can leave one of its
    queues' locks held, and stopping the workers would then wait on it forever. Only the
    main thread runs Python signal handlers; elsewhere this does nothing.
    """
    sigchld = getattr(signal, "SIGCHLD", None)
    if sigchld is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(sigchld)
    deferred = _Deferred(previous)
    signal.signal(sigchld, deferred)
    try:
        yield
    finally:
        deferred.active = False
        if signal.getsignal(sigchld) is deferred:
            signal.signal(sigchld, previous if previous is not None else signal.SIG_DFL)
        # Else torch installed its own handler meanwhile; it chains to ``deferred``, which
        # now passes every signal on.
        handler = signal.getsignal(sigchld)
        if deferred.pending and callable(handler):
            handler(sigchld, None)
