"""A cache entry being downloaded, read while its bytes arrive (NOTE [ Reading a download ]).

NOTE [ Reading a download ]
A file source's reader that opens a remote file the cache does not hold downloads it
itself (NOTE [ File cache ] in ``storage/cache/node.py``); a shard of hundreds of MB would then hold
its first sample back until its last byte arrived. For a file of at least
:data:`STREAM_MIN_BYTES` opened by a stream's reader (``stream=True``: the tar and JSON
lines cursors, which read from the start or one offset on), the download runs in a
thread of the reader's process instead, and the reader reads the temp file as it grows:

* The thread fetches the file in byte ranges, one request each, in order, the first of
  :data:`FIRST_CHUNK_BYTES` and each next one twice the last, up to
  :data:`MAX_CHUNK_BYTES` (a 50 MB shard takes 7 requests), so the first bytes come after
  one small request and a large file costs few. The last range asks for one byte past the
  signature's size: a longer or shorter answer means the file changed since its
  signature was taken, and fails the download (:class:`Changed`, a ``ConnectionError``,
  which the reader's retry answers by opening the file anew). On S3 so does a range of
  another ETag than the signature's (``range_reader`` in ``storage/cache/probe.py``), not retried.
* Each range's request is retried by the thread under the source's retry policy (NOTE
  [ Retries ] in ``storage/retry.py``), so a fault costs one range, not the bytes before it. When
  a range's attempts are spent, the download fails with a ``StorageError`` that the
  reader's own retry does not take up again (a second round of attempts would square
  their number).
* The reader's reads and seeks are those of a local file, except that a read past the
  bytes written so far waits for them (the time is the reader's storage wait); a read
  after a failed download raises the download's error, once the bytes written before it
  are read.
* The rest is the cache's usual download: the thread holds the entry's ``.download``
  lock throughout, the complete file is fsynced, checked against the signature's size,
  renamed over ``<key>.data`` (the reader's open file is that inode, and stays readable)
  and the sidecar written. A reader that closes early leaves the thread to finish, so
  the entry serves the next open.
* A file opened for a memory map (``TokenSource``), a fetch ahead (``TableSource``), a
  prefetch or a count is downloaded whole first, as before.

Every download of a cache object, streamed or whole, is tracked by its :class:`InFlight`:
the cache's close cancels its prefetch threads' downloads, and the process's exit all of
them, removing the temp files of those it cannot wait for (NOTE [ File cache ] in
``storage/cache/node.py``, "Writes are atomic").
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "FIRST_CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "STREAM_MIN_BYTES",
    "Cancelled",
    "Changed",
    "Download",
    "GrowingFile",
    "InFlight",
    "fetch_into",
]

#: Files at least this large are read while they download (NOTE [ Reading a download ]).
STREAM_MIN_BYTES = 4 * 2**20
#: The first range of such a download, and the largest (NOTE [ Reading a download ]).
FIRST_CHUNK_BYTES, MAX_CHUNK_BYTES = 2**20, 16 * 2**20

_POLL_SECONDS = 1.0
_NEW = os.O_NOFOLLOW | os.O_CLOEXEC


class Changed(ConnectionError):
    """The remote file is not what its signature says: replaced since it was taken."""


class Cancelled(Exception):
    """A download stopped by the cache's close or by the process's exit (:class:`InFlight`)."""


class InFlight:
    """The downloads in flight of one cache object in one process: their temp files, and
    which of them are cancelled (a prefetch thread's after :meth:`stop_prefetch`, every
    one after :meth:`end`)."""

    def __init__(self) -> None:
        self._temps: set[Path] = set()
        self._prefetch_stopped = self._ended = False
        self._committing = 0
        self._mutex = threading.Lock()

    def add(self, temp: Path) -> Path:
        """Tracks ``temp``, the file of a download starting; returns it."""
        with self._mutex:
            self._temps.add(temp)
        return temp

    def discard(self, temp: Path) -> None:
        """The download of ``temp`` ended (its file renamed or removed)."""
        with self._mutex:
            self._temps.discard(temp)

    def check(self, prefetch: bool) -> None:
        """Raises :class:`Cancelled` if a download (a ``prefetch`` thread's) is cancelled."""
        if self._ended or (prefetch and self._prefetch_stopped):
            raise Cancelled("the cache was closed")

    @contextlib.contextmanager
    def committing(self) -> Iterator[None]:
        """A download becoming an entry, which :meth:`end` waits for.

        Raises:
            Cancelled: :meth:`end` ran: no entry is made any more.
        """
        with self._mutex:
            if self._ended:
                raise Cancelled("the process exits")
            self._committing += 1
        try:
            yield
        finally:
            with self._mutex:
                self._committing -= 1

    def stop(self, *, every: bool) -> None:
        """Cancels the prefetch threads' downloads (the cache's close), or ``every`` one."""
        self._prefetch_stopped = True
        self._ended = self._ended or every

    def end(self, wait: float) -> None:
        """Cancels every download, waits up to ``wait`` seconds for the ones becoming
        entries, and removes the temp files of those still in flight (the process exits)."""
        self._ended = True
        deadline = time.monotonic() + wait
        while self._committing and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._mutex:
            temps, self._temps = self._temps, set()
        for temp in temps:
            with contextlib.suppress(OSError):
                temp.unlink()


class Download:
    """A file being written to ``temp`` in order, up to ``size`` bytes, by one thread.

    Creates ``temp`` (a new file, never through a link: NOTE [ A shared folder ] in
    ``storage/cache/entries.py``) and opens it for the reader (``reader_fd``, which the reader's
    :class:`GrowingFile` takes), before the thread can rename it away.
    """

    def __init__(self, temp: Path, size: int) -> None:
        self.temp = temp
        self.size = size
        self.reader_fd = os.open(temp, os.O_RDONLY | os.O_CREAT | os.O_EXCL | _NEW, 0o644)
        self._written = 0
        self._error: BaseException | None = None
        self._done = False
        self._changed = threading.Condition()

    def wrote(self, count: int) -> None:
        """The thread wrote ``count`` more bytes (already in the file)."""
        with self._changed:
            self._written += count
            self._changed.notify_all()

    def end(self, error: BaseException | None = None) -> None:
        """The download ended: complete, or failed with ``error``."""
        with self._changed:
            self._done, self._error = True, error
            self._changed.notify_all()

    def written_past(self, position: int, on_wait: Callable[[float], None]) -> int:
        """The bytes written, once more than ``position`` are or the download ended;
        ``on_wait`` gets the seconds waited.

        Raises:
            BaseException: The download's error, when it failed before ``position``.
        """
        with self._changed:
            if self._written > position or self._done:
                written = self._written
            else:
                started = time.perf_counter()
                while self._written <= position and not self._done:
                    self._changed.wait(_POLL_SECONDS)
                written = self._written
                on_wait(time.perf_counter() - started)
            if written <= position and self._error is not None:
                raise self._error
            return written


def fetch_into(
    fs: Any,
    url: str,
    download: Download,
    counted: Callable[[int], None],
    retried: Callable[[Callable[[], bytes | None]], bytes | None],
    *,
    first: bytes = b"",
    read: Callable[[int, int], bytes | None] | None = None,
) -> int:
    """Downloads ``url`` into ``download.temp`` (created already) range by range (NOTE
    [ Reading a download ]), each range's request run by ``retried`` (the source's retry
    policy), telling ``counted`` and then ``download`` as the bytes land (so that a
    reader who read them finds them counted). ``first``: the file's first bytes, fetched
    and counted already (NOTE [ Probing a download ] in ``storage/cache/probe.py``); the ranges
    start after them. ``read(start, end)``: a range's bytes (default ``fs.cat_file``),
    None when the answer is of another version of the file. Returns the bytes' CRC-32
    (NOTE [ Checked entries ] in ``storage/cache/entries.py``).

    Raises:
        Changed: The file's length is not ``download.size``.
        Exception: What ``retried`` or ``counted`` raised.
    """
    position, chunk, size = len(first), FIRST_CHUNK_BYTES, download.size
    crc = zlib.crc32(first)
    fd = os.open(download.temp, os.O_WRONLY | _NEW)
    try:
        if first:
            _write(fd, first)
            download.wrote(len(first))
            chunk = min(2 * max(len(first), FIRST_CHUNK_BYTES), MAX_CHUNK_BYTES)
        while position < size:
            end = min(position + chunk, size)
            last = end == size
            stop = end + 1 if last else end
            if read is None:
                request = functools.partial(fs.cat_file, url, start=position, end=stop)
            else:
                request = functools.partial(read, position, stop)
            data = retried(request)
            if data is None:  # not retried: the store would answer the same
                raise Changed(f"{url} was replaced while it was being downloaded")
            if len(data) != end - position:
                raise Changed(f"{url} answered {position + len(data)}+ bytes, not {size}")
            _write(fd, data)
            crc = zlib.crc32(data, crc)
            counted(len(data))
            download.wrote(len(data))
            position, chunk = end, min(chunk * 2, MAX_CHUNK_BYTES)
    finally:
        os.close(fd)
    return crc


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class GrowingFile(io.RawIOBase):
    """``download``'s file, read while it is written (NOTE [ Reading a download ]);
    ``on_wait`` gets the seconds a read waited for bytes. No ``fileno()``: a memory map
    of a file still being written would read zeros."""

    def __init__(self, download: Download, on_wait: Callable[[float], None]) -> None:
        super().__init__()
        self._download = download
        self._on_wait = on_wait
        self._fd = download.reader_fd
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        if self._position >= self._download.size or not len(buffer):
            return 0
        written = self._download.written_past(self._position, self._on_wait)
        data = os.pread(self._fd, min(len(buffer), written - self._position), self._position)
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._download.size}
        position = base[whence] + offset
        if position < 0:
            raise ValueError(f"negative seek position {position}")
        self._position = position
        return position

    def tell(self) -> int:
        return self._position

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()
