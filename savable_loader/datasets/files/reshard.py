"""What is left of a file epoch after an elastic restore, and how file sources reshard.

NOTE [ Elastic file order ]
The canonical order of epoch ``e`` is its file order above, lines or samples in order
within a file; it depends on neither ranks nor workers. What a layout consumed is, per
stream, a prefix of its files: whole files before its ``shard``, the current one up to
its position, nothing after. On a restore onto another layout (NOTE [ Elastic resume ]
in ``datasets/protocol/elastic.py``) the source gathers that over every saved stream and records the
rest of the epoch in three fields that every new stream holds alike: ``done_below`` (every
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
"""

from __future__ import annotations

import errno
import functools
import io
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, Annotated, Any, ClassVar, Protocol

from pydantic import Field

from ...config import WorkerContext
from ...errors import StateError
from ..protocol.cursor import StageState
from ..protocol.elastic import ReshardPlan

__all__ = ["FileLayout", "Rest", "ShardState", "check_begun", "reshard_files", "seek_checked"]

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


def check_begun(
    position: tuple[int, ...], start: tuple[int, ...], fields: tuple[str, ...], where: str
) -> None:
    """Raises a StateError when ``position`` in a file lies before where it resumes."""
    if any(a < b for a, b in zip(position, start, strict=True)):
        now, then = dict(zip(fields, position, strict=True)), dict(zip(fields, start, strict=True))
        raise StateError(
            f"{where}: position {now} lies before {then}, where the file resumes in this "
            "epoch; restore a state saved by the same pipeline"
        )


def seek_checked(file: IO[bytes], offset: int, url: str, where: str) -> None:
    """Moves ``file`` (decompressed) to the byte ``offset`` of a restored position.

    Seeking past the end of a file succeeds and the next read finds the end, which would
    skip the rest of the file silently; so the byte before ``offset`` is read.

    Raises:
        StateError: ``offset`` lies past the end of the file; names it, the offset and
            the file's size.
    """
    if offset <= 0:
        return
    try:
        file.seek(offset - 1)
    except (OverflowError, ValueError):
        pass  # farther than the file system seeks: past the end
    except OSError as error:  # a transient one (a reset connection) goes to the retries
        if error.errno != errno.EINVAL:
            raise
    else:
        if file.read(1):
            return
    try:
        size = file.seek(0, io.SEEK_END)
    except ValueError:  # a stream that cannot seek from its end stands there
        size = file.tell()
    raise StateError(
        f"{where}: the state's byte offset {offset} lies past the end of {url}, which "
        f"holds {size} bytes (decompressed); the file changed since the save, or the "
        "state is another file's: restore a state saved over the same files"
    )


class FileLayout(Protocol):
    """What :func:`reshard_files` asks of a file source (``ShardedSource``)."""

    urls: tuple[str, ...]
    position_fields: ClassVar[tuple[str, ...]]

    def places(self, context: WorkerContext, rest: Rest | None) -> list[int]: ...

    def parse_state(self, state: Any | None) -> tuple[ShardState, Rest | None]: ...

    def position(self, state: ShardState) -> tuple[int, ...]: ...


def reshard_files(source: FileLayout, plan: ReshardPlan) -> dict[str, Any]:
    """The state of ``plan.new``'s stream (NOTE [ Elastic file order ]); what the old
    streams left is worked out once per restore (NOTE [ One answer per restore ] in
    ``datasets/protocol/elastic.py``).

    Raises:
        StateError: The saved states are malformed, stand in another epoch or
            disagree on what was left of the epoch.
    """
    rest: Rest | None = plan.once(("files", id(source)), lambda: _rest_of(source, plan))
    if rest is None:
        # Nothing of the epoch was read: a fresh start, in the plain state.
        return {"epoch": plan.epoch, "shard": 0, **dict.fromkeys(source.position_fields, 0)}
    return _resumed(source, plan, rest)


def _rest_of(source: FileLayout, plan: ReshardPlan) -> Rest | None:
    """What the old streams left of the epoch; None when they read nothing of it."""
    name, count = type(source).__name__, len(source.urls)
    zero = (0,) * len(source.position_fields)
    finished: list[WorkerContext] = []
    reading: list[tuple[WorkerContext, ShardState]] = []
    rests: list[Rest | None] = []
    for stream in plan.old:
        state, recorded = source.parse_state(stream.state)
        at_next = state.epoch == plan.epoch + 1 and state.shard == 0
        if at_next and source.position(state) == zero and recorded is None:
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
        return Rest(count, (), {})  # every stream finished the epoch: nothing is left
    rest = rests[0]
    starts = {} if rest is None else dict(rest.starts)
    done: set[int] = set()
    for context in finished:
        done.update(source.places(context, rest))
    for context, state in reading:
        where = f"{name}, rank {context.rank} worker {context.worker_id}"
        mine = source.places(context, rest)
        if state.shard > len(mine):
            raise StateError(
                f"{where}: file {state.shard} is past the stream's {len(mine)} files of "
                f"epoch {state.epoch}; restore a state saved by the same pipeline"
            )
        done.update(mine[: state.shard])
        if state.shard < len(mine):
            place, position = mine[state.shard], source.position(state)
            check_begun(position, starts.get(place, zero), source.position_fields, where)
            if any(position):
                starts[place] = position
    if rest is None and not done and not starts:
        return None
    files = range(count) if rest is None else rest.files
    left = tuple(place for place in files if place not in done)
    return Rest(count, left, {p: starts[p] for p in left if p in starts})


def _resumed(source: FileLayout, plan: ReshardPlan, rest: Rest) -> dict[str, Any]:
    """The state at the start of ``plan.new``'s share of ``rest``."""
    mine = source.places(plan.new, rest)
    start = rest.starts.get(mine[0]) if mine else None
    position = start or (0,) * len(source.position_fields)
    return {
        "epoch": plan.epoch,
        "shard": 0,
        **dict(zip(source.position_fields, position, strict=True)),
        **rest.fields(),
    }
