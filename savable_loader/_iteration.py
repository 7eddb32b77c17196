"""The iterator ``iter(SavableDataLoader)`` returns: one epoch of the loader's stream."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["LoaderIterator"]


class LoaderIterator(Iterator[Any]):
    """An iterator over a loader's stream for the current epoch (NOTE [ Iterators
    continue the stream ] in ``loader.py``).

    Args:
        next_item: The loader's next item; raises StopIteration when the epoch ends.
    """

    def __init__(self, next_item: Callable[[], Any]) -> None:
        self._next_item = next_item
        self._done = False

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            return self._next_item()
        except StopIteration:
            self._done = True
            raise
