"""The few private names of torch's ``DataLoader`` this library relies on, in one place.

NOTE [ Private torch names ]
Everything else extends ``DataLoader`` through public seams (``__init__``, the dataset
it iterates, ``__iter__``). Two things have no public seam: stopping a persistent
iterator's workers before the loader is garbage collected (needed by a restore on a
running loader and by ``close()``), and seeing the worker processes to tell a dead worker
from a slow one while waiting on a command. ``tests/test_torch_compat.py`` pins each
behaviour used here, so a torch upgrade that changes one fails there first.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

__all__ = ["drop_persistent_iterator", "worker_alive", "worker_count"]


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
