"""How a file source shares an epoch's samples out over ranks and workers.

NOTE [ Splitting files by samples ]
With ``split="samples"`` (the default) the samples of epoch ``e`` form one sequence: the
files in the epoch's order (NOTE [ Shard listing and assignment ] in ``datasets/files/sharded.py``),
the samples of each file in order. Sample ``s`` of that sequence has the *id* ``s``, and the
ids go on cyclically past the last sample: id ``i`` is sample ``i % N`` of an ``N``-sample
epoch. A fresh epoch on ``R`` ranks reads the ids ``[0, L)``, ``L`` being ``N`` padded up
to a multiple of ``R`` (``even="pad"``: the first samples come again at the end, as
``DistributedSampler`` repeats the start of its list) or cut down to one (``even="drop"``:
the last samples are left out), so every rank reads ``L / R`` samples. Rank ``r`` reads
the contiguous ids ``[r L/R, (r+1) L/R)``, so that a stream reads its files from one
place on instead of every file in part. Within a rank, the ids are cut into blocks of
``batch_size`` and worker ``w`` of ``W`` reads a contiguous run of about ``1/W`` of the
blocks; every rank then has the same number of samples per worker, hence yields the
same number of batches, with or without ``drop_last``. A rank with fewer blocks than
workers would leave a worker with no sample in every fresh epoch (an empty stream, and
an error at the first pass of an endless ``Repeat`` over it): ``ShardedSource.check_layout``
refuses that layout when the loader is built, naming the fix (fewer workers).

Sharing out samples needs the number of samples of each file: the source counts them
once per process, reading every file (NOTE [ Counting samples ] in ``datasets/files/sharded.py``),
in the main process when the loader is built, before its workers start. A single stream
(one rank, at most one worker) reads the files in order and needs no count.

A stream's position is the ids it consumed (``taken``) plus where its reading stands in
a file (``file``, a place in the epoch's order; ``at``, the samples of that file before
the byte position the source keeps, ``offset`` first). A stream whose run begins inside
a file reads that file's first samples without yielding them, once per epoch.

NOTE [ Elastic sample order ]
The ids are the canonical order of the epoch; they depend on neither ranks nor workers.
What a layout consumed is, per stream, a prefix of its run of ids. On a restore onto
another layout (NOTE [ Elastic resume ] in ``datasets/protocol/elastic.py``) the source takes every
saved stream's prefix out of the ids the layout read and records what is left as ``rest``
(ascending ``[start, stop)`` spans of ids) and ``length`` (one past the largest id the
epoch has used). So that every new rank reads as many, ``even="pad"`` first appends the
fewest next ids (``length``, ``length + 1``, ..., the cyclic order going on) that make
the count a multiple of the new number of ranks, and ``even="drop"`` leaves out the
fewest last ones. The rest is then laid out over the new ranks and workers as a fresh
epoch's ids are. A second elastic restore in that epoch maps the new streams' prefixes
back through ``rest``, so resharding composes; at the end of the epoch ``rest`` goes and
the next epoch is laid out as a fresh run on the new layout lays it out. ``rest`` holds
at most one span more than the saved layout had streams.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from pydantic import Field

from ...config import WorkerContext
from ...errors import StateError
from ..index.order import Even, epoch_length
from ..protocol.cursor import StageState
from ..protocol.elastic import ReshardPlan

__all__ = ["SampleState", "Spans", "locate", "reshard_samples", "starved_worker", "stream_run"]

Count = Annotated[int, Field(ge=0)]


class SampleState(StageState):
    """A file stream's position with ``split="samples"`` (NOTE [ Splitting files by
    samples ]); each source adds the rest of its position inside a file."""

    epoch: int = Field(ge=0, description="The epoch being read.")
    taken: int = Field(ge=0, description="Samples of this stream's run of the epoch consumed.")
    file: int = Field(ge=0, description="Place in the epoch's order of the file being read.")
    at: int = Field(ge=0, description="Samples of that file before offset.")
    offset: int = Field(ge=0, description="Byte offset of sample `at`, decompressed.")
    samples: int | None = Field(
        default=None, ge=0, description="Samples in an epoch, when the stream counted them."
    )
    length: int | None = Field(
        default=None,
        ge=0,
        description="After an elastic restore: one past the largest id of the epoch used "
        "(NOTE [ Elastic sample order ]).",
    )
    rest: list[list[Count]] | None = Field(
        default=None,
        description="After an elastic restore: the [start, stop) spans of ids left.",
    )


@dataclass(frozen=True)
class Spans:
    """The ids of an epoch that a layout reads, in order (NOTE [ Elastic sample order ]).

    Attributes:
        spans: Ascending, disjoint, non-empty ``(start, stop)`` spans of ids.
        length: One past the largest id the epoch has used; the cyclic order goes on there.
    """

    spans: tuple[tuple[int, int], ...]
    length: int

    @classmethod
    def fresh(cls, samples: int, world_size: int, even: Even) -> Spans:
        """The ids a fresh epoch of ``samples`` samples reads on ``world_size`` ranks."""
        length = epoch_length(samples, world_size, even)
        return cls(((0, length),) if length else (), length)

    @classmethod
    def parse(cls, rest: list[list[int]], length: int, stage: str) -> Spans:
        """The spans a state's ``rest`` and ``length`` record, checked.

        Raises:
            StateError: ``rest`` is not ascending, disjoint, non-empty spans below ``length``.
        """
        spans = tuple((entry[0], entry[1]) for entry in rest if len(entry) == 2)
        bounds = [bound for span in spans for bound in span]
        ordered = all(a < b for a, b in spans) and all(
            a <= b for a, b in itertools.pairwise(bounds)
        )
        if len(spans) != len(rest) or not ordered or (bounds and bounds[-1] > length):
            raise StateError(
                f"{stage}: malformed state (rest must hold ascending, disjoint [start, stop) "
                f"spans of ids below length {length}); restore a state saved by the same "
                "pipeline"
            )
        return cls(spans, length)

    @property
    def total(self) -> int:
        """How many ids the spans hold."""
        return sum(stop - start for start, stop in self.spans)

    def fields(self) -> dict[str, Any]:
        """The state's fields that record these spans."""
        return {"length": self.length, "rest": [list(span) for span in self.spans]}

    def id_at(self, k: int) -> int:
        """The id at index ``k`` of the spans, read in order."""
        for start, stop in self.spans:
            if k < stop - start:
                return start + k
            k -= stop - start
        raise IndexError(k)

    def between(self, first: int, last: int) -> list[tuple[int, int]]:
        """The spans of ids at indices ``[first, last)``."""
        taken: list[tuple[int, int]] = []
        k = 0
        for start, stop in self.spans:
            low, high = max(first - k, 0), min(last - k, stop - start)
            if low < high:
                taken.append((start + low, start + high))
            k += stop - start
        return taken

    def without(self, consumed: Sequence[tuple[int, int]]) -> Spans:
        """These spans less the ``consumed`` ids."""
        cuts = sorted(consumed)
        left: list[tuple[int, int]] = []
        for start, stop in self.spans:
            low = start
            for cut_start, cut_stop in cuts:
                if cut_stop <= low or cut_start >= stop:
                    continue
                if cut_start > low:
                    left.append((low, cut_start))
                low = max(low, cut_stop)
            if low < stop:
                left.append((low, stop))
        return Spans(tuple(left), self.length)

    def evened(self, world_size: int, even: Even) -> Spans:
        """These spans made a multiple of ``world_size`` long (NOTE [ Elastic sample
        order ]): the next ids appended, or the last ones left out."""
        total = self.total
        if even == "pad":
            extra = -total % world_size
            if not extra:
                return self
            return Spans((*self.spans, (self.length, self.length + extra)), self.length + extra)
        return Spans(tuple(self.between(0, total - total % world_size)), self.length)


def stream_run(total: int, context: WorkerContext) -> tuple[int, int]:
    """The indices ``[first, last)`` of ``total`` ids that ``context``'s stream reads
    (NOTE [ Splitting files by samples ]); ``total`` is a multiple of the ranks."""
    per_rank = total // context.world_size
    block = context.batch_size or 1
    workers = max(context.num_workers, 1)
    blocks = -(-per_rank // block)
    begin = context.rank * per_rank
    first = begin + min(context.worker_id * blocks // workers * block, per_rank)
    last = begin + min((context.worker_id + 1) * blocks // workers * block, per_rank)
    return first, last


def starved_worker(total: int, context: WorkerContext) -> int | None:
    """The first worker of ``context``'s rank whose run of ``total`` ids is empty (NOTE
    [ Splitting files by samples ]), None when every worker reads some; ranks read as
    many, so when one rank has such a worker, every rank has."""
    for worker in range(max(context.num_workers, 1)):
        first, last = stream_run(total, dataclasses.replace(context, worker_id=worker))
        if first == last:
            return worker
    return None


def locate(sample: int, starts: Sequence[int]) -> tuple[int, int]:
    """``(place, index)`` of ``sample`` in files whose first samples are ``starts``
    (ascending, one per file of the epoch's order, the first 0); empty files skipped."""
    place = bisect.bisect_right(starts, sample) - 1
    return place, sample - starts[place]


class SampleLayout(Protocol):
    """What :func:`reshard_samples` asks of a file source (``ShardedSource``)."""

    even: Even

    def sample_counts(self) -> tuple[int, ...]: ...

    def sample_starts(self, epoch: int) -> list[int]: ...

    def zero_position(self) -> dict[str, int]: ...

    def parse_samples(self, state: Any | None) -> tuple[SampleState, Spans | None]: ...


def reshard_samples(source: SampleLayout, plan: ReshardPlan) -> dict[str, Any]:
    """The state of ``plan.new``'s stream (NOTE [ Elastic sample order ]).

    Raises:
        StateError: The saved states are malformed, stand in another epoch, were saved
            over other files or disagree on what was left of the epoch.
    """
    name, samples = type(source).__name__, sum(source.sample_counts())
    streams: list[tuple[WorkerContext, int | None]] = []  # None: finished the epoch
    recorded: list[Spans | None] = []
    for stream in plan.old:
        state, spans = source.parse_samples(stream.state)
        if state.samples is not None and state.samples != samples:
            raise StateError(
                f"{name}: a saved stream counted {state.samples} samples and the files now "
                f"hold {samples}; the data changed since the save"
            )
        if state.epoch == plan.epoch + 1 and state.taken == 0 and spans is None:
            streams.append((stream.context, None))
            continue
        if state.epoch != plan.epoch:
            raise StateError(
                f"{name}: a saved stream stands in epoch {state.epoch} while the loader "
                f"resumes epoch {plan.epoch}; restore a state saved by the same pipeline"
            )
        if recorded and spans != recorded[0]:
            raise StateError(
                f"{name}: the saved streams disagree on what was left of epoch "
                f"{plan.epoch} before their own restore; restore the states of one save "
                "together"
            )
        recorded.append(spans)
        streams.append((stream.context, state.taken))
    old = (recorded[0] if recorded else None) or Spans.fresh(
        samples, plan.old[0].context.world_size, source.even
    )
    consumed: list[tuple[int, int]] = []
    for context, taken in streams:
        first, last = stream_run(old.total, context)
        if taken is not None and taken > last - first:
            raise StateError(
                f"{name}, rank {context.rank} worker {context.worker_id}: taken {taken} is "
                f"past the stream's {last - first} samples of epoch {plan.epoch}; restore a "
                "state saved by the same pipeline"
            )
        consumed += old.between(first, last if taken is None else first + taken)
    start = {"epoch": plan.epoch, "taken": 0, "at": 0, **source.zero_position()}
    if not (recorded and recorded[0]) and not consumed:
        return {**start, "file": _first_file(source, plan, None, samples)}
    left = old.without(consumed).evened(plan.new.world_size, source.even)
    return {
        **start,
        "file": _first_file(source, plan, left, samples),
        "samples": samples,
        **left.fields(),
    }


def _first_file(source: SampleLayout, plan: ReshardPlan, spans: Spans | None, samples: int) -> int:
    """The place of the file where ``plan.new``'s stream begins (0 when it reads nothing)."""
    spans = spans or Spans.fresh(samples, plan.new.world_size, source.even)
    first, last = stream_run(spans.total, plan.new)
    if first == last or not samples:
        return 0
    return locate(spans.id_at(first) % samples, source.sample_starts(plan.epoch))[0]
