"""A saved state moved onto another number of workers or ranks (NOTE [ Elastic resume ]).

:func:`reshard` turns the states of every rank of one save into the state of one rank of
the new layout. It brings each saved stream to the consumer's exact position first: a
worker's checkpoint may stand a few events before what the loader handed on, and the
events in between are replayed here, in the main process, by the same runtime the
workers run (NOTE [ The runtime ] in ``_worker/runtime.py``), under the checkpoint's own
generators. The pipeline's root stage then answers one
:class:`~savable_loader.datasets.protocol.elastic.ReshardPlan` per new worker. The new workers
start the resumed epoch from those states with nothing to replay and their global
generators seeded for that epoch (NOTE [ Generators per epoch ] in ``_worker/runtime.py``).

NOTE [ A rank at its last batch ]
A rank saved right after it handed on its last batch of epoch ``e`` has not asked for the
next one, so its workers' ends of the epoch were never handed on: the state stands in
``e`` with workers not ``ended``, though nothing of ``e`` is left for it. Next to ranks
that began ``e + 1`` it must stand where they started from: the start of ``e + 1``. So
each such worker is run on from its exact position, in the main process by the workers'
runtime; when its next event is the end of the epoch, the state takes what the worker
would have saved right after handing that end on (the checkpoint after the end, with its
generators seeded for ``e + 1``). A worker whose next event is a batch still has items
of ``e``: next to ranks in ``e + 1`` the save is refused as ranks in different epochs.
When every rank stands in ``e``, the same is tried for all of them, and the first worker
with a batch left stops it (so a save mid-epoch costs one batch more): if no rank has a
batch of ``e`` left, the save restores as one taken between epochs, and the next epoch
starts as a fresh run's on the new layout. Read as positions instead, such a save would
leave the positions a filter had not yet read (the worker's last batch was full before
them) to the new layout, padded for its number of ranks.

NOTE [ One reshard per restore ]
What the old layout left does not depend on the new rank: the checks, the ranks brought
past their last batch, every old stream's exact state and the salt are computed once per
restore (``_Move.of``), and each new rank only asks the root for its streams' states
(:func:`reshard_ranks`, which ``restore_state_global(src_rank=...)`` calls for every new
rank at once). A stream whose checkpoint stands at its delivered position takes the
checkpoint's state and is not run; one behind it is replayed once, in
:func:`_finish_epoch` when that looked for the end of its epoch, else in
:func:`_exact_state`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import msgpack

from .._channel.events import END, ITEM
from .._version import __version__
from .._worker.runtime import PipelineRuntime, RuntimeSpec, WorkerStart, epoch_rng_state
from ..config import WorkerContext
from ..datasets.adapt import DatasetStage
from ..datasets.adapters.stateful import StatefulDataset
from ..datasets.protocol.elastic import OldStream, ReshardPlan
from ..datasets.protocol.stage import Stage
from ..errors import ApproximateResumeWarning, StateError, StateFormatError, StateMismatchError
from ..state.bounds import MAX_RESHARD_EPOCH, check_counters
from ..state.models import FORMAT_VERSION, Checkpoint, RankState, WorkerState
from ..state.names import name_changes
from .layout import Layout

__all__ = ["reshard", "reshard_ranks"]

logger = logging.getLogger(__name__)


def reshard(
    states: Sequence[RankState], layout: Layout, rank: int, *, approximate: bool = False
) -> RankState:
    """Returns rank ``rank``'s state in ``layout`` from every rank's state of one save
    (as ``one_save()`` validated them).

    Raises:
        As :func:`reshard_ranks`.
    """
    return reshard_ranks(states, layout, (rank,), approximate=approximate, stacklevel=5)[0]


def reshard_ranks(
    states: Sequence[RankState],
    layout: Layout,
    ranks: Sequence[int],
    *,
    approximate: bool = False,
    stacklevel: int = 4,
) -> list[RankState]:
    """Returns the state of each of ``ranks`` in ``layout`` from every rank's state of one
    save (as ``one_save()`` validated them), the old streams brought to their exact
    positions once for all of them (NOTE [ One reshard per restore ]).

    Raises:
        StateMismatchError: The states do not belong together or to this pipeline, or the
            pipeline is not elastic and ``approximate`` is False.
        StateError: A saved position cannot be reached again.
        StateFormatError: A counter is beyond what a save leaves (NOTE [ Counter bounds ]).
    """
    move = _Move.of(states, layout, approximate=approximate)
    if move.approximated is not None:
        message = f"approximate resume: {move.approximated}"
        logger.warning(message)
        warnings.warn(message, ApproximateResumeWarning, stacklevel=stacklevel)
    return [move.rank_state(rank) for rank in ranks]


@dataclasses.dataclass(frozen=True)
class _Move:
    """What one restore onto ``layout`` computes once, whatever the new rank
    (NOTE [ One reshard per restore ]).

    Attributes:
        layout: The new layout.
        saved: One of the saved states (they agree on what a new state copies).
        epoch: The epoch the saved streams stand in.
        target: The epoch the new streams resume.
        old: Every saved stream at its exact position (empty when not elastic).
        salt: ``ReshardPlan.salt``.
        untouched: No saved stream consumed anything of ``target``.
        approximated: What an approximate resume gives up, or None.
        restart: The epoch an approximate resume restarts from its beginning.
        shared: ``ReshardPlan.shared`` of this restore's plans.
    """

    layout: Layout
    saved: RankState
    epoch: int
    target: int
    old: tuple[OldStream, ...]
    salt: int
    untouched: bool
    approximated: str | None
    restart: int
    shared: dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, states: Sequence[RankState], layout: Layout, *, approximate: bool) -> _Move:
        """Checks ``states`` against ``layout`` and brings every saved stream to its exact
        position, once."""
        for state in states:  # before anything replays (NOTE [ Counter bounds ])
            check_counters(state)
        between = all(state.between_epochs for state in states)
        latest = max(state.epoch for state in states) + between
        if latest > MAX_RESHARD_EPOCH:
            raise StateFormatError(
                f"cannot restore onto another layout: epoch is {latest - between}, and a "
                "restore onto another layout walks the pipeline through every earlier epoch, "
                f"at most {MAX_RESHARD_EPOCH} (NOTE [ Counter bounds ]); restore on the number "
                "of workers and ranks it was saved with"
            )
        _check(states, layout)
        root = layout.root
        problem = root.not_elastic()
        if problem is not None and not approximate:
            # Refused before anything replays: a pipeline that is not elastic may not
            # replay in the main process either (a sampler's order is drawn by the loader).
            saved = states[0]
            changes = "; ".join(
                f"{name} was {before} when the state was saved and is {after} now"
                for name, before, after in (
                    ("world_size", saved.world_size, layout.world_size),
                    ("num_workers", saved.num_workers, layout.num_workers),
                    ("batch_size", saved.batch_size, layout.batch_size),
                )
                if before != after
            )
            fix = (
                f", or build the loader with batch_size={saved.batch_size}"
                if saved.batch_size != layout.batch_size
                else ""
            )
            raise StateMismatchError(
                f"cannot restore: {changes}, and the pipeline is not elastic: "
                f"{problem.stage}: {problem.reason}. To resume, {problem.fix}{fix}"
            )
        exact: dict[tuple[int, int], Any] = {}
        epoch, states = _standing(states, layout, exact)
        saved = states[0]
        target = epoch + 1 if between else epoch
        if problem is None:
            old = tuple(_old_streams(layout, states, exact))
            untouched = all(_at_start(root, stream, target) for stream in old)
            return cls(layout, saved, epoch, target, old, _salt(old), untouched, None, target)
        initial = _restarts_from_initial(root)
        restart = (
            "restarts your dataset from its initial state (restore_state(None))"
            if initial
            else f"restarts epoch {target} from its beginning, so the items of epoch {target} "
            "delivered before the save come again"
        )
        approximated = f"{problem.stage}: {problem.reason}; the new layout {restart}"
        return cls(
            layout, saved, epoch, target, (), 0, False, approximated, 0 if initial else target
        )

    def rank_state(self, rank: int) -> RankState:
        """Rank ``rank``'s state in the new layout."""
        layout, target = self.layout, self.target
        contexts = [layout.context(w, rank) for w in range(max(layout.num_workers, 1))]
        root = layout.root
        elastic = self.approximated is None
        if not elastic:
            scratch = copy.deepcopy(root)  # NOTE [ A dataset is its own position ] in adapt.py
            new_states = [_epoch_start(scratch, context, self.restart) for context in contexts]
        elif self.untouched:
            # No saved stream consumed anything of the epoch (a save between epochs, or
            # before any item): it starts as a fresh run's, its states, its generators.
            new_states = [_epoch_start(root, context, target) for context in contexts]
        else:
            new_states = [
                copy.deepcopy(
                    root.reshard(ReshardPlan(target, self.old, context, self.salt, self.shared))
                )
                for context in contexts
            ]
        ended = elastic and target != self.epoch  # a save between epochs
        # The rest of an epoch draws from salted generators: a new worker must not repeat
        # the draws the old worker of the same id made at the start of the epoch.
        # With seed_each_item nothing draws from what they hold between items: the
        # epoch's seeding stands for them (NOTE [ Items seeded one by one ] in rng/keys.py).
        salted = elastic and not self.untouched and not layout.seed_each_item
        workers = tuple(
            WorkerState(
                worker_id=context.worker_id,
                delivered=1 if ended else 0,
                ended=ended,
                checkpoint=Checkpoint(
                    seq=1 if ended else 0,
                    state=state,
                    # Generators seeded for the epoch are named by it, with no bytes (NOTE
                    # [ Untouched generators ] in rng/generators.py); salted ones are saved
                    # as bytes.
                    rng=epoch_rng_state(layout.seed, rank, context.worker_id, target, self.salt)
                    if salted
                    else None,
                    seeded_epoch=None if salted else target,
                ),
            )
            for context, state in zip(contexts, new_states, strict=True)
        )
        saved = self.saved
        return RankState(
            format_version=FORMAT_VERSION,
            library_version=__version__,
            fingerprint=layout.fingerprint,
            rank=rank,
            world_size=layout.world_size,
            num_workers=layout.num_workers,
            batch_size=layout.batch_size,
            seed=saved.seed,
            epoch=self.epoch if elastic else target,
            next_worker=0,
            workers=workers,
            callables=layout.callables,
        )


def _restarts_from_initial(root: Stage[Any]) -> bool:
    """Whether an approximate resume restarts the pipeline from its initial state rather
    than from the epoch: a pipeline that is your dataset, or an adapted Stateful object,
    itself (under another stage they read the earlier epochs through)."""
    pipeline = root.children[0] if root.children else root
    return isinstance(pipeline, (DatasetStage, StatefulDataset))


def _check(states: Sequence[RankState], layout: Layout) -> None:
    """Checks the states are one save of this pipeline, before anything replays."""
    first = states[0]  # one_save() checked the list's ranks
    for index, state in enumerate(states):
        for name in ("fingerprint", "seed", "batch_size", "num_workers"):
            if getattr(state, name) != getattr(first, name):
                raise StateMismatchError(
                    f"states[{index}] has {name} {getattr(state, name)!r} but states[0] has "
                    f"{getattr(first, name)!r}: the states come from different saves"
                )
    if (first.batch_size is None) != (layout.batch_size is None):
        raise StateMismatchError(
            f"cannot restore: batch_size was {first.batch_size} when the state was saved "
            f"and is {layout.batch_size} now; a state saved with batches restores into a "
            "loader with a batch_size, one saved without into a loader without"
        )
    if first.seed != layout.seed:
        raise StateMismatchError(
            f"cannot restore: seed was {first.seed} when the state was saved and is "
            f"{layout.seed} now; build the loader with seed={first.seed}"
        )
    if not layout.matches(first.fingerprint, first.num_workers, first.batch_size):
        change = layout.argument_change(first.fingerprint, first.num_workers, first.batch_size)
        if change is not None:
            raise StateMismatchError(f"cannot restore: {change}")
        raise StateMismatchError(
            "cannot restore: "
            + (
                name_changes(first.callables, layout.callables)
                or f"the pipeline fingerprint was {first.fingerprint} when the state was "
                f"saved and is {layout.fingerprint_for(first.num_workers, first.batch_size)} "
                "now; rebuild the pipeline and loader as they were (only the number of "
                "ranks, workers and the batch size may change)"
            )
        )


def _standing(
    states: Sequence[RankState], layout: Layout, exact: dict[tuple[int, int], Any]
) -> tuple[int, Sequence[RankState]]:
    """The epoch the states of one save stand in, and the states to reshard. ``exact``
    receives the exact states found on the way (:func:`_finish_epoch`).

    Ranks that finished epoch ``e`` and have not begun ``e + 1`` count as standing at the
    start of ``e + 1`` when the other ranks already began it; so do ranks that handed on
    their last batch of ``e`` and not yet its end (NOTE [ A rank at its last batch ]).
    """
    epochs = sorted({state.epoch for state in states})
    if len(epochs) == 1:
        finished = _finished(layout, states, epochs[0], exact, strict=False)
        return epochs[0], finished or states
    # A rank between epochs e and e + 1 stands where one that began e + 1 started from.
    ahead = [state for state in states if state.epoch == epochs[-1]]
    if (
        len(epochs) == 2
        and epochs[1] == epochs[0] + 1
        and not any(state.between_epochs for state in ahead)
    ):
        finished = _finished(layout, states, epochs[0], exact, strict=True)
        if finished is not None:
            return epochs[1], finished
    raise StateMismatchError(
        f"cannot restore onto another layout: the saved ranks stand in different epochs "
        f"{epochs}; restore on the layout it was saved with, or save when every rank is "
        "in the same epoch"
    )


def _salt(old: tuple[OldStream, ...]) -> int:
    """A 63-bit number drawn from the old streams' pipeline states, batching aside
    (ReshardPlan.salt)."""
    # The context's fields before seed_each_item: salts of earlier versions stay.
    plain = [[list(dataclasses.astuple(s.context))[:6], _pipeline_state(s.state)] for s in old]
    digest = hashlib.blake2b(msgpack.packb(plain, use_bin_type=True), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _pipeline_state(state: Any) -> Any:
    """The pipeline's part of a root state (below the batching stage)."""
    return state["parent"] if isinstance(state, dict) and "parent" in state else state


def _finished(
    layout: Layout,
    states: Sequence[RankState],
    epoch: int,
    exact: dict[tuple[int, int], Any],
    *,
    strict: bool,
) -> list[RankState] | None:
    """The states with every rank of ``epoch`` brought past its end (NOTE [ A rank at its
    last batch ]); None as soon as one rank still has a batch of it, or (unless
    ``strict``) its pipeline raises producing that batch."""
    finished = []
    for state in states:
        done = state if state.epoch != epoch else _finish_epoch(layout, state, exact, strict=strict)
        if done is None:
            return None
        finished.append(done)
    return finished


def _finish_epoch(
    layout: Layout, state: RankState, exact: dict[tuple[int, int], Any], *, strict: bool
) -> RankState | None:
    """``state`` once its workers that handed on their last batch of the epoch handed on
    their end too (NOTE [ A rank at its last batch ]); None when one still has a batch.
    Each worker's exact state, reached on the way, goes into ``exact`` by (rank, worker).

    Raises:
        StateError: A worker's pipeline raised replaying to its saved position, or (when
            ``strict``) producing what comes next.
    """
    if state.between_epochs:
        return state
    spec = _spec(layout, state)
    workers = []
    for worker in state.workers:
        if worker.ended:
            workers.append(worker)
            continue
        runtime = PipelineRuntime(spec, worker.worker_id, in_main=True)
        try:
            exact[state.rank, worker.worker_id] = copy.deepcopy(_catch_up(runtime, spec, worker))
            _, seq, kind, _ = next(runtime.epoch())
            if kind == ITEM or (kind != END and not strict):
                return None
            if kind != END:
                raise StateError(
                    f"cannot reshard: the pipeline of rank {state.rank} worker "
                    f"{worker.worker_id} raised after its saved position in epoch "
                    f"{state.epoch}; restore on the layout it was saved with"
                )
            checkpoint = runtime.checkpoint_for(runtime.seq)
        except StateError:
            raise
        except Exception as error:
            if not strict:
                return None
            raise StateError(
                f"cannot reshard: bringing rank {state.rank} worker {worker.worker_id} to "
                f"the end of epoch {state.epoch} raised {error!r}; the pipeline must read "
                "the same items again to be resharded"
            ) from error
        finally:
            runtime.close()
        workers.append(
            WorkerState(
                worker_id=worker.worker_id, delivered=seq + 1, ended=True, checkpoint=checkpoint
            )
        )
    return state.model_copy(update={"workers": tuple(workers), "next_worker": 0})


def _spec(layout: Layout, state: RankState) -> RuntimeSpec:
    """How the workers of ``state`` run again in the main process, to where it stood."""
    return RuntimeSpec(
        root=layout.root_for(state.batch_size),
        seed=state.seed,
        rank=state.rank,
        world_size=state.world_size,
        num_workers=state.num_workers,
        batch_size=state.batch_size,
        checkpoint_share=1.0,
        max_lag=0,
        starts=tuple(
            WorkerStart(checkpoint=worker.checkpoint, delivered=worker.delivered)
            for worker in state.workers
        ),
        epoch=state.epoch,
        seed_each_item=layout.seed_each_item,
    )


def _old_streams(
    layout: Layout, states: Sequence[RankState], exact: dict[tuple[int, int], Any]
) -> list[OldStream]:
    """Every saved stream at its exact position (NOTE [ One reshard per restore ])."""
    streams = []
    for state in states:
        spec = _spec(layout, state)
        for worker in state.workers:
            context = spec.context(worker.worker_id)
            streams.append(OldStream(context, _exact_state(spec, worker, exact)))
    return streams


def _exact_state(spec: RuntimeSpec, worker: WorkerState, exact: dict[tuple[int, int], Any]) -> Any:
    """The pipeline's state once the worker's delivered events are all consumed: its
    checkpoint's when that stands there, else the state :func:`_finish_epoch` reached,
    else replayed."""
    checkpoint = worker.checkpoint
    if worker.replay == 0:
        return None if checkpoint is None else copy.deepcopy(checkpoint.state)
    if (spec.rank, worker.worker_id) in exact:
        return exact[spec.rank, worker.worker_id]
    runtime = PipelineRuntime(spec, worker.worker_id, in_main=True)
    try:
        return _catch_up(runtime, spec, worker)
    finally:
        runtime.close()


def _catch_up(runtime: PipelineRuntime, spec: RuntimeSpec, worker: WorkerState) -> Any:
    """``runtime.catch_up()``, its failure a :class:`StateError`."""
    try:
        return runtime.catch_up()
    except Exception as error:
        raise StateError(
            f"cannot reshard: replaying {worker.replay} batch(es) of rank {spec.rank} worker "
            f"{worker.worker_id} to the position it was saved at raised {error!r}; the "
            "pipeline must read the same items again to be resharded"
        ) from error


def _at_start(root: Stage[Any], stream: OldStream, epoch: int) -> bool:
    """Whether ``stream`` stands at the start of ``epoch``, having consumed none of it."""
    if stream.state is None:
        return epoch == 0
    return bool(stream.state == _epoch_start(root, stream.context, epoch))


def _epoch_start(root: Stage[Any], context: WorkerContext, epoch: int) -> Any:
    """The pipeline's state at the start of ``epoch`` for ``context``."""
    cursor = root.cursor(context)
    try:
        cursor.restore(None)
        for _ in range(epoch):
            cursor.end_epoch()
        return cursor.state()
    finally:
        cursor.close()
