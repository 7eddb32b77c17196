"""Skipping that reports how far it went, for stages that count their parent's items.

NOTE [ Counted skips ]
``Cursor.skip(n)`` stops at the end of the epoch without saying where that was. A
stage that counts its parent's items (``Limit``'s ``count``, ``Repeat``'s crossing to
the next source epoch) must know how many items a skip really passed, or its state
would differ from the state reading gives. :func:`skip_counted` asks a cursor that
can tell: an :class:`IndexedCursor` by its position, and any cursor with the methods
``counts_skips()`` and ``skip_counted(n)`` (Limit and Repeat have them). Other cursors
answer None. A base ``Cursor.skip`` that returned the count would make this module
unnecessary.
"""

from __future__ import annotations

from typing import Any

from .indexed import IndexedCursor
from .stage import Cursor

__all__ = ["counts_skips", "skip_counted"]


def counts_skips(cursor: Cursor[Any]) -> bool:
    """Whether :func:`skip_counted` on ``cursor`` returns an exact count."""
    if isinstance(cursor, IndexedCursor):
        return True
    counts = getattr(cursor, "counts_skips", None)
    return callable(counts) and bool(counts())


def skip_counted(cursor: Cursor[Any], n: int) -> int | None:
    """Skips as ``cursor.skip(n)`` does; returns the items passed, or None if unknown.

    The count is exact whenever :func:`counts_skips` says so; ``cursor.can_skip()`` must
    be true (the caller checks it).
    """
    if isinstance(cursor, IndexedCursor):
        before = cursor.pos
        cursor.skip(n)
        return cursor.pos - before
    counted = getattr(cursor, "skip_counted", None)
    if callable(counted) and counts_skips(cursor):
        result: int = counted(n)
        return result
    cursor.skip(n)
    return None
