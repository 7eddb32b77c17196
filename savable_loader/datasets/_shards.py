"""What the file sources share: listing, sharding, opening a file at an offset, moving a
position to another layout.

The module is longer than one stage's because the elastic restore (NOTE [ Elastic file
order ]) inverts the file layout, which lives here, and serves every file source alike.

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

NOTE [ Elastic file order ]
The canonical order of epoch ``e`` is its file order above, lines or samples in order
within a file; it depends on neither ranks nor workers. What a layout consumed is, per
stream, a prefix of its files: whole files before its ``shard``, the current one up to
its position, nothing after. On a restore onto another layout (NOTE [ Elastic resume ]
in ``elastic.py``) the source gathers that over every saved stream and records the rest
of the epoch in three fields that every new stream holds alike: ``done_below`` (every
file before that place of the order is finished), ``done`` (the finished files after
it, ascending) and ``started`` (``[place, offset, ...]`` for each begun file that is
not finished: where it resumes, the rest of the position as the source's state names
it). The files left, in canonical order, are laid out over the new streams as a whole
epoch is, entry ``j`` to the stream whose ``shard_index`` is ``j % num_shards``; a
stream's ``shard`` then indexes its own entries, and it begins each at its ``started``
position. A stream that finished the epoch dropped these fields, so they are taken from
one still in it (the streams of one layout agree, else the states are not of one save);
the new streams' progress maps back through the same layout, so a second elastic
restore in that epoch composes. At the end of the epoch the fields go, and the next
epoch is laid out as on a fresh run. The fields are few: streams move through their
files at a similar pace, so few finished files lie past the first one left, and at most
one begun file per saved stream.

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
import functools
import itertools
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Annotated, Any, ClassVar, TypeVar

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem
from pydantic import Field

from ..config import WorkerContext
from ..errors import ConfigError, SavableLoaderError, StateError, StorageError
from ..rng import derive_seed
from ..storage import _describe
from .elastic import ReshardPlan
from .stage import Cursor, Stage, StageState, validate_state

__all__ = [
    "Rest",
    "ShardCursor",
    "ShardState",
    "ShardedSource",
    "expand_urls",
    "storage_errors",
]

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


Place = Annotated[int, Field(ge=0)]


class ShardState(StageState):
    """A file stream's position (NOTE [ Shard listing and assignment ]); each source
    adds the rest of its position inside a file."""

    epoch: int = Field(ge=0, description="The epoch being read.")
    shard: int = Field(ge=0, description="Index of the file in this stream's list.")
    offset: int = Field(ge=0, description="Byte offset of the next item, decompressed.")
    done_below: int | None = Field(
        default=None,
        ge=0,
        description="After an elastic restore: every file before this place of the epoch's "
        "order was finished before it (NOTE [ Elastic file order ]).",
    )
    done: list[Place] | None = Field(
        default=None, description="After an elastic restore: finished files after done_below."
    )
    started: list[list[Place]] | None = Field(
        default=None,
        description="After an elastic restore: [place, offset, ...] of every begun file left.",
    )


@dataclass(frozen=True)
class Rest:
    """What is left of an epoch after an elastic restore (NOTE [ Elastic file order ]).

    Attributes:
        count: Files in an epoch.
        files: Places in the epoch's order of the files left, ascending.
        starts: Where a begun file of ``files`` resumes: its position inside the file
            (``offset`` first), by place.
    """

    count: int
    files: tuple[int, ...]
    starts: Mapping[int, tuple[int, ...]]

    @classmethod
    def parse(
        cls, state: ShardState, count: int, fields: tuple[str, ...], stage: str
    ) -> Rest | None:
        """The rest ``state`` records, checked; None when it records none.

        Raises:
            StateError: The fields are incomplete or do not describe an epoch of
                ``count`` files.
        """
        below, done, started = state.done_below, state.done, state.started
        if below is None and done is None and started is None:
            return None
        if below is None or done is None or started is None:
            raise _malformed(stage, "done_below, done and started come together")
        ascending = all(a < b for a, b in itertools.pairwise([below, *done]))
        if below > count or not ascending or (done and done[-1] >= count):
            raise _malformed(
                stage,
                f"done_below {below} and done must be ascending places of an epoch of "
                f"{count} files",
            )
        finished = set(done)
        files = tuple(place for place in range(below, count) if place not in finished)
        left = set(files)
        starts: dict[int, tuple[int, ...]] = {}
        for entry in started:
            if len(entry) != 1 + len(fields) or entry[0] not in left or entry[0] in starts:
                raise _malformed(
                    stage,
                    f"started must hold [place, {', '.join(fields)}] of distinct files left, "
                    f"got {entry}",
                )
            starts[entry[0]] = tuple(entry[1:])
        return cls(count, files, starts)

    @functools.cached_property
    def _fields(self) -> tuple[int, list[int], list[list[int]]]:
        below = self.files[0] if self.files else self.count
        left = set(self.files)
        done = [place for place in range(below, self.count) if place not in left]
        started = [[place, *self.starts[place]] for place in self.files if place in self.starts]
        return below, done, started

    def fields(self) -> dict[str, Any]:
        """The state's fields that record this rest (computed once)."""
        below, done, started = self._fields
        return {"done_below": below, "done": list(done), "started": [*map(list, started)]}


def _malformed(stage: str, problem: str) -> StateError:
    return StateError(
        f"{stage}: malformed state ({problem}); restore a state saved by the same pipeline"
    )


def _check_begun(
    position: tuple[int, ...], start: tuple[int, ...], fields: tuple[str, ...], where: str
) -> None:
    """Raises a StateError when ``position`` in a file lies before where it resumes."""
    if any(a < b for a, b in zip(position, start, strict=True)):
        now, then = dict(zip(fields, position, strict=True)), dict(zip(fields, start, strict=True))
        raise StateError(
            f"{where}: position {now} lies before {then}, where the file resumes in this "
            "epoch; restore a state saved by the same pipeline"
        )


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
        """The state of ``plan.new``'s stream (NOTE [ Elastic file order ]).

        Raises:
            StateError: The saved states are malformed, stand in another epoch or
                disagree on what was left of the epoch.
        """
        name, count = type(self).__name__, len(self.urls)
        zero = (0,) * len(self.position_fields)
        finished: list[WorkerContext] = []
        reading: list[tuple[WorkerContext, ShardState]] = []
        rests: list[Rest | None] = []
        for stream in plan.old:
            state, recorded = self.parse_state(stream.state)
            at_next = state.epoch == plan.epoch + 1 and state.shard == 0
            if at_next and self.position(state) == zero and recorded is None:
                finished.append(stream.context)
                continue
            if state.epoch != plan.epoch:
                raise StateError(
                    f"{name}: a saved stream stands in epoch {state.epoch} while the loader "
                    f"resumes epoch {plan.epoch}; restore a state saved by the same pipeline"
                )
            if rests and recorded != rests[0]:
                raise StateError(
                    f"{name}: the saved streams disagree on what was left of epoch "
                    f"{plan.epoch} before their own restore; restore the states of one save "
                    "together"
                )
            rests.append(recorded)
            reading.append((stream.context, state))
        if not reading:
            # Every stream finished the epoch: nothing of it is left.
            return self._resumed(plan, Rest(count, (), {}))
        rest = rests[0]
        starts = {} if rest is None else dict(rest.starts)
        done: set[int] = set()
        for context in finished:
            done.update(self.places(context, rest))
        for context, state in reading:
            where = f"{name}, rank {context.rank} worker {context.worker_id}"
            mine = self.places(context, rest)
            if state.shard > len(mine):
                raise StateError(
                    f"{where}: file {state.shard} is past the stream's {len(mine)} files of "
                    f"epoch {state.epoch}; restore a state saved by the same pipeline"
                )
            done.update(mine[: state.shard])
            if state.shard < len(mine):
                place, position = mine[state.shard], self.position(state)
                _check_begun(position, starts.get(place, zero), self.position_fields, where)
                if any(position):
                    starts[place] = position
        if rest is None and not done and not starts:
            # Nothing of the epoch was read: a fresh start, in the plain state.
            return {"epoch": plan.epoch, "shard": 0, **dict.fromkeys(self.position_fields, 0)}
        files = range(count) if rest is None else rest.files
        left = tuple(place for place in files if place not in done)
        return self._resumed(plan, Rest(count, left, {p: starts[p] for p in left if p in starts}))

    def _resumed(self, plan: ReshardPlan, rest: Rest) -> dict[str, Any]:
        """The state at the start of ``plan.new``'s share of ``rest``."""
        mine = self.places(plan.new, rest)
        start = rest.starts.get(mine[0]) if mine else None
        position = start or (0,) * len(self.position_fields)
        return {
            "epoch": plan.epoch,
            "shard": 0,
            **dict(zip(self.position_fields, position, strict=True)),
            **rest.fields(),
        }


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

    def close(self) -> None:
        """Closes the open file, if any (idempotent); the position is kept."""
        file, self.file = self.file, None
        if file is not None:
            file.close()

    def move(self, epoch: int, shard: int, position: tuple[int, ...] | None = None) -> None:
        """Closes the open file and stands at ``position`` in file ``shard`` of ``epoch``
        (None: where this stream begins that file)."""
        self.close()
        self.epoch, self.shard = epoch, shard
        self.set_position(self.start(shard) if position is None else position)

    def next_shard(self) -> None:
        """Moves to the beginning of this stream's next file."""
        self.move(self.epoch, self.shard + 1)

    def end_epoch(self) -> None:
        self.rest = None
        self._files = (-1, [], [])
        self.move(self.epoch + 1, 0)

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "shard": self.shard}
        state.update(zip(self.stage.position_fields, self.position(), strict=True))
        if self.rest is not None:
            state.update(self.rest.fields())
        return state

    def restore(self, state: Any | None) -> None:
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
                _check_begun(position, begun, self.stage.position_fields, where)
        self.close()
        self.rest = rest
        self._files = (-1, [], [])
        self.move(model.epoch, model.shard, position)
