"""A file source's samples by global position: ``split="global"``.

NOTE [ File sources by position ]
With ``split="global"`` a file source (``JsonLinesSource``, ``TarSource``) is read by
position (NOTE [ Pipelines read by position ] in ``datasets/global_view.py``): the loader shares
the epoch's positions out over ranks and workers as an ``IndexedDataset``'s, so global
batch ``j`` holds positions ``[j G, (j + 1) G)`` on every layout of one global batch
size ``G`` (ranks x per-rank batch size). Position ``p`` is mapped to one of the epoch's
sample ids (NOTE [ Splitting files by samples ] in ``datasets/files/sample_split.py``: the files in
the epoch's order, the samples of each in order) through *lanes*:

- the ``N`` ids are cut into ``G`` lanes of consecutive ids, the first ``m`` of
  ``S = ceil(N / G)`` ids and the others of ``S - 1`` (``m = N - (S - 1) G``);
- position ``p = j G + k`` is id ``j`` of lane ``k``.

Global batch ``j`` thus holds the ``j``-th id of every lane, the same ids on every layout
of ``G``. Rank ``r`` of ``R``, which reads every ``R``-th position of a global batch
(NOTE [ Indexed order and sharding ] in ``datasets/index/indexed.py``), reads ``b = G / R`` whole
lanes, ``r, r + R, ...``: about ``N / R`` ids, as with ``split="samples"``, but in ``b`` runs
spread over the epoch rather than one. A worker reads every ``W``-th step of its rank's
lanes, one forward reader per lane, passing the samples of the other workers' steps (a
tar member's header, a JSON line, without parsing it), and a reader whose lane begins
inside a file passes that file's earlier samples once per epoch. Compared with
``split="samples"`` a worker thus holds ``b`` files open at once, passes ``W - 1``
samples per sample it reads plus about half a file per lane and epoch, and the loader
counts every file's samples when it is built (or reads the counts file), whatever the
number of streams. ``benchmarks/bench_file_positions.py`` measures it: with 2 workers
and lanes as long as the files, 0.64x the items per second of ``split="samples"`` for
50 KB tar samples, 0.91x for JSON lines, 0.93x for gzip JSON lines.

``G`` is the loader's, for a fresh epoch. A state records the ``G`` of its epoch
(``"lanes"``), and a restore onto another global batch size reads the rest of that epoch
with the saved lanes, so that every position left is the same id; the next epoch is laid
out for the new ``G``.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Generic, Protocol, TypeVar, cast

from ...config import WorkerContext
from .sample_split import locate

__all__ = ["FilePositions", "laid_out_for", "lanes_of"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

#: Readers a worker keeps open at once; past them the least recently used is closed,
#: and reopened (from its file's start) when its lane is read again.
_READERS = 64


def lanes_of(context: WorkerContext) -> int:
    """``G``, the global batch size a fresh epoch is laid out for."""
    return context.world_size * (context.batch_size or 1)


def laid_out_for(context: WorkerContext, lanes: int) -> WorkerContext:
    """``context`` with the global batch size ``lanes``, for the accesses of an epoch
    laid out on another layout (only :func:`lanes_of` reads those fields in an access)."""
    return dataclasses.replace(context, world_size=1, batch_size=lanes)


class Reader(Protocol[T_co]):
    """What a file source's cursor (``ShardCursor``) offers a reader by position."""

    epoch: int
    place: int
    at: int
    prefetching: bool

    def read_at(self, place: int, index: int) -> T_co: ...

    def close_own(self) -> None: ...

    def close(self) -> None: ...


class Source(Protocol[T_co]):
    """What a file source (``ShardedSource``) offers a reader by position."""

    def sample_counts(self) -> tuple[int, ...]: ...

    def sample_starts(self, epoch: int) -> list[int]: ...

    def cursor(self, context: WorkerContext) -> Any: ...


class FilePositions(Generic[T]):
    """A file source's samples by position (NOTE [ File sources by position ])."""

    def __init__(self, stage: Source[T], context: WorkerContext) -> None:
        self.stage = stage
        self.context = context
        self.lanes = lanes_of(context)
        self._readers: OrderedDict[int, Reader[T]] = OrderedDict()
        self._starts: tuple[int, list[int]] = (-1, [])

    def length(self) -> int:
        return sum(self.stage.sample_counts())

    def ids(self, positions: list[int]) -> list[tuple[int, int]]:
        """``(lane, id)`` of each position."""
        total, lanes = self.length(), self.lanes
        steps = -(-total // lanes)
        full = total - (steps - 1) * lanes  # lanes of ``steps`` ids; the others one less
        out = []
        for position in positions:
            step, lane = divmod(position, lanes)
            out.append((lane, lane * steps - max(0, lane - full) + step))
        return out

    def _places(self, epoch: int, ids: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """``(lane, place, index)``: the file of ``epoch``'s order and the sample in it."""
        cached, starts = self._starts
        if cached != epoch:
            starts = self.stage.sample_starts(epoch)
            self._starts = (epoch, starts)
        return [(lane, *locate(sample, starts)) for lane, sample in ids]

    def get_many(self, epoch: int, positions: list[int]) -> list[T]:
        items = []
        for lane, place, index in self._places(epoch, self.ids(positions)):
            reader = self._reader(lane, epoch)
            items.append(reader.read_at(place, index))
        return items

    def keys(self, epoch: int, positions: list[int]) -> list[tuple[int, ...]]:
        """``(epoch, place, index)``, as a ``split="samples"`` stream keys its samples."""
        places = self._places(epoch, self.ids(positions))
        return [(epoch, place, index) for _, place, index in places]

    def _reader(self, lane: int, epoch: int) -> Reader[T]:
        reader = self._readers.pop(lane, None)
        if reader is None:
            if len(self._readers) >= _READERS:
                _, oldest = self._readers.popitem(last=False)
                oldest.close()
            reader = cast("Reader[T]", self.stage.cursor(self.context))
            reader.prefetching = False
        if reader.epoch != epoch:
            reader.close_own()
            reader.epoch, reader.place, reader.at = epoch, -1, 0
        self._readers[lane] = reader
        return reader

    def close(self) -> None:
        """Closes the readers' files."""
        readers, self._readers = list(self._readers.values()), OrderedDict()
        for reader in readers:
            reader.close()
