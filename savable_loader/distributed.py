"""Saving and restoring every rank's loader state at once, over ``torch.distributed``.

NOTE [ Global state ]
``save_state_global`` is a collective: every rank of the loader's group
(``WorkerConfig.data_parallel_group``, the default group when None) calls it. Each rank
first takes its own state (``save_state_rank``); an ``all_gather_object`` of a small
status (ok, or the error's type and text) then tells every rank whether all of them
succeeded, so a failure on one rank (a dead worker, say) makes *every* rank raise the
same error naming the failing ranks, instead of leaving the others waiting in the next
collective. Only then does ``gather_object`` carry the states, as plain data, to
``global_dst_rank``, which returns them as ``RankState`` objects in the order of the
ranks within the group; the other ranks return None.

``restore_state_global`` either takes the full list on every rank (each rank restores
``states[rank]``; no data moves), or takes it on ``src_rank`` only, which validates the
list and ``scatter_object_list``-s each rank its own state, or an error marker when the
list is invalid, so every rank raises rather than waits. Each rank then restores its
state with ``restore_state_rank`` (which checks world size, fingerprint and the rest)
and an ``all_gather_object`` of the outcome makes every rank raise if any rank failed.
Every rank must call these functions with the same ``global_dst_rank`` / ``src_rank``.

Objects travel between ranks pickled by ``torch.distributed``'s object collectives over
the process group, in memory: only plain data and error texts this library built, never
into or out of a file (files hold msgpack: :mod:`savable_loader.state.files`). With
``nccl``, object collectives go through the current CUDA device: call
``torch.cuda.set_device`` first, as torch asks. A rank that never reaches a collective
(killed, or stuck in user code) makes the others wait until the process group's timeout,
set with ``init_process_group(timeout=...)``; the library adds no timeout of its own.

Without ``torch.distributed`` initialised, both functions work for a single rank
(``world_size`` 1) and refuse more.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch.distributed as dist

from ._resume.compat import own_state, saved_on_layout, states_for_layout
from ._resume.layout import Layout
from .config import WorkerConfig
from .errors import (
    ApproximateResumeWarning,
    ConfigError,
    SavableLoaderError,
    StateError,
    StateFileNotFoundError,
    StateFormatError,
    StateMismatchError,
    StorageError,
    UnsavableDatasetError,
    WorkerError,
)
from .state.models import RankState, one_save

__all__ = [
    "GlobalStates",
    "every_rank_state_dict",
    "restore_state_global",
    "save_state_global",
]


class SavableDataLoader(Protocol):
    """What these collectives use of a loader (``savable_loader.SavableDataLoader``)."""

    rank: int
    world_size: int
    worker_config: WorkerConfig
    layout: Layout

    def save_state_rank(self) -> RankState: ...

    def restore_state_rank(self, state: Any, *, approximate: bool = False) -> None: ...


class GlobalStates:
    """The loader's collective methods (``savable_loader.SavableDataLoader`` has them)."""

    def save_state_global(
        self: SavableDataLoader, global_dst_rank: int = 0
    ) -> list[RankState] | None:
        """Gathers every rank's state on ``global_dst_rank``: a collective, every rank calls it.

        Returns:
            On ``global_dst_rank``, one state per rank of the loader's data-parallel group,
            in rank order; None on the other ranks.

        Raises:
            WorkerError: Saving failed on some rank; every rank raises, naming it.
        """
        return save_state_global(self, global_dst_rank)

    def restore_state_global(
        self: SavableDataLoader,
        states: Sequence[RankState | dict[str, Any]] | None,
        src_rank: int | None = None,
        *,
        approximate: bool = False,
    ) -> None:
        """Restores every rank from the list :meth:`save_state_global` returned.

        Either every rank passes the full list (``src_rank=None``), or only ``src_rank``
        (a rank within the data-parallel group) does and each rank receives its own entry.
        A list saved with another number of ranks or workers is resharded (NOTE [ Elastic
        resume ] in ``datasets/protocol/elastic.py``); ``approximate`` is as in
        :meth:`restore_state_rank`.

        Raises:
            StateError: The list does not fit this job (pipeline, seed, batch size, or a
                layout change on a pipeline that is not elastic); every rank raises.
        """
        restore_state_global(self, states, src_rank, approximate=approximate)


#: What a rank reports to the others: None when it succeeded, else (error type, text).
_Status = tuple[str, str] | None

_ERRORS: dict[str, type[SavableLoaderError]] = {
    cls.__name__: cls
    for cls in (
        ConfigError,
        SavableLoaderError,
        StateError,
        StateFileNotFoundError,
        StateFormatError,
        StateMismatchError,
        StorageError,
        UnsavableDatasetError,
        WorkerError,
    )
}


def save_state_global(
    loader: SavableDataLoader, global_dst_rank: int = 0
) -> list[RankState] | None:
    """Gathers every rank's state on ``global_dst_rank``; a collective over the group.

    Args:
        loader: This rank's loader.
        global_dst_rank: Global rank that receives the states; a member of the loader's
            ``data_parallel_group``.

    Returns:
        On ``global_dst_rank``, one state per rank of the group, in group rank order;
        None on the other ranks.

    Raises:
        WorkerError: Saving failed on some rank (on every rank, naming the failing ones).
        ConfigError: ``global_dst_rank`` is not in the group, or the loader's rank and
            world size disagree with the group's.
    """
    if not _initialized():
        _check_single(loader, "save_state_global")
        if global_dst_rank != 0:
            raise ConfigError(
                f"global_dst_rank is {global_dst_rank} but torch.distributed is not "
                "initialized, so the only rank is 0; pass global_dst_rank=0"
            )
        return [loader.save_state_rank()]
    group = loader.worker_config.data_parallel_group
    members = _members(group)
    if global_dst_rank not in members:
        raise ConfigError(
            f"global_dst_rank {global_dst_rank} is not a member of the loader's "
            f"data_parallel_group (global ranks {members}); pass one of them"
        )
    plain: dict[str, Any] | None = None
    failure: BaseException | None = None
    try:
        _check_layout(loader, group)
        plain = loader.save_state_rank().to_plain()
    except Exception as error:  # reported to every rank below, so that no rank waits
        failure = error
    _agree(group, failure, "save_state_global", default=WorkerError)
    gathered: list[Any] | None = None
    if dist.get_rank() == global_dst_rank:
        gathered = [None] * len(members)
    dist.gather_object(plain, gathered, dst=global_dst_rank, group=group)
    if gathered is None:
        return None
    return [RankState.from_plain(state) for state in gathered]


def restore_state_global(
    loader: SavableDataLoader,
    states: Sequence[RankState | dict[str, Any]] | None,
    src_rank: int | None = None,
    *,
    approximate: bool = False,
) -> None:
    """Restores every rank's state from the list :func:`save_state_global` returned.

    A collective over the loader's group when ``torch.distributed`` is initialized. A
    list saved with another number of ranks or workers is resharded onto this layout
    (NOTE [ Elastic resume ] in ``datasets/protocol/elastic.py``): with ``src_rank`` that rank
    computes every rank's new state and scatters them.

    Args:
        loader: This rank's loader.
        states: One state per rank of the save (``RankState`` or plain data), in rank
            order. With ``src_rank`` None every rank passes the full list; otherwise only
            ``src_rank`` needs it (the other ranks' argument is ignored; pass None).
        src_rank: Rank within the group that holds ``states`` and scatters them.
        approximate: As in ``SavableDataLoader.restore_state_rank``.

    Raises:
        StateMismatchError: A state does not fit this loader, or the layout changed and
            the pipeline is not elastic (raised on every rank).
        StateFormatError: The list, or a state in it, is malformed (on every rank).
        ConfigError: ``src_rank`` is not a rank of the group, or the loader's rank and
            world size disagree with the group's.
    """
    if not _initialized():
        _check_single(loader, "restore_state_global")
        if src_rank not in (None, 0):
            raise ConfigError(
                f"src_rank is {src_rank} but torch.distributed is not initialized, so the "
                "only rank is 0; pass src_rank=None or 0"
            )
        loader.restore_state_rank(_validated(states), approximate=approximate)
        return
    group = loader.worker_config.data_parallel_group
    size = dist.get_world_size(group)
    own: RankState | None = None
    failure: BaseException | None = None
    if src_rank is None:
        try:
            _check_layout(loader, group)
            own = own_state(_validated(states), loader.layout, approximate=approximate)
        except Exception as error:  # reported to every rank below
            failure = error
    else:
        if not 0 <= src_rank < size:
            raise ConfigError(
                f"src_rank {src_rank} is not a rank of the loader's group (0..{size - 1}); "
                "it is the rank within data_parallel_group that holds the states"
            )
        received = _scatter(loader, group, states, src_rank, approximate)
        try:
            own = RankState.from_plain(received)
            _check_layout(loader, group)
        except Exception as error:  # reported to every rank below
            failure, own = error, None
    if own is not None:
        try:
            loader.restore_state_rank(own)
        except Exception as error:  # reported to every rank below
            failure = error
    _agree(group, failure, "restore_state_global", default=StateError)


def _scatter(
    loader: SavableDataLoader,
    group: Any,
    states: Sequence[RankState | dict[str, Any]] | None,
    src_rank: int,
    approximate: bool,
) -> Any:
    """Sends each rank its plain state from ``src_rank``; raises on every rank if invalid."""
    size = dist.get_world_size(group)
    payload: list[Any] | None = None
    if dist.get_rank(group) == src_rank:
        try:
            saved = _validated(states)
            note: str | None = None
            if saved_on_layout(saved, loader.layout):
                mine = saved
            else:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", ApproximateResumeWarning)
                    mine = states_for_layout(saved, loader.layout, approximate=approximate)
                notes = [w for w in caught if issubclass(w.category, ApproximateResumeWarning)]
                note = str(notes[0].message) if notes else None  # one per rank, all alike
            payload = [("ok", (state.to_plain(), note)) for state in mine]
        except Exception as error:  # sent to every rank instead of the states
            payload = [("error", (type(error).__name__, str(error)))] * size
    received: list[Any] = [None]
    source = src_rank if group is None else dist.get_global_rank(group, src_rank)
    dist.scatter_object_list(received, payload, src=source, group=group)
    kind, body = received[0]
    if kind == "error":
        name, text = body
        raise _ERRORS.get(name, StateError)(
            f"restore_state_global: the states on rank {src_rank} cannot be restored: {text}"
        )
    state, note = body
    if note is not None:
        # Every rank says what its restore approximated, not only the one that computed it.
        warnings.warn(note, ApproximateResumeWarning, stacklevel=4)
    return state


def _validated(states: Any) -> list[RankState]:
    """Checks ``states`` is a list of states, each at its own rank's index."""
    if states is None or isinstance(states, (RankState, dict, str, bytes)):
        raise StateFormatError(
            "restore_state_global takes the list save_state_global() or load_state() "
            f"returned (one state per rank), got {type(states).__name__}; for one rank's "
            "state use restore_state_rank()"
        )
    if not isinstance(states, Sequence):
        raise StateFormatError(
            f"restore_state_global takes a list of states, got {type(states).__name__}"
        )
    return one_save(states)


def every_rank_state_dict(
    loader: SavableDataLoader, own: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """Every rank's entry of the loader's ``state_dict()``: ``{"rank_0": ..., ...}``.

    For a trainer that writes its checkpoint from one process (Lightning, Accelerate): a
    collective over the loader's ``data_parallel_group`` when ``torch.distributed`` is
    initialized and the loader has more than one rank (every rank calls it); this rank's
    own entry otherwise.

    Args:
        loader: The loader.
        own: Returns this rank's entry (``SavableDataLoader.state_dict`` of the loader).

    Raises:
        SavableLoaderError: Saving failed on some rank (every rank raises, naming it).
    """
    if loader.world_size == 1 or not _initialized():
        return own()
    mine: dict[str, Any] | str
    try:
        mine = own()
    except Exception as error:  # reported to every rank, so that no rank waits
        mine = f"rank {loader.rank}: {type(error).__name__}: {error}"
    group = loader.worker_config.data_parallel_group
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    failed = [entry for entry in gathered if isinstance(entry, str)]
    if failed:
        raise SavableLoaderError(f"saving the loader's state failed: {'; '.join(failed)}")
    merged: dict[str, Any] = {}
    for entry in gathered:
        merged.update(entry)
    return merged


def _agree(
    group: Any,
    failure: BaseException | None,
    what: str,
    *,
    default: type[SavableLoaderError],
) -> None:
    """Shares each rank's outcome; if any rank failed, raises the same error on every rank."""
    status: _Status = None
    if failure is not None:
        status = (type(failure).__name__, str(failure))
    statuses: list[_Status] = [None] * dist.get_world_size(group)
    dist.all_gather_object(statuses, status, group=group)
    failed: dict[tuple[str, str], list[int]] = {}
    for rank, reported in enumerate(statuses):
        if reported is not None:
            failed.setdefault(reported, []).append(rank)
    if not failed:
        return
    names = {name for name, _ in failed}
    error_type = _ERRORS.get(names.pop(), default) if len(names) == 1 else default
    ranks = sorted(rank for group_ranks in failed.values() for rank in group_ranks)
    details = "; ".join(
        f"rank(s) {group_ranks}: {name}: {text}" for (name, text), group_ranks in failed.items()
    )
    raise error_type(
        f"{what} failed on rank(s) {ranks} (this is rank {dist.get_rank(group)}): {details}"
    ) from failure


def _check_layout(loader: SavableDataLoader, group: Any) -> None:
    """Refuses a loader whose rank or world size is not its place in ``group``."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if (loader.rank, loader.world_size) != (rank, size):
        raise ConfigError(
            f"the loader has rank {loader.rank} of world_size {loader.world_size} but is "
            f"rank {rank} of {size} in its data_parallel_group; leave WorkerConfig's rank "
            "and world_size unset, or pass the group the loader shards over"
        )


def _check_single(loader: SavableDataLoader, what: str) -> None:
    if loader.world_size != 1:
        raise ConfigError(
            f"{what} needs torch.distributed for world_size {loader.world_size}; call "
            "torch.distributed.init_process_group() on every rank first"
        )


def _members(group: Any) -> list[int]:
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()
