"""How a resumed item differs from the expected one: :class:`ResumeMismatch`, the
structural differences between two items (dict keys, sequence indices, tensor dtype,
shape and values) and short one-line reprs of items for messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .digests import digest

_SHORT = 160


class ResumeMismatch(AssertionError):
    """A restored loader did not continue the uninterrupted stream exactly.

    Messages count items from 1, as the save point labels do ("after item 7" is followed
    by item 8); :attr:`position` is 0-based. Attributes other than the message are None
    (or empty) when they do not apply, e.g. for a pipeline that is not deterministic.

    Attributes:
        point: Label of the save point whose restore diverged.
        epoch: Epoch (of the uninterrupted run) of the first differing item.
        position: Its 0-based index within that epoch.
        after_restore: Items the resumed loader yielded before it (0: its first).
        worker: Worker that produced the resumed loader's item; None without workers,
            or when the resumed loader ended early.
        expected_worker: Worker that produced the item in the uninterrupted run.
        fields: Paths of the fields that differ (``"index"``, ``"image.pixels"``,
            ``"[1]"``; ``"<item>"`` for the item itself).
        differences: One line per differing field saying how it differs.
        expected: The uninterrupted run's item (None if the resumed loader yielded an
            item too many, or the item could not be fetched again).
        got: The resumed loader's item (None if it ended early).
    """

    def __init__(
        self,
        message: str,
        *,
        point: str | None = None,
        epoch: int | None = None,
        position: int | None = None,
        after_restore: int | None = None,
        worker: int | None = None,
        expected_worker: int | None = None,
        fields: Sequence[str] = (),
        differences: Sequence[str] = (),
        expected: Any = None,
        got: Any = None,
    ) -> None:
        super().__init__(message)
        self.point = point
        self.epoch = epoch
        self.position = position
        self.after_restore = after_restore
        self.worker = worker
        self.expected_worker = expected_worker
        self.fields = list(fields)
        self.differences = list(differences)
        self.expected = expected
        self.got = got


def _differences(want: Any, got: Any, path: str) -> list[tuple[str, str]]:
    """Paths of the fields that differ between two items, with how they differ."""
    name = path or "<item>"
    if isinstance(want, dict) and isinstance(got, dict):
        found: list[tuple[str, str]] = []
        keys = list(want) + [key for key in got if key not in want]
        for key in keys:
            sub = _key_path(path, key)
            if key not in got:
                found.append((sub, "missing from the resumed item"))
            elif key not in want:
                found.append((sub, "not in the expected item"))
            else:
                found += _differences(want[key], got[key], sub)
        return found
    if isinstance(want, (list, tuple)) and type(want) is type(got):
        if len(want) != len(got):
            return [(name, f"length {len(got)}, expected {len(want)}")]
        found = []
        for index, (a, b) in enumerate(zip(want, got, strict=True)):
            found += _differences(a, b, f"{path}[{index}]")
        return found
    if type(want) is not type(got):
        return [(name, f"a {type(got).__name__}, expected a {type(want).__name__}")]
    if digest(want) == digest(got):
        return []
    if isinstance(want, (torch.Tensor, np.ndarray)):
        return [(name, _array_difference(want, got))]
    return [(name, f"{_short(got)}, expected {_short(want)}")]


def _key_path(path: str, key: Any) -> str:
    if isinstance(key, str) and key.isidentifier():
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def _array_difference(want: Any, got: Any) -> str:
    if want.dtype != got.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if tuple(want.shape) != tuple(got.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    a, b = _as_numpy(want), _as_numpy(got)
    differ = a != b
    if a.dtype.kind in "fc":
        differ &= ~(np.isnan(a) & np.isnan(b))
    count = int(np.count_nonzero(differ))
    if count == 0:
        return "values equal but their bytes differ (e.g. -0.0 and 0.0, or NaN payloads)"
    first = tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(differ)[0]), a.shape))
    return (
        f"{count} of {a.size} values differ; first at {list(first)}: "
        f"{_scalar(b[first])}, expected {_scalar(a[first])}"
    )


def _as_numpy(value: Any) -> np.ndarray[Any, Any]:
    if isinstance(value, np.ndarray):
        return value
    tensor = value.detach().cpu()
    try:
        array: np.ndarray[Any, Any] = tensor.numpy()
    except TypeError:  # bfloat16 and other dtypes numpy lacks
        array = tensor.to(torch.float64).numpy()
    return array


def _scalar(value: Any) -> str:
    if isinstance(value, (float, np.floating)):
        return f"{float(value):.6g}"
    return repr(value.item() if isinstance(value, np.generic) else value)


def _short(value: Any, width: int = _SHORT) -> str:
    """A one-line repr of an item, cut to about ``width`` characters."""
    text = _compact(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _compact(value: Any) -> str:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        kind = "tensor" if isinstance(value, torch.Tensor) else "array"
        flat = _as_numpy(value).reshape(-1)
        shown = ", ".join(_scalar(x) for x in flat[:6]) + (", ..." if flat.size > 6 else "")
        if value.ndim == 1 and flat.size <= 6:
            return f"{kind}([{shown}])"
        return f"{kind}({value.dtype}, shape {tuple(value.shape)}, [{shown}])"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_compact(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_compact(v) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + ", ".join(_compact(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, float):
        return f"{value:.6g}"
    return repr(value)
