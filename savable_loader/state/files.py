"""``save_state`` / ``load_state``: loader states in files at any fsspec URL.

A file holds one payload, ``{"kind": "rank", "state": ...}`` for what
``save_state_rank()`` returns or ``{"kind": "global", "states": [...]}`` for a list of
them (one per rank), encoded by :mod:`savable_loader.serialization` (msgpack behind a
checked header; never pickle) and written by :mod:`savable_loader.storage` (atomic for
local paths).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .. import serialization, storage
from ..errors import StateFormatError
from .models import RankState

__all__ = ["decode_state", "encode_state", "load_state", "save_state"]

_KINDS = ("rank", "global")


def save_state(
    state: RankState | Sequence[RankState], url: str | os.PathLike[str], **storage_options: Any
) -> None:
    """Writes a loader state (one rank's, or a list with one per rank) to ``url``.

    Args:
        state: What ``save_state_rank()`` or ``save_state_global()`` returned.
        url: A local path (written atomically) or any fsspec URL (``memory://``, ``s3://``).
        **storage_options: Passed to fsspec (credentials, endpoint).

    Raises:
        StateFormatError: ``state`` is not a loader state.
        StorageError: Writing failed.
    """
    storage.write_bytes(url, encode_state(state), **storage_options)


def encode_state(state: RankState | Sequence[RankState]) -> bytes:
    """Returns the bytes of a state file holding ``state`` (what :func:`save_state` writes)."""
    if isinstance(state, RankState):
        payload: dict[str, Any] = {"kind": "rank", "state": state.to_plain()}
    elif isinstance(state, Sequence) and all(isinstance(s, RankState) for s in state):
        payload = {"kind": "global", "states": [s.to_plain() for s in state]}
    else:
        raise StateFormatError(
            f"save_state takes what save_state_rank() or save_state_global() returns, "
            f"got {type(state).__name__}"
        )
    return serialization.dumps(payload)


def decode_state(data: bytes) -> RankState | list[RankState]:
    """Returns the state held by the bytes :func:`encode_state` returned.

    Raises:
        StateFormatError: ``data`` is not a valid loader state.
    """
    return state_from_payload(serialization.loads(data))


def load_state(url: str | os.PathLike[str], **storage_options: Any) -> RankState | list[RankState]:
    """Reads a loader state written by :func:`save_state`.

    Raises:
        StateFormatError: The file is not a valid loader state (corrupt, truncated,
            foreign, pickle, or of an unknown format version). Nothing is executed.
        StorageError: Reading failed.
    """
    return decode_state(storage.read_bytes(url, **storage_options))


def state_from_payload(payload: Any) -> RankState | list[RankState]:
    """Validates a decoded file payload into the state it holds."""
    if not isinstance(payload, dict) or payload.get("kind") not in _KINDS:
        raise StateFormatError(
            "the file is a savable_loader file but holds no loader state "
            f"(expected a dict with kind in {_KINDS})"
        )
    if payload["kind"] == "rank":
        return RankState.from_plain(payload.get("state"))
    states = payload.get("states")
    if not isinstance(states, list):
        raise StateFormatError("a global loader state holds a list of rank states")
    return [RankState.from_plain(s) for s in states]
