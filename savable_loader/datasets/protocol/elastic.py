"""What a stage is told when a state moves to another number of workers or ranks.

NOTE [ Elastic resume ]
A saved state holds one position per (rank, worker) stream. To restore it onto another
layout, the loader first brings every saved stream to the consumer's exact position
(restoring its checkpoint and replaying what the ring left out, in the main process),
then asks the pipeline's outermost stage for the state of each *new* stream with a
:class:`ReshardPlan`: the epoch being resumed, every old stream's context and exact
state, and the new stream's context. A transform answers from its parent's answer
(``plan.parents()``) plus what it adds; a source works out which of the epoch's items
the old streams consumed and lays the rest out over the new streams
(NOTE [ Elastic indexed order ] in ``datasets/index/indexed.py``, NOTE [ Elastic file order ] in
``datasets/files/reshard.py``). Every new stream computes its answer alone from the same plan, so
the streams agree without talking to each other.

NOTE [ One answer per restore ]
What a stage works out from the old streams (its parent's states, the positions they
consumed, the files left) is the same for every new stream of a restore; only where the
new stream takes its share differs. The plans of one restore share ``ReshardPlan.shared``,
and a stage computes such a part once through ``plan.once(key, ...)``, keyed by itself,
so a restore onto ``R`` new streams from ``S`` old ones costs ``O(S + R)``, not
``O(S * R)``.

A stage whose state ties it to the worker that saved it (a shuffle buffer, a blend's
generator, a user's own dataset) raises :class:`NotElastic`; the loader turns that into
a ``StateError`` that names the stage, says why and what to change, unless the user
asked for an approximate resume.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ...config import WorkerContext

__all__ = ["NotElastic", "OldStream", "ReshardPlan"]


class NotElastic(Exception):
    """A stage cannot carry its position to another layout (NOTE [ Elastic resume ]).

    Args:
        stage: The stage's description (``stage.describe()``).
        reason: Why its position is tied to the layout that saved it.
        fix: What the user can change to make the pipeline elastic.
    """

    def __init__(self, stage: str, reason: str, fix: str) -> None:
        super().__init__(f"{stage}: {reason}; {fix}")
        self.stage = stage
        self.reason = reason
        self.fix = fix


@dataclass(frozen=True)
class OldStream:
    """One (rank, worker) stream of the saved layout.

    Attributes:
        context: The stream's rank and worker in the saved layout.
        state: The stage's exact state at the consumer's position (None: the stream never
            started, so it stands at the start of epoch 0).
    """

    context: WorkerContext
    state: Any


@dataclass(frozen=True)
class ReshardPlan:
    """What a stage needs to give a new stream its state (NOTE [ Elastic resume ]).

    Attributes:
        epoch: The epoch the new streams resume. Old streams stand in it, or at the start
            of the next one once they finished it.
        old: Every stream of the saved layout, rank by rank, worker by worker.
        new: The new stream's context.
        salt: A number drawn from the old streams' states, the same for every new
            stream of one restore and different for another save: stages that key random
            draws by position add it to the keys of the resumed epoch, so that a new
            stream does not repeat the draws an old stream made at the same positions.
        shared: What the plans of one restore compute once for all their new streams
            (NOTE [ One answer per restore ]), shared by the plans that differ only in
            ``new``; a plan built alone shares nothing.
    """

    epoch: int
    old: tuple[OldStream, ...]
    new: WorkerContext
    salt: int = 0
    shared: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def parents(self) -> ReshardPlan:
        """The same plan for a transform's parent: each state's ``"parent"`` entry,
        worked out once per restore."""
        entry = self.shared.get(_PARENTS)
        if entry is None:
            old = tuple(
                OldStream(stream.context, None if stream.state is None else stream.state["parent"])
                for stream in self.old
            )
            entry = self.shared[_PARENTS] = (old, {})
        old, shared = entry
        return ReshardPlan(self.epoch, old, self.new, self.salt, shared)

    def once(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()``, or what it returned for ``key`` for another new stream of this
        restore (NOTE [ One answer per restore ]). The answer is shared: do not change it."""
        if key not in self.shared:
            self.shared[key] = compute()
        return self.shared[key]

    def map_states(self, fn: Callable[[Any], Any]) -> ReshardPlan:
        """The same plan with every old state replaced by ``fn(state)``."""
        return replace(
            self,
            old=tuple(OldStream(stream.context, fn(stream.state)) for stream in self.old),
            shared={},
        )


#: The key of a plan's parents in ``ReshardPlan.shared``.
_PARENTS = object()
