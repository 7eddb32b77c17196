"""``TokenSource``: fixed-length windows of flat token files, for language-model pretraining.

NOTE [ Token windows ]
The files (raw arrays of ``dtype``, or 1-D ``.npy`` arrays of it) are cut into
non-overlapping windows of ``seq_len`` tokens; a file's tail shorter than ``seq_len`` is
dropped. Window ``i`` over all files is found by bisecting the cumulative window counts,
so the windows form a map-style dataset and :class:`IndexedDataset` gives them their
per-epoch order, sharding, O(1) state and O(1) skip.

NOTE [ Lazy file access ]
Sizes (and ``.npy`` data offsets) are read once, at construction, through fsspec. The
data is opened only in the process that reads it, on first use: local files as a
read-only ``np.memmap`` (the operating system pages in only the windows read), other
URLs by one byte-range ``cat_file`` per window. Open maps are dropped when the windows
are pickled, so a worker never receives an open file or a copy of a file's data.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from typing import Any

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from ..errors import ConfigError
from .indexed import Even, IndexedDataset

__all__ = ["TokenSource"]

logger = logging.getLogger(__name__)


class TokenSource(IndexedDataset[np.ndarray]):
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

    Raises:
        ConfigError: No file matches, a file cannot be read, a raw file's size is not a
            multiple of the dtype's size, a ``.npy`` file is not 1-D or has another
            dtype, ``dtype`` is not an integer type or ``seq_len`` is below 1. The
            loader also raises it when a rank would read no window (no file holds
            ``seq_len`` tokens, or fewer windows than ranks with ``even="drop"``).

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
    ) -> None:
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise ConfigError(f"TokenSource needs an int seq_len >= 1, got {seq_len!r}")
        try:
            token = np.dtype(dtype)
        except TypeError:
            raise ConfigError(f"TokenSource: {dtype!r} is not a numpy dtype") from None
        if token.kind not in "iu":
            raise ConfigError(f"TokenSource needs an integer dtype, got {dtype!r}")
        files = _expand([urls] if isinstance(urls, str) else list(urls))
        layout = [_layout(url, token) for url in files]
        self.dtype = str(dtype)
        self.windows = _Windows(files, layout, seq_len, token)
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


class _Windows:
    """The windows of all files as a map-style dataset (NOTE [ Lazy file access ])."""

    def __init__(
        self, urls: list[str], layout: list[tuple[int, int]], seq_len: int, dtype: np.dtype
    ) -> None:
        self.urls = urls
        self.layout = layout  # per file: (byte offset of the data, size in tokens)
        self.seq_len = seq_len
        self.dtype = dtype
        self.ends: list[int] = []
        total = 0
        for _, size in layout:
            total += size // seq_len
            self.ends.append(total)
        self._open: dict[int, np.ndarray | tuple[Any, str]] = {}

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
            fs, path = handle
            offset = self.layout[file][0] + start * self.dtype.itemsize
            data = fs.cat_file(path, start=offset, end=offset + self.seq_len * self.dtype.itemsize)
            window = np.frombuffer(data, dtype=self.dtype)
        return window.astype(np.int64)

    def _handle(self, file: int) -> np.ndarray | tuple[Any, str]:
        handle = self._open.get(file)
        if handle is None:
            fs, path = fsspec.url_to_fs(self.urls[file])
            offset, size = self.layout[file]
            if isinstance(fs, LocalFileSystem):
                handle = np.memmap(path, dtype=self.dtype, mode="r", offset=offset, shape=(size,))
            else:
                handle = (fs, path)
            self._open[file] = handle
        return handle

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = {}
        return state


def _expand(urls: list[str]) -> list[str]:
    if not urls:
        raise ConfigError("TokenSource needs at least one file, got an empty list")
    files: list[str] = []
    for url in urls:
        if not isinstance(url, str):
            raise ConfigError(f"TokenSource urls must be strings, got {type(url).__name__}")
        fs, path = fsspec.url_to_fs(url)
        local = isinstance(fs, LocalFileSystem)
        matches = sorted(fs.glob(path)) if any(c in path for c in "*?[") else [path]
        if not matches:
            raise ConfigError(f"TokenSource: no file matches {url!r}")
        files.extend(match if local else fs.unstrip_protocol(match) for match in matches)
    return files


def _layout(url: str, dtype: np.dtype) -> tuple[int, int]:
    """Returns (byte offset of the data, size in tokens) of a token file."""
    fs, path = fsspec.url_to_fs(url)
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
