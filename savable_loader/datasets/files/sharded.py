"""The base of the sources that read a sorted list of files, sharded over streams.

NOTE [ Shard listing and assignment ]
The files are listed and sorted as NOTE [ Listing files ] in ``datasets/files/file_list.py`` says.
In epoch ``e`` the files come in that sorted order, or in a permutation drawn from
``(seed, e)`` with ``shuffle_shards``. With ``split="samples"`` (the default) the
samples of the epoch are shared out over the (rank, worker) streams so that every rank
reads as many (NOTE [ Splitting files by samples ] in ``datasets/files/sample_split.py``). With
``split="files"`` (the only rule before the option existed) whole files are: file ``i`` of
the order goes to the stream whose ``context.shard_index`` is ``i % context.num_shards``,
which reads its files one after the other, so its position is an index into its own
list plus a position inside the current file. Files of different sizes then give ranks
different numbers of samples. ``config()`` names ``split`` only with ``"samples"``, so
states saved before the option existed keep their fingerprint when the source is built
with ``split="files"``.

NOTE [ Counting samples ]
``split="samples"`` needs the number of samples of every file. The source counts them
the first time a layout with more than one stream needs them (the loader asks when it
is built, in the main process, so its workers inherit the counts), reading every file
once in a few threads, through the cache when there is one (so the workers then find the
files there): lines for JSON lines, member headers for tar (a local file, or a remote
one's copy in the cache, is read header to header, seeking over the members' data; a
remote file read in place, or a compressed one, is read through). With ``counts=``, the
files that a counts file describes as they are now are not read: their counts come from
it (NOTE [ Counts files ] in ``datasets/files/counts_file.py``). The counts stay with the stage
object (and its pickles) for the life of the process. Files that change after they were counted
are an error when read, not a silent shift.

NOTE [ Seeking into compressed files ]
Files are opened through fsspec with ``compression="infer"`` (``.gz``, ``.bz2``,
``.xz``...), and positions are byte offsets in the *decompressed* stream. Seeking an
uncompressed file is a jump (a range request on object stores); seeking a compressed
one decompresses from the start of the file up to the offset, in C, without handing
any of it to the parser. Restores into the middle of a large compressed file are
therefore not free; small shards keep them cheap.
"""

from __future__ import annotations

import itertools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, ClassVar, Literal, TypeVar

import numpy as np

from ...config import WorkerContext
from ...errors import ConfigError, StateError
from ...rng import Purpose, seed_for
from ...storage.cache.entries import cacheable, entry_path
from ...storage.cache.node import signature_of
from ...storage.filesystems import start_client
from ...storage.retry import RetryPolicy
from ..index.order import Even, epoch_length
from ..protocol.cursor import Cursor, validate_state
from ..protocol.elastic import ReshardPlan
from ..protocol.stage import Stage
from .access import FileAccess
from .counts_file import (
    FileCount,
    fetch_counts,
    local_url,
    read_counts,
    recorded_signature,
    same_file,
)
from .counts_file import write_counts as write_counts_file
from .file_list import Urls, expand_urls, storage_errors
from .positions import FilePositions
from .reshard import Rest, ShardState, reshard_files
from .sample_split import SampleState, Spans, reshard_samples, starved_worker

__all__ = ["SampleState", "ShardState", "ShardedSource", "Split", "storage_errors"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_COUNTING_THREADS = 8

#: How a file source shares an epoch out over streams (NOTE [ Shard listing and assignment ]).
Split = Literal["samples", "files", "global"]


class ShardedSource(FileAccess, Stage[T]):
    """Base of the sources that read a sorted list of files, sharded over streams.

    Args:
        urls: A path, glob or fsspec URL, or a list of them.
        shuffle_shards: Visit the files in a new seeded order every epoch.
        seed: Seed of those orders.
        split: ``"samples"`` shares the epoch's samples out so that every rank reads
            as many; ``"files"`` gives each stream whole files.
        even: With ``split="samples"``: ``"pad"`` repeats the first samples so that
            the ranks' shares are equal, ``"drop"`` leaves the last ones out.
        retry: How reads are retried after transient storage errors (NOTE [ Retries ]
            in ``storage/retry.py``); None: ``retry.DEFAULT_POLICY``. Not part of ``config()``.
        storage_options: Passed to fsspec (credentials, endpoint...); not part of
            ``config()``.
        cache_dir: A local folder where remote files are downloaded whole before they
            are read and kept for later opens, shared by the processes of a node (NOTE
            [ File cache ] in ``storage/cache/node.py``); None: read in place. Not part of
            ``config()``.
        cache_limit: Bytes the cache keeps once its files are read; None: 10 GiB. A
            larger file is streamed uncached. Needs ``cache_dir``.
        prefetch: With ``cache_dir``: the next files of each stream downloaded in the
            background while one is read, by as many threads (0: none; NOTE
            [ Prefetching files ] in ``storage/cache/node.py``).
        counts: A counts file (path or URL) written by :meth:`write_counts`: with
            ``split="samples"``, the samples of the files it describes unchanged are
            taken from it instead of counted (NOTE [ Counts files ] in
            ``datasets/files/counts_file.py``). Not part of ``config()``.

    Raises:
        ConfigError: An argument is invalid or a glob matches nothing.
        StorageError: Listing the files failed.
    """

    keyed = True

    #: The state's names for a position inside a file, ``offset`` first.
    position_fields: ClassVar[tuple[str, ...]] = ("offset",)
    #: The model of the state (subclasses add the fields after ``offset``).
    State: ClassVar[type[ShardState]] = ShardState
    #: The model of the state with ``split="samples"`` (subclasses add the same fields).
    SampleModel: ClassVar[type[SampleState]] = SampleState

    def __init__(
        self,
        urls: Urls,
        *,
        shuffle_shards: bool = False,
        seed: int = 0,
        split: Split = "samples",
        even: Even = "pad",
        retry: RetryPolicy | None = None,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        prefetch: int = 2,
        counts: str | os.PathLike[str] | None = None,
    ) -> None:
        name = type(self).__name__
        if not isinstance(shuffle_shards, bool):
            raise ConfigError(f"{name} shuffle_shards must be a bool, got {shuffle_shards!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"{name} seed must be an int, got {seed!r}")
        if split not in ("samples", "files", "global"):
            raise ConfigError(f'{name} split must be "samples", "files" or "global", got {split!r}')
        if even not in ("pad", "drop"):
            raise ConfigError(f'{name} even must be "pad" or "drop", got {even!r}')
        if counts is not None and not isinstance(counts, str | os.PathLike):
            raise ConfigError(f"{name} counts must be a path or URL or None, got {counts!r}")
        if counts is not None and split == "files":
            raise ConfigError(
                f'{name} counts applies to split="samples"; split="files" counts nothing'
            )
        if split == "files" and even != "pad":
            raise ConfigError(
                f'{name} even={even!r} applies to split="samples"; split="files" gives '
                "whole files to streams and neither pads nor drops"
            )
        self.init_access(
            retry=retry,
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit=cache_limit,
            prefetch=prefetch,
        )
        self.counts = None if counts is None else os.fspath(counts)
        listed: dict[str, dict[str, Any]] = {}  # what the listing said of each file
        # A remote counts file is requested while the globs are listed
        # (NOTE [ Counts files ]): its bytes wait in _early_counts for sample_counts().
        self._early_counts: bytes | None = None
        with ThreadPoolExecutor(1, thread_name_prefix="counts-file") as pool:
            early = None
            beside: tuple[str, ...] = ()
            if self.counts is not None and not local_url(self.counts):
                start_client(self.filesystem(self.counts))  # the listing's too, mostly
                if self._counts_held():  # the listing vouches for the cached copy
                    beside = (self.counts,)
                else:
                    early = pool.submit(self._fetch_counts)
            self.urls = expand_urls(urls, self.storage_options, name, listed, beside)
            if early is not None:
                self._early_counts = None if early.exception() else early.result()
        if counts is not None or cache_dir is not None:  # what they are spent on:
            # the counts file's signatures, NOTE [ Listed signatures ] in file_list.py
            self.keep_listing({url: signature_of(info) for url, info in listed.items()})
        self.shuffle_shards = shuffle_shards
        self.seed = seed
        #: ``split="global"``: read by position (NOTE [ File sources by position ] in
        #: ``datasets/files/positions.py``); its cursor reads as ``split="samples"`` otherwise.
        self.by_position = split == "global"
        self.split: Split = "samples" if split == "global" else split
        self.even: Even = even
        self._counts: tuple[int, ...] | None = None

    def config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "type": type(self).__name__,
            "urls": list(self.urls),
            "shuffle_shards": self.shuffle_shards,
            "seed": self.seed,
        }
        if self.split == "samples":  # NOTE [ Shard listing and assignment ]
            config["split"] = "global" if self.by_position else "samples"
        if self.even != "pad":
            config["even"] = self.even
        return config

    def describe(self) -> str:
        count = f"{len(self.urls)} file{'' if len(self.urls) == 1 else 's'}"
        shuffled = f", shuffle_shards=True, seed={self.seed}" if self.shuffle_shards else ""
        split = ', split="files"' if self.split == "files" else ""
        split = ', split="global"' if self.by_position else split
        even = f", even={self.even!r}" if self.even != "pad" else ""
        return f"{type(self).__name__}({count}{shuffled}{split}{even})"

    def count_items(self, file: IO[bytes], url: str) -> int:
        """The number of samples in the open ``file`` (NOTE [ Counting samples ])."""
        raise NotImplementedError(f"{type(self).__name__} cannot count its samples")

    def sample_counts(self) -> tuple[int, ...]:
        """The samples of each file of ``urls``, counted once (NOTE [ Counting samples ]),
        or taken from the counts file (NOTE [ Counts files ] in ``datasets/files/counts_file.py``).

        Raises:
            StorageError: Reading a file, or the counts file, failed.
            ConfigError: The counts file is malformed or another source's.
        """
        if self._counts is None:
            recorded = {}
            if self.counts is not None:
                url, name = self.counts, type(self).__name__
                raw, self._early_counts = self._early_counts, None
                if raw is None:
                    raw = self.read_retrying(url, self._fetch_counts)
                recorded = read_counts(raw, url, name)
            self._counts = self._count(recorded, dict(self.listed))
            logger.debug(
                "%s: %d samples in %d files", self.describe(), sum(self._counts), len(self._counts)
            )
        return self._counts

    def _counts_held(self) -> bool:
        """Whether the node's cache holds a copy of the remote counts file (NOTE
        [ Counts files ] in ``datasets/files/counts_file.py``)."""
        assert self.counts is not None
        if self.cache_dir is None or not cacheable(self.counts):
            return False
        return entry_path(Path(self.cache_dir), self.counts, ".json").exists()

    def _fetch_counts(self) -> bytes:
        """The counts file's bytes; through the node's cache when there is one, with the
        signature the listing gave it where s3fs keeps that listing (NOTE [ Counts files ]
        in ``datasets/files/counts_file.py``)."""
        url = self.counts
        assert url is not None
        # A copy the listing vouches for is read without a request
        # (NOTE [ Listed signatures ] in datasets/files/file_list.py); any other is
        # downloaded anew.
        cached = self.cache_dir is not None and cacheable(url)
        read = (lambda: self.read_whole(url)) if cached else None
        return fetch_counts(url, type(self).__name__, self.filesystem, read)

    def write_counts(self, url: str | os.PathLike[str]) -> None:
        """Counts the samples of every file, as a loader would, and writes them to a counts
        file at ``url`` (a path or URL, written atomically when local) with each file's
        signature, for ``counts=url`` (NOTE [ Counts files ] in ``datasets/files/counts_file.py``).

        Raises:
            StorageError: Reading a file, or writing ``url``, failed.
        """
        signatures = dict(self.listed)
        counts = self._count({}, signatures, sign_all=True)
        write_counts_file(
            os.fspath(url),
            type(self).__name__,
            self.urls,
            counts,
            [signatures[url] for url in self.urls],
            self.storage_options,
        )

    def _count(
        self,
        recorded: dict[str, FileCount],
        signatures: dict[str, dict[str, Any]],
        *,
        sign_all: bool = False,
    ) -> tuple[int, ...]:
        """Each file's samples: ``recorded``'s for a file whose signature (from
        ``signatures``, else asked with ``info()`` and put there) is the recorded one,
        else counted. With ``sign_all``, every file's signature is in ``signatures``
        before its count is taken, so that a later change shows as another signature."""

        def signature(url: str) -> dict[str, Any]:
            if url not in signatures:
                info = self.read_retrying(url, lambda: self.filesystem(url).info(url))
                signatures[url] = signature_of(info)
            return signatures[url]

        def count(url: str) -> tuple[int, bool]:
            now = signature(url) if sign_all or url in recorded else None
            entry = recorded.get(url)
            if entry is not None and now is not None and same_file(recorded_signature(entry), now):
                return entry.samples, True

            def once() -> int:
                with self.open(url) as file:
                    return self.count_items(file, url)

            return self.read_retrying(url, once), False

        self.file_cache()  # one per process, before the threads share it
        threads = min(_COUNTING_THREADS, len(self.urls))
        with ThreadPoolExecutor(threads, thread_name_prefix="count-samples") as pool:
            found = list(pool.map(count, self.urls))
        counted = sum(1 for _, known in found if not known)
        if self.counts is not None and counted:
            logger.info(
                "%s: %d of %d files counted: the counts file %s does not describe them as "
                "they are now",
                self.describe(),
                counted,
                len(found),
                self.counts,
            )
        return tuple(samples for samples, _ in found)

    def sample_starts(self, epoch: int) -> list[int]:
        """The first sample of each file of ``epoch``'s order, in that order."""
        counts = self.sample_counts()
        return [0, *itertools.accumulate(counts[i] for i in self.order(epoch))][:-1]

    def check_layout(self, context: WorkerContext) -> None:
        """Refuses a layout on which a stream would read nothing while others read.

        With ``split="samples"`` the samples are counted here (NOTE [ Counting samples ])
        and a layout is refused when the ranks would read no sample, or a rank's workers
        outnumber its batches (NOTE [ Splitting files by samples ]); with
        ``split="files"``, when a stream would get no file (NOTE [ Shard listing and
        assignment ]): its rank would leave the others waiting in a collective.

        Raises:
            ConfigError: A rank or stream would read nothing; names it, the numbers of
                files, samples and streams, and the fix.
            StorageError: Counting the samples failed.
        """
        if self.by_position:
            return  # the positions are checked as an IndexedDataset's (GlobalView)
        if self.split == "samples":
            if context.num_shards > 1:
                self._check_samples(context)
            return
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

    def _check_samples(self, context: WorkerContext) -> None:
        samples, ranks = sum(self.sample_counts()), context.world_size
        count = len(self.urls)
        files = f"{samples} sample{'s' * (samples != 1)} in {count} file{'s' * (count != 1)}"
        length = epoch_length(samples, ranks, self.even)
        if length == 0:
            fix = 'use even="pad" or fewer ranks' if samples else "check the files"
            raise ConfigError(
                f"{self.describe()}: rank {context.rank} would read no sample: {files} over "
                f"{ranks} rank{'s' * (ranks != 1)} (even={self.even!r}) leave every rank "
                f"with an empty epoch; {fix}"
            )
        worker = starved_worker(length, context)
        if worker is None:
            return
        workers, block = context.num_workers, context.batch_size or 1
        per_rank = length // ranks
        blocks = -(-per_rank // block)
        unit = f"{blocks} batch{'es' * (blocks != 1)} of {block}" if context.batch_size else ""
        share = f"{per_rank} sample{'s' * (per_rank != 1)}" + (f" ({unit})" if unit else "")
        smaller = ", a smaller batch_size" if block > 1 else ""
        raise ConfigError(
            f"{self.describe()}: rank {context.rank} worker {worker} would read no sample: "
            f"{files} over {context.num_shards} streams ({ranks} rank{'s' * (ranks != 1)} x "
            f"{workers} workers) give each rank {share} for its {workers} workers, so a "
            f"worker would yield nothing in every epoch; use at most {blocks} "
            f"worker{'s' * (blocks != 1)} per rank (num_workers={blocks}){smaller} or more "
            "samples"
        )

    def access(self, context: WorkerContext) -> FilePositions[T] | None:
        """The samples by position with ``split="global"`` (NOTE [ File sources by
        position ] in ``datasets/files/positions.py``); else None."""
        return FilePositions(self, context) if self.by_position else None

    def reads_by_layout(self) -> bool:
        return self.by_position

    def needs_positions(self) -> str | None:
        return self.describe() if self.by_position else None

    def draws_nothing(self) -> bool:
        """Reading a file draws from no global generator."""
        return True

    def order(self, epoch: int) -> list[int]:
        """Indices into ``urls`` of the files of ``epoch``, in the epoch's order."""
        count = len(self.urls)
        if not self.shuffle_shards:
            return list(range(count))
        rng = np.random.default_rng(seed_for(Purpose.FILE_ORDER, self.seed, epoch))
        return [int(i) for i in rng.permutation(count)]

    def places(self, context: WorkerContext, rest: Rest | None) -> list[int]:
        """Places in the epoch's order of the files ``context``'s stream reads, in
        reading order: of every file, or of those ``rest`` leaves."""
        files = range(len(self.urls)) if rest is None else rest.files
        return list(files[context.shard_index :: context.num_shards])

    def parse_samples(self, state: Any | None) -> tuple[SampleState, Spans | None]:
        """A ``split="samples"`` ``state`` validated (None: the start of epoch 0), and the
        spans of ids it records after an elastic restore.

        Raises:
            StateError: ``state`` is malformed or was saved with ``split="files"``.
        """
        name = type(self).__name__
        if state is None:
            start = {"epoch": 0, "taken": 0, "file": 0, "at": 0}
            return self.SampleModel.model_validate({**start, **self.zero_position()}), None
        if isinstance(state, dict) and "shard" in state:
            raise StateError(
                f'{name}: the state was saved with split="files" and this source splits '
                f'by samples; build it with split="files" to continue that state'
            )
        model = validate_state(self.SampleModel, state, name)
        if (model.rest is None) != (model.length is None):
            raise StateError(
                f"{name}: malformed state (rest and length come together); restore a state "
                "saved by the same pipeline"
            )
        spans = None if model.rest is None else Spans.parse(model.rest, model.length or 0, name)
        return model, spans

    def items_left(self, state: Any, context: WorkerContext) -> int | None:
        """Samples left of a ``split="samples"`` stream's run (None with one stream, which
        reads to the end of its files, or with ``split="files"`` before its last file is
        done); restoring the position refuses one past the stream's files."""
        cursor = self.cursor(context)
        cursor.restore(state)
        return cursor.left()  # type: ignore[attr-defined,no-any-return]

    def checking_cursor(self, context: WorkerContext) -> Cursor[T]:
        """A cursor to restore a state into (NOTE [ States checked at the door ] in
        ``datasets/protocol/stage.py``); without workers it opens the file at the restored offset,
        as the first read in this process would."""
        cursor = self.cursor(context)
        if context.num_workers == 0 and hasattr(cursor, "check_files"):  # a ShardCursor
            cursor.check_files = True
        return cursor

    def zero_position(self) -> dict[str, int]:
        """The position at the start of a file, as the state names it."""
        return dict.fromkeys(self.position_fields, 0)

    def parse_state(self, state: Any | None) -> tuple[ShardState, Rest | None]:
        """``state`` validated (None: the start of epoch 0), and the rest it records.

        Raises:
            StateError: ``state`` is malformed.
        """
        name = type(self).__name__
        if state is None:
            start = {"epoch": 0, "shard": 0, **dict.fromkeys(self.position_fields, 0)}
            return self.State.model_validate(start), None
        if isinstance(state, dict) and "taken" in state:
            raise StateError(
                f'{name}: the state was saved with split="samples" and this source gives '
                f'whole files to streams; build it with split="samples" to continue that state'
            )
        model = validate_state(self.State, state, name)
        return model, Rest.parse(model, len(self.urls), self.position_fields, name)

    def position(self, state: ShardState) -> tuple[int, ...]:
        """The position inside a file that ``state`` holds, ``offset`` first."""
        return tuple(int(getattr(state, field)) for field in self.position_fields)

    def reshard(self, plan: ReshardPlan) -> dict[str, Any]:
        """The state of ``plan.new``'s stream (NOTE [ Elastic sample order ] in
        ``datasets/files/sample_split.py``, NOTE [ Elastic file order ] in
        ``datasets/files/reshard.py``).

        Raises:
            StateError: The saved states are malformed, stand in another epoch or
                disagree on what was left of the epoch.
        """
        if self.split == "samples":
            return reshard_samples(self, plan)
        return reshard_files(self, plan)
