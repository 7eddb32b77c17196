"""The cursor of the file sources: one stream's share of an epoch, one open file at a time.

It reads with either rule of NOTE [ Shard listing and assignment ] in ``datasets/files/sharded.py``:
whole files (``split="files"``: an index into the stream's own list of files), or a run
of the epoch's sample ids (``split="samples"``, NOTE [ Splitting files by samples ] in
``datasets/files/sample_split.py``). A source's cursor only says how to read one item of an open
file (:meth:`ShardCursor.read_item`) and what its position inside a file is. Every read goes
through :meth:`ShardCursor.attempt`, which retries transient storage errors from the same
position (NOTE [ Retries ] in ``storage/retry.py``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import IO, Any, Generic, TypeVar

from ...config import WorkerContext
from ...errors import StateError, StorageError
from ...storage.retry import retrying
from ..protocol.cursor import Cursor
from .file_list import storage_errors
from .reshard import Rest, check_begun, seek_checked
from .sample_split import Spans, locate, stream_run
from .sharded import ShardedSource

__all__ = ["ShardCursor"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class _Run(Generic[T]):
    """A ``split="samples"`` epoch as one stream reads it: the ids, its run of them, the
    files' first samples in the epoch's order."""

    def __init__(
        self, stage: ShardedSource[T], context: WorkerContext, epoch: int, spans: Spans | None
    ) -> None:
        self.samples = sum(stage.sample_counts())
        self.epoch = epoch
        self.spans = spans or Spans.fresh(self.samples, context.world_size, stage.even)
        self.first, self.last = stream_run(self.spans.total, context)
        self.starts = stage.sample_starts(epoch)

    def __len__(self) -> int:
        return self.last - self.first

    def target(self, taken: int) -> tuple[int, int]:
        """``(place, index)`` of the stream's sample ``taken``."""
        return locate(self.spans.id_at(self.first + taken) % self.samples, self.starts)

    def count(self, place: int) -> int:
        """The samples of file ``place`` of the epoch's order."""
        ends = [*self.starts[1:], self.samples]
        return ends[place] - self.starts[place]


class ShardCursor(Cursor[T]):
    """Reads one stream's share of a file source's epoch, one open file at a time.

    Subclasses read items from :meth:`open_file` in :meth:`read_item` and keep
    ``offset`` up to date; those whose position inside a file holds more than ``offset``
    override :meth:`position` and :meth:`set_position`.
    """

    def __init__(self, stage: ShardedSource[T], context: WorkerContext) -> None:
        super().__init__(context)
        self.stage = stage
        self.epoch = 0
        self.offset = 0
        self.file: IO[bytes] | None = None
        #: Set by :meth:`read_item` when it met the end of the file.
        self.file_done = False
        # split="files": this stream's file, what is left of the epoch after an elastic
        # restore (else None), and this stream's files of the epoch.
        self.shard = 0
        self.rest: Rest | None = None
        self._files: tuple[int, list[int], list[str]] = (-1, [], [])
        # split="samples": the ids consumed, the file being read (a place in the epoch's
        # order), its samples before offset, the ids left after an elastic restore.
        self.taken = 0
        self.place = 0
        self.at = 0
        self.spans: Spans | None = None
        self._run: _Run[T] | None = None
        #: A restore opens the file at the restored offset to check it (else the first
        #: read does): NOTE [ States checked at the door ] in ``datasets/protocol/stage.py``.
        self.check_files = False
        #: The key of the item ``next()`` last returned (:meth:`item_key`).
        self._key: tuple[int, ...] | None = None
        #: Whether opening a file starts downloading the stream's next ones (a reader
        #: by position, NOTE [ File sources by position ], does not know them).
        self.prefetching = True
        if stage.split == "files" and context.shard_index >= len(stage.urls):
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

    # -- what a source's cursor fills in -------------------------------------------------

    def read_item(self, url: str) -> T | None:
        """Reads the next item of the open file at the current position and moves past
        it; None at the end of the file. Sets ``file_done`` once it met the end."""
        raise NotImplementedError

    def pass_item(self, url: str) -> bool:
        """Moves past the next item without making it (False: the file ended)."""
        return self.read_item(url) is not None or not self.file_done

    def position(self) -> tuple[int, ...]:
        """The position inside the current file, as ``stage.position_fields`` names it."""
        return (self.offset,)

    def set_position(self, position: tuple[int, ...]) -> None:
        """Takes back what :meth:`position` gave."""
        (self.offset,) = position

    # -- reading -------------------------------------------------------------------------

    def __next__(self) -> T:
        if self.stage.split == "samples":
            return self._next_sample()
        while True:
            url = self.url()
            if url is None:
                self.end_epoch()
                raise StopIteration
            key = (self.epoch, self._layout()[0][self.shard], self.position()[0])
            item = self.attempt(url, functools.partial(self.read_item, url))
            if self.file_done:
                self.next_shard()
            if item is not None:
                self._key = key
                return item

    def _next_sample(self) -> T:
        run = self._sample_run()
        if run is None:  # one stream: the files in order, no count needed
            while self.place < len(self.stage.urls):
                item = self._read_sample(self._url(self.place))
                if item is not None:
                    return item
            self.end_epoch()
            raise StopIteration
        if self.taken >= len(run):
            self.end_epoch()
            raise StopIteration
        return self.read_at(*run.target(self.taken))

    def read_at(self, place: int, index: int) -> T:
        """Sample ``index`` of file ``place`` of this cursor's epoch, read on from where
        the cursor stands in that file (passing the samples before it), or from the
        file's start when it stands elsewhere.

        Raises:
            StorageError: The file ended before that sample: it changed since counted.
        """
        if self.place != place or self.at > index:
            self.move_to(place)
        url = self._url(place)
        while self.at < index:
            if not self.attempt(url, functools.partial(self.pass_item, url)):
                break
            self.at += 1
        before = self.at
        item = self._read_sample(url) if self.at == index else None
        if item is None:
            counted = self.stage.sample_counts()[self.stage.order(self.epoch)[place]]
            raise StorageError(
                f"{url} ended after {before} samples, fewer than the {counted} "
                "counted when the loader started; the file changed while the job ran"
            )
        return item

    def _read_sample(self, url: str) -> T | None:
        """Reads the sample at ``at`` of the open file; at its end moves to the next one."""
        start = self.position()
        key = (self.epoch, self.place, self.at)
        try:
            item = self.attempt(url, functools.partial(self.read_item, url))
        except BaseException as exc:
            # The source moved past a malformed item; a storage error moves past none
            # (a JSON lines file may have moved past blank lines).
            if not isinstance(exc, StorageError) and self.position() != start:
                self.at += 1
                self.taken += 1
            self.close()
            raise
        if item is not None:
            self.at += 1
            self.taken += 1
            self._key = key
        if self.file_done:
            self.move_to(self.place + 1)
        return item

    def item_key(self) -> tuple[int, ...] | None:
        """``(epoch, place, at)`` with ``split="samples"``: the file's place in the
        epoch's order and the sample's index in it; ``(epoch, place, offset)`` with
        ``split="files"``: where the item begins in the file. Both are places of the
        epoch's canonical order (NOTE [ Elastic sample order ], NOTE [ Elastic file order ])."""
        return self._key

    def skip_fast(self, n: int) -> int | None:
        run = self._sample_run() if self.stage.split == "samples" else None
        if run is None:
            return None  # reading is the replay
        passed = min(n, len(run) - self.taken)
        self.taken += passed  # the file is reached when the next sample is read
        if passed < n:
            self.end_epoch()
        return passed

    def left(self) -> int | None:
        """Samples left of this stream's epoch when its position tells without reading
        data: of a ``split="samples"`` run on several streams, or none once a
        ``split="files"`` stream is past its last file; else None (the files' samples
        are not counted)."""
        if self.stage.split == "files":
            return 0 if self.url() is None else None
        run = self._sample_run()
        return None if run is None else len(run) - self.taken

    def _sample_run(self) -> _Run[T] | None:
        """The epoch as this stream reads it; None when one stream reads the files in
        order (NOTE [ Splitting files by samples ])."""
        if self.spans is None and self.context.num_shards == 1:
            return None
        if self._run is None or self._run.epoch != self.epoch:
            self._run = _Run(self.stage, self.context, self.epoch, self.spans)
        return self._run

    def _url(self, place: int) -> str:
        return self.stage.urls[self.stage.order(self.epoch)[place]]

    def move_to(self, place: int) -> None:
        """Closes the open file and stands at the start of file ``place`` of the epoch."""
        self.close_own()
        self.place, self.at = place, 0
        self.set_position((0,) * len(self.stage.position_fields))

    # -- split="files" -------------------------------------------------------------------

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

    def move(self, epoch: int, shard: int, position: tuple[int, ...] | None = None) -> None:
        """Closes the open file and stands at ``position`` in file ``shard`` of ``epoch``
        (None: where this stream begins that file)."""
        self.close_own()
        self.epoch, self.shard = epoch, shard
        self.set_position(self.start(shard) if position is None else position)

    def next_shard(self) -> None:
        """Moves to the beginning of this stream's next file."""
        self.move(self.epoch, self.shard + 1)

    # -- files ---------------------------------------------------------------------------

    def attempt(self, url: str, call: Callable[[], R]) -> R:
        """Returns ``call()``, a read of ``url``; after a failure closes the file, keeping
        the position, and retries a transient error (NOTE [ Retries ] in ``storage/retry.py``)."""
        return retrying(url, call, self.close, self.stage.retry)

    def open_file(self, url: str) -> IO[bytes]:
        """Returns the open file being read, positioned at ``offset``."""
        if self.file is None:
            with storage_errors(url):
                file = self.stage.open(url, stream=True)
                try:
                    seek_checked(file, self.offset, url, self._where())
                except BaseException:
                    file.close()
                    raise
            self.file = file
            # After the open: its first bytes do not share the store with the files ahead.
            if self.stage.cache_dir is not None and self.stage.prefetch and self.prefetching:
                self.stage.prefetch_files(self.upcoming())
        return self.file

    def upcoming(self) -> list[str]:
        """The next ``stage.prefetch`` files this stream reads after the current one in
        this epoch, as far as its position tells (NOTE [ Prefetching files ] in
        ``storage/cache/node.py``): a hint that changes nothing read."""
        ahead = self.stage.prefetch
        if self.stage.split == "files":
            urls = self._layout()[1]
            return urls[self.shard + 1 : self.shard + 1 + ahead]
        run = self._sample_run()
        if run is None:
            order = self.stage.order(self.epoch)[self.place + 1 : self.place + 1 + ahead]
            return [self.stage.urls[i] for i in order]
        places: list[int] = []
        taken = self.taken
        while len(places) < ahead and taken < len(run):
            place, index = run.target(taken)
            if place != self.place and place not in places:
                places.append(place)
            taken += max(run.count(place) - index, 1)
        return [self._url(place) for place in places]

    def close_own(self) -> None:
        """Closes the open file, if any; the position is kept."""
        file, self.file, self.file_done = self.file, None, False
        if file is not None:
            file.close()

    def end_epoch(self) -> None:
        self.close_own()
        stats = self.stage.cache_stats()
        if stats is not None:
            logger.debug("%s: epoch %d read, cache %s", self.stage.describe(), self.epoch, stats)
        self.rest, self.spans, self._run = None, None, None
        self._files = (-1, [], [])
        self.epoch, self.shard, self.taken, self.place, self.at = self.epoch + 1, 0, 0, 0, 0
        self.set_position((0,) * len(self.stage.position_fields))

    # -- state ---------------------------------------------------------------------------

    def own_state(self) -> dict[str, Any]:
        if self.stage.split == "samples":
            return self._sample_state()
        state: dict[str, Any] = {"epoch": self.epoch, "shard": self.shard}
        state.update(zip(self.stage.position_fields, self.position(), strict=True))
        if self.rest is not None:
            state.update(self.rest.fields())
        return state

    def _sample_state(self) -> dict[str, Any]:
        place, at, position = self.place, self.at, self.position()
        state: dict[str, Any] = {"epoch": self.epoch, "taken": self.taken}
        run = self._sample_run()
        if run is not None:
            if self.taken < len(run):
                target, index = run.target(self.taken)
                if place != target or at > index:  # the file is reached when read
                    place, at, position = target, 0, (0,) * len(position)
            state["samples"] = run.samples
        state.update(file=place, at=at)
        state.update(zip(self.stage.position_fields, position, strict=True))
        if self.spans is not None:
            state.update(self.spans.fields())
        return state

    def restore_own(self, state: Any | None) -> None:
        self._key = None
        if self.stage.split == "samples":
            self._restore_samples(state)
            return
        model, rest = self.stage.parse_state(state)
        position = self.stage.position(model)
        places = self.stage.places(self.context, rest)
        if model.shard > len(places):
            left = "left of" if rest is not None else "of"
            raise StateError(
                f"{self._where()}: shard {model.shard} is past the stream's {len(places)} "
                f"files {left} epoch {model.epoch}; restore a state saved by the same pipeline"
            )
        if rest is not None and model.shard < len(places) and places[model.shard] in rest.starts:
            begun = rest.starts[places[model.shard]]
            check_begun(position, begun, self.stage.position_fields, self._where())
        self.close_own()
        self.rest = rest
        self._files = (-1, [], [])
        self.move(model.epoch, model.shard, position)
        if self.check_files:
            self._check_offset(self.url())

    def _check_offset(self, url: str | None) -> None:
        """Opens ``url`` at the restored offset, which refuses one past its end, and
        closes it again."""
        if url is not None and self.offset:
            try:
                self.attempt(url, functools.partial(self.open_file, url))
            finally:
                self.close_own()

    def _where(self) -> str:
        context = self.context
        return f"{type(self.stage).__name__}, rank {context.rank} worker {context.worker_id}"

    def _restore_samples(self, state: Any | None) -> None:
        model, spans = self.stage.parse_samples(state)
        self.close_own()
        self.epoch, self.taken, self.spans, self._run = model.epoch, model.taken, spans, None
        self.place, self.at = model.file, model.at
        self.set_position(tuple(getattr(model, field) for field in self.stage.position_fields))
        run = self._sample_run()
        if run is None:
            if model.file > len(self.stage.urls):
                raise StateError(
                    f"{self._where()}: file {model.file} is past the epoch's "
                    f"{len(self.stage.urls)} files; restore a state saved by the same pipeline"
                )
            if self.check_files and model.file < len(self.stage.urls):
                self._check_offset(self._url(model.file))
            return
        if model.samples is not None and model.samples != run.samples:
            raise StateError(
                f"{self._where()}: the state was saved over {model.samples} samples and the "
                f"files now hold {run.samples}; the data changed since the save: restore it "
                "onto the files it was saved with"
            )
        if model.taken > len(run):
            raise StateError(
                f"{self._where()}: taken {model.taken} is past the stream's {len(run)} "
                f"samples of epoch {model.epoch}; restore a state saved by the same pipeline"
            )
        if model.taken < len(run):
            place, index = run.target(model.taken)
            fresh = model.at == 0 and not any(self.position())
            if not fresh and (model.file != place or model.at > index):
                raise StateError(
                    f"{self._where()}: file {model.file} at sample {model.at} is not where "
                    f"the stream's sample {model.taken} lies (file {place}, sample {index}); "
                    "restore a state saved by the same pipeline"
                )
            if self.check_files and not fresh:
                self._check_offset(self._url(place))
