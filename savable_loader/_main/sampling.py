"""What the main process draws at the start of an epoch, as torch's ``DataLoader`` draws it.

NOTE [ Epoch orders ]
Torch's ``DataLoader`` draws from the loader's ``generator`` (the global torch generator
when it is None) each time it builds an iterator: first the workers' base seed, then,
as it reads the sampler, whatever the sampler draws (a ``RandomSampler`` draws from its
own generator, which ``shuffle=True`` sets to the loader's, or seeds one from the global
generator). It builds an iterator for every epoch, except with persistent workers,
where only the first one is built. The :class:`EpochPlanner` makes the same draws at
the start of each epoch, in the same order, and reads the whole sampler at once: the
generators end the epoch where torch leaves them, and the epoch's index groups become
the order of the pipeline's source (NOTE [ Samplers are sources ] in
``datasets/index/sampled.py``), read into int64 arrays without a Python list of the epoch.

A sampler without a generator of its own draws from the process's global generators.
The first draw of a loader is made on them, as torch makes it; every later draw continues
from where the previous draw left the global generators' states, on a copy swapped in
for the draw, so the data stream never depends on what the training loop draws between
epochs (torch's would) and resumes exactly without restoring the training loop's
generators. Give the sampler (or the loader) a ``generator=`` to own the order outright.

The planner remembers the generators just before and just after the draw
(:class:`~savable_loader.state.models.OrderState`), and a save carries them. A restore
mid-epoch draws the epoch again from the state before, so the sampler gives the same
order and the generators end where an uninterrupted run leaves them; a restore between
epochs starts the next draw from the state after. The generators you passed (the
loader's and the sampler's) take those states, as they would have in an uninterrupted
run; the process's global generators are swapped in for that draw only and put back
afterwards, so a restore never changes the training loop's own global generators.

A sampler's own position rides along: its ``state_dict()`` when it has one, and the
``epoch`` that ``DistributedSampler.set_epoch`` sets. An epoch resumed mid-way must be
drawn with the epoch it was saved in: a different one is an error naming both.

NOTE [ Endless samplers ]
Torch reads a sampler lazily, so one that never ends (detectron2's ``TrainingSampler``,
``while True: yield from randperm(n)``) gives an epoch that never ends. The rule here:

- The start of an epoch reads the sampler into buffers as above, but no further than a
  bound: ``len(sampler)`` groups (batches with automatic batching, else indices) when it
  has a ``len()``, and at most :data:`SIZED_BOUND` indices; :data:`UNSIZED_BOUND` groups
  and indices when it has none. A sampler that ends within the bound is the epoch's order.
- One that gives more (an endless sampler, or one giving more than its ``len()``) is read
  lazily. The epoch's order is what the sampler gives from ``start``: the generators just
  before the epoch's first read of it (the loader's and the sampler's generators, its
  ``state_dict()``, the global generators, after the base seed). The main process drops
  its buffers. Each worker (the main process
  without workers) reads its own copy of the sampler (fork's copy, the one pickled with
  the pipeline under spawn or forkserver, the sampler itself without workers) from
  ``start``, with ``start``'s global generators swapped in around each read of a few
  hundred groups, and keeps group ``g`` when ``g % num_workers`` is its id: torch's
  round-robin, so the stream is torch's (for a sampler drawing from the global
  generators, when nothing else draws from them between ``iter()`` and the reads, as
  torch reads them in the main process).
- A save carries ``start`` (the state's ``before``) and each worker's count; a restore
  reads the copy anew from ``start`` and drops the groups already read (their items are
  not fetched): time in the position, no memory. Each worker reads every group of the
  epoch, its own and the others'.
- Before the copies are trusted, the main process reads the first groups anew from
  ``start``. A sampler that gives others (its ``__iter__`` goes on with a stream kept
  across calls: mmengine's ``InfiniteSampler`` makes one generator in ``__init__``; a
  generator object passed as the sampler) is refused with a ``ConfigError`` naming it,
  after the bounded read: no copy of it could restart the epoch.
- ``len(loader)`` is torch's (the sampler's ``len()``, a ``TypeError`` without one), and
  the epoch ends when the sampler does: an endless one's never, unless a new ``iter()``
  cuts it. The next epoch's draws start where the bounded read left the generators (the
  state's ``after``), not where the workers' reading got: the main process cannot know
  how far that is, and torch's own stand wherever its read-ahead got. So a new epoch over
  an endless sampler that draws from generators kept across ``iter()`` (its own, or the
  global ones) is a new stream, as with torch, but not torch's; a sampler that re-seeds
  on each ``iter()`` (detectron2's, mmengine's) starts over, as with torch; and the
  epochs after the first of a sampler that gives more than its ``len()`` and then ends
  differ from torch's. Each resumes exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import rng
from ..datasets.index.lazy_order import LazyOrder, apply_snapshot, find_generators, stateful_inner
from ..datasets.index.sampled import EpochOrder
from ..errors import StateError, StateMismatchError
from ..plain import find_non_plain
from ..state.models import OrderSnapshot, OrderState, RngState

__all__ = ["SIZED_BOUND", "UNSIZED_BOUND", "EpochPlanner"]

#: Indices (and index groups) read at the start of an epoch from a sampler without a
#: ``len()`` before it is read lazily instead (NOTE [ Endless samplers ]).
UNSIZED_BOUND = 1 << 14

#: Indices read at the start of an epoch from a sampler with a ``len()`` before it is read
#: lazily instead, whatever its length says (NOTE [ Endless samplers ]).
SIZED_BOUND = 1 << 27


class EpochPlanner:
    """Draws each epoch's base seed and order in the main process (NOTE [ Epoch orders ]).

    Args:
        index_sampler: What torch would read indices from (the batch sampler with
            automatic batching, else the sampler); None when the pipeline orders itself.
        generator: The loader's ``generator`` argument.
        batched: ``index_sampler`` yields batches of indices (automatic batching).
        draws_every_epoch: Torch builds an iterator every epoch (no persistent workers).
    """

    def __init__(
        self,
        index_sampler: Any,
        generator: torch.Generator | None,
        *,
        batched: bool,
        draws_every_epoch: bool,
    ) -> None:
        self.index_sampler = index_sampler
        self.generator = generator
        self.draws_every_epoch = draws_every_epoch
        self.batched = batched
        self._generators = find_generators(generator, index_sampler)
        self.order = EpochOrder()
        #: How the current epoch was drawn (None: no epoch drawn yet).
        self.state: OrderState | None = None
        #: After a restore: the snapshot the next draw starts from, and whether that
        #: draw must be of the saved epoch (a mid-epoch restore).
        self._pending: tuple[OrderSnapshot, int | None] | None = None
        #: The current epoch is read lazily, from copies of the generators (the sampler's
        #: own without workers: NOTE [ Endless samplers ]).
        self._lazy = False

    @property
    def sampler(self) -> Any:
        """The sampler whose ``state_dict``/``epoch`` is saved (inside a batch sampler)."""
        return stateful_inner(self.index_sampler)

    def needs_draw(self, epoch: int) -> bool:
        """Whether epoch ``epoch``'s draws are still to make (not when workers restart
        within an epoch whose order is drawn)."""
        return self._pending is not None or self.state is None or self.state.epoch != epoch

    def generator_before(self) -> torch.Generator | None:
        """A copy of the loader's generator as it stood before the current epoch's draws
        (None: the loader has no generator)."""
        if self.generator is None:
            return None
        if self.state is None:
            raise StateError("internal error: no draw yet; please report")
        copy = torch.Generator()
        data = self.state.before.generators[0]
        copy.set_state(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return copy

    def draw(self, epoch: int) -> int | None:
        """Makes epoch ``epoch``'s draws; returns the workers' base seed, or None when torch
        would not draw one for this epoch (persistent workers after the first)."""
        pending, self._pending = self._pending, None
        if pending is None and self.state is None:
            # The first draw of a loader: on the process's generators, as torch draws.
            before = self._snapshot(rng.capture().to_state())
            base_seed = self._draw(epoch)
            after = self._snapshot(rng.capture().to_state())
        else:
            # The global generators' part continues the previous draw, not the process.
            before, must_be = pending or (self._snapshot(self._previous_after().rng), None)
            self._apply(before, must_be)
            own = rng.OwnGenerators.of(before.rng)
            with own:
                base_seed = self._draw(epoch)
            after = self._snapshot(own.snapshot.to_state())
        self._lazy = self.order.lazy is not None
        self.state = OrderState(epoch=epoch, before=before, after=after)
        return base_seed

    def _previous_after(self) -> OrderSnapshot:
        """The generators where the previous epoch's draws left them, which they hold."""
        if self.state is None:
            raise StateError("internal error: no previous draw; please report")
        if self._lazy:  # NOTE [ Endless samplers ]: put back as the bounded read left them
            self._apply(self.state.after, None)
        return self.state.after

    def _draw_base_seed(self, epoch: int) -> int | None:
        if not (self.draws_every_epoch or epoch == 0):
            return None
        return int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())

    def _draw(self, epoch: int) -> int | None:
        base_seed = self._draw_base_seed(epoch)
        if self.index_sampler is not None:
            # The previous epoch's order goes first, so two epochs never coexist.
            self.order.clear()
            start = self._snapshot(rng.capture().to_state())
            fresh, first = EpochOrder.read(
                epoch, self.index_sampler, batched=self.batched, bound=self._bound()
            )
            order = self.order
            if fresh is None:
                order.lazy = self._lazily(start, first)
            else:
                order.indices, order.offsets, order.kind = fresh.indices, fresh.offsets, fresh.kind
            self.order.epoch = epoch
        return base_seed

    def _bound(self) -> tuple[int, int]:
        """How far the sampler is read at the start of an epoch: (groups, indices)."""
        try:
            length = len(self.index_sampler)
        except (TypeError, ValueError, NotImplementedError):
            return UNSIZED_BOUND, UNSIZED_BOUND
        return min(length, SIZED_BOUND), SIZED_BOUND

    def _lazily(self, start: OrderSnapshot, first: list[Any]) -> LazyOrder:
        """The order of an epoch whose sampler gave more than its bound (NOTE [ Endless
        samplers ]); the generators stay where the bounded read left them."""
        read = self._snapshot(start.rng)
        lazy = LazyOrder(self.generator, self.index_sampler, start, self._name())
        lazy.check_restarts(first)
        apply_snapshot(self._generators, self.sampler, read)
        return lazy

    def _name(self) -> str:
        outer, inner = type(self.index_sampler).__name__, type(self.sampler).__name__
        return outer if self.sampler is self.index_sampler else f"{outer}({inner})"

    def restore(self, state: OrderState | None, *, epoch: int, between_epochs: bool) -> None:
        """Makes the next draw continue ``state`` (None: from where things stand).

        Raises:
            StateError: ``state`` belongs to another epoch than the saved position.
        """
        self.state, self._lazy = state, False
        if state is None:
            self._pending = None
            return
        if state.epoch != epoch:
            raise StateError(
                f"the state's order was drawn for epoch {state.epoch} but its position "
                f"stands in epoch {epoch}; restore a state as save_state_rank() returned it"
            )
        if len(state.before.generators) != len(self._generators):
            raise StateMismatchError(
                f"the state holds {len(state.before.generators)} generator states but this "
                f"loader and its sampler have {len(self._generators)} generators; build the "
                "loader with the same generator and sampler arguments as the saved one"
            )
        self._pending = (state.after, None) if between_epochs else (state.before, epoch)

    def _snapshot(self, global_rng: RngState) -> OrderSnapshot:
        """The generators now, with ``global_rng`` as the global generators' part."""
        sampler = self.sampler
        state_dict = getattr(sampler, "state_dict", None)
        sampler_state = state_dict() if callable(state_dict) else None
        problem = find_non_plain(sampler_state)
        if problem is not None:
            raise StateError(
                f"{type(sampler).__name__}.state_dict() is not plain data ({problem}); a "
                "sampler's state must be made of dict, list, str, int, float, bool, None, bytes"
            )
        epoch = getattr(sampler, "epoch", None)
        return OrderSnapshot(
            rng=global_rng,
            generators=tuple(g.get_state().numpy().tobytes() for g in self._generators),
            sampler=sampler_state,
            sampler_epoch=epoch if type(epoch) is int else None,
        )

    def _apply(self, snapshot: OrderSnapshot, must_be: int | None) -> None:
        """Puts the loader's and the sampler's generators and the sampler's own state back
        as ``snapshot`` holds them (the global generators' part is swapped in apart)."""
        sampler = self.sampler
        if must_be is not None and snapshot.sampler_epoch is not None:
            current = getattr(sampler, "epoch", None)
            if current != snapshot.sampler_epoch:
                raise StateMismatchError(
                    f"the sampler's epoch is {current} but the state was saved in its epoch "
                    f"{snapshot.sampler_epoch}; call sampler.set_epoch("
                    f"{snapshot.sampler_epoch}) before iterating, as the saved run did"
                )
        apply_snapshot(self._generators, sampler, snapshot)
