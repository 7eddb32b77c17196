"""Keeping a cache folder under its limit: eviction and the recorded usage (NOTE [ File
cache ] in ``storage/cache/node.py``, its "Eviction" point). Links and other files the cache did not
make are neither counted, nor kept, nor removed; a link in place of ``.usage``, ``.over``
or a lock is a StorageError naming it (NOTE [ A shared folder ] in ``storage/cache/entries.py``)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from .entries import folder_error, open_fd, refuse_link, replace_file

__all__ = [
    "STALE_TEMP_SECONDS",
    "evict",
    "evict_after_close",
    "evict_locked",
    "flocked",
    "over",
    "record",
]

logger = logging.getLogger(__name__)

#: Age after which a temp file is a killed download's, and the usage record is rebuilt.
STALE_TEMP_SECONDS = 3600.0


@contextlib.contextmanager
def flocked(path: Path, mode: int) -> Iterator[int]:
    """``path`` (created if missing) locked with ``flock`` in ``mode`` while in the block.

    Raises:
        OSError: ``linked`` (``storage/cache/entries.py``) for a link at ``path``.
    """
    fd = open_fd(path, os.O_RDONLY | os.O_CREAT)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)


def over(directory: Path) -> bool:
    """Whether the last eviction left ``directory`` over its limit (the ``.over`` marker)."""
    return os.path.lexists(directory / ".over")


def record(directory: Path, limit: int, size: int) -> None:
    """Adds a download of ``size`` bytes to the folder's recorded usage; evicts when the
    record says the entries exceed ``limit``, or is missing or an hour old."""
    usage = directory / ".usage"
    with flocked(directory / ".evict.lock", fcntl.LOCK_EX):
        with contextlib.suppress(OSError, ValueError):
            with os.fdopen(open_fd(usage, os.O_RDONLY), "rb") as file:
                fresh = time.time() - os.fstat(file.fileno()).st_mtime < STALE_TEMP_SECONDS
                total = int(file.read()) + size
            if fresh and total <= limit:
                replace_file(directory, ".usage", str(total).encode())
                return
        evict_locked(directory, limit)


def evict(directory: Path, limit: int) -> None:
    """Removes the least recently used entries no one holds until the folder's entries
    take at most ``limit`` bytes."""
    with flocked(directory / ".evict.lock", fcntl.LOCK_EX):
        evict_locked(directory, limit)


def evict_after_close(directory: Path, limit: int) -> None:
    """:func:`evict`, as a reader's close runs it: an error of the folder is logged at
    WARNING, naming it, instead of failing the close of a file read in full (a download
    and an explicit eviction raise it; ``folder_error`` in ``storage/cache/entries.py``)."""
    try:
        evict(directory, limit)
    except OSError as exc:
        logger.warning("%s The folder may stay over its limit.", folder_error(directory, exc))


def evict_locked(directory: Path, limit: int) -> None:
    """:func:`evict` with ``.evict.lock`` held; records the usage it leaves and removes
    temp files an hour old.

    Raises:
        OSError: ``linked`` (``storage/cache/entries.py``) for a link at ``.usage`` or ``.over``.
    """
    refuse_link(directory / ".usage")
    refuse_link(directory / ".over")
    entries = []
    for data in directory.glob("*.data"):
        with contextlib.suppress(OSError):
            found = os.lstat(data)
            if stat.S_ISREG(found.st_mode):
                entries.append((found.st_mtime, found.st_size, data))
    total = sum(size for _, size, _ in entries)
    for _, size, data in sorted(entries):
        if total <= limit:
            break
        if _remove(data):
            total -= size
    if total > limit:
        os.close(open_fd(directory / ".over", os.O_RDONLY | os.O_CREAT))
    else:
        (directory / ".over").unlink(missing_ok=True)
    replace_file(directory, ".usage", str(total).encode())
    now = time.time()
    for temp in directory.glob(".tmp-*"):
        with contextlib.suppress(OSError):
            found = os.lstat(temp)
            if stat.S_ISREG(found.st_mode) and now - found.st_mtime > STALE_TEMP_SECONDS:
                temp.unlink()


def _remove(data: Path) -> bool:
    """Removes the entry of ``data`` unless someone holds it (its ``.lock``) or a file
    of it is a link (never touched: NOTE [ A shared folder ] in ``storage/cache/entries.py``)."""
    try:
        refuse_link(data.with_suffix(".json"))
        fd = open_fd(data.with_suffix(".lock"), os.O_RDONLY | os.O_CREAT)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return False
        raise
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a reader holds it
        data.with_suffix(".json").unlink(missing_ok=True)
        data.unlink(missing_ok=True)
        logger.debug("evicted %s", data)
        return True
    finally:
        os.close(fd)
