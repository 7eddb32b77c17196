"""Plain data: what a state may hold, checked in one place.

A state file, and every pipeline state inside it, holds only plain data: dicts with str
keys, lists, str, int (within msgpack's range), float, bool, None and bytes, nested at
most :data:`MAX_DEPTH` levels. :func:`find_non_plain` says where a value breaks that rule
and how to convert it; :func:`plain_copy` turns a pipeline's state into an independent
plain copy, the form in which a worker keeps and sends its checkpoints.

NOTE [ Tuples in a pipeline state ]
msgpack has one array type, so a tuple comes back from a state file as a list. A state
file refuses tuples outright (:func:`find_non_plain`): what it writes must read back equal
and of the same types. A pipeline's ``save_state()`` may still return tuples, as it always
could: :func:`plain_copy` turns them into lists when the state is taken, so the pipeline
sees lists on restore whether or not the state went through a file.
"""

from __future__ import annotations

from typing import Any

from .errors import StateError

__all__ = ["MAX_DEPTH", "find_non_plain", "plain_copy"]

#: Deepest nesting accepted: below msgpack's own limit (511) and Python's recursion limit.
MAX_DEPTH = 500
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
_SCALARS = frozenset({str, int, float, bool, type(None), bytes})


class _NotPlain(Exception):
    """Internal: carries the reason and the path (innermost first) up the recursion."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.path: list[str | int] = []

    def where(self) -> str:
        """``"<path>: <reason>"``, the path written as Python would index it."""
        path = ""
        for part in reversed(self.path):
            if isinstance(part, int):
                path += f"[{part}]"
            elif part.isidentifier():
                path += f".{part}" if path else part
            else:
                path += f"[{part!r}]"
        if len(path) > 120:  # a container that holds itself
            path = path[:120] + "..."
        return f"{path or 'the top level'}: {self.reason}"


def find_non_plain(value: object) -> str | None:
    """Returns ``"<path>: <reason>"`` for the first non-plain value in ``value``, or None."""
    try:
        _walk(value, 0, tuples=False)
    except _NotPlain as exc:
        return exc.where()
    return None


def plain_copy(value: Any, *, what: str = "the pipeline's state") -> Any:
    """Returns an independent copy of ``value`` as plain data, tuples turned into lists
    (NOTE [ Tuples in a pipeline state ]).

    Raises:
        StateError: ``value`` holds something else; the message names its path and how
            to convert it.
    """
    try:
        return _walk(value, 0, tuples=True)
    except _NotPlain as exc:
        raise StateError(
            f"{what} is not plain data: {exc.where()}; a state holds dict (str keys), "
            "list, str, int, float, bool, None or bytes"
        ) from None


def _walk(value: Any, depth: int, *, tuples: bool) -> Any:
    """Checks ``value``; returns its plain copy (containers copied, tuples as lists)."""
    kind = type(value)
    if kind is int:
        if not _INT_MIN <= value <= _INT_MAX:
            raise _NotPlain(
                f"int {value} is outside msgpack's range -2**63..2**64-1; store it as a str"
            )
        return value
    if kind in _SCALARS:
        return value
    if depth >= MAX_DEPTH:
        raise _NotPlain(
            f"nested more than {MAX_DEPTH} levels deep (a container that holds itself?)"
        )
    if kind is list or (tuples and kind is tuple):
        items = []
        for index, item in enumerate(value):
            try:
                items.append(_walk(item, depth + 1, tuples=tuples))
            except _NotPlain as exc:
                exc.path.append(index)
                raise
        return items
    if kind is dict:
        copy = {}
        for key, item in value.items():
            if type(key) is not str:
                raise _NotPlain(
                    f"dict key {key!r} is {type(key).__name__}, not str; keys must be str"
                )
            try:
                copy[key] = _walk(item, depth + 1, tuples=tuples)
            except _NotPlain as exc:
                exc.path.append(key)
                raise
        return copy
    raise _NotPlain(_refusal(value))


def _refusal(value: object) -> str:
    kind = type(value)
    name = kind.__name__
    module = kind.__module__.partition(".")[0]
    allowed = "plain data is dict with str keys, list, str, int, float, bool, None, bytes"
    if isinstance(value, tuple):
        return f"{name} is not plain data; use a list (msgpack would silently give back a list)"
    if isinstance(value, (set, frozenset)):
        return f"{name} is not plain data; use a sorted list"
    if isinstance(value, (bytearray, memoryview)):
        return f"{name} is not plain data; convert it with bytes(...)"
    if module == "numpy":
        return (
            f"numpy.{name} is not plain data; convert it with int(x), float(x), "
            "x.tolist() or x.tobytes()"
        )
    if module == "torch":
        return (
            f"torch.{name} is not plain data; convert it with x.item(), x.tolist() "
            "or x.numpy().tobytes()"
        )
    base = next((b for b in kind.__mro__ if b in _SCALARS or b in (list, dict)), None)
    if base is not None:
        plain = base.__name__
        return f"{name} (a subclass of {plain}) is not plain data; convert it with {plain}(x)"
    return f"{name} is not plain data ({allowed})"
