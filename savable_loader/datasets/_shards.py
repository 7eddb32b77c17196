"""What the file sources share: listing, sharding, opening a file at an offset.

NOTE [ Shard listing and assignment ]
A file source takes paths, globs or fsspec URLs. Globs are expanded with fsspec when the
stage is built, in the process that builds it, and the whole list is sorted, so every
worker of every rank sees the same list (a glob matching nothing is a ``ConfigError``;
a literal path is kept without a look-up, so a missing file shows when it is read). In
epoch ``e`` the files come in that sorted order, or in a permutation drawn from
``(seed, e)`` with ``shuffle_shards``; file ``i`` of that order goes to the (rank,
worker) stream whose ``context.shard_index`` is ``i % context.num_shards``. A stream
reads its files one after the other, so its position is an index into its own list
plus a position inside the current file, and the list of the next epoch costs nothing
until it is read.

NOTE [ Seeking into compressed files ]
Files are opened through fsspec with ``compression="infer"`` (``.gz``, ``.bz2``,
``.xz``...), and positions are byte offsets in the *decompressed* stream. Seeking an
uncompressed file is a jump (a range request on object stores); seeking a compressed
one decompresses from the start of the file up to the offset, in C, without handing
any of it to the parser. Restores into the middle of a large compressed file are
therefore not free; small shards keep them cheap.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from typing import IO, Any, TypeVar

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from ..config import WorkerContext
from ..errors import ConfigError, SavableLoaderError, StorageError
from ..rng import derive_seed
from ..storage import _describe
from .stage import Cursor, Stage

__all__ = ["ShardCursor", "ShardedSource", "expand_urls", "storage_errors"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ORDER_PURPOSE = 0x5A4D
_GLOB_CHARACTERS = frozenset("*?[")

Urls = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


@contextlib.contextmanager
def storage_errors(url: str, action: str = "read") -> Iterator[None]:
    """Turns what fsspec, a backend or a decompressor raises into a StorageError."""
    try:
        yield
    except SavableLoaderError:
        raise
    except Exception as exc:
        raise StorageError(f"Cannot {action} {url}: {_describe(exc)}.") from exc


def expand_urls(urls: Urls, storage_options: dict[str, Any], stage: str) -> tuple[str, ...]:
    """Returns the sorted files that ``urls`` name (NOTE [ Shard listing and assignment ]).

    Raises:
        ConfigError: ``urls`` is empty or a glob in it matches nothing.
        StorageError: Listing failed.
    """
    given = [urls] if isinstance(urls, (str, os.PathLike)) else list(urls)
    if not given:
        raise ConfigError(f"{stage} needs at least one path, glob or URL")
    found: set[str] = set()
    for item in given:
        url = os.fspath(item) if isinstance(item, (str, os.PathLike)) else item
        if not isinstance(url, str):
            raise ConfigError(f"{stage} takes paths or URLs as str, got {type(url).__name__}")
        with storage_errors(url, "list"):
            fs, path = fsspec.url_to_fs(url, **storage_options)
            if "::" in url or not _GLOB_CHARACTERS.intersection(path):
                found.add(url if "::" in url else _unstrip(fs, path))
                continue
            listing = fs.glob(path, detail=True)
            matches = [
                _unstrip(fs, match)
                for match, info in listing.items()
                if info.get("type") != "directory"
            ]
        if not matches:
            raise ConfigError(f"{stage}: {url!r} matches no file")
        found.update(matches)
    return tuple(sorted(found))


def _unstrip(fs: Any, path: str) -> str:
    return path if isinstance(fs, LocalFileSystem) else str(fs.unstrip_protocol(path))


class ShardedSource(Stage[T]):
    """Base of the sources that read a sorted list of files, sharded over streams.

    Args:
        urls: A path, glob or fsspec URL, or a list of them.
        shuffle_shards: Visit the files in a new seeded order every epoch.
        seed: Seed of those orders.
        storage_options: Passed to fsspec (credentials, endpoint...); not part of
            ``config()``.

    Raises:
        ConfigError: An argument is invalid or a glob matches nothing.
        StorageError: Listing the files failed.
    """

    def __init__(
        self,
        urls: Urls,
        *,
        shuffle_shards: bool = False,
        seed: int = 0,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        name = type(self).__name__
        if not isinstance(shuffle_shards, bool):
            raise ConfigError(f"{name} shuffle_shards must be a bool, got {shuffle_shards!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"{name} seed must be an int, got {seed!r}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"{name} storage_options must be a dict or None")
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        self._filesystems: dict[str, Any] = {}
        self.urls = expand_urls(urls, self.storage_options, name)
        self.shuffle_shards = shuffle_shards
        self.seed = seed

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__,
            "urls": list(self.urls),
            "shuffle_shards": self.shuffle_shards,
            "seed": self.seed,
        }

    def describe(self) -> str:
        count = f"{len(self.urls)} file{'' if len(self.urls) == 1 else 's'}"
        shuffled = f", shuffle_shards=True, seed={self.seed}" if self.shuffle_shards else ""
        return f"{type(self).__name__}({count}{shuffled})"

    def open(self, url: str) -> IO[bytes]:
        """Opens ``url`` for reading, decompressed by its extension.

        One filesystem per protocol and process serves every file of this stage, so that
        opening a file costs no new client (``skip_instance_cache`` included); a forked
        worker builds its own (fsspec's async filesystems are not fork-safe).
        """
        if "::" in url:
            return fsspec.open(url, "rb", compression="infer", **self.storage_options).open()  # type: ignore[no-any-return]
        key = f"{os.getpid()}:{url.partition('://')[0] if '://' in url else 'file'}"
        if key not in self._filesystems:
            self._filesystems[key] = fsspec.url_to_fs(url, **self.storage_options)[0]
        return self._filesystems[key].open(url, "rb", compression="infer")  # type: ignore[no-any-return]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_filesystems"] = {}  # rebuilt where the stage is read
        return state

    def files_for(self, context: WorkerContext, epoch: int) -> list[str]:
        """The files ``context``'s stream reads in ``epoch``, in reading order."""
        count = len(self.urls)
        if self.shuffle_shards:
            rng = np.random.default_rng(derive_seed(self.seed, _ORDER_PURPOSE, epoch))
            order = [int(i) for i in rng.permutation(count)]
        else:
            order = list(range(count))
        return [self.urls[order[i]] for i in range(context.shard_index, count, context.num_shards)]


class ShardCursor(Cursor[T]):
    """Reads one stream's files: the epoch, the file index, one open file at a time.

    Subclasses read items from :meth:`open_file` and keep ``offset`` up to date.
    """

    def __init__(self, stage: ShardedSource[T], context: WorkerContext) -> None:
        super().__init__(context)
        self.stage = stage
        self.epoch = 0
        self.shard = 0
        self.offset = 0
        self.file: IO[bytes] | None = None
        self._files: tuple[int, list[str]] = (-1, [])
        if context.shard_index >= len(stage.urls):
            logger.warning(
                "%s: %d files for %d streams (%d ranks x %d workers): rank %d worker %d "
                "reads no file and yields nothing",
                stage.describe(),
                len(stage.urls),
                context.num_shards,
                context.world_size,
                max(context.num_workers, 1),
                context.rank,
                context.worker_id,
            )

    def url(self) -> str | None:
        """The file being read, or None once this stream's files of the epoch are done."""
        epoch, files = self._files
        if epoch != self.epoch:
            files = self.stage.files_for(self.context, self.epoch)
            self._files = (self.epoch, files)
        return files[self.shard] if self.shard < len(files) else None

    def open_file(self, url: str) -> IO[bytes]:
        """Returns the open file of the current shard, positioned at ``offset``."""
        if self.file is None:
            with storage_errors(url):
                file = self.stage.open(url)
                try:
                    if self.offset:
                        file.seek(self.offset)
                except BaseException:
                    file.close()
                    raise
            self.file = file
        return self.file

    def close(self) -> None:
        """Closes the open file, if any (idempotent); the position is kept."""
        file, self.file = self.file, None
        if file is not None:
            file.close()

    def move(self, epoch: int, shard: int, offset: int) -> None:
        """Closes the open file and stands at ``offset`` of file ``shard`` of ``epoch``."""
        self.close()
        self.epoch, self.shard, self.offset = epoch, shard, offset

    def next_shard(self) -> None:
        """Moves to the start of this stream's next file."""
        self.move(self.epoch, self.shard + 1, 0)

    def end_epoch(self) -> None:
        self.move(self.epoch + 1, 0, 0)
