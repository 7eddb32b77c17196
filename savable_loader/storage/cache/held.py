"""Holding entries of the node's cache: the locks that hold them (:class:`HeldLocks`), and a
file opened from the cache, holding its entry while it is open (:class:`HeldFile`)."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from fsspec.compression import compr
from fsspec.core import get_compression

from .entries import open_fd

__all__ = ["HeldFile", "HeldLocks", "decompressed"]


class HeldLocks:
    """The ``flock`` locks by which one cache object holds entries (NOTE [ File cache ] in
    ``storage/cache/node.py``, "Locks"): their file descriptors, which a forked child lets go."""

    def __init__(self) -> None:
        self._fds: set[int] = set()
        self._mutex = threading.Lock()

    def take(self, path: Path, mode: int) -> int:
        """A lock on ``path`` (created if missing, never through a link: NOTE [ A shared
        folder ] in ``storage/cache/entries.py``) in ``mode`` (``fcntl.LOCK_SH`` or ``LOCK_EX``),
        waited for; its fd, held until :meth:`drop`."""
        fd = open_fd(path, os.O_RDONLY | os.O_CREAT)
        try:
            fcntl.flock(fd, mode)
        except BaseException:
            os.close(fd)
            raise
        with self._mutex:
            self._fds.add(fd)
        return fd

    def drop(self, fd: int) -> None:
        """Closes ``fd``, a held lock, unless a fork already let it go here."""
        with self._mutex:
            if fd not in self._fds:
                return
            self._fds.discard(fd)
        os.close(fd)

    def forget(self) -> None:
        """In a forked child: closes the child's copies of the parent's locks (the parent
        keeps its own), so the child holds nothing it does not use."""
        self._mutex = threading.Lock()
        self.drop_all()

    def drop_all(self) -> bool:
        """Closes every lock held (files opened stay readable); whether there was one."""
        with self._mutex:
            fds, self._fds = self._fds, set()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        return bool(fds)


def decompressed(raw: IO[bytes], url: str) -> tuple[IO[bytes], ...]:
    """``raw``, preceded by its decompressed view when ``url``'s extension names a
    compression (as ``compression="infer"`` reads the remote file): the files of a
    :class:`HeldFile`."""
    compression = get_compression(url, "infer")
    return (raw,) if compression is None else (compr[compression](raw, mode="rb"), raw)


class HeldFile(io.BufferedIOBase):
    """A file opened from the cache: reads go to ``files[0]``; closing it closes
    ``files`` and runs ``release`` once (the entry's lock)."""

    def __init__(self, files: tuple[IO[bytes], ...], release: Callable[[], None]) -> None:
        super().__init__()
        self._files = files
        self._file = files[0]
        self._release: Callable[[], None] | None = release

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        return self._file.read(-1 if size is None else size)

    def readinto(self, buffer: Any) -> int:
        data = self._file.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readline(self, size: int | None = -1) -> bytes:
        return self._file.readline(-1 if size is None else size)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def fileno(self) -> int:  # the cached data file's, when read as stored (a token map)
        if len(self._files) > 1:
            raise io.UnsupportedOperation("a decompressed file from the cache has no fileno")
        return self._files[0].fileno()

    def close(self) -> None:
        if self.closed:
            return
        try:
            for file in self._files:
                file.close()
        finally:
            super().close()
            release, self._release = self._release, None
            if release is not None:
                release()
