"""The savable dataset protocol.

NOTE [ The savable dataset protocol ]
A :class:`SavableDataset` is an ``IterableDataset`` that knows where it stands:
``save_state()`` reports its position as small plain data, ``restore_state(state)``
takes one back (None: the initial state), and ``__iter__`` continues from the current
state. When an iteration ends (an epoch), the dataset moves its own state to the start
of the next epoch, so the next ``iter()`` begins that epoch. ``config()`` says what
identifies the pipeline (it feeds the fingerprint a restore checks). Two optional hooks:
``setup(context)`` tells the dataset its rank and worker before it is restored, and
``skip(n)`` passes ``n`` items faster than iterating and returns how many it passed
(fewer when the epoch ended: the dataset then stands at its next epoch, NOTE [ A
dataset's skip ] in ``datasets/adapt.py``); ``skip`` must leave the dataset exactly as iterating
would have, including any draws its items make from the global generators, or not be
defined at all.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any, TypeVar

from torch.utils.data import IterableDataset

from ...config import WorkerContext
from ...state.names import qualified_name

__all__ = ["SavableDataset"]

T_co = TypeVar("T_co", covariant=True)


class SavableDataset(IterableDataset[T_co], abc.ABC):
    """An iterable dataset whose position can be saved and restored.

    State:
        Whatever the subclass returns from :meth:`save_state`: plain data (dict, list,
        str, int, float, bool, None, bytes), small, never samples.
    """

    @abc.abstractmethod
    def __iter__(self) -> Iterator[T_co]:
        """Yields items from the current state on; at the end, moves to the next epoch."""

    @abc.abstractmethod
    def save_state(self) -> Any:
        """Returns the current position as small plain data."""

    @abc.abstractmethod
    def restore_state(self, state: Any | None) -> None:
        """Returns to ``state`` (as :meth:`save_state` gave it), or to the start if None."""

    def config(self) -> dict[str, Any]:
        """Returns plain data identifying this pipeline; the default names the class."""
        return {"type": qualified_name(type(self))}

    def setup(self, context: WorkerContext) -> None:
        """Called once per worker with its rank and worker id, before any restore."""
