"""``Batch``: items grouped into batches, the root of every loader's pipeline.

NOTE [ Batching is a stage ]
The loader batches inside each worker, so one batch never mixes workers (as with torch
and an ``IterableDataset``): the pipeline it runs is ``Batch(<your pipeline>)``. A batch
is the next ``batch_size`` items of the parent, merged by ``collate_fn`` (torch's
``default_collate`` by default); without a ``batch_size`` each item is passed through
``collate_fn`` (``default_convert`` by default). When the parent's epoch ends while a
batch fills, the short batch is yielded (or dropped with ``drop_last``) and the parent
already stands at its next epoch, so the batch remembers that its own epoch ends next
(``exhausted``). Being a stage, batching replays like any other: a restore passes the
batches it must recompute with ``skip``. With torch's own ``collate_fn``
(``default_collate``, ``default_convert``, or None for them) the batch's items are
passed through the parent's own ``skip`` (an indexed source moves by arithmetic); a
``collate_fn`` of your own runs on the replayed batches, since it may draw from the
global generators and the draws must be the same as the first time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field
from torch.utils.data import default_collate, default_convert

from ...config import WorkerContext
from ...errors import ConfigError
from ...state.names import qualified_name
from ..protocol.cursor import Cursor, StageState, TransformCursor
from ..protocol.elastic import ReshardPlan
from .transform import Transform

__all__ = ["Batch"]


class Batch(Transform[Any]):
    """Yields batches of ``source``'s items (NOTE [ Batching is a stage ]).

    Args:
        source: The stage (or dataset) whose items are batched.
        batch_size: Items per batch, at least 1; None passes items one by one.
        drop_last: Drop the short last batch of an epoch.
        collate_fn: Merges a list of items into a batch (with ``batch_size``) or converts
            one item (without); torch's ``default_collate`` / ``default_convert`` if None.

    Raises:
        ConfigError: ``batch_size`` is neither None nor an int of at least 1, or
            ``drop_last`` is set without a ``batch_size``.

    State:
        ``{"parent": ..., "exhausted": bool}``: the parent's state and whether the
        parent's epoch already ended while the last batch filled, so that the next
        ``next()`` ends this epoch. Restore replays nothing; ``skip`` passes the parent's
        items by the parent's own ``skip`` with the default ``collate_fn``, and reads
        them otherwise. Elastic when its source is.
    """

    keyed = True

    def __init__(
        self,
        source: Any,
        *,
        batch_size: int | None,
        drop_last: bool = False,
        collate_fn: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(source)
        if batch_size is not None and (
            not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1
        ):
            raise ConfigError(f"batch_size must be a positive int or None, got {batch_size!r}")
        if batch_size is None and drop_last:
            raise ConfigError("drop_last=True needs a batch_size (it drops incomplete batches)")
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn

    def config(self) -> dict[str, Any]:
        collate = self.collate_fn
        name = None if collate is None else qualified_name(collate)
        return {
            "type": "Batch",
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "collate_fn": name,
            "source": self.source.config(),
        }

    def describe_own(self) -> str:
        return f"batch({self.batch_size}, drop_last={self.drop_last})"

    def cursor_over(self, parent: Cursor[Any], context: WorkerContext) -> Cursor[Any]:
        return _BatchCursor(self, parent, context)

    def items_left(self, state: Any, context: WorkerContext) -> int | None:
        """Batches left: those the source's items left fill (NOTE [ Checking a replay ]
        in ``_resume/compat.py``)."""
        if not isinstance(state, dict) or "parent" not in state:
            return None
        if state.get("exhausted") is True:
            return 0
        items = self.source.items_left(state["parent"], context)
        if items is None or self.batch_size is None:
            return items
        return items // self.batch_size if self.drop_last else -(-items // self.batch_size)

    def reshard(self, plan: ReshardPlan) -> dict[str, Any]:
        """Elastic when the source is: a new stream starts with a batch to fill."""
        return {"parent": self.source.reshard(plan.parents()), "exhausted": False}


class _State(StageState):
    exhausted: bool = Field(description="The parent's epoch ended while the last batch filled.")


class _BatchCursor(TransformCursor[Any]):
    State = _State
    stage_name = "Batch"

    def __init__(self, stage: Batch, parent: Cursor[Any], context: WorkerContext) -> None:
        super().__init__(parent, context)
        self.size = stage.batch_size
        self.drop_last = stage.drop_last
        # Torch's own collate functions draw nothing, so skipping them is exact too (the
        # loader passes default_collate explicitly for a batch sampler's groups).
        self.default = stage.collate_fn in (None, default_collate, default_convert)
        if stage.collate_fn is not None:
            self.collate: Callable[[Any], Any] = stage.collate_fn
        else:
            self.collate = default_convert if stage.batch_size is None else default_collate
        self.exhausted = False

    def __next__(self) -> Any:
        if self.exhausted:
            self.exhausted = False
            raise StopIteration
        if self.size is None:
            return self.collate(next(self.parent))
        # A short batch means the parent's epoch ended while it filled (the parent then
        # stands at its next epoch).
        batch = self.parent.take_batch(self.size)
        if len(batch) < self.size:
            if not batch or self.drop_last:
                raise StopIteration
            self.exhausted = True
        return self.collate(batch)

    def goes_on_after_error(self) -> bool:
        """The parent's answer: a batch takes its items before it collates them."""
        return self.parent.goes_on_after_error()

    def own_state(self) -> dict[str, Any]:
        return {"exhausted": self.exhausted}

    def restore_own(self, state: Any | None) -> None:
        self.exhausted = state.exhausted if isinstance(state, _State) else False

    def end_epoch(self) -> None:
        if self.exhausted:
            self.exhausted = False
        else:
            self.parent.end_epoch()

    def skip_fast(self, n: int) -> int | None:
        if not self.default:
            return None
        if self.exhausted:
            self.exhausted = False
            return 0
        if self.size is None:
            return self.parent.skip(n)
        wanted = n * self.size
        passed = self.parent.skip_batches(n, self.size)
        if passed == wanted:
            return n
        # The parent's epoch ended during the skip and it stands at its next epoch.
        full, short = divmod(passed, self.size)
        batches = full + (1 if short and not self.drop_last else 0)
        if batches == n:
            self.exhausted = True  # the short batch was the last one asked for
        return batches
