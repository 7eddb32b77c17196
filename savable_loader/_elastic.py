"""A saved state moved onto another number of workers or ranks (NOTE [ Elastic resume ]).

:func:`reshard` turns the states of every rank of one save into the state of one rank of
the new layout. It brings each saved stream to the consumer's exact position first: a
worker's checkpoint may stand a few events before what the loader handed on, and the
events in between are replayed here, in the main process, by the same runtime the
workers run (NOTE [ The runtime ] in ``_runtime.py``), under the checkpoint's own
generators. The pipeline's root stage then answers one
:class:`~savable_loader.datasets.elastic.ReshardPlan` per new worker. The new workers
start the resumed epoch from those states with nothing to replay and their global
generators seeded for that epoch (NOTE [ Generators per epoch ] in ``_runtime.py``).
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

from ._layout import Layout
from ._runtime import PipelineRuntime, RuntimeSpec, WorkerStart, epoch_rng_state
from ._version import __version__
from .config import WorkerContext
from .datasets.adapt import DatasetStage
from .datasets.elastic import OldStream, ReshardPlan
from .datasets.stage import Stage
from .datasets.stateful import StatefulDataset
from .errors import ApproximateResumeWarning, StateError, StateMismatchError
from .state.models import FORMAT_VERSION, Checkpoint, RankState, WorkerState
from .state.names import name_changes

__all__ = ["reshard"]

logger = logging.getLogger(__name__)


def reshard(
    states: Sequence[RankState], layout: Layout, rank: int, *, approximate: bool = False
) -> RankState:
    """Returns rank ``rank``'s state in ``layout`` from every rank's state of one save
    (as ``one_save()`` validated them).

    Raises:
        StateMismatchError: The states do not belong together or to this pipeline, or the
            pipeline is not elastic and ``approximate`` is False.
        StateError: A saved position cannot be reached again.
    """
    epoch = _check(states, layout)
    saved = states[0]
    between = all(state.between_epochs for state in states)
    target = epoch + 1 if between else epoch
    root = layout.root
    approximated: str | None = None
    new_states: list[Any] = []
    untouched = False
    salt = 0
    contexts = [
        WorkerContext(
            rank, layout.world_size, w, layout.num_workers, layout.seed, layout.batch_size
        )
        for w in range(max(layout.num_workers, 1))
    ]
    problem = root.not_elastic()
    if problem is None:
        old = tuple(_old_streams(root, states))
        salt = _salt(old)
        new_states = [root.reshard(ReshardPlan(target, old, context, salt)) for context in contexts]
        untouched = all(_at_start(root, stream, target) for stream in old)
    elif not approximate:
        changes = "; ".join(
            f"{name} was {before} when the state was saved and is {after} now"
            for name, before, after in (
                ("world_size", saved.world_size, layout.world_size),
                ("num_workers", saved.num_workers, layout.num_workers),
            )
            if before != after
        )
        raise StateMismatchError(
            f"cannot restore: {changes}, and the pipeline is not elastic: {problem.stage}: "
            f"{problem.reason}. To resume, {problem.fix}"
        )
    else:
        initial = _restarts_from_initial(root)
        restart = (
            "restarts your dataset from its initial state (restore_state(None))"
            if initial
            else f"restarts epoch {target} from its beginning, so the items of epoch {target} "
            "delivered before the save come again"
        )
        approximated = f"{problem.stage}: {problem.reason}; the new layout {restart}"
        scratch = copy.deepcopy(root)  # NOTE [ A dataset is its own position ] in adapt.py
        new_states = [
            _epoch_start(scratch, context, 0 if initial else target) for context in contexts
        ]
    if approximated is not None:
        message = f"approximate resume: {approximated}"
        logger.warning(message)
        warnings.warn(message, ApproximateResumeWarning, stacklevel=4)
    ended = between and approximated is None
    # The rest of an epoch draws from salted generators: a new worker must not repeat
    # the draws the old worker of the same id made at the start of the epoch. When no
    # saved stream consumed anything of the epoch (a save between epochs, or before any
    # item), the epoch starts as a fresh run's: its states, its generators, no quota.
    salted = approximated is None and not untouched
    if approximated is None and untouched:
        new_states = [_epoch_start(root, context, target) for context in contexts]
    workers = tuple(
        WorkerState(
            worker_id=context.worker_id,
            delivered=1 if ended else 0,
            ended=ended,
            checkpoint=Checkpoint(
                seq=1 if ended else 0,
                state=state,
                rng=epoch_rng_state(
                    layout.seed, rank, context.worker_id, target, salt if salted else None
                ),
            ),
        )
        for context, state in zip(contexts, new_states, strict=True)
    )
    return RankState(
        format_version=FORMAT_VERSION,
        library_version=__version__,
        fingerprint=layout.fingerprint,
        rank=rank,
        world_size=layout.world_size,
        num_workers=layout.num_workers,
        batch_size=saved.batch_size,
        seed=saved.seed,
        epoch=epoch if approximated is None else target,
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


def _check(states: Sequence[RankState], layout: Layout) -> int:
    """Checks the states are one save of this pipeline; returns the epoch they stand in.

    Ranks that finished epoch ``e`` and have not begun ``e + 1`` count as standing at the
    start of ``e + 1`` when the other ranks already began it.
    """
    first = states[0]  # one_save() checked the list's ranks
    for index, state in enumerate(states):
        for name in ("fingerprint", "seed", "batch_size", "num_workers"):
            if getattr(state, name) != getattr(first, name):
                raise StateMismatchError(
                    f"states[{index}] has {name} {getattr(state, name)!r} but states[0] has "
                    f"{getattr(first, name)!r}: the states come from different saves"
                )
    if not layout.matches(first.fingerprint, first.num_workers):
        raise StateMismatchError(
            "cannot restore: "
            + (
                name_changes(first.callables, layout.callables)
                or f"the pipeline fingerprint was {first.fingerprint} when the state was "
                f"saved and is {layout.fingerprint_for(first.num_workers)} now; rebuild the "
                "pipeline and loader as they were (only the number of workers and ranks may "
                "change)"
            )
        )
    checks = [
        ("seed", first.seed, layout.seed),
        ("batch_size", first.batch_size, layout.batch_size),
    ]
    for name, saved, current in checks:
        if saved != current:
            raise StateMismatchError(
                f"cannot restore: {name} was {saved} when the state was saved and is "
                f"{current} now; rebuild the pipeline and loader as they were (only the "
                "number of workers and ranks may change)"
            )
    epochs = sorted({state.epoch for state in states})
    if len(epochs) == 1:
        return epochs[0]
    # A rank between epochs e and e + 1 stands where one that began e + 1 started from.
    behind = [state for state in states if state.epoch == epochs[0]]
    ahead = [state for state in states if state.epoch == epochs[-1]]
    if (
        len(epochs) == 2
        and epochs[1] == epochs[0] + 1
        and all(state.between_epochs for state in behind)
        and not any(state.between_epochs for state in ahead)
    ):
        return epochs[1]
    raise StateMismatchError(
        f"cannot restore onto another layout: the saved ranks stand in different epochs "
        f"{epochs}; restore on the layout it was saved with, or save when every rank is "
        "in the same epoch"
    )


def _salt(old: tuple[OldStream, ...]) -> int:
    """A 63-bit number drawn from the old streams' pipeline states, batching aside
    (ReshardPlan.salt)."""
    plain = [[list(dataclasses.astuple(s.context)), _pipeline_state(s.state)] for s in old]
    digest = hashlib.blake2b(msgpack.packb(plain, use_bin_type=True), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _pipeline_state(state: Any) -> Any:
    """The pipeline's part of a root state (below the batching stage)."""
    return state["parent"] if isinstance(state, dict) and "parent" in state else state


def _old_streams(root: Stage[Any], states: Sequence[RankState]) -> list[OldStream]:
    streams = []
    for state in states:
        spec = RuntimeSpec(
            root=root,
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
        )
        for worker in state.workers:
            context = spec.context(worker.worker_id)
            streams.append(OldStream(context, _exact_state(spec, worker)))
    return streams


def _exact_state(spec: RuntimeSpec, worker: WorkerState) -> Any:
    """The pipeline's state once the worker's delivered events are all consumed."""
    checkpoint = worker.checkpoint
    if worker.replay == 0:
        return None if checkpoint is None else copy.deepcopy(checkpoint.state)
    runtime = PipelineRuntime(spec, worker.worker_id, in_main=True)
    try:
        return runtime.catch_up()
    except Exception as error:
        raise StateError(
            f"cannot reshard: replaying {worker.replay} batch(es) of rank {spec.rank} worker "
            f"{worker.worker_id} to the position it was saved at raised {error!r}; the "
            "pipeline must read the same items again to be resharded"
        ) from error
    finally:
        runtime.close()


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
