"""``TokenSource``: fixed-length windows of flat token files, for language-model pretraining.

NOTE [ Token windows ]
The files (raw arrays of ``dtype``, or 1-D ``.npy`` arrays of it) are cut into
non-overlapping windows of ``seq_len`` tokens; a file's tail shorter than ``seq_len`` is
dropped. Window ``i`` over all files is found by bisecting the cumulative window counts,
so the windows form a map-style dataset and :class:`IndexedDataset` gives them their
per-epoch order, sharding, O(1) state and O(1) skip.

NOTE [ Lazy file access ]
Sizes (and ``.npy`` data offsets) are read once, at construction, through fsspec with
the source's ``storage_options``. The data is opened only in the process that reads it,
on first use, and the same bytes are read whichever way:

* a local file as a read-only ``np.memmap`` (the operating system pages in only the
  windows read);
* with ``cache_dir``, a remote file is downloaded whole into the node's cache (NOTE
  [ File cache ] in ``storage/cache/node.py``; a later process, or a restart, finds it there) and
  its cached copy mapped the same way, so a shuffled stream costs no request per window.
  The cached file stays open, its entry held, until the cursor is closed (or
  ``close_cache()``): the cache never evicts a mapped file, so the folder may exceed
  ``cache_limit`` while more token files are mapped than it holds. A file the cache
  cannot map (larger than ``cache_limit``, or named with a compression extension, whose
  cached copy is not the raw bytes) is read as without a cache;
* otherwise, by one byte-range ``cat_file`` per window.

Opening a file and every range read go through ``read_retrying`` (NOTE [ Retries ] in
``storage/retry.py``): a transient error is retried, and a retried read returns the same bytes.
Open maps are dropped when the windows are pickled, and in a forked child, so a worker
never receives an open file or a copy of a file's data.

NOTE [ Prefetching token files ]
With ``cache_dir`` and ``prefetch`` > 0, a cursor plans, at the start of each epoch (and
after a restore), the order in which its worker first touches the files: the files of
the windows at its next ``_PLAN_WINDOWS`` positions, in order of first touch, then the
files not seen there in file order, from the one after the last seen. Each time the
worker opens a file it has not opened yet, the next ``prefetch`` files of that plan that
it has not opened are handed to the cache's prefetch threads (NOTE [ Prefetching files ]
in ``storage/cache/node.py``). Unshuffled, that is the next files in order; shuffled, the first
windows touch nearly every file at once, and the downloads overlap instead of each first
touch waiting for its own. The plan is a hint: it changes where bytes come from, never
which bytes are read.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from ...config import WorkerContext
from ...errors import ConfigError
from ...storage.cache.node import cacheable, signature_of
from ...storage.filesystems import url_to_fs
from ...storage.retry import RetryPolicy
from ..index.indexed import Even, IndexedCursor, IndexedDataset
from .access import FileAccess

__all__ = ["TokenSource"]

logger = logging.getLogger(__name__)

#: Positions a cursor looks ahead to plan its prefetches (NOTE [ Prefetching token files ]).
_PLAN_WINDOWS = 65536


class TokenSource(FileAccess, IndexedDataset[np.ndarray]):
    """Serves ``seq_len``-token windows of flat token files (NOTE [ Token windows ]).

    Each item is a 1-D ``numpy.ndarray`` of ``seq_len`` int64 tokens (``default_collate``
    makes a LongTensor of a batch). A file's last tokens that do not fill a window are
    dropped, as are files shorter than ``seq_len``.

    Args:
        urls: A path, glob or fsspec URL, or a list of them. Globs are expanded with
            fsspec and their matches sorted; the list keeps its order.
        seq_len: Tokens per window, at least 1.
        dtype: The files' integer dtype (raw files hold a flat array of it; a ``.npy``
            file's header must name it).
        shuffle: Visit the windows in a new seeded permutation every epoch.
        seed: Seed of the permutations.
        even: As for :class:`IndexedDataset`: ``"pad"`` (the default) repeats the first
            windows of the epoch's order, ``"drop"`` leaves its last ones out, so that
            every rank reads as many windows and yields as many batches.
        retry: How reads are retried after transient storage errors (NOTE [ Retries ]
            in ``storage/retry.py``); None: ``retry.DEFAULT_POLICY``. Not part of ``config()``.
        storage_options: Passed to fsspec (credentials, endpoint...), for listing and
            sizing the files too; not part of ``config()``.
        cache_dir: A local folder where remote files are downloaded whole and then
            memory-mapped, shared by the processes of a node (NOTE [ Lazy file access ],
            NOTE [ File cache ] in ``storage/cache/node.py``); None: one range read per window. Not
            part of ``config()``.
        cache_limit: Bytes the cache keeps once its files are closed; None: 10 GiB. A
            larger file is read by range reads, uncached. Needs ``cache_dir``.
        prefetch: With ``cache_dir``: files downloaded ahead of the stream, by as many
            threads (0: none; NOTE [ Prefetching token files ]).

    Raises:
        ConfigError: No file matches, a file cannot be read, a raw file's size is not a
            multiple of the dtype's size, a ``.npy`` file is not 1-D or has another
            dtype, ``dtype`` is not an integer type, ``seq_len`` is below 1, or an
            access argument is invalid. The loader also raises it when a rank would
            read no window (no file holds ``seq_len`` tokens, or fewer windows than
            ranks with ``even="drop"``).

    State:
        ``{"epoch": e, "pos": k}`` as for :class:`IndexedDataset`: the epoch and the
        position in this worker's shard of the windows. Restore and skip are O(1); a
        restore replays nothing, and skipped windows are never read.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        seq_len: int,
        dtype: str = "uint16",
        shuffle: bool = False,
        seed: int = 0,
        even: Even = "pad",
        retry: RetryPolicy | None = None,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        prefetch: int = 2,
    ) -> None:
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise ConfigError(f"TokenSource needs an int seq_len >= 1, got {seq_len!r}")
        try:
            token = np.dtype(dtype)
        except TypeError:
            raise ConfigError(f"TokenSource: {dtype!r} is not a numpy dtype") from None
        if token.kind not in "iu":
            raise ConfigError(f"TokenSource needs an integer dtype, got {dtype!r}")
        self.init_access(
            retry=retry,
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit=cache_limit,
            prefetch=prefetch,
        )
        listed: dict[str, dict[str, Any]] = {}
        files = _expand([urls] if isinstance(urls, str) else list(urls), self.locate, listed)
        if cache_dir is not None:  # only a cache spends them
            self.keep_listing(listed)
        layout = [_layout(url, token, self.locate) for url in files]
        self.dtype = str(dtype)
        self.windows = _Windows(files, layout, seq_len, token, self)
        logger.debug("TokenSource: %d files, %d windows", len(files), len(self.windows))
        super().__init__(
            self.windows, shuffle=shuffle, seed=seed, deterministic_items=True, even=even
        )

    def config(self) -> dict[str, Any]:
        config = {
            "type": "TokenSource",
            "urls": list(self.windows.urls),
            "sizes": [size for _, size in self.windows.layout],
            "seq_len": self.windows.seq_len,
            "dtype": self.dtype,
            "shuffle": self.shuffled,
            "seed": self.seed,
        }
        return self.with_even(config)

    def describe(self) -> str:
        files = len(self.windows.urls)
        return f"TokenSource({files} file{'s' * (files != 1)}, seq_len={self.windows.seq_len})"

    def locate(self, url: str) -> tuple[Any, str]:
        """This process's filesystem for ``url`` (built once per protocol with the
        ``storage_options``), and the path of ``url`` on it."""
        if "::" in url:
            fs, path = url_to_fs(url, **self.storage_options)
            return fs, path
        fs = self.filesystem(url)
        return fs, fs._strip_protocol(url)

    def cursor(self, context: WorkerContext) -> IndexedCursor[np.ndarray]:
        return _TokenCursor(self, context)

    def close_cache(self) -> None:
        """Closes this process's mapped files, then stops its prefetch threads and logs
        its cache counters (``FileAccess.close_cache``); idempotent."""
        self.windows.close()
        super().close_cache()


class _TokenCursor(IndexedCursor[np.ndarray]):
    """An :class:`IndexedCursor` that plans its worker's prefetches (NOTE [ Prefetching
    token files ]) and closes the mapped files when it is closed."""

    def __init__(self, stage: TokenSource, context: WorkerContext) -> None:
        super().__init__(stage, context)
        self.windows = stage.windows
        self.planned = -1  # the epoch planned for; -1: none

    def __next__(self) -> np.ndarray:
        if self.planned != self.epoch:
            self.plan()
        return super().__next__()

    def take(self, n: int) -> list[np.ndarray]:
        if self.planned != self.epoch:
            self.plan()
        return super().take(n)

    def restore_own(self, state: Any | None) -> None:
        super().restore_own(state)
        self.planned = -1

    def close_own(self) -> None:
        super().close_own()
        self.windows.close()

    def plan(self) -> None:
        """Tells the windows the order in which this worker first touches the files."""
        self.planned = self.epoch
        access = self.windows.source
        if access.cache_dir is None or not access.prefetch or self.pos >= self.shard_length:
            return
        stop = min(self.pos + _PLAN_WINDOWS, self.shard_length)
        files = np.searchsorted(self.windows.ends, self.indices(self.pos, stop), side="right")
        _, first = np.unique(files, return_index=True)
        seen = [int(f) for f in files[np.sort(first)]]
        count, after, known = len(self.windows.urls), seen[-1] + 1, set(seen)
        rest = [f % count for f in range(after, after + count) if f % count not in known]
        self.windows.plan = seen + rest


class _Windows:
    """The windows of all files as a map-style dataset (NOTE [ Lazy file access ])."""

    def __init__(
        self,
        urls: list[str],
        layout: list[tuple[int, int]],
        seq_len: int,
        dtype: np.dtype,
        source: TokenSource,
    ) -> None:
        self.urls = urls
        self.layout = layout  # per file: (byte offset of the data, size in tokens)
        self.seq_len = seq_len
        self.dtype = dtype
        self.source = source
        self.ends: list[int] = []
        total = 0
        for _, size in layout:
            total += size // seq_len
            self.ends.append(total)
        self._reset()

    def _reset(self) -> None:
        """Forgets what this process opened (after a fork, the parent's)."""
        self._pid = os.getpid()
        self._open: dict[int, np.ndarray | str] = {}  # a map, or the URL to read by range
        self._held: list[IO[bytes]] = []  # cached files kept open while mapped
        #: NOTE [ Prefetching token files ]: the files in order of first touch.
        self.plan: list[int] | None = None

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range 0..{len(self) - 1}")
        file = bisect.bisect_right(self.ends, index)
        first = self.ends[file - 1] if file else 0
        start = (index - first) * self.seq_len
        handle = self._handle(file)
        if isinstance(handle, np.ndarray):
            window = handle[start : start + self.seq_len]
        else:
            offset = self.layout[file][0] + start * self.dtype.itemsize
            end = offset + self.seq_len * self.dtype.itemsize
            fs, path = self.source.locate(handle)
            started = time.perf_counter()
            data = self.source.read_retrying(
                handle, lambda: fs.cat_file(path, start=offset, end=end)
            )
            if cacheable(handle):  # a range request to the store (NOTE [ Direct reads ])
                self.source.counted_reads().add(
                    bytes_downloaded=len(data),
                    misses=1,
                    wait_seconds=time.perf_counter() - started,
                )
            window = np.frombuffer(data, dtype=self.dtype)
        return window.astype(np.int64)

    def _handle(self, file: int) -> np.ndarray | str:
        if self._pid != os.getpid():
            self._reset()
        handle = self._open.get(file)
        if handle is None:
            handle = self._map(file)
            self._open[file] = handle
        return handle

    def _map(self, file: int) -> np.ndarray | str:
        """File ``file`` memory-mapped, or its URL when it is read by range reads."""
        url, (offset, size) = self.urls[file], self.layout[file]
        access = self.source
        if not cacheable(url):
            fs, path = self.source.locate(url)
            if isinstance(fs, LocalFileSystem):
                return np.memmap(path, dtype=self.dtype, mode="r", offset=offset, shape=(size,))
            return url
        if access.cache_dir is None:
            return url
        self._prefetch(file)
        held = access.read_retrying(url, lambda: access.open(url))
        try:
            held.fileno()  # the cached copy, as stored (NOTE [ Lazy file access ])
            mapped = np.memmap(held, dtype=self.dtype, mode="r", offset=offset, shape=(size,))
        except (OSError, ValueError):  # streamed (over the limit) or decompressed
            held.close()
            logger.debug("%s: not mapped from the cache; read by range reads", url)
            return url
        self._held.append(held)
        return mapped

    def _prefetch(self, file: int) -> None:
        """Hands the next files of the plan not opened yet to the cache's prefetch
        threads (NOTE [ Prefetching token files ])."""
        access = self.source
        if not access.prefetch:
            return
        count = len(self.urls)
        plan = self.plan or [f % count for f in range(file + 1, file + 1 + count)]
        ahead = [f for f in plan if f != file and f not in self._open][: access.prefetch]
        access.prefetch_files([self.urls[f] for f in ahead])

    def close(self) -> None:
        """Drops this process's maps and closes the cached files they hold; idempotent.
        Reading again opens them again."""
        if self._pid != os.getpid():
            self._reset()
            return
        held, self._held = self._held, []
        self._open = {}
        for file in held:
            file.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_open={}, _held=[], plan=None)
        return state


def _expand(
    urls: list[str],
    locate: Callable[[str], tuple[Any, str]],
    listed: dict[str, dict[str, Any]],
) -> list[str]:
    """The files ``urls`` name, globs expanded in order; puts in ``listed`` the signature
    the listing of a glob gave each remote file it matched (NOTE [ Listed signatures ] in
    ``datasets/files/file_list.py``)."""
    if not urls:
        raise ConfigError("TokenSource needs at least one file, got an empty list")
    files: list[str] = []
    for url in urls:
        if not isinstance(url, str):
            raise ConfigError(f"TokenSource urls must be strings, got {type(url).__name__}")
        fs, path = locate(url)
        local = isinstance(fs, LocalFileSystem)
        found = fs.glob(path, detail=True) if any(c in path for c in "*?[") else {path: None}
        matches = sorted(found)
        if not matches:
            raise ConfigError(f"TokenSource: no file matches {url!r}")
        files.extend(match if local else fs.unstrip_protocol(match) for match in matches)
        if not local:
            listed.update(
                (fs.unstrip_protocol(match), signature_of(info))
                for match, info in found.items()
                if info is not None
            )
    return files


def _layout(url: str, dtype: np.dtype, locate: Callable[[str], tuple[Any, str]]) -> tuple[int, int]:
    """Returns (byte offset of the data, size in tokens) of a token file."""
    fs, path = locate(url)
    try:
        if not path.endswith(".npy"):
            size = int(fs.size(path))
            if size % dtype.itemsize:
                raise ConfigError(
                    f"TokenSource: {url} has {size} bytes, not a multiple of {dtype} "
                    f"({dtype.itemsize} bytes); is dtype right?"
                )
            return 0, size // dtype.itemsize
        with fs.open(path, "rb") as file:
            version = np.lib.format.read_magic(file)
            read = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, stored = read(file)
            offset = int(file.tell())
    except (OSError, ValueError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"TokenSource cannot read {url}: {error}") from error
    if len(shape) != 1:
        raise ConfigError(f"TokenSource: {url} holds a {len(shape)}-D array; tokens are 1-D")
    if stored != dtype:
        raise ConfigError(f"TokenSource: {url} holds {stored} tokens, not dtype={dtype}")
    return offset, int(shape[0])
