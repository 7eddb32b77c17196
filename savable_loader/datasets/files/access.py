"""How a source reaches its files: fsspec filesystems per process, retries, the cache.

Every source that reads files (the file sources, ``TokenSource``, ``TableSource``) mixes
:class:`FileAccess` in, so they share one meaning for ``retry``, ``storage_options``,
``cache_dir``, ``cache_limit`` and ``prefetch``, and one set of methods a user calls on
any of them: ``cache_stats()`` and ``close_cache()``. What the cache does is NOTE
[ File cache ] in ``storage/cache/node.py``; what is counted without one, NOTE [ Direct reads ] in
``storage/counted_reads.py``; how a read is retried is NOTE [ Retries ] in ``storage/retry.py``.

NOTE [ fsspec after fork ]
fsspec runs its async filesystems (s3fs, gcsfs, http) on one event loop, in a thread of
the process. A forked worker inherits that loop object but not its thread, so its first
call (``info``, ``open``) waits forever for a loop no thread runs. Recent fsspec releases
forget the loop in a forked child themselves (``reset_after_fork``, registered with
``os.register_at_fork``); older ones, down to the 2024.6 this project supports, do not,
and a loader whose workers are forked (torch's default) hung reading ``s3://`` once its
main process had used S3 (``tests/stages/files/test_token_cache.py`` under ``nox -s
tests_lowest``). So on those releases the reset is registered here: the child starts a
loop of its own at its first async call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import fsspec
import fsspec.asyn
from fsspec.core import get_compression

from ...errors import ConfigError
from ...storage.cache.entries import folder_error, in_folder, is_valid
from ...storage.cache.node import DEFAULT_CACHE_LIMIT, FileCache, cacheable
from ...storage.cache.probe import asks
from ...storage.counted_reads import CountedReads
from ...storage.filesystems import url_to_fs
from ...storage.retry import RetryPolicy, retrying
from ...storage.stats import CacheStats, summed
from ..protocol.stage import Stage
from .file_list import storage_errors

__all__ = ["FileAccess", "release_caches", "storage_stats"]

logger = logging.getLogger(__name__)

R = TypeVar("R")

# NOTE [ fsspec after fork ] in the module docstring.
if not hasattr(fsspec.asyn, "reset_after_fork"):  # pragma: no cover - fsspec version
    os.register_at_fork(after_in_child=fsspec.asyn.reset_lock)


class FileAccess:
    """Mixin: the files of a source, opened through fsspec, the node's cache and retries.

    The owner calls :meth:`init_access` in its ``__init__`` and has ``describe()``
    (every stage does). None of what this holds is part of the owner's ``config()``:
    where and how the bytes are fetched does not change what is read.
    """

    retry: RetryPolicy | None
    storage_options: dict[str, Any]
    cache_dir: str | None
    cache_limit: int
    prefetch: int
    #: Each file's signature as the source's listing gave it when it was built (NOTE
    #: [ Listed signatures ] in ``datasets/files/file_list.py``), by URL; empty for a source that
    #: lists none.
    listed: dict[str, dict[str, Any]]
    _filesystems: dict[str, Any]
    _cache: tuple[int, FileCache] | None
    _counted: dict[int, CountedReads]
    #: Per process, the figures of caches released by :meth:`release_cache`.
    _released: dict[int, CacheStats]

    if TYPE_CHECKING:

        def describe(self) -> str: ...  # every stage has it

    def init_access(
        self,
        *,
        retry: RetryPolicy | None,
        storage_options: dict[str, Any] | None,
        cache_dir: str | os.PathLike[str] | None,
        cache_limit: int | None,
        prefetch: int,
    ) -> None:
        """Validates and keeps the access arguments.

        Raises:
            ConfigError: One of them is invalid; names the source and the argument.
        """
        name = type(self).__name__
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ConfigError(f"{name} retry must be a RetryPolicy or None, got {retry!r}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"{name} storage_options must be a dict or None")
        if cache_dir is not None and not isinstance(cache_dir, str | os.PathLike):
            raise ConfigError(f"{name} cache_dir must be a path or None, got {cache_dir!r}")
        if cache_limit is not None:
            if isinstance(cache_limit, bool) or not isinstance(cache_limit, int):
                raise ConfigError(f"{name} cache_limit must be an int or None, got {cache_limit!r}")
            if cache_limit <= 0:
                raise ConfigError(f"{name} cache_limit must be positive, got {cache_limit}")
            if cache_dir is None:
                raise ConfigError(f"{name} cache_limit={cache_limit} needs a cache_dir")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"{name} prefetch must be an int >= 0, got {prefetch!r}")
        self.retry = retry
        self.storage_options = dict(storage_options or {})
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        self.cache_limit = DEFAULT_CACHE_LIMIT if cache_limit is None else cache_limit
        self.prefetch = prefetch
        self.listed = {}
        self._trusted: frozenset[str] = frozenset()
        self._filesystems = {}
        self._cache = None
        self._counted = {}
        self._released = {}

    def open(
        self,
        url: str,
        *,
        ahead: bool = False,
        known: dict[str, Any] | None = None,
        stream: bool = False,
    ) -> IO[bytes]:
        """Opens ``url`` for reading, decompressed by its extension.

        One filesystem per protocol and process serves every file of this source, so
        that opening a file costs no new client (``skip_instance_cache`` included); a
        forked worker builds its own (fsspec's async filesystems are not fork-safe).
        With ``cache_dir``, a remote file is read from the node's cache, downloaded
        first when needed (NOTE [ File cache ] in ``storage/cache/node.py``); without, its open and
        reads are counted (NOTE [ Direct reads ] in ``storage/counted_reads.py``).

        Args:
            url: The file.
            ahead: The open is made ahead of the reader (``TableSource``'s fetch
                threads): its time is not the reader's wait and is not counted.
            known: With a cache, the file's signature from a listing (``signature_of``
                in ``storage/cache/node.py``), so the cache does not ask the store for it.
            stream: With a cache, a large file this open downloads is read as it
                arrives (NOTE [ Reading a download ] in ``storage/cache/download.py``): for a
                reader that reads on from one place, not a memory map.
        """
        if "::" in url:
            return fsspec.open(url, "rb", compression="infer", **self.storage_options).open()  # type: ignore[no-any-return]
        if not cacheable(url):
            return self.filesystem(url).open(url, "rb", compression="infer")  # type: ignore[no-any-return]
        cache = self.file_cache()
        if cache is not None:
            with _cache_folder_errors(cache.directory, url):
                known = known or self._listed_hit(cache, url)
                return cache.open(
                    url,
                    lambda: self.filesystem(url),
                    ahead=ahead,
                    known=known,
                    stream=stream,
                    retry=self.retry,
                )
        return self.counted_reads().open(self.filesystem(url), url, ahead=ahead)

    def read_whole(
        self, url: str, *, ahead: bool = False, known: dict[str, Any] | None = None
    ) -> bytes:
        """The bytes of ``url``, decompressed by its extension, as :meth:`open` reads them;
        a remote file read without a cache, and not compressed, takes one request (NOTE
        [ Direct reads ] in ``storage/counted_reads.py``), where an open asks for its size first."""
        if self.cache_dir is None and cacheable(url) and get_compression(url, "infer") is None:
            return self.counted_reads().cat(self.filesystem(url), url, ahead=ahead)
        with self.open(url, ahead=ahead, known=known) as file:
            return file.read()

    def read_retrying(self, url: str, read: Callable[[], R]) -> R:
        """``read()``, a read of ``url``, with storage errors as ``StorageError`` and
        transient ones retried (NOTE [ Retries ] in ``storage/retry.py``)."""

        def once() -> R:
            with storage_errors(url):
                return read()

        return retrying(url, once, lambda: None, self.retry)

    def filesystem(self, url: str) -> Any:
        """This process's fsspec filesystem for ``url``'s protocol."""
        key = f"{os.getpid()}:{url.partition('://')[0] if '://' in url else 'file'}"
        if key not in self._filesystems:
            self._filesystems[key] = url_to_fs(url, **self.storage_options)[0]
        return self._filesystems[key]

    def file_cache(self) -> FileCache | None:
        """This process's view of the cache (None without ``cache_dir``), built when
        first needed in every process."""
        if self.cache_dir is None:
            return None
        if self._cache is None or self._cache[0] != os.getpid():
            with _cache_folder_errors(Path(self.cache_dir)):
                cache = FileCache(self.cache_dir, self.cache_limit, self.prefetch)
            self._cache = (os.getpid(), cache)
        return self._cache[1]

    def counted_reads(self) -> CountedReads:
        """This process's counters of the reads the cache does not count (NOTE
        [ Direct reads ] in ``storage/counted_reads.py``), built when first needed in every
        process; threads that build it at once get the same one."""
        counted = self._counted.get(os.getpid())
        if counted is None:
            counted = self._counted.setdefault(os.getpid(), CountedReads())  # atomic
        return counted

    def cache_stats(self) -> CacheStats | None:
        """What this process's reads of remote files cost so far, a snapshot.

        With ``cache_dir``, the cache's figures (NOTE [ File cache ] in ``storage/cache/node.py``);
        without, those of the direct reads (NOTE [ Direct reads ] in
        ``storage/counted_reads.py``); a ``TableSource``'s reader's waits for its fetch threads
        are added to either. None while this process has read no remote file (or since
        :meth:`close_cache`).
        """
        pid = os.getpid()
        cache = self._cache[1] if self._cache is not None and self._cache[0] == pid else None
        counted = self._counted.get(pid)
        released = self._released.get(pid)
        return summed(
            [
                *([] if cache is None else [cache.stats]),
                *([] if counted is None else [counted.stats]),
                *([] if released is None else [released]),
            ]
        )

    def release_cache(self) -> None:
        """Stops this process's prefetch threads and releases the entries they hold,
        evicting to the limit, as a loader's close does; unlike :meth:`close_cache` the
        figures stay, so ``cache_stats()`` still reports what the reads cost. The cache
        starts afresh if the source reads again."""
        pid = os.getpid()
        if self._cache is not None and self._cache[0] == pid:
            cache, self._cache = self._cache[1], None
            cache.close()
            kept = self._released.get(pid)
            total = summed([cache.stats, *([] if kept is None else [kept])])
            if total is not None:
                self._released[pid] = total

    def prefetch_files(self, urls: list[str]) -> None:
        """Downloads ``urls``, the next files a stream reads, into the cache in the
        background (NOTE [ Prefetching files ] in ``storage/cache/node.py``); nothing without
        one."""
        cache = self.file_cache()
        if cache is not None and urls:
            known = {url: s for url in urls if (s := self._listed_signature(url)) is not None}
            cache.want(urls, self.filesystem, known)

    def keep_listing(self, listed: dict[str, dict[str, Any]]) -> None:
        """Keeps what the listing said of each file (``signature_of``'s signatures) and,
        in this process, which of them the cache may take instead of asking the store
        (NOTE [ Listed signatures ] in ``datasets/files/file_list.py``): decided once, with
        the filesystem that listed them, so that a worker's first open of a file its cache
        holds builds no filesystem (an S3 client takes 40 to 75 ms of CPU to build)."""
        self.listed = listed
        self._trusted = frozenset(url for url in listed if asks(self.filesystem(url), url))

    def _listed_signature(self, url: str) -> dict[str, Any] | None:
        """``url``'s signature from the source's listing, where the cache may take it
        instead of asking the store (NOTE [ Listed signatures ] in
        ``datasets/files/file_list.py``)."""
        return self.listed.get(url) if url in self._trusted else None

    def _listed_hit(self, cache: FileCache, url: str) -> dict[str, Any] | None:
        """``url``'s listed signature when ``cache`` holds the file it describes (NOTE
        [ Listed signatures ] in ``datasets/files/file_list.py``): an open then asks the store
        nothing."""
        known = self._listed_signature(url)
        return known if known is not None and is_valid(cache.directory, url, known) else None

    def close_cache(self) -> None:
        """Stops this process's prefetch threads and logs its counters (``cache_stats()``)
        at DEBUG; the cache and the counters start afresh if the source reads again.
        Idempotent."""
        stats = self.cache_stats()
        if self._cache is not None and self._cache[0] == os.getpid():
            cache, self._cache = self._cache[1], None
            cache.close()
        self._counted.pop(os.getpid(), None)
        self._released.pop(os.getpid(), None)
        if stats is not None:
            logger.debug("%s: storage %s", self.describe(), stats)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_filesystems"] = {}  # rebuilt where the source is read
        state["_cache"] = None  # threads and locks are per process
        state["_counted"] = {}
        state["_released"] = {}
        return state


@contextlib.contextmanager
def _cache_folder_errors(directory: Path, url: str | None = None) -> Iterator[None]:
    """Turns an ``OSError`` of the cache folder (not of the remote file) into a
    StorageError that names the folder, never retried: a full disk or a folder that
    cannot be written is not the store's fault (``in_folder`` in ``storage/cache/entries.py``)."""
    try:
        yield
    except OSError as exc:
        if not in_folder(directory, exc):
            raise
        raise folder_error(directory, exc, url) from exc


def release_caches(root: Stage[Any]) -> None:
    """Releases this process's cache of every file source under ``root``
    (``FileAccess.release_cache``): its prefetches stop, the entries it held are evicted
    to the limit, its figures stay; the cache starts afresh if the source reads again."""
    for stage in _stages(root):
        if isinstance(stage, FileAccess):
            stage.release_cache()


def _stages(root: Stage[Any]) -> list[Stage[Any]]:
    """Every stage of the tree under ``root``, once each."""
    found: list[Stage[Any]] = []
    seen: set[int] = set()
    stages = [root]
    while stages:
        stage = stages.pop()
        if id(stage) in seen:
            continue
        seen.add(id(stage))
        found.append(stage)
        stages.extend(stage.children)
    return found


def storage_stats(root: Stage[Any]) -> dict[str, Any] | None:
    """What the reads of remote files by the file sources under ``root`` cost in this
    process, summed.

    Every stage of the tree that mixes in ``FileAccess`` counts once, its
    ``cache_stats()``: ``bytes_downloaded`` (downloaded into the cache; without one, read
    from the store), ``hits`` (opens served by the cache; 0 without), ``misses`` (opens
    that downloaded; without a cache, every open of a remote file), ``prefetched``
    (files the cache's prefetch threads downloaded; 0 without) and ``wait_seconds``
    (seconds the readers waited on storage: NOTE [ File cache ] in ``storage/cache/node.py``, NOTE
    [ Direct reads ] in ``storage/counted_reads.py``). None when no such stage has read a remote
    file here yet: local files are not counted.
    """
    parts: list[CacheStats] = []
    for stage in _stages(root):
        stats = stage.cache_stats() if isinstance(stage, FileAccess) else None
        if stats is not None:
            parts.append(stats)
    total = summed(parts)
    return None if total is None else dataclasses.asdict(total)
