"""The few private names of torch's ``DataLoader`` this library relies on, in one place.

NOTE [ Private torch names ]
Everything else extends ``DataLoader`` through public seams (``__init__``, the dataset
it iterates, ``__iter__``). Two things have no public seam: stopping a persistent
iterator's workers before the loader is garbage collected (needed by a restore on a
running loader and by ``close()``), and seeing the worker processes to tell a dead worker
from a slow one while waiting on a command, or to stop one that hung, and taking them off
torch's SIGCHLD watch (:func:`unwatch_workers`). One behaviour is
relied on without a private name: an iterator whose ``timeout`` expired raises
RuntimeError("DataLoader timed out after ...") and, asked again, keeps waiting for the
same item, losing nothing (NOTE [ Watchdog ] in ``_main/stream.py``).
``tests/processes/test_torch_compat.py`` pins each behaviour used here, so a torch upgrade that
changes one fails there first.

NOTE [ Delivery order before in_order ]
``DataLoader`` takes ``in_order`` from torch 2.6 on; it defaults to True, and torch
before it always delivered in order (round-robin over workers, NOTE [ Worker order ] in
``_main/book.py``). :func:`in_order_argument` passes ``in_order=True`` where torch takes it
and nothing where it does not, so the loader asks for the same order on every torch it
supports.

NOTE [ Shared memory of a killed worker ]
A worker sends a tensor through a shared memory file that torch creates under
``/dev/shm`` as ``torch_<pid>_...``. With torch's default sharing strategy
(``file_descriptor``) the worker unlinks it as soon as it is opened, so a worker killed
between the two leaves the file behind for good. With the ``file_system`` strategy the
file keeps its name while any tensor uses it: the last process to drop such a tensor
unlinks it, and aborts (SIGABRT, "could not unlink the shared memory file") when the
name is already gone; torch's ``torch_shm_manager`` removes the rest once every process
using it has exited. Once the workers of a stream are stopped,
:func:`remove_leaked_shared_memory` removes the files left under their pids that no
process maps or holds open, under either strategy: the files of a killed worker, and
those of tensors still in flight when the workers stopped, but never the file of a
tensor the main process (or any other process of this user) still holds: a batch in the
user's hand, or one torch's iterator buffered. This process is looked at first; the
others only when a file is still unclaimed. Without ``/proc`` nothing is removed.

NOTE [ The workers-done event ]
Torch's iterator shares a ``multiprocessing.Event`` with its workers; they poll
``is_set()`` on it, which takes the event's condition lock. A worker killed while it
holds that lock never releases it, and the main process's next ``is_set()`` (torch calls
it when it marks a dead worker unavailable) or ``set()`` (at shutdown) then blocks
forever. :func:`unblock_done_event` gives the main process a view of the event that takes
the lock as usual (live workers hold the semaphore for a moment inside their own
``is_set()``, so reading it without the lock could miss a set event), but waits for it at
most ``_LOCK_WAIT`` seconds and then reads or sets the semaphore without it: nobody waits
on the condition (workers poll), so nothing needs the notification the lock protects.
Live workers stuck on the lock are terminated by torch's shutdown after its join timeout.

NOTE [ The worker's dataset ]
Torch builds a worker's ``WorkerInfo`` with ``dataset=`` what it iterates (the worker
wrapper) right before it calls ``worker_init_fn``, and ``get_worker_info()`` returns that
same object for the rest of the worker's life. ``WorkerInfo`` refuses attribute
assignment (a frozen dataclass in recent torch, a guarded ``__setattr__`` before), so
:func:`set_worker_dataset` writes the attribute with ``object.__setattr__``, from the
loader's own ``worker_init_fn`` (``_worker/wrapper.py``): from then on ``worker_info.dataset`` is
the user's dataset, inside the user's ``worker_init_fn`` and during iteration.

NOTE [ A worker's first tensor ]
Torch's ``reduce_tensor``, which pickles every tensor a worker sends, imports
``torch.nested._internal.nested_tensor`` on its first call. Torch imports that module
itself from 2.5 or so on; torch 2.4 does not, and there the import brings SymPy and
``torch.fx``'s symbolic shapes: about 1 s of CPU in every worker, at every epoch whose
workers start anew, before its first batch leaves (a loader of 2 workers over 4 items:
0.97 s an epoch on torch 2.4, 0.08 s on 2.13; with the import done first, as here).
:func:`import_tensor_pickling` imports it in the main process before the workers start,
once: forked workers inherit it, and where torch already has it, it costs nothing.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import inspect
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, cast

from torch.utils.data import DataLoader
from torch.utils.data._utils import signal_handling

__all__ = [
    "deferred_worker_death",
    "drop_persistent_iterator",
    "drop_unfinished_iterator",
    "import_tensor_pickling",
    "in_order_argument",
    "is_timeout",
    "kill_worker",
    "remove_leaked_shared_memory",
    "set_worker_dataset",
    "unblock_done_event",
    "worker_alive",
    "worker_count",
    "worker_pids",
]

_TIMEOUT_MESSAGE = "DataLoader timed out after "
#: How long the main process waits for the workers-done event's lock before it takes the
#: lock as left held by a dead worker (a live worker holds it for microseconds).
_LOCK_WAIT = 0.5
_PROC = "/proc"
_TAKES_IN_ORDER = "in_order" in inspect.signature(DataLoader.__init__).parameters


_TENSOR_PICKLING = "torch.nested._internal.nested_tensor"


def import_tensor_pickling() -> None:
    """Imports what torch's tensor pickling imports on first use (NOTE [ A worker's first
    tensor ]), where it is not imported yet and exists."""
    if _TENSOR_PICKLING not in sys.modules:
        with contextlib.suppress(ImportError):
            importlib.import_module(_TENSOR_PICKLING)


def in_order_argument() -> dict[str, Any]:
    """``DataLoader``'s keyword for in-order delivery: ``{"in_order": True}`` where torch
    takes it, else ``{}`` (NOTE [ Delivery order before in_order ])."""
    return {"in_order": True} if _TAKES_IN_ORDER else {}


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


def worker_pid(iterator: Any, worker_id: int) -> int | None:
    """Worker ``worker_id``'s process id, while it runs; None otherwise."""
    workers = getattr(iterator, "_workers", None)
    if workers is None or worker_id >= len(workers) or not workers[worker_id].is_alive():
        return None
    return cast(int | None, workers[worker_id].pid)


def worker_exit(iterator: Any, worker_id: int) -> str:
    """How worker ``worker_id`` ended, in the words of torch's SIGCHLD handler ("DataLoader
    worker (pid N) is killed by signal: Killed."); empty while it runs or once reaped
    elsewhere."""
    workers = getattr(iterator, "_workers", None)
    if workers is None or worker_id >= len(workers) or workers[worker_id].is_alive():
        return ""
    process = workers[worker_id]
    code = process.exitcode
    if code is None:
        return ""
    if code < 0:
        try:
            name = signal.strsignal(-code) or f"signal {-code}"
        except ValueError:
            name = f"signal {-code}"
        return f"DataLoader worker (pid {process.pid}) is killed by signal: {name}."
    return f"DataLoader worker (pid {process.pid}) exited unexpectedly with exit code {code}."


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


class _DoneFlag:
    """The main process's view of torch's workers-done event (NOTE [ The workers-done
    event ]): under the event's lock as usual, unless that lock stays taken for
    :data:`_LOCK_WAIT` seconds (a worker died holding it); then without it."""

    def __init__(self, event: Any) -> None:
        # Keep the event itself: with spawn or forkserver, collecting one of its named
        # semaphores unlinks it before workers still starting have opened it.
        self._event = event
        self._lock = event._cond._lock
        self._flag = event._flag

    def _read(self) -> bool:
        if self._flag.acquire(False):
            self._flag.release()
            return True
        return False

    def is_set(self) -> bool:
        if self._lock.acquire(timeout=_LOCK_WAIT):
            try:
                return self._read()
            finally:
                self._lock.release()
        return self._read()

    def set(self) -> None:
        # Nobody waits on the event's condition (workers poll is_set()), so setting the
        # semaphore needs no notification.
        locked = self._lock.acquire(timeout=_LOCK_WAIT)
        try:
            self._flag.acquire(False)
            self._flag.release()
        finally:
            if locked:
                self._lock.release()


def unwatch_workers(iterator: Any) -> None:
    """Takes the iterator's workers off torch's SIGCHLD watch (NOTE [ Worker deaths are
    found where they are asked about ] in ``_main/stream.py``); torch's shutdown then skips
    them there too. A no-op once done, and for an iterator without workers."""
    if getattr(iterator, "_worker_pids_set", False):
        signal_handling._remove_worker_pids(id(iterator))  # type: ignore[attr-defined]
        iterator._worker_pids_set = False


def unblock_done_event(iterator: Any) -> None:
    """Replaces a multi-process iterator's ``_workers_done_event`` by :class:`_DoneFlag`,
    in the main process only (the workers already hold the real event)."""
    event = getattr(iterator, "_workers_done_event", None)
    if event is not None and not isinstance(event, _DoneFlag) and hasattr(event, "_flag"):
        iterator._workers_done_event = _DoneFlag(event)


def set_worker_dataset(info: Any, dataset: Any) -> None:
    """Makes ``info.dataset`` (``info`` is this worker's ``get_worker_info()``) be
    ``dataset`` (NOTE [ The worker's dataset ])."""
    object.__setattr__(info, "dataset", dataset)


def worker_pids(iterator: Any) -> list[int]:
    """The process ids of a multi-process iterator's workers."""
    return [w.pid for w in getattr(iterator, "_workers", None) or () if w.pid is not None]


def remove_leaked_shared_memory(pids: list[int], folder: str = "/dev/shm") -> list[str]:
    """Removes torch's shared memory files left by the stopped processes ``pids`` that no
    process uses (NOTE [ Shared memory of a killed worker ]); returns the paths removed."""
    left = {p for pid in pids for p in glob.glob(os.path.join(folder, f"torch_{pid}_*"))}
    if not left or not os.path.isdir(_PROC):
        return []
    left -= _in_use(left, [os.getpid()])
    if left:
        left -= _in_use(left, _own_processes())
    removed = []
    for path in sorted(left):
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(path)
    return removed


def _own_processes() -> list[int]:
    """The processes of this user other than this one."""
    me, uid = os.getpid(), os.getuid()
    pids = []
    for entry in os.scandir(_PROC):
        with contextlib.suppress(OSError, ValueError):
            if entry.name.isdigit() and int(entry.name) != me and entry.stat().st_uid == uid:
                pids.append(int(entry.name))
    return pids


def _in_use(paths: set[str], pids: list[int]) -> set[str]:
    """Which of ``paths`` one of the processes ``pids`` maps or holds open (processes
    that are gone or cannot be read are skipped)."""
    used: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(os.path.join(_PROC, str(pid), "maps")) as maps:
                for line in maps:
                    fields = line.rstrip("\n").split(maxsplit=5)
                    if len(fields) == 6 and fields[5] in paths:
                        used.add(fields[5])
            fds = os.path.join(_PROC, str(pid), "fd")
            for fd in os.listdir(fds):
                with contextlib.suppress(OSError):
                    target = os.readlink(os.path.join(fds, fd))
                    if target in paths:
                        used.add(target)
    return used
