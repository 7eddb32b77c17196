"""Older state formats brought to the current one (NOTE [ State format versions ] in
``models.py``); works on plain data, before the models validate it."""

from __future__ import annotations

from typing import Any

import msgpack

from ..errors import StateFormatError
from ..plain import find_non_plain

__all__ = ["migrate"]


def migrate(data: dict[str, Any]) -> dict[str, Any]:
    """Returns ``data`` in the current format; a current or unknown version is returned
    as it is, for the models to accept or refuse.

    Raises:
        StateFormatError: A format-1 state is malformed where the migration reads it.
    """
    if data.get("format_version") != 1 or type(data.get("format_version")) is not int:
        return data
    workers = data.get("workers")
    if not isinstance(workers, (list, tuple)):
        return data  # the models refuse it, naming the field
    return {**data, "format_version": 2, "workers": [_worker(w, i) for i, w in enumerate(workers)]}


def _worker(worker: Any, index: int) -> Any:
    if not isinstance(worker, dict) or not isinstance(worker.get("checkpoint"), dict):
        return worker
    checkpoint = worker["checkpoint"]
    where = f"invalid loader state (format 1): workers[{index}].checkpoint"
    if set(checkpoint) != {"seq", "exhausted", "dataset_state", "rng"}:
        raise StateFormatError(
            f"{where} has the fields {sorted(checkpoint)}, expected ['dataset_state', "
            "'exhausted', 'rng', 'seq']"
        )
    encoded, exhausted = checkpoint["dataset_state"], checkpoint["exhausted"]
    if type(encoded) is not bytes or type(exhausted) is not bool:
        raise StateFormatError(
            f"{where}: dataset_state must be bytes and exhausted a bool, got "
            f"{type(encoded).__name__} and {type(exhausted).__name__}"
        )
    state = _decode(encoded, where)
    return {
        **worker,
        "checkpoint": {
            "seq": checkpoint["seq"],
            "state": {"parent": state, "exhausted": exhausted},
            "rng": checkpoint["rng"],
        },
    }


def _decode(encoded: bytes, where: str) -> Any:
    """The dataset state a format-1 checkpoint held as msgpack bytes, checked as plain."""
    n = len(encoded)
    try:
        state = msgpack.unpackb(
            encoded,
            raw=False,
            strict_map_key=False,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n,
            max_ext_len=n,
        )
    except (ValueError, msgpack.UnpackException) as error:
        raise StateFormatError(
            f"{where}.dataset_state is not valid msgpack ({str(error) or type(error).__name__})"
        ) from None
    except TypeError as error:  # a map key msgpack cannot make a dict key: an array, a map
        raise StateFormatError(
            f"{where}.dataset_state is not plain data: a map key is not a str ({error})"
        ) from None
    problem = find_non_plain(state)
    if problem is not None:
        raise StateFormatError(f"{where}.dataset_state is not plain data: {problem}")
    return state
