"""Checkpoint directories: every rank writes its own state file, one small file says which.

NOTE [ Per-rank checkpoint directories ]
``save_state_global`` gathers every rank's state on one rank, which grows with the job.
:func:`save_checkpoint` (a collective over the loader's group, as NOTE [ Global state ]
in ``distributed.py`` says of the other collectives) instead has each rank write its own
state, so no rank holds more than its own: rank 0 draws a save id and broadcasts it,
every rank writes ``<url>/<id>/rank-<r>.msgpack`` (a local file atomically; one object on
a store), the ranks agree that every write succeeded, and only then does rank 0 write
``<url>/metadata.msgpack`` (the id, the layout, the file of each rank), atomically, last.
The outcome of that write is agreed like the ranks' own: when it fails, every rank raises
:class:`~savable_loader.StorageError`, so no rank goes on as if the save were taken.
A job killed during a save leaves the metadata of the previous save in place, naming its
files, which are still there: the previous checkpoint stays valid. So rank 0 reads the
previous metadata before it writes the new one, and only once the new one is written
removes exactly the files the previous one lists, then their folder ``<url>/<old id>`` if
nothing else is left in it. Nothing else in the directory is touched: a folder or file of
the user's is never removed, whatever its name, and neither is the folder of a save killed
before its metadata was written (no metadata names it; it costs only space). Removal is
best effort: a file that cannot be removed is logged and left.

:func:`load_checkpoint` reads the metadata on every rank (a few hundred bytes). On the
layout the save was taken on, each rank reads its own file only. On another layout
(NOTE [ Elastic resume ] in ``datasets/protocol/elastic.py``) rank 0 reads every file and
computes each rank's new state once, then scatters them (``restore_state_global`` with
``src_rank=0``); every other rank reads nothing but the metadata. The metadata's file
names are checked before any state file is read: each must be the name the library
writes, ``<save id>/rank-<r>.msgpack`` with the metadata's save id and r its rank, in rank
order, so a damaged or forged metadata file cannot make a load read (or a save remove) a
file elsewhere, such as ``../outside/state.msgpack``. A directory without
metadata (no checkpoint yet) raises :class:`~savable_loader.StateFileNotFoundError`,
which ``except FileNotFoundError:`` catches. Files hold msgpack behind the checksummed
header of every state file, never pickle.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from typing import Any

import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import distributed, serialization
from .errors import ConfigError, StateError, StateFileNotFoundError, StateFormatError, StorageError
from .state.files import load_state, read_state_bytes, save_state
from .state.models import RankState
from .storage import urls as storage
from .storage.filesystems import url_to_fs

__all__ = ["load_checkpoint", "save_checkpoint"]

METADATA = "metadata.msgpack"
_KIND = "savable_loader checkpoint directory"
#: The largest metadata file read (a line per rank: far below this at 10**5 ranks).
_MAX_METADATA_BYTES = 64 << 20

logger = logging.getLogger(__name__)


class Metadata(BaseModel):
    """What ``metadata.msgpack`` holds (NOTE [ Per-rank checkpoint directories ])."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    kind: str
    save: str = Field(pattern=r"^[0-9a-f]{32}$")
    world_size: int = Field(ge=1)
    num_workers: int = Field(ge=0)
    files: list[str]


def save_checkpoint(loader: Any, url: str | os.PathLike[str], **storage_options: Any) -> None:
    """Writes every rank's state into the directory ``url``; a collective over the
    loader's group (NOTE [ Per-rank checkpoint directories ]).

    Args:
        loader: This rank's ``SavableDataLoader``.
        url: A local folder or any fsspec URL; created if missing.
        **storage_options: Passed to fsspec (credentials, endpoint).

    Raises:
        WorkerError: Saving failed on some rank (raised on every rank, naming them).
        StorageError: Writing failed on some rank, or rank 0's write of the metadata
            failed (raised on every rank; the previous checkpoint is then still valid).
    """
    root = _root(url)
    group = loader.worker_config.data_parallel_group if _initialized() else None
    save = _shared(uuid.uuid4().hex, group)
    failure: BaseException | None = None
    try:
        url = f"{root}/{_file_name(save, loader.rank)}"
        save_state(loader.save_state_rank(), url, **storage_options)
    except Exception as error:  # reported to every rank below, so that no rank waits
        failure = error
    _agree(group, failure, "save_checkpoint", StorageError)
    previous: Metadata | None = None
    if loader.rank == 0:
        previous = _previous(f"{root}/{METADATA}", storage_options)
        try:
            metadata = Metadata(
                kind=_KIND,
                save=save,
                world_size=loader.world_size,
                num_workers=loader.layout.num_workers,
                files=[_file_name(save, rank) for rank in range(loader.world_size)],
            )
            data = serialization.dumps(metadata.model_dump())
            storage.write_bytes(f"{root}/{METADATA}", data, **storage_options)
        except Exception as error:  # reported to every rank below, so that all raise
            failure = error
    _agree(group, failure, "save_checkpoint", StorageError)
    if previous is not None and previous.save != save:
        _remove_save(root, previous, storage_options)


def load_checkpoint(
    loader: Any,
    url: str | os.PathLike[str],
    *,
    approximate: bool = False,
    **storage_options: Any,
) -> None:
    """Restores every rank from the directory :func:`save_checkpoint` wrote; a collective
    over the loader's group (NOTE [ Per-rank checkpoint directories ]).

    Args:
        loader: This rank's ``SavableDataLoader``.
        url: The directory.
        approximate: As in ``SavableDataLoader.restore_state_rank``.
        **storage_options: Passed to fsspec.

    Raises:
        StateFileNotFoundError: The directory holds no checkpoint (also a
            ``FileNotFoundError``); raised on every rank.
        StateError: The checkpoint is malformed or does not fit this loader; also
            (:class:`~savable_loader.StateFormatError`) when the metadata names a file
            other than ``<save id>/rank-<r>.msgpack`` for rank r, before any is read.
        StorageError: Reading failed.
    """
    root = _root(url)
    group = loader.worker_config.data_parallel_group if _initialized() else None
    metadata: Metadata | None = None
    failure: BaseException | None = None
    try:
        metadata = _metadata(f"{root}/{METADATA}", storage_options)
    except Exception as error:
        failure = error
    _agree(group, failure, "load_checkpoint", StateError)
    if metadata is None:  # _agree raised on every rank if the read failed on any
        raise StateError(f"internal error: no checkpoint metadata read from {root}; please report")
    same = metadata.world_size == loader.world_size and (
        metadata.num_workers == loader.layout.num_workers
    )
    if same:
        try:
            name = f"{root}/{metadata.files[loader.rank]}"
            own = load_state(name, **storage_options)
            if not isinstance(own, RankState) or own.rank != loader.rank:
                raise StateFormatError(
                    f"{name} does not hold rank {loader.rank}'s state; the checkpoint "
                    "directory is damaged"
                )
            loader.restore_state_rank(own, approximate=approximate)
        except Exception as error:  # reported to every rank below
            failure = error
        _agree(group, failure, "load_checkpoint", StateError)
        return
    states: list[Any] | None = None
    if loader.rank == 0:
        try:
            states = [load_state(f"{root}/{name}", **storage_options) for name in metadata.files]
        except Exception as error:
            failure = error
    _agree(group, failure, "load_checkpoint", StateError)
    source = 0 if _initialized() else None
    distributed.restore_state_global(loader, states, source, approximate=approximate)


def _metadata(url: str, storage_options: dict[str, Any]) -> Metadata:
    payload = serialization.loads(
        read_state_bytes(url, max_bytes=_MAX_METADATA_BYTES, **storage_options)
    )
    try:
        metadata = Metadata.model_validate(payload)
    except ValidationError as error:
        raise StateFormatError(f"{url} is not a checkpoint directory's metadata: {error}") from None
    if metadata.kind != _KIND or len(metadata.files) != metadata.world_size:
        raise StateFormatError(f"{url} is not a checkpoint directory's metadata")
    for rank, name in enumerate(metadata.files):
        expected = _file_name(metadata.save, rank)
        if name != expected:
            raise StateFormatError(
                f"{url} names the file {name!r} for rank {rank}, where save_checkpoint "
                f"writes {expected!r} (the save id, then rank-<r>.msgpack): the metadata "
                "is damaged or was not written by save_checkpoint; no state file was read"
            )
    return metadata


def _file_name(save: str, rank: int) -> str:
    """The name of ``rank``'s file of the save ``save``, relative to the directory."""
    return f"{save}/rank-{rank}.msgpack"


def _previous(url: str, storage_options: dict[str, Any]) -> Metadata | None:
    """The metadata of the save being replaced, or None: no checkpoint there yet, or one
    that cannot be read (then nothing is removed)."""
    try:
        return _metadata(url, storage_options)
    except StateFileNotFoundError:
        return None
    except Exception as error:
        logger.warning(
            "save_checkpoint: cannot read the previous metadata %s (%s); the files of "
            "earlier saves are left in place",
            url,
            error,
        )
        return None


def _root(url: str | os.PathLike[str]) -> str:
    text = os.fspath(url)
    if not isinstance(text, str) or not text:
        raise ConfigError(f"a checkpoint directory is a path or URL, got {url!r}")
    return text.rstrip("/")


def _shared(value: str, group: Any) -> str:
    """``value`` of rank 0 of ``group``, on every rank."""
    if not _initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=distributed._members(group)[0], group=group)
    return str(box[0])


def _agree(group: Any, failure: BaseException | None, what: str, default: Any) -> None:
    if _initialized():
        distributed._agree(group, failure, what, default=default)
    elif failure is not None:
        raise failure


def _remove_save(root: str, previous: Metadata, storage_options: dict[str, Any]) -> None:
    """Removes the files ``previous`` lists, then their folder if nothing else is in it
    (best effort: a leftover costs only space)."""
    try:
        fs, path = url_to_fs(root, **storage_options)
        folder = f"{path}/{previous.save}"
        if isinstance(fs, LocalFileSystem) and os.path.islink(folder):
            # Not the folder the library wrote: what it points to is never touched.
            logger.warning("save_checkpoint: %s is a symbolic link; left as it is", folder)
            return
        for name in previous.files:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(f"{path}/{name}")
    except Exception as error:
        logger.warning(
            "save_checkpoint: cannot remove the files of the previous save %s in %s (%s)",
            previous.save,
            root,
            error,
        )
        return
    # A local folder and a memory:// one are removed only when empty; an object store has
    # no folder left once its objects are gone (s3fs's rmdir removes only buckets).
    with contextlib.suppress(OSError):
        fs.rmdir(f"{path}/{previous.save}")


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()
