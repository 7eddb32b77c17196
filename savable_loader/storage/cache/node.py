"""A node-local cache of remote files, shared by the workers and ranks of one node.

NOTE [ File cache ]
With ``cache_dir`` a file source downloads each remote file whole into that folder before
reading it, and reads the local copy. An entry is three files named by the SHA-256 of the URL:
``<key>.data`` (the bytes as stored, still compressed), ``<key>.json`` (the sidecar: the remote
size and ETag or modification time that fsspec's ``info()`` gave, and the URL), and two
``fcntl.flock`` lock files, never deleted (unlinking a lock file races with its next user):
``<key>.lock``, held shared by the entry's users, and ``<key>.download``, held exclusively by
its one writer.

* An entry is valid when its sidecar exists and its size and ETag/mtime (its signature)
  equal what ``info()`` says now; a later open, in this process or another, after a restart
  too, reads it without downloading. A changed remote file is downloaded again. An open
  of a URL that has no sidecar takes the signature from the download's first request
  instead (NOTE [ Probing a download ] in ``storage/cache/probe.py``). A caller
  that knows the signature from a listing (NOTE [ Listing folders ] in ``storage/listing.py``,
  NOTE [ Listed signatures ] in ``datasets/files/file_list.py``) passes it instead of asking
  ``info()``; if the download's size then differs from it, ``info()`` is asked and the file
  downloaded again.
* Writes are atomic: the bytes go to a temp file in the same folder, are fsynced and renamed
  over ``<key>.data``; the sidecar is removed before and written (temp file, rename) after, so a
  sidecar never describes a partial file; it records a checksum of the bytes (NOTE [ Checked
  entries ] in ``storage/cache/entries.py``; no link in the folder is followed: NOTE [ A shared
  folder ] there). A process's exit cancels its downloads and removes their temp files; one
  killed midway leaves a ``.tmp-*`` file, removed by a later eviction once an hour old.
* Locks: a reader holds ``.lock`` shared from before it checks the entry until its file is
  closed (a prefetched entry is held the same way until the reader opens it). A download holds
  ``.download`` exclusively, so one process downloads and the others wait and then read its
  copy; it replaces the data by a rename, which leaves readers of an older copy reading their
  open file. An eviction takes ``.lock`` exclusively without waiting and skips the entry if it
  cannot, so no file in use or just downloaded is removed. Evictions run one at a time per
  folder (``.evict.lock``).
* Eviction: after a download, and after a reader closes a file while the folder was over
  ``cache_limit`` (a ``.over`` marker file says so), entries are removed least recently used
  first (the data file's mtime, touched at every open) until the total of the ``.data`` files is
  under the limit. Entries being read are kept, so the folder may exceed the limit while more
  files are open than it holds, and falls back once they are closed. A download adds its
  size to ``.usage`` (the entries' total, rewritten by every eviction) under ``.evict.lock``
  and scans the folder only when that total passes the limit, or the record is missing,
  unreadable or an hour old: so many small files cost no scan each.
* A file larger than ``cache_limit`` is not cached: it is streamed from the store as without a
  cache (counted as a miss, not as downloaded bytes).
* Files are opened from the cache as local files and decompressed by the URL's extension, as
  ``compression="infer"`` does for the remote file.
* A stream's reader that downloads a large file itself reads it as it arrives (NOTE [ Reading
  a download ] in ``storage/cache/download.py``); eviction and the usage record are
  ``storage/cache/evict.py``'s.

NOTE [ Prefetching files ]
``prefetch`` threads per process download the next files of a stream into the cache while the
current one is read (``ShardCursor.upcoming`` and NOTE [ Prefetching token files ] in
``datasets/files/tokens.py`` name them). They only fill the cache: what is read, and from where,
does not depend on them. Their errors are logged at DEBUG and dropped; the reader's own open
downloads, retries and raises as without them. An entry a prefetch validated is held, and opened
without asking ``info()`` again (at most ``prefetch`` per process: the oldest, never opened, is let
go). The threads are daemons, exit after a second idle, stop at :meth:`FileCache.close` and at the
process's exit (cancelling their downloads; the entries they held are evicted as at a reader's
close), and are rebuilt when needed. A forked child (a DataLoader worker) closes its copies of
the locks its parent held, so that it keeps no entry from eviction that it does not use.

Near 500 lines: the cache, its locks and its download threads share held locks and pins.
"""

from __future__ import annotations

import fcntl
import functools
import io
import logging
import multiprocessing.util
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ..retry import RetryPolicy, retrying
from ..stats import CacheStats
from .download import STREAM_MIN_BYTES, Download, GrowingFile, InFlight, fetch_into
from .download import Changed as _Changed
from .entries import (
    Verified,
    cacheable,
    commit,
    entry_path,
    final_error,
    intact,
    is_valid,
    open_fd,
    signature_of,
    temp_path,
)
from .evict import evict, evict_after_close, over, record
from .held import HeldFile, HeldLocks, decompressed
from .probe import asks, probe, range_reader, write_rest

__all__ = ["DEFAULT_CACHE_LIMIT", "FileCache", "cacheable", "signature_of"]

logger = logging.getLogger(__name__)

#: ``cache_limit`` when a ``cache_dir`` is given without one: 10 GiB.
DEFAULT_CACHE_LIMIT = 10 * 2**30

_IDLE_SECONDS = 1.0
#: How long a process's exit waits for its cancelled downloads before removing their files.
_EXIT_SECONDS = 1.0

#: Every cache object of this process: a forked child lets go of what they hold, and the
#: process's exit (a worker's too: multiprocessing's finalizers) of all they do.
_CACHES: weakref.WeakSet[FileCache] = weakref.WeakSet()
_EXIT_HOOK = [0]  # the process that registered _at_exit


def _after_fork_in_child() -> None:
    for cache in list(_CACHES):
        cache._forget_inherited()


def _at_exit() -> None:
    for cache in list(_CACHES):  # downloads cancelled, the files of those left removed
        cache._flight.stop(every=True)  # the threads stop at their next bytes
        cache.close(wait=_EXIT_SECONDS)
        cache._flight.end(_EXIT_SECONDS)
        if cache._locks.drop_all() and over(cache.directory):  # readers' files: never closed
            evict_after_close(cache.directory, cache.limit)


os.register_at_fork(after_in_child=_after_fork_in_child)


class FileCache:
    """The cache of one folder, as one process uses it (NOTE [ File cache ]).

    Args:
        directory: The folder, created if missing; may be shared by the processes of
            a node.
        limit: Bytes the entries may take once no reader holds them.
        prefetch: Threads (and files ahead) that download files before they are read.
    """

    def __init__(self, directory: str | os.PathLike[str], limit: int, prefetch: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)  # NOTE [ A shared folder ]
        self.limit = limit
        self.prefetch = prefetch
        self.stats = CacheStats()
        self._verified = Verified()  # NOTE [ Checked entries ] in cache_entries.py
        self._flight = InFlight()
        self._mutex = threading.Lock()
        self._checked: dict[str, dict[str, Any]] = {}  # prefetched: url -> signature
        self._pinned: dict[str, int] = {}  # prefetched: url -> fd of its shared lock
        self._wanted: set[str] = set()
        self._jobs: queue.Queue[tuple[str, Any, Any] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._locks = HeldLocks()  # of the entries this object holds
        _CACHES.add(self)
        if _EXIT_HOOK[0] != os.getpid():
            _EXIT_HOOK[0] = os.getpid()
            multiprocessing.util.Finalize(None, _at_exit, exitpriority=10)

    def path(self, url: str, suffix: str) -> Path:
        """The file of ``url``'s entry with ``suffix`` (``.data``, ``.json``, ``.lock``...)."""
        return entry_path(self.directory, url, suffix)

    # -- reading -------------------------------------------------------------------------

    def open(
        self,
        url: str,
        fs_for: Callable[[], Any],
        *,
        ahead: bool = False,
        known: dict[str, Any] | None = None,
        stream: bool = False,
        retry: RetryPolicy | None = None,
    ) -> IO[bytes]:
        """``url`` opened from the cache, downloaded first unless a valid entry holds it;
        decompressed by the URL's extension. Closing the file releases the entry.
        ``fs_for()`` gives the filesystem of ``url``, asked for only when the store is (a
        hit of a listed file asks nothing: a forked worker then builds no client). An
        open made ``ahead`` of the reader (a ``TableSource`` fetch thread) is not counted
        in ``wait_seconds``: the reader's wait for it is. ``known``: the file's signature
        from a listing (:func:`signature_of`), used instead of asking ``info()``, which is
        asked after all if the download disagrees with it (NOTE [ File cache ]).
        ``stream``: a download this open makes is read as it arrives (NOTE [ Reading a
        download ] in ``storage/cache/download.py``), its ranges retried under ``retry``.

        Raises:
            Exception: What the filesystem raised (the caller makes it a StorageError,
                retried).
        """
        started = time.perf_counter()
        fs_for = functools.cache(fs_for)  # one filesystem for the whole open, if any
        try:
            with self._mutex:
                checked = self._checked.pop(url, None)
            first = None  # NOTE [ Probing a download ] in cache_probe.py
            signature = checked or known
            if signature is None:
                signature, first = self._signature(url, fs_for())
            listed = checked is None and known is not None
            while True:
                if signature["size"] > self.limit:
                    self._count(misses=1)
                    size = signature["size"]
                    logger.debug("%s: %d bytes, over the cache limit: streamed", url, size)
                    return fs_for().open(url, "rb", compression="infer")  # type: ignore[no-any-return]
                try:
                    fd, downloaded, download = self._hold(
                        url, fs_for, signature, stream=stream, retry=retry, first=first
                    )
                    break
                except _Changed:
                    if not listed:
                        raise
                    listed = False  # replaced since the listing: ask the store
                    logger.debug("%s: changed since it was listed", url)
                    signature = signature_of(fs_for().info(url))
        finally:
            self._count(wait_seconds=0.0 if ahead else time.perf_counter() - started)
        with self._mutex:
            pinned = self._pinned.pop(url, None)
            self._wanted.discard(url)
        if pinned is not None:
            self._locks.drop(pinned)
        self._count(misses=1 if downloaded else 0, hits=0 if downloaded else 1)
        try:
            files = self._open_local(url, download)
        except BaseException:
            self._locks.drop(fd)
            raise
        return HeldFile(files, functools.partial(self._release, fd))  # type: ignore[return-value]

    def _signature(self, url: str, fs: Any) -> tuple[dict[str, Any], bytes | None]:
        """``url``'s signature, and its first bytes when no entry of it exists and no
        prefetch thread of this process was asked for it: then the request that takes
        the signature fetches them too where ``fs`` can (NOTE [ Probing a download ] in
        ``storage/cache/probe.py``); they count as downloaded."""
        with self._mutex:
            prefetching = url in self._wanted  # its download is under way: wait for it
        if not prefetching and not os.path.lexists(self.path(url, ".json")):
            probed = probe(fs, url)
            if probed is not None:
                self._count(bytes_downloaded=len(probed[1]))
                return signature_of(probed[0]), probed[1]
        return signature_of(fs.info(url)), None

    def _forget_inherited(self) -> None:
        """In a forked child: lets go of the parent's locks, threads and downloads."""
        self._mutex = threading.Lock()
        self._threads, self._pinned, self._checked, self._wanted = [], {}, {}, set()
        self._jobs, self._flight, self._verified = queue.Queue(), InFlight(), Verified()
        self._locks.forget()

    def _release(self, fd: int) -> None:
        self._locks.drop(fd)
        if over(self.directory):
            evict_after_close(self.directory, self.limit)

    def _open_local(self, url: str, download: Download | None = None) -> tuple[IO[bytes], ...]:
        """The entry's file (or the one ``download`` writes), decompressed (``decompressed``)."""
        if download is None:
            return decompressed(os.fdopen(open_fd(self.path(url, ".data"), os.O_RDONLY), "rb"), url)
        growing = GrowingFile(download, lambda waited: self._count(wait_seconds=waited))
        return decompressed(io.BufferedReader(growing), url)

    def _hold(
        self,
        url: str,
        fs_for: Callable[[], Any],
        signature: dict[str, Any],
        *,
        prefetch: bool = False,
        stream: bool = False,
        retry: RetryPolicy | None = None,
        first: bytes | None = None,
    ) -> tuple[int, bool, Download | None]:
        """A shared lock on a valid, intact entry of ``url`` (its fd; NOTE [ Checked entries ]
        in ``storage/cache/entries.py``), whether this call downloaded it (``prefetch``: for a
        prefetch thread), and with ``stream``, the download still running for a large file
        (NOTE [ Reading a download ]). The shared lock is taken first and kept, so no eviction
        removes the entry between its download and its use. ``retry``: the policy of a
        streamed download's ranges; ``first``: the file's first bytes, from a probe."""
        fd = self._locks.take(self.path(url, ".lock"), fcntl.LOCK_SH)
        try:
            if intact(self.directory, url, signature, self._verified):
                return fd, False, None
            downloaded, download = False, None
            lock: int | None = self._locks.take(self.path(url, ".download"), fcntl.LOCK_EX)
            try:
                if not intact(self.directory, url, signature, self._verified):  # downloaded since?
                    downloaded, fs = True, fs_for()
                    if stream and signature["size"] >= STREAM_MIN_BYTES:
                        temp = self._flight.add(temp_path(self.directory, url))
                        download = Download(temp, signature["size"])
                        threading.Thread(
                            target=self._stream,
                            args=(url, fs, signature, download, lock, retry, first),
                            name="cache-stream",
                            daemon=True,
                        ).start()
                        lock = None  # the thread's now
                    else:
                        self._download(url, fs, signature, prefetch=prefetch, first=first)
            finally:
                if lock is not None:
                    self._locks.drop(lock)
            if download is None and not is_valid(self.directory, url, signature):
                raise _Changed(f"{url} changed while it was being cached")
        except BaseException:
            self._locks.drop(fd)
            raise
        return fd, downloaded, download

    def _stream(
        self,
        url: str,
        fs: Any,
        signature: dict[str, Any],
        download: Download,
        lock: int,
        retry: RetryPolicy | None,
        first: bytes | None,
    ) -> None:
        """The thread of a download read as it arrives; holds the download ``lock``."""

        def retried(call: Callable[[], bytes | None]) -> bytes | None:
            return retrying(url, call, lambda: None, retry)

        try:
            read = range_reader(fs, url, signature["etag"])
            counted = self._landed(prefetch=False)
            crc = fetch_into(fs, url, download, counted, retried, first=first or b"", read=read)
            self._commit(url, download.temp, signature, crc, counted=True)
        except BaseException as exc:
            download.temp.unlink(missing_ok=True)
            download.end(final_error(self.directory, url, exc))
        else:
            download.end()
        finally:
            self._flight.discard(download.temp)
            self._locks.drop(lock)

    def _download(
        self,
        url: str,
        fs: Any,
        signature: dict[str, Any],
        *,
        prefetch: bool = False,
        first: bytes | None = None,
    ) -> None:
        """Downloads ``url`` into its entry (the caller holds its download lock), after its
        ``first`` bytes when a probe fetched them (NOTE [ Probing a download ]); counted
        before the sidecar makes the entry valid, as a reader that finds it valid expects."""
        temp = self._flight.add(temp_path(self.directory, url))  # removed at exit if left
        ours = first is not None or asks(fs, url)
        try:
            if ours:  # counted as it lands (a probe's bytes already are)
                landed = self._landed(prefetch)
                crc = write_rest(fs, url, signature, first or b"", temp, landed)
            else:
                crc = None  # read back for the checksum (NOTE [ Checked entries ])
                os.close(open_fd(temp, os.O_RDONLY | os.O_CREAT | os.O_EXCL))  # ours, not a link
                fs.get_file(url, str(temp))  # one GET on object stores (open would HEAD first)
            self._commit(url, temp, signature, crc, prefetch=prefetch, counted=ours)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        finally:
            self._flight.discard(temp)

    def _landed(self, prefetch: bool) -> Callable[[int], None]:
        """Counts bytes as they land; stops a download ``InFlight`` cancels."""

        def landed(size: int) -> None:
            self._flight.check(prefetch)
            self._count(bytes_downloaded=size)

        return landed

    def _commit(
        self,
        url: str,
        temp: Path,
        signature: dict[str, Any],
        crc: int | None,
        *,
        prefetch: bool = False,
        counted: bool = False,
    ) -> None:
        """Makes ``temp`` ``url``'s entry (``cache_entries.commit``), counting its bytes
        unless they were ``counted`` as they landed, and keeps the folder's usage; not
        once the process exits (:meth:`exit`)."""

        def count(size: int) -> None:
            self._count(bytes_downloaded=0 if counted else size, prefetched=int(prefetch))

        with self._flight.committing():
            size = commit(self.directory, url, temp, signature, crc, count, self._verified)
        logger.debug("%s: %d bytes downloaded into %s", url, size, self.path(url, ".data"))
        record(self.directory, self.limit, size)

    def _count(self, **added: float) -> None:
        with self._mutex:
            for name, value in added.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)

    def evict(self) -> None:
        """Removes least recently used entries no one holds, down to ``limit`` bytes."""
        evict(self.directory, self.limit)

    # -- prefetching (NOTE [ Prefetching files ]) ----------------------------------------

    def want(
        self, urls: list[str], fs_for: Callable[[str], Any], known: dict[str, dict[str, Any]]
    ) -> None:
        """Downloads ``urls`` (the next files of a stream) in the background; ``known``:
        their signatures from a listing, where one holds them (as in :meth:`open`)."""
        if self.prefetch == 0:
            return
        with self._mutex:
            if self._closed:
                return
            fresh = [u for u in urls[: self.prefetch] if cacheable(u) and u not in self._wanted]
            self._wanted.update(fresh)
            for url in fresh:
                self._jobs.put((url, fs_for, known.get(url)))
            self._threads = [t for t in self._threads if t.is_alive()]
            for _ in range(min(self.prefetch, len(fresh)) - len(self._threads)):
                thread = threading.Thread(target=self._work, name="cache-prefetch", daemon=True)
                thread.start()
                self._threads.append(thread)

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=_IDLE_SECONDS)
            except queue.Empty:
                return
            if job is None:
                return
            url, fs_for, signature = job
            try:
                # The filesystem is built only if the store is asked: a file already held
                # under its listed signature costs none (NOTE [ Listed signatures ] in
                # ``datasets/files/file_list.py``).
                self._fetch(url, functools.cache(functools.partial(fs_for, url)), signature)
            except Exception as exc:  # the reader's own open retries and raises
                logger.debug("prefetching %s failed: %r", url, exc)
                with self._mutex:
                    self._wanted.discard(url)

    def _fetch(self, url: str, fs_for: Callable[[], Any], signature: dict[str, Any] | None) -> None:
        # Not probed: no reader waits for this round trip (NOTE [ Probing a download ]).
        signature = signature or signature_of(fs_for().info(url))
        if signature["size"] > self.limit:
            return
        fd, _, _ = self._hold(url, fs_for, signature, prefetch=True)
        dropped = []
        with self._mutex:
            keep = not self._closed and url in self._wanted and url not in self._pinned
            if keep:
                self._pinned[url] = fd
                self._checked[url] = signature
                while len(self._pinned) > self.prefetch:  # never read: let it go
                    oldest = next(iter(self._pinned))
                    dropped.append(self._pinned.pop(oldest))
                    self._checked.pop(oldest, None)
                    self._wanted.discard(oldest)
        if not keep:
            dropped.append(fd)
        self._let_go(dropped)

    def _let_go(self, fds: list[int]) -> None:
        """Releases entries a prefetch held, evicting as a reader's close does."""
        for fd in fds:
            self._locks.drop(fd)
        if fds and over(self.directory):
            evict_after_close(self.directory, self.limit)

    def close(self, wait: float = 30.0) -> None:
        """Stops the prefetch threads (their downloads in flight cancelled, waiting up to
        ``wait`` seconds for them) and releases the entries they hold, evicting as a
        reader's close does; idempotent. Files already opened stay readable."""
        with self._mutex:
            self._closed = True
            self._flight.stop(every=False)
            while True:
                try:
                    self._jobs.get_nowait()
                except queue.Empty:
                    break
            for _ in self._threads:
                self._jobs.put(None)
            threads, self._threads = self._threads, []
            pinned, self._pinned = self._pinned, {}
            self._wanted.clear()
            self._checked.clear()
        deadline = time.monotonic() + wait
        for thread in threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        self._let_go(list(pinned.values()))
