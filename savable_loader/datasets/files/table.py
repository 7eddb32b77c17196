"""``TableSource``: an index-driven source, a table of samples whose rows name their files.

NOTE [ Index-driven source ]
A table (Parquet, CSV or JSON lines: NOTE [ Table formats ] in ``datasets/files/table_read.py``) is
read once, when the source is built, in the process that builds it; workers receive it
with the source. Each row is a sample: its metadata, and in the ``files`` columns the
URLs of the files it needs (an image, a caption...). The rows form a map-style dataset,
so :class:`IndexedDataset` gives them their per-epoch order, their sharding over ranks
and workers with equal counts, an O(1) state and skip, and elastic resume. Reading row
``i`` reads its files whole, through the source's file access (the node's cache with
``cache_dir``, retries): what a row is depends on the table and the files only.

NOTE [ Fetching files ahead ]
A cursor reads its files through a pool of ``threads`` daemon threads per process (built
when first needed in the process that reads, never pickled, stopped by
``close_cache()``; idle threads exit after a second). Before it reads ``n`` rows (one,
or a batch), it asks the pool for the files of the rows at its next ``n + prefetch``
positions of the epoch (``IndexedCursor.upcoming``) that it has not asked for yet, and
lets go of the requests for files no longer among them (after a restore or a skip):
so at most ``(n + prefetch) * len(files)`` fetched files wait, in a dict keyed by URL.
Reading a row takes its files' results from that dict, waiting for them if needed; a
request that failed, was let go or was cancelled by ``close_cache()`` is dropped, and the
file is read in the reading thread, retried and raised as without prefetching (a fetch
makes one attempt). Each file is read whole either way, so the same bytes arrive
whatever the timing: prefetching changes when a row is ready, never what it holds. The
fetch does not cross the end of an epoch.

The reader's wait on storage (``wait_seconds`` of ``cache_stats()``) is counted once,
where it waits: on a remote file's fetch result (NOTE [ Direct reads ] in
``storage/counted_reads.py``, with a cache too), or in the open and reads of a file it reads
itself (``threads=0``, a dropped request). The fetch threads' opens count their bytes,
hits and misses, not their time, which passes while the reader works.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from ...config import WorkerContext
from ...errors import ConfigError
from ...storage.cache.node import cacheable
from ...storage.filesystems import url_to_fs
from ...storage.listing import FolderListings
from ...storage.retry import RetryPolicy
from ..index.indexed import Even, IndexedCursor, IndexedDataset
from .access import FileAccess
from .file_list import Urls, expand_urls, storage_errors
from .table_fetch import Fetcher
from .table_read import Columns, Format, concatenate, infer_format, parse_table

__all__ = ["TableSource"]

logger = logging.getLogger(__name__)


class TableSource(FileAccess, IndexedDataset[dict[str, Any]]):
    """Serves the rows of a table of samples with the files they name (NOTE
    [ Index-driven source ]).

    Item ``i`` is a dict of row ``i``'s columns, in the table's order, where each
    ``files`` column holds the bytes of its file (None where the row's value is null or
    empty),
    plus two keys: ``"__row__"``, the row's index in the table, and ``"__urls__"``, the
    URL each ``files`` column was read from (None for a null). A file named with a
    compression extension (``.gz``...) is decompressed, as every file source opens files.

    Memory: the whole table, held column by column in the process that builds the source
    and in every worker: Parquet as Arrow columns (about the size of the values, shared
    with forked workers), CSV and JSON lines as one Python list per column (about 50
    bytes per value plus its text). Beside it, at most ``(rows read at once + prefetch)
    * len(files)`` fetched files per cursor.

    Args:
        table: A path, glob or fsspec URL of a ``.parquet``, ``.csv`` or ``.jsonl``
            (``.json``) table, or a list of them: the files are sorted and their rows
            concatenated. Read once, at construction, with retries.
        files: The columns holding the URLs (or paths) of the files each row needs: a
            name or a list of names. A URL with a protocol or an absolute path is read as
            it is; another path is relative to the folder of the table file of its row.
        shuffle: Visit the rows in a new seeded permutation every epoch.
        seed: Seed of the permutations.
        even: As for :class:`IndexedDataset`: ``"pad"`` (the default) repeats the first
            rows of the epoch's order, ``"drop"`` leaves its last ones out, so that every
            rank reads as many rows and yields as many batches.
        format: ``"parquet"``, ``"csv"`` or ``"jsonl"``; None: from each table file's
            extension (NOTE [ Table formats ] in ``datasets/files/table_read.py``).
        threads: Threads per process that fetch files (NOTE [ Fetching files ahead ]);
            0: every file is read in the reading thread, one after the other.
        prefetch: Rows ahead of the one being read whose files are fetched, with
            ``threads`` > 0.
        list_folders: With ``cache_dir``, take the remote files' sizes and ETags from a
            listing of their folders, made once per process in the background (on S3 one
            request per 1,000 keys of the folder), instead of asking the store before
            each file (a request per file): for folders that hold mostly the table's
            files (NOTE [ Listing folders ] in ``storage/listing.py``). Not part of ``config()``.
        retry: How reads are retried after transient storage errors (NOTE [ Retries ]
            in ``storage/retry.py``); None: ``retry.DEFAULT_POLICY``. Not part of ``config()``.
        storage_options: Passed to fsspec (credentials, endpoint...), for the table too;
            not part of ``config()``.
        cache_dir: A local folder where remote files (the table too) are downloaded and
            kept for later reads, shared by the processes of a node (NOTE [ File cache ]
            in ``storage/cache/node.py``); None: read in place. Not part of ``config()``.
        cache_limit: Bytes the cache keeps; None: 10 GiB. Needs ``cache_dir``.

    Raises:
        ConfigError: An argument is invalid, a glob matches nothing, a table's format is
            unknown or it cannot be parsed, the tables hold no row, a ``files`` column is
            missing or holds other than strings, a column is named ``__row__`` or
            ``__urls__``, or a Parquet table is given without
            ``pyarrow`` installed (``pip install savable-loader[parquet]``).
        StorageError: A table cannot be read (names its URL). Reading a row whose file
            cannot be read raises it too, naming the file's URL.

    State:
        ``{"epoch": e, "pos": k}`` as for :class:`IndexedDataset`: the epoch and the
        position in this worker's shard of the rows. Restore and skip are O(1); a restore
        replays nothing, and skipped rows' files are never read.
    """

    def __init__(
        self,
        table: Urls,
        *,
        files: str | Sequence[str] = (),
        shuffle: bool = False,
        seed: int = 0,
        even: Even = "pad",
        format: Format | None = None,
        threads: int = 8,
        prefetch: int = 16,
        list_folders: bool = False,
        retry: RetryPolicy | None = None,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
    ) -> None:
        names = [files] if isinstance(files, str) else files
        if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
            raise ConfigError(
                f"TableSource files must be a column name or a list of them, got {files!r}"
            )
        for flag, given in (("shuffle", shuffle), ("list_folders", list_folders)):
            if not isinstance(given, bool):
                raise ConfigError(f"TableSource {flag} must be a bool, got {given!r}")
        for count, value in (("seed", seed), ("threads", threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"TableSource {count} must be an int >= 0, got {value!r}")
        self.init_access(
            retry=retry,
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit=cache_limit,
            prefetch=prefetch,
        )
        self.tables = expand_urls(table, self.storage_options, "TableSource")
        formats = {infer_format(url, format) for url in self.tables}
        if len(formats) > 1:
            raise ConfigError(
                f"TableSource: the tables mix formats ({sorted(formats)}); give tables of one"
            )
        self.format: Format = formats.pop()
        self.files = list(dict.fromkeys(names))
        self.threads = threads
        self.list_folders = list_folders
        self._fetcher: tuple[int, Fetcher] | None = None
        self._listings: tuple[int, FolderListings] | None = None
        parts = [(url, *self._parse(url)) for url in self.tables]
        columns = concatenate(self.format, parts)
        for name in self.files:
            columns.check_urls(name)
        reserved = [name for name in ("__row__", "__urls__") if name in columns.data]
        if reserved:
            raise ConfigError(f"TableSource: the column names {reserved} are reserved for items")
        self.rows = _Rows(columns, self.files, [_folder(url) for url in self.tables], self)
        logger.debug("TableSource: %d rows from %d tables", len(self.rows), len(self.tables))
        super().__init__(self.rows, shuffle=shuffle, seed=seed, deterministic_items=True, even=even)

    def _parse(self, url: str) -> tuple[list[str], Any]:
        def read() -> tuple[list[str], Any]:
            with self.open(url) as file:
                return parse_table(url, file, self.format)

        return self.read_retrying(url, read)

    def config(self) -> dict[str, Any]:
        config = {
            "type": "TableSource",
            "tables": list(self.tables),
            "format": self.format,
            "rows": len(self.rows),
            "columns": list(self.rows.columns.names),
            "files": list(self.files),
            "shuffle": self.shuffled,
            "seed": self.seed,
        }
        return self.with_even(config)

    def describe(self) -> str:
        tables = len(self.tables)
        return (
            f"TableSource({len(self.rows)} rows of {tables} {self.format} "
            f"table{'s' * (tables != 1)}, files={self.files})"
        )

    def cursor(self, context: WorkerContext) -> IndexedCursor[dict[str, Any]]:
        return _TableCursor(self, context)

    def read_file(self, url: str) -> bytes:
        """The bytes of ``url``, retried (NOTE [ Retries ] in ``storage/retry.py``).

        Raises:
            StorageError: The file cannot be read; names the URL.
        """
        return self.read_retrying(url, lambda: self.read_whole(url, known=self.known(url)))

    def known(self, url: str) -> dict[str, Any] | None:
        """``url``'s signature from its folder's listing, with ``list_folders`` and a
        cache (NOTE [ Listing folders ] in ``storage/listing.py``); else None."""
        if not self.list_folders or self.cache_dir is None or not cacheable(url):
            return None
        return self.folder_listings().known(url)

    def folder_listings(self) -> FolderListings:
        """This process's listings of the files' folders, built when first needed in
        every process (NOTE [ Listing folders ] in ``storage/listing.py``)."""
        if self._listings is None or self._listings[0] != os.getpid():
            options = {
                **self.storage_options,
                "use_listings_cache": False,  # NOTE [ Listing folders ]
                "skip_instance_cache": True,
            }
            listings = FolderListings(lambda folder: url_to_fs(folder, **options)[0])
            self._listings = (os.getpid(), listings)
        return self._listings[1]

    def fetcher(self) -> Fetcher | None:
        """This process's fetch threads (None with ``threads=0``), built when first
        needed in every process (NOTE [ Fetching files ahead ])."""
        if not self.threads:
            return None
        if self._fetcher is None or self._fetcher[0] != os.getpid():
            self.file_cache()  # built here, not by two fetch threads at once
            if self.list_folders:
                self.folder_listings()
            fetch = Fetcher(self.threads, self._fetch_once)
            self._fetcher = (os.getpid(), fetch)
        return self._fetcher[1]

    def _fetch_once(self, url: str) -> bytes:
        with storage_errors(url):
            return self.read_whole(url, ahead=True, known=self.known(url))

    def close_cache(self) -> None:
        """Stops this process's fetch threads (their pending fetches are cancelled), then
        its cache's (``FileAccess.close_cache``); idempotent."""
        if self._fetcher is not None and self._fetcher[0] == os.getpid():
            fetch, self._fetcher = self._fetcher[1], None
            fetch.close()
        if self._listings is not None and self._listings[0] == os.getpid():
            listings, self._listings = self._listings[1], None
            listings.close()
        super().close_cache()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_fetcher"] = None  # threads are per process
        state["_listings"] = None
        return state


def _folder(url: str) -> str:
    """The folder of a table file, that relative paths in it are resolved against."""
    if "://" in url:
        return url.rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(url))


class _Rows:
    """The rows as a map-style dataset, their files read in the calling thread."""

    def __init__(
        self, columns: Columns, files: list[str], folders: list[str], access: TableSource
    ) -> None:
        self.columns = columns
        self.files = files
        self.folders = folders
        self.access = access

    def __len__(self) -> int:
        return len(self.columns)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.item(index, self.access.read_file)

    def urls(self, index: int) -> list[str | None]:
        """The URLs of row ``index``'s files, in ``files`` order (None for a null)."""
        folder = self.folders[bisect.bisect_right(self.columns.ends, index)]
        return [_resolve(self.columns.value(name, index), folder) for name in self.files]

    def item(self, index: int, read: Callable[[str], bytes]) -> dict[str, Any]:
        """Row ``index`` with its files' bytes, each read by ``read(url)``."""
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range 0..{len(self) - 1}")
        row = self.columns.row(index)
        urls = self.urls(index)
        for name, url in zip(self.files, urls, strict=True):
            row[name] = None if url is None else read(url)
        row["__row__"] = index
        row["__urls__"] = dict(zip(self.files, urls, strict=True))
        return row


def _resolve(value: str | None, folder: str) -> str | None:
    if not value:
        return None  # a null, or CSV's empty field: no file
    if "://" in value or "::" in value or os.path.isabs(value):
        return value
    return f"{folder}/{value}" if "://" in folder else os.path.join(folder, value)


class _TableCursor(IndexedCursor[dict[str, Any]]):
    """An :class:`IndexedCursor` that fetches the files of its next rows ahead (NOTE
    [ Fetching files ahead ])."""

    def __init__(self, stage: TableSource, context: WorkerContext) -> None:
        super().__init__(stage, context)
        self.source = stage
        self.ahead: dict[str, Future[bytes]] = {}
        #: ``(epoch, first, stop)``: the files of positions ``[first, stop)`` of ``epoch``
        #: were asked for (``epoch`` -1: none).
        self.planned = (-1, 0, 0)

    def __next__(self) -> dict[str, Any]:
        self._fetch_ahead(1)
        return super().__next__()

    def take(self, n: int) -> list[dict[str, Any]]:
        self._fetch_ahead(n)
        return super().take(n)

    def item(self, index: int) -> dict[str, Any]:
        return self.source.rows.item(index, self._bytes)

    def _bytes(self, url: str) -> bytes:
        future = self.ahead.pop(url, None)
        if future is not None:
            remote, started = cacheable(url), time.perf_counter()
            try:
                return future.result()
            except Exception as error:  # dropped: read again below, retried
                logger.debug("fetching %s ahead failed: %r", url, error)
            finally:  # the reader's wait (NOTE [ Fetching files ahead ])
                if remote:
                    self.source.counted_reads().add_wait(time.perf_counter() - started)
        return self.source.read_file(url)

    def _fetch_ahead(self, n: int) -> None:
        source = self.source
        if not source.files:
            return
        fetcher = source.fetcher()
        if fetcher is None:
            return
        window = n + source.prefetch
        end = min(self.pos + window, self.shard_length)
        epoch, first, stop = self.planned
        if epoch == self.epoch and first <= self.pos <= stop:  # moved on by reading
            indices = self.upcoming(window, after=stop - self.pos)
            end = max(end, stop)
        else:  # a new epoch, or a restore or skip: let go of the rest
            indices = self.upcoming(window)
            wanted = {url for index in indices for url in source.rows.urls(index)}
            for stale in [url for url in self.ahead if url not in wanted]:
                self.ahead.pop(stale).cancel()
        for index in indices:
            for url in source.rows.urls(index):
                if url is not None and url not in self.ahead:
                    self.ahead[url] = fetcher.submit(url)
        self.planned = (self.epoch, self.pos, end)

    def skip_fast(self, n: int) -> int:
        self.planned = (-1, 0, 0)
        return super().skip_fast(n)

    def restore_own(self, state: Any | None) -> None:
        self.planned = (-1, 0, 0)
        super().restore_own(state)

    def close_own(self) -> None:
        self.planned = (-1, 0, 0)
        ahead, self.ahead = self.ahead, {}
        for future in ahead.values():
            future.cancel()
