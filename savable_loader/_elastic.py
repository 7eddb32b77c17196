"""A saved state moved onto another number of workers or ranks (NOTE [ Elastic resume ]).

:func:`reshard` turns the states of every rank of one save into the state of one rank of
the new layout. It brings each saved stream to the consumer's exact position first: a
worker's checkpoint may stand a few events before what the loader handed on, and the
events in between are replayed here, in the main process, under the checkpoint's own
generators (which are put back afterwards). The pipeline's outermost stage then answers
one :class:`~savable_loader.datasets.elastic.ReshardPlan` per new worker. The new
workers start the resumed epoch from those states with nothing to replay and their
global generators seeded for that epoch (NOTE [ Generators per epoch ] in ``_worker.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from . import rng
from ._version import __version__
from ._worker import decode_dataset_state, epoch_rng_state
from .config import WorkerContext
from .datasets.elastic import NotElastic, OldStream, ReshardPlan
from .datasets.stage import Cursor, Stage
from .errors import ApproximateResumeWarning, StateError, StateMismatchError
from .state.models import FORMAT_VERSION, Checkpoint, RankState, WorkerState

__all__ = ["Layout", "reshard"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """The loader a state is resharded for.

    Attributes:
        dataset: The loader's pipeline.
        fingerprint: The loader's fingerprint.
        fingerprint_for: The loader's fingerprint had it ``num_workers`` workers.
        seed: The loader seed.
        batch_size: Items per batch (None: no batching).
        world_size: Ranks of the new layout.
        num_workers: Workers per rank of the new layout.
    """

    dataset: Any
    fingerprint: str
    fingerprint_for: Callable[[int], str]
    seed: int
    batch_size: int | None
    world_size: int
    num_workers: int


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
    stage = layout.dataset
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
    try:
        if not isinstance(stage, Stage):
            name = type(stage).__name__
            raise NotElastic(
                name,
                "its state is your dataset's own save_state(), which only your dataset can read",
                "restore on the number of workers and ranks it was saved with, build the "
                "pipeline from the library's sources, or pass approximate=True to restart the "
                "interrupted epoch on the new layout",
            )
        old = tuple(_old_streams(stage, states))
        salt = _salt(old)
        new_states = [
            stage.reshard(ReshardPlan(target, old, context, salt)) for context in contexts
        ]
        untouched = all(_at_start(stage, stream, target) for stream in old)
    except NotElastic as error:
        if not approximate:
            changes = "; ".join(
                f"{name} was {before} when the state was saved and is {after} now"
                for name, before, after in (
                    ("world_size", saved.world_size, layout.world_size),
                    ("num_workers", saved.num_workers, layout.num_workers),
                )
                if before != after
            )
            raise StateMismatchError(
                f"cannot restore: {changes}, and the pipeline is not elastic: {error.stage}: "
                f"{error.reason}. To resume, {error.fix}"
            ) from None
        restart = (
            f"restarts epoch {target} from its beginning, so the items of epoch {target} "
            "delivered before the save come again"
            if isinstance(stage, Stage)
            else "restarts your dataset from its initial state (restore_state(None))"
        )
        approximated = f"{error.stage}: {error.reason}; the new layout {restart}"
        new_states = [_epoch_start(stage, context, target) for context in contexts]
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
        new_states = [_epoch_start(stage, context, target) for context in contexts]
    workers = tuple(
        WorkerState(
            worker_id=context.worker_id,
            delivered=1 if ended else 0,
            ended=ended,
            checkpoint=Checkpoint(
                seq=1 if ended else 0,
                exhausted=False,
                dataset_state=_pack(state),
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
    )


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
    checks = [
        ("fingerprint", first.fingerprint, layout.fingerprint_for(first.num_workers)),
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
    """A 63-bit number drawn from the old streams' states (ReshardPlan.salt)."""
    plain = [[list(dataclasses.astuple(s.context)), s.state] for s in old]
    digest = hashlib.blake2b(msgpack.packb(plain, use_bin_type=True), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _old_streams(stage: Stage[Any], states: Sequence[RankState]) -> list[OldStream]:
    streams = []
    for state in states:
        for worker in state.workers:
            context = WorkerContext(
                state.rank,
                state.world_size,
                worker.worker_id,
                state.num_workers,
                state.seed,
                state.batch_size,
            )
            streams.append(OldStream(context, _exact_state(stage, context, worker)))
    return streams


def _exact_state(stage: Stage[Any], context: WorkerContext, worker: WorkerState) -> Any:
    """The stage's state once the worker's delivered events are all consumed."""
    checkpoint = worker.checkpoint
    if worker.replay == 0:
        return None if checkpoint is None else decode_dataset_state(checkpoint.dataset_state)
    cursor = stage.cursor(context)
    outer = rng.capture()
    try:
        if checkpoint is None:
            cursor.restore(None)
            start = epoch_rng_state(context.seed, context.rank, context.worker_id, 0)
            rng.apply(rng.RngSnapshot.from_state(start))
        else:
            if checkpoint.exhausted:
                raise StateError(
                    f"rank {context.rank} worker {context.worker_id}: its checkpoint stands at "
                    f"the end of an epoch but {worker.replay} events follow it; the state is "
                    "inconsistent"
                )
            cursor.restore(decode_dataset_state(checkpoint.dataset_state))
            rng.apply(rng.RngSnapshot.from_state(checkpoint.rng))
        items = worker.replay * (context.batch_size or 1)
        try:
            _replay(cursor, items)
        except Exception as error:
            raise StateError(
                f"cannot reshard: replaying {items} item(s) of rank {context.rank} worker "
                f"{context.worker_id} to the position it was saved at raised {error!r}; the "
                "pipeline must read the same items again to be resharded"
            ) from error
        return cursor.state()
    finally:
        rng.apply(outer)


def _replay(cursor: Cursor[Any], items: int) -> None:
    """Moves ``cursor`` by ``items`` items as the worker's batches read them."""
    if cursor.can_skip():
        cursor.skip(items)
        return
    for _ in range(items):
        try:
            next(cursor)
        except StopIteration:
            return


def _at_start(stage: Stage[Any], stream: OldStream, epoch: int) -> bool:
    """Whether ``stream`` stands at the start of ``epoch``, having consumed none of it."""
    if stream.state is None:
        return epoch == 0
    return bool(stream.state == _epoch_start(stage, stream.context, epoch))


def _epoch_start(stage: Any, context: WorkerContext, epoch: int) -> Any:
    """The pipeline's state at the start of ``epoch`` for ``context`` (approximate resume)."""
    if isinstance(stage, Stage):
        cursor = stage.cursor(context)
        cursor.restore(None)
        for _ in range(epoch):
            cursor.end_epoch()
        return cursor.state()
    dataset = copy.deepcopy(stage)
    dataset.setup(context)
    dataset.restore_state(None)
    return dataset.save_state()


def _pack(state: Any) -> bytes:
    try:
        return msgpack.packb(state, use_bin_type=True)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError) as error:
        raise StateError(f"a resharded state is not plain data: {error}") from error
