"""The base of the sources that read a sorted list of files, sharded over streams.

NOTE [ Shard listing and assignment ]
The files are listed and sorted as NOTE [ Listing files ] in ``files.py`` says. In
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

import logging
import os
from typing import IO, Any, ClassVar, TypeVar

import fsspec
import numpy as np

from ..config import WorkerContext
from ..errors import ConfigError, StateError
from ..rng import derive_seed
from .cursor import Cursor, validate_state
from .elastic import ReshardPlan
from .file_rest import Rest, ShardState, check_begun, reshard_files
from .files import Urls, expand_urls, storage_errors
from .stage import Stage

__all__ = ["ShardCursor", "ShardState", "ShardedSource", "storage_errors"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ORDER_PURPOSE = 0x5A4D


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

    #: The state's names for a position inside a file, ``offset`` first.
    position_fields: ClassVar[tuple[str, ...]] = ("offset",)
    #: The model of the state (subclasses add the fields after ``offset``).
    State: ClassVar[type[ShardState]] = ShardState

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

    def check_layout(self, context: WorkerContext) -> None:
        """Refuses more (rank, worker) streams than files (NOTE [ Shard listing and
        assignment ]): a stream without a file would yield nothing, and its rank would
        leave the others waiting in a collective.

        Raises:
            ConfigError: A stream would read no file; names the first one (of this rank
                when it has one), the numbers of files and streams, and the fix.
        """
        files, streams = len(self.urls), context.num_shards
        if files >= streams:
            return
        workers = max(context.num_workers, 1)
        starved = max(files, context.rank * workers)  # this rank's first, else the first
        rank, worker = divmod(starved, workers)
        raise ConfigError(
            f"{self.describe()}: {files} file{'s' * (files != 1)} for {streams} streams "
            f"({context.world_size} ranks x {workers} workers): rank {rank} worker {worker} "
            f"would read no file and yield nothing while other ranks wait for it; use at "
            f"most {files} streams (fewer workers or ranks) or split the data into at "
            f"least {streams} files"
        )

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
        state = self.__dict__.copy()
        state["_filesystems"] = {}  # rebuilt where the stage is read
        return state

    def order(self, epoch: int) -> list[int]:
        """Indices into ``urls`` of the files of ``epoch``, in the epoch's order."""
        count = len(self.urls)
        if not self.shuffle_shards:
            return list(range(count))
        rng = np.random.default_rng(derive_seed(self.seed, _ORDER_PURPOSE, epoch))
        return [int(i) for i in rng.permutation(count)]

    def places(self, context: WorkerContext, rest: Rest | None) -> list[int]:
        """Places in the epoch's order of the files ``context``'s stream reads, in
        reading order: of every file, or of those ``rest`` leaves."""
        files = range(len(self.urls)) if rest is None else rest.files
        return list(files[context.shard_index :: context.num_shards])

    def parse_state(self, state: Any | None) -> tuple[ShardState, Rest | None]:
        """``state`` validated (None: the start of epoch 0), and the rest it records.

        Raises:
            StateError: ``state`` is malformed.
        """
        name = type(self).__name__
        if state is None:
            start = {"epoch": 0, "shard": 0, **dict.fromkeys(self.position_fields, 0)}
            return self.State.model_validate(start), None
        model = validate_state(self.State, state, name)
        return model, Rest.parse(model, len(self.urls), self.position_fields, name)

    def position(self, state: ShardState) -> tuple[int, ...]:
        """The position inside a file that ``state`` holds, ``offset`` first."""
        return tuple(int(getattr(state, field)) for field in self.position_fields)

    def reshard(self, plan: ReshardPlan) -> dict[str, Any]:
        """The state of ``plan.new``'s stream (NOTE [ Elastic file order ] in
        ``file_rest.py``).

        Raises:
            StateError: The saved states are malformed, stand in another epoch or
                disagree on what was left of the epoch.
        """
        return reshard_files(self, plan)


class ShardCursor(Cursor[T]):
    """Reads one stream's files: the epoch, the file index, one open file at a time.

    Subclasses read items from :meth:`open_file` and keep ``offset`` up to date; those
    whose position inside a file holds more than ``offset`` override :meth:`position`
    and :meth:`set_position`.
    """

    def __init__(self, stage: ShardedSource[T], context: WorkerContext) -> None:
        super().__init__(context)
        self.stage = stage
        self.epoch = 0
        self.shard = 0
        self.offset = 0
        self.file: IO[bytes] | None = None
        #: What is left of epoch ``self.epoch`` after an elastic restore, else None.
        self.rest: Rest | None = None
        self._files: tuple[int, list[int], list[str]] = (-1, [], [])
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

    def _layout(self) -> tuple[list[int], list[str]]:
        """This stream's files of the epoch: their places in the epoch's order, their URLs."""
        epoch, places, urls = self._files
        if epoch != self.epoch:
            places = self.stage.places(self.context, self.rest)
            order = self.stage.order(self.epoch)
            urls = [self.stage.urls[order[place]] for place in places]
            self._files = (self.epoch, places, urls)
        return places, urls

    def url(self) -> str | None:
        """The file being read, or None once this stream's files of the epoch are done."""
        urls = self._layout()[1]
        return urls[self.shard] if self.shard < len(urls) else None

    def start(self, shard: int) -> tuple[int, ...]:
        """Where this stream begins its file ``shard``: the file's start, or where an
        elastic restore left it (NOTE [ Elastic file order ])."""
        places = self._layout()[0]
        if self.rest is not None and shard < len(places) and places[shard] in self.rest.starts:
            return self.rest.starts[places[shard]]
        return (0,) * len(self.stage.position_fields)

    def position(self) -> tuple[int, ...]:
        """The position inside the current file, as ``stage.position_fields`` names it."""
        return (self.offset,)

    def set_position(self, position: tuple[int, ...]) -> None:
        """Takes back what :meth:`position` gave."""
        (self.offset,) = position

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

    def close_own(self) -> None:
        """Closes the open file, if any; the position is kept."""
        file, self.file = self.file, None
        if file is not None:
            file.close()

    def move(self, epoch: int, shard: int, position: tuple[int, ...] | None = None) -> None:
        """Closes the open file and stands at ``position`` in file ``shard`` of ``epoch``
        (None: where this stream begins that file)."""
        self.close_own()
        self.epoch, self.shard = epoch, shard
        self.set_position(self.start(shard) if position is None else position)

    def next_shard(self) -> None:
        """Moves to the beginning of this stream's next file."""
        self.move(self.epoch, self.shard + 1)

    def end_epoch(self) -> None:
        self.rest = None
        self._files = (-1, [], [])
        self.move(self.epoch + 1, 0)

    def own_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "shard": self.shard}
        state.update(zip(self.stage.position_fields, self.position(), strict=True))
        if self.rest is not None:
            state.update(self.rest.fields())
        return state

    def restore_own(self, state: Any | None) -> None:
        model, rest = self.stage.parse_state(state)
        position = self.stage.position(model)
        if rest is not None:
            places = self.stage.places(self.context, rest)
            context = self.context
            where = f"{type(self.stage).__name__}, rank {context.rank} worker {context.worker_id}"
            if model.shard > len(places):
                raise StateError(
                    f"{where}: file {model.shard} is past the stream's {len(places)} files "
                    f"left of epoch {model.epoch}; restore a state saved by the same pipeline"
                )
            if model.shard < len(places) and places[model.shard] in rest.starts:
                begun = rest.starts[places[model.shard]]
                check_begun(position, begun, self.stage.position_fields, where)
        self.close_own()
        self.rest = rest
        self._files = (-1, [], [])
        self.move(model.epoch, model.shard, position)
