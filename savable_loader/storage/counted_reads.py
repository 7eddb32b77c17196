"""What a source's reads of remote files cost without a cache: counted files, counters.

NOTE [ Direct reads ]
Without ``cache_dir`` a source reads a remote file (``cacheable(url)`` in ``storage/cache/node.py``:
a URL with a protocol other than the local one, not chained) straight from the store.
``FileAccess.open`` then opens it through this process's :class:`CountedReads`, which
counts, in the same :class:`CacheStats` fields the cache fills:

* ``misses``: each open (every one goes to the store; a retried open counts again);
* ``bytes_downloaded``: the bytes read from the remote file, as stored (compressed: the
  decompression reads the counted file, above it), so a file read whole counts its
  stored size; a file closed early counts what was read of it;
* ``wait_seconds``: the time spent in the open (fsspec asks the store for the size; a
  process's first open also sets up the filesystem's client) and in the reads and seeks
  of the raw remote file, where the reader waits on the network or on the filesystem's
  read-ahead buffer. An open made ``ahead`` of the reader
  (``TableSource``'s fetch threads) counts its bytes and its miss, not its time: the
  reader's wait for it is counted once, by the reader (NOTE [ Fetching files ahead ] in
  ``datasets/files/table.py``), through :meth:`CountedReads.add_wait`.

``TokenSource`` without a cache reads a window with one range request (``cat_file``),
not through an open: it adds each request as a miss, with its bytes and its time. So
does ``TableSource`` for a file it reads whole and need not decompress
(:meth:`CountedReads.cat`): one request, a byte range from 0 to the end, where an open,
or a ``cat_file`` of the whole file on S3, asks the store for the size first.
``hits`` and ``prefetched`` stay 0. Local files are opened as they are and counted
nowhere. The counters are this process's, as the cache's are: ``FileAccess`` keeps one
:class:`CountedReads` per process id, so a forked worker starts its own.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import threading
import time
from typing import IO, Any, cast

from fsspec.compression import compr
from fsspec.core import get_compression

from .cache.held import HeldFile
from .cache.probe import read_whole
from .stats import CacheStats

__all__ = ["CountedFile", "CountedReads"]


class CountedReads:
    """One process's counters of the direct reads of a source (NOTE [ Direct reads ])."""

    def __init__(self) -> None:
        self._stats = CacheStats()
        self._lock = threading.Lock()

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def open(self, fs: Any, url: str, *, ahead: bool = False) -> IO[bytes]:
        """``url``, a remote file, opened with ``fs`` and decompressed by its extension;
        its open and its reads counted (not timed when ``ahead``).

        Raises:
            Exception: What ``fs`` raised (the caller turns it into a StorageError and
                retries it); the open counts as a miss all the same.
        """
        started = time.perf_counter()
        try:
            raw = fs.open(url, "rb")
        finally:
            self.add(misses=1, wait_seconds=0.0 if ahead else time.perf_counter() - started)
        counted = cast(IO[bytes], CountedFile(raw, self, timed=not ahead))
        compression = get_compression(url, "infer")
        if compression is None:
            return counted
        try:
            decompressed = compr[compression](counted, mode="rb")
        except BaseException:
            counted.close()
            raise
        # A decompressor does not close the file it reads: the HeldFile closes both.
        return HeldFile((decompressed, counted), lambda: None)  # type: ignore[return-value]

    def cat(self, fs: Any, url: str, *, ahead: bool = False) -> bytes:
        """``url``, a remote file, read whole with one request: a byte range from 0 to its
        end (a plain ``cat_file`` asks the size first on S3). A range no store can satisfy
        (``EINVAL``) is an empty file's when the store says its size is 0 (a second
        request). Each request is counted as an open, with its bytes and (unless
        ``ahead``) its time.

        Raises:
            Exception: What ``fs`` raised (the caller turns it into a StorageError and
                retries it); the request counts as a miss all the same.
        """
        started, data, requests = time.perf_counter(), b"", 1
        try:
            try:
                whole = read_whole(fs, url)  # NOTE [ Synchronous GETs ] in _s3_client.py
                data = fs.cat_file(url, start=0) if whole is None else whole
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                requests = 2
                if fs.info(url).get("size") != 0:
                    raise
            return data
        finally:
            waited = 0.0 if ahead else time.perf_counter() - started
            self.add(bytes_downloaded=len(data), misses=requests, wait_seconds=waited)

    def add_wait(self, seconds: float) -> None:
        """Counts ``seconds`` a reader waited for files fetched ahead for it."""
        self.add(wait_seconds=seconds)

    def add(self, *, bytes_downloaded: int = 0, misses: int = 0, wait_seconds: float = 0.0) -> None:
        with self._lock:
            self._stats.bytes_downloaded += bytes_downloaded
            self._stats.misses += misses
            self._stats.wait_seconds += wait_seconds


class CountedFile(io.BufferedIOBase):
    """A remote file as opened by fsspec, whose reads ``counts`` counts: the bytes they
    return and, when ``timed``, the time they and the seeks take. Closing it closes the
    file."""

    def __init__(self, file: IO[bytes], counts: CountedReads, *, timed: bool) -> None:
        super().__init__()
        self._file = file
        self._counts = counts
        self._timed = timed

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return bool(self._file.seekable())

    def read(self, size: int | None = -1) -> bytes:
        started, data = time.perf_counter(), b""
        try:
            data = self._file.read(-1 if size is None else size)
            return data
        finally:
            self._count(len(data), started)

    def read1(self, size: int = -1) -> bytes:
        return self.read(size)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readline(self, size: int | None = -1) -> bytes:
        started, data = time.perf_counter(), b""
        try:
            # fsspec's buffered files take no size: a size only where one is given.
            data = (
                self._file.readline(size)
                if size is not None and size >= 0
                else self._file.readline()
            )
            return data
        finally:
            self._count(len(data), started)

    def seek(self, offset: int, whence: int = 0) -> int:
        started = time.perf_counter()
        try:
            return int(self._file.seek(offset, whence))
        finally:
            self._count(0, started)

    def tell(self) -> int:
        return int(self._file.tell())

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._file.close()
        finally:
            super().close()

    def _count(self, size: int, started: float) -> None:
        waited = time.perf_counter() - started if self._timed else 0.0
        self._counts.add(bytes_downloaded=size, wait_seconds=waited)
