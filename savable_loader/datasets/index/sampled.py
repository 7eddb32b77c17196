"""``SampledDataset``: a map-style dataset read in the order a sampler gave.

NOTE [ Samplers are sources ]
A loader given ``sampler=``, ``batch_sampler=`` or ``generator=`` over a map-style
dataset reads it as torch's ``DataLoader`` does: the main process draws the epoch's order
from the sampler (``_main/sampling.py``), and the epoch's index groups (one per batch, or one
index per item without automatic batching) are the order of this source. Group ``g``
goes to worker ``g % W``, as torch hands index batches to its workers round-robin, and
the loader takes the workers' batches round-robin, so the stream is torch's. The order
reaches the workers in an :class:`EpochOrder` that travels with the pipeline when the
workers start (the loader starts its workers for each epoch on this path); a cursor
reads only the epoch its order holds.

The sampler is read once, straight into int64 buffers: 8 bytes an index, and with
automatic batching 8 more a group for its length, then for its offset. No Python list of
the epoch is built, so the main process adds about 8 bytes an index to what the sampler
holds itself while it is read (torch's ``RandomSampler`` holds ``randperm(N).tolist()``,
which torch's ``DataLoader`` pays too). The dataset receives every index as the sampler
gave it, as with torch: integers of one type (Python's ``int``, or one NumPy integer
type, read back as that type) take the buffers; from the first index of another type (a
list for bulk loading, a key of a dict, a tensor, a mix of types) the epoch is kept as a
list of the sampler's objects instead. Forked workers share those arrays' pages; with
spawn or forkserver each worker receives a copy of the whole epoch, since torch sends
the same pipeline to every worker and a worker's share is only known in the worker
(giving each only its groups would change what torch sends, not a public seam).

The cursor's state is the epoch and the number of this worker's groups already read:
restoring it moves by arithmetic. Skipping fetches the skipped groups' items (without
collating them) so that draws a dataset makes from the global generators stay exact;
a restore skips only what the worker produced after its last checkpoint (NOTE
[ Checkpoint policy ] in ``_worker/ring.py``), never the sampler's order through the data.
"""

from __future__ import annotations

import itertools
import operator
import sys
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import Field

from ...config import WorkerContext
from ...errors import ConfigError, SavableLoaderError, StateError
from ...state.names import qualified_name
from ..protocol.cursor import Cursor, StageState
from ..protocol.stage import Stage
from .indexed import read_batch
from .lazy_order import LazyOrder

__all__ = ["EpochOrder", "SampledDataset"]


@dataclass
class EpochOrder:
    """The index groups of one epoch of one rank, as the sampler gave them.

    Attributes:
        epoch: The loader epoch the groups belong to (-1: none drawn yet).
        indices: Every index of the epoch, in order.
        offsets: With automatic batching, group ``g`` is ``indices[offsets[g]:
            offsets[g + 1]]``; None: every index is a group of its own (an item).
        kind: The type of every index in an int64 ``indices``.
        lazy: The sampler to read the epoch's groups from as they are needed, instead
            of ``indices`` (NOTE [ Endless samplers ] in ``_main/sampling.py``); None: the
            groups are in ``indices``.
    """

    epoch: int = -1
    indices: np.ndarray | list[Any] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    offsets: np.ndarray | None = None
    kind: type = int
    lazy: LazyOrder | None = None

    @classmethod
    def of(cls, epoch: int, groups: Iterable[Any], *, batched: bool) -> EpochOrder:
        """Builds the order of ``epoch`` by reading the sampler ``groups`` to its end."""
        order, _ = cls.read(epoch, groups, batched=batched, bound=(sys.maxsize, sys.maxsize))
        if order is None:
            raise SavableLoaderError("internal error: an unbounded read stopped; please report")
        return order

    @classmethod
    def read(
        cls, epoch: int, groups: Iterable[Any], *, batched: bool, bound: tuple[int, int]
    ) -> tuple[EpochOrder | None, list[Any]]:
        """Reads the sampler ``groups`` once, into int64 buffers while its indices are
        integers (NOTE [ Samplers are sources ]), but no further than ``bound``: (groups,
        indices) read at most.

        Returns:
            The order of ``epoch``, or None when the sampler gave more (NOTE [ Endless
            samplers ] in ``_main/sampling.py``); and the first groups read.
        """
        flat, (max_groups, max_indices) = _Indices(), bound
        if not batched:
            indices, limit = iter(groups), min(max_groups, max_indices)
            first: list[Any] = []
            while chunk := list(itertools.islice(indices, min(_CHUNK, limit + 1 - len(flat)))):
                first = first or chunk[:_FIRST]
                flat.extend(chunk)
                if len(flat) > limit:
                    return None, first
            return cls(epoch, flat.values(), None, flat.kind), first
        lengths: array[int] = array("q")
        first = []
        for group in groups:
            if len(first) < _FIRST:
                first.append(group)
            start = len(flat)
            flat.extend(group)
            lengths.append(len(flat) - start)
            if len(lengths) > max_groups or len(flat) > max_indices:
                return None, first
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(np.frombuffer(lengths, dtype=np.int64), out=offsets[1:])
        return cls(epoch, flat.values(), offsets, flat.kind), first

    def clear(self) -> None:
        """Forgets the epoch's groups (before the next epoch is read)."""
        self.epoch = -1
        self.indices = np.zeros(0, dtype=np.int64)
        self.offsets = None
        self.lazy = None

    def __len__(self) -> int:
        """Groups in the epoch."""
        return len(self.indices) if self.offsets is None else len(self.offsets) - 1

    def group(self, g: int) -> list[Any] | Any:
        """Group ``g``: a list of indices, or one index without automatic batching."""
        indices, kind = self.indices, self.kind
        if self.offsets is None:
            return kind(indices[g]) if isinstance(indices, np.ndarray) else indices[g]
        group = indices[self.offsets[g] : self.offsets[g + 1]]
        if not isinstance(group, np.ndarray):
            return group
        return group.tolist() if kind is int else [kind(index) for index in group]


#: Indices of an unbatched sampler read at a time.
_CHUNK = 1 << 16

#: Groups kept from the start of a read that went past its bound, to check a re-read.
_FIRST = 64


class _Indices:
    """An epoch's indices as they are read: int64 while they are integers, then the
    sampler's objects (NOTE [ Samplers are sources ])."""

    def __init__(self) -> None:
        self._ints: array[int] = array("q")
        self._objects: list[Any] | None = None
        #: The type of every index so far, while they are integers of one type.
        self.kind: type = int

    def __len__(self) -> int:
        return len(self._ints) if self._objects is None else len(self._objects)

    def extend(self, indices: Iterable[Any]) -> None:
        if self._objects is None:
            indices = list(indices)
            if indices and not self._ints:
                self.kind = type(indices[0])
            integers = self.kind is int or issubclass(self.kind, np.integer)
            if integers and set(map(type, indices)) <= {self.kind}:
                try:
                    self._ints.extend(array("q", map(operator.index, indices)))
                    return
                except OverflowError:  # beyond int64
                    pass
            self._objects = [self.kind(index) for index in self._ints]
        self._objects.extend(indices)

    def values(self) -> np.ndarray | list[Any]:
        if self._objects is not None:
            return self._objects
        return np.frombuffer(self._ints, dtype=np.int64)


class _State(StageState):
    """A sampled source's position."""

    epoch: int = Field(ge=0, description="The epoch being read.")
    pos: int = Field(ge=0, description="Groups of this worker's share already read in it.")


class SampledDataset(Stage[Any]):
    """Reads ``data`` in the order of the loader's sampler (NOTE [ Samplers are sources ]).

    Built by ``SavableDataLoader`` when it is given ``sampler=``, ``batch_sampler=`` or
    ``generator=`` over a map-style dataset; not meant to be built by hand.

    Args:
        data: The map-style dataset.
        order: The holder of the current epoch's order, filled by the loader.
        batched: The order's groups are batches (lists of indices); each group is then
            read as the list of its items. Otherwise each group is one index, read as
            its item.
        sampler: What identifies the sampler in the pipeline's ``config()``.

    State:
        ``{"epoch": e, "pos": k}``: the epoch and the groups of this worker's share read
        in it. Restore is O(1); skipping fetches the skipped items (NOTE [ Samplers are
        sources ]). Not elastic: the order belongs to the sampler of each rank.
    """

    elastic_reason = "the order comes from each rank's own sampler, which cannot be split"

    def __init__(self, data: Any, *, order: EpochOrder, batched: bool, sampler: str) -> None:
        if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
            raise ConfigError(
                f"a sampler needs a map-style dataset (__getitem__ and __len__); "
                f"{type(data).__name__} lacks them"
            )
        self.data = data
        self.order = order
        self.batched = batched
        self.sampler = sampler

    def config(self) -> dict[str, Any]:
        return {
            "type": "SampledDataset",
            "data": qualified_name(type(self.data)),
            "len": len(self.data),
            "sampler": self.sampler,
            "batched": self.batched,
        }

    def describe(self) -> str:
        return f"SampledDataset({len(self.data)} items, {self.sampler})"

    def cursor(self, context: WorkerContext) -> Cursor[Any]:
        return _SampledCursor(self, context)


class _SampledCursor(Cursor[Any]):
    State = _State
    stage_name = "SampledDataset"

    def __init__(self, stage: SampledDataset, context: WorkerContext) -> None:
        super().__init__(context)
        self.stage = stage
        self.epoch = 0
        self.pos = 0
        self.step = max(context.num_workers, 1)
        #: With a lazy order: this worker's groups from ``_at`` of them on.
        self._groups: Iterator[Any] | None = None
        self._at = 0

    def _order(self) -> EpochOrder:
        order = self.stage.order
        if order.epoch != self.epoch:
            raise SavableLoaderError(
                f"internal error: the sampler's order is for epoch {order.epoch} but the "
                f"reading stands in epoch {self.epoch}; please report"
            )
        return order

    def _share(self) -> int:
        """Groups of the current epoch that fall to this worker."""
        return len(range(self.context.worker_id, len(self._order()), self.step))

    def _next_group(self) -> Any:
        """This worker's next group (from ``pos``); StopIteration at the epoch's end."""
        order = self._order()
        if order.lazy is None:
            if self.pos >= self._share():
                raise StopIteration
            return order.group(self.context.worker_id + self.pos * self.step)
        if self._groups is None or self._at != self.pos:
            # NOTE [ Endless samplers ] in _sampling.py: resumed by count.
            self._groups = order.lazy.share(self.context.worker_id, self.step, self.pos)
            self._at = self.pos
        group = next(self._groups)
        self._at += 1
        return group

    def _read(self, group: Any) -> Any:
        data = self.stage.data
        if not self.stage.batched:
            return data[group]
        return read_batch(data, group)

    def __next__(self) -> Any:
        try:
            group = self._next_group()
        except StopIteration:
            self.end_epoch()
            raise
        self.pos += 1  # before the read: NOTE [ Going on after an error ] in _runtime.py
        return self._read(group)

    def goes_on_after_error(self) -> bool:
        return True

    def own_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos}

    def restore_own(self, state: Any | None) -> None:
        position = state if isinstance(state, _State) else _State(epoch=0, pos=0)
        self.epoch, self.pos = position.epoch, position.pos
        self._groups = None
        order = self.stage.order
        if order.epoch == self.epoch and order.lazy is None and self.pos > self._share():
            raise StateError(
                f"SampledDataset: position {self.pos} is past this worker's "
                f"{self._share()} groups of epoch {self.epoch}; restore a state saved with "
                "the same sampler"
            )

    def end_epoch(self) -> None:
        self.epoch += 1
        self.pos = 0
        self._groups = None

    def skip_fast(self, n: int) -> int:
        passed = 0
        while passed < n:
            try:
                group = self._next_group()
            except StopIteration:
                self.end_epoch()
                break
            self.pos += 1
            passed += 1
            self._read(group)
        return passed
