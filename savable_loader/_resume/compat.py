"""Whether a saved state fits a loader, and which state a rank restores.

Shared by ``SavableDataLoader.restore_state_rank`` and the collectives of
``distributed.py``: both check a state against the loader's
:class:`~savable_loader._resume.elastic.Layout` before any worker starts (STYLE point 7), and
both take a rank's own state from the list of one save, resharded when the save comes
from another number of ranks or workers (NOTE [ Elastic resume ] in
``datasets/protocol/elastic.py``).

NOTE [ state_dict for checkpoints ]
``torch.distributed.checkpoint`` loads in place: it asks a fresh loader for its
``state_dict()`` and fills the same keys from the checkpoint, so the key structure must
not depend on where the stream is (a worker's checkpoint is None before it starts).
It also keeps one copy of a non-tensor value per key across ranks, so ranks must not
share a key. Hence one key per data-parallel rank holding the encoded state: ranks with
the same data-parallel rank (tensor-parallel peers) yield the same stream, so one copy of
their states serves them all. The encoded state is a state file's bytes (checked header,
msgpack body) written as base64 text, so that the dict is JSON as it is: torchdata's
suite ``json.dumps`` a loader's state, users keep it in JSON metadata beside their
checkpoints, and ``torch.load(weights_only=True)`` takes a str on every torch version
(torch 2.4 refused bytes). ``load_state_dict`` also takes the bytes that versions before
it wrote, and a plain ``RankState`` dict.

NOTE [ Checking a replay ]
A restored worker restores its checkpoint and then skips ``delivered - checkpoint.seq``
batches (``catch_up`` in ``_worker/runtime.py``) in the worker, after ``restore_state_rank``
returned. A state whose ``delivered`` lies past the end of the epoch would only fail
there, at the first ``next()``. So the restore asks the pipeline first how many batches
it has left from the checkpoint (``Stage.items_left``): sources that know their shard
(an ``IndexedDataset``, a map-style dataset, ``TokenSource``, a file source with
``split="samples"`` on several streams) answer by arithmetic on the state, without
reading data or running the user's code; a map or a filter answers with its parent's
bound, a limit with its count, a window shuffle with its parent's less what it emitted,
batching with the batches those items fill. Every worker with a checkpoint is asked,
replay or not: a file source restores the position into a cursor, which refuses one
past the stream's files. Where a stage cannot tell (a user's dataset, whole files whose
samples are not counted, a blend) nothing is checked here and the worker reports it
when it replays, naming ``workers[i].delivered``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..config import WorkerContext
from ..errors import StateError, StateFormatError, StateMismatchError
from ..state.bounds import check_counters
from ..state.files import decode_state
from ..state.models import RankState, one_save
from ..state.names import name_changes
from .elastic import reshard, reshard_ranks
from .layout import Layout

__all__ = [
    "check_compatible",
    "check_pipeline_states",
    "own_state",
    "saved_on_layout",
    "state_from_dict",
    "state_key",
    "states_for_layout",
]

SavedStates = RankState | dict[str, Any] | Sequence[RankState | dict[str, Any]]


def own_state(state: SavedStates, layout: Layout, *, approximate: bool) -> RankState:
    """This rank's state from ``state`` (one rank's, or the list of one save), resharded
    if it was saved on another layout.

    Raises:
        StateError: ``state`` is malformed or cannot move onto this layout.
    """
    if isinstance(state, (RankState, dict)):
        single = RankState.from_plain(state)
        if single.world_size != 1 or (1, single.num_workers, single.batch_size) == (
            layout.world_size,
            layout.num_workers,
            layout.batch_size,
        ):
            return single
        states = [single]
    elif isinstance(state, Sequence) and not isinstance(state, (str, bytes)):
        states = one_save(state)
    else:
        raise StateFormatError(
            "restore_state_rank takes a state, a list of every rank's state, or None; "
            f"got {type(state).__name__}"
        )
    if saved_on_layout(states, layout):
        return states[layout.rank]
    return reshard(states, layout, layout.rank, approximate=approximate)


def state_key(rank: int) -> str:
    """The key of a rank's entry in ``SavableDataLoader.state_dict()``."""
    return f"rank_{rank}"


def state_from_dict(state_dict: Any, layout: Layout) -> RankState:
    """This rank's state from what ``state_dict()`` returned (base64 text, or bytes as
    earlier versions returned them), or a plain ``RankState`` dict.

    Raises:
        StateError: The dict is malformed or holds no entry for this rank.
    """
    if not isinstance(state_dict, dict):
        raise StateFormatError(
            f"load_state_dict takes the dict state_dict() returned, got {type(state_dict).__name__}"
        )
    if "format_version" in state_dict or state_dict.keys() & RankState.model_fields.keys():
        return RankState.from_plain(state_dict)
    key = state_key(layout.rank)
    if key not in state_dict:
        saved = sorted(k for k in state_dict if isinstance(k, str) and k.startswith("rank_"))
        raise StateMismatchError(
            f"cannot restore: the state holds {saved or 'no rank entries'} and this loader "
            f"is rank {layout.rank} of {layout.world_size}; restore each rank from a "
            "checkpoint saved with the same number of ranks"
        )
    state = decode_state(state_dict[key])
    if not isinstance(state, RankState):
        raise StateFormatError(
            f"the entry {key!r} holds a list of rank states; pass such a list to "
            "restore_state_global()"
        )
    return state


def states_for_layout(
    states: Sequence[RankState], layout: Layout, *, approximate: bool
) -> list[RankState]:
    """Every rank's state of ``layout`` from one save (as ``one_save()`` checked it), the
    saved streams brought to their positions once for all of them (NOTE [ One reshard per
    restore ] in ``_resume/elastic.py``)."""
    if saved_on_layout(states, layout):
        return list(states)
    return reshard_ranks(states, layout, range(layout.world_size), approximate=approximate)


def saved_on_layout(states: Sequence[RankState], layout: Layout) -> bool:
    """Whether one save's states come from ``layout``'s number of ranks and workers and
    its batch size, so that no reshard is needed."""
    return len(states) == layout.world_size and all(
        (state.num_workers, state.batch_size) == (layout.num_workers, layout.batch_size)
        for state in states
    )


def check_compatible(state: RankState, layout: Layout) -> None:
    """Refuses a state this loader cannot continue, naming the field, both values and
    the fix.

    Raises:
        StateFormatError: A counter no run can reach (a hand-edited or corrupted state).
        StateMismatchError: The state was saved by another pipeline or loader.
        UnsavableDatasetError: The pipeline has no position to restore.
    """
    layout.check_savable()
    check_counters(state)
    checks = [
        (
            "world_size",
            state.world_size,
            layout.world_size,
            "restore the list of every rank's state (restore_state_global) to reshard it",
        ),
        ("rank", state.rank, layout.rank, "restore each rank's own state"),
        (
            "num_workers",
            state.num_workers,
            layout.num_workers,
            f"build the loader with num_workers={state.num_workers}, or restore the list "
            "of every rank's state to reshard it onto this layout",
        ),
        (
            "batch_size",
            state.batch_size,
            layout.batch_size,
            f"build the loader with batch_size={state.batch_size}, or restore the list of "
            "every rank's state to move it onto this batch size",
        ),
        ("seed", state.seed, layout.seed, f"build the loader with seed={state.seed}"),
    ]
    for name, saved, current, fix in checks:
        if saved != current:
            raise StateMismatchError(
                f"cannot restore: {name} was {saved} when the state was saved and is "
                f"{current} now; {fix}"
            )
    if not layout.matches(state.fingerprint, state.num_workers):
        changes = layout.argument_change(state.fingerprint, state.num_workers)
        changes = changes or name_changes(state.callables, layout.callables)
        if layout.saved_with_file_split(state.fingerprint, state.num_workers):
            changes = (
                "the state was saved with file sources that give whole files to streams; "
                'build every JsonLinesSource and TarSource with split="files" to continue it'
            )
        raise StateMismatchError(
            f"cannot restore: {changes}"
            if changes is not None
            else f"cannot restore: the pipeline fingerprint was {state.fingerprint} when "
            f"the state was saved and is {layout.fingerprint} now; the dataset's config() "
            "or the loader arguments drop_last / collate_fn differ. Rebuild the pipeline "
            "exactly as it was when the state was saved"
        )
    check_pipeline_states(state, layout)
    check_replays(state, layout)


def _context(layout: Layout, worker_id: int) -> WorkerContext:
    """The context of worker ``worker_id`` of ``layout``'s rank."""
    return layout.context(worker_id)


def check_pipeline_states(state: RankState, layout: Layout) -> None:
    """Refuses a worker checkpoint whose pipeline state the pipeline's stages would refuse
    or misread, ended workers' included (NOTE [ States checked at the door ] in
    ``datasets/protocol/stage.py``).

    Raises:
        StateError: A checkpoint's state is malformed; names its path and saved value.
    """
    for worker in state.workers:
        if worker.checkpoint is not None:
            at = f"workers[{worker.worker_id}].checkpoint.state"
            layout.root.check_state(
                worker.checkpoint.state, _context(layout, worker.worker_id), at=at
            )


def check_replays(state: RankState, layout: Layout) -> None:
    """Refuses a worker whose replay would run past the end of its epoch (NOTE [ Checking
    a replay ]).

    Raises:
        StateError: A worker's ``delivered`` lies past what its pipeline has left.
    """
    for worker in state.workers:
        checkpoint = worker.checkpoint
        if checkpoint is None or worker.ended:
            continue
        left = layout.root.items_left(checkpoint.state, _context(layout, worker.worker_id))
        if left is not None and worker.replay > left:
            raise StateError(
                f"invalid loader state: workers[{worker.worker_id}].delivered is "
                f"{worker.delivered}, {worker.replay} batches past its checkpoint at seq "
                f"{checkpoint.seq}, but the pipeline has {left} left in that epoch from "
                "there: the position lies past the end of the data. Restore a state saved "
                "by the same pipeline over the same data"
            )
