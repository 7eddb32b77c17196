"""Adapts any object with ``state_dict()``/``load_state_dict()`` (torch's ``Stateful``)."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeVar

from ..errors import ConfigError
from .base import SavableDataset

__all__ = ["StatefulDataset", "from_stateful"]

T_co = TypeVar("T_co", covariant=True)


class _Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state_dict: Any, /) -> None: ...


class StatefulDataset(SavableDataset[T_co]):
    """A savable view of an iterable that follows torch's ``Stateful`` protocol.

    Args:
        obj: An iterable with ``state_dict()`` and ``load_state_dict()`` (a Hugging Face
            ``IterableDataset``, a torchdata node, your own class).

    State:
        ``obj.state_dict()`` as it is, which must be plain data. The state at
        construction serves as the initial state, so ``restore_state(None)`` returns to
        it. The object shards itself over workers (as with torch's ``DataLoader``).
    """

    def __init__(self, obj: Any) -> None:
        self.obj: Any = obj
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
            and isinstance(obj, Iterable)
        ):
            raise ConfigError(
                f"{type(obj).__name__} is not an iterable with state_dict() and load_state_dict()"
            )
        self._initial = copy.deepcopy(self.obj.state_dict())

    def config(self) -> dict[str, Any]:
        return {"type": "StatefulDataset", "of": f"{type(self.obj).__qualname__}"}

    def save_state(self) -> Any:
        return self.obj.state_dict()

    def restore_state(self, state: Any | None) -> None:
        self.obj.load_state_dict(copy.deepcopy(self._initial if state is None else state))

    def __iter__(self) -> Iterator[T_co]:
        return iter(self.obj)


def from_stateful(obj: Any) -> StatefulDataset[Any]:
    """Wraps ``obj`` (``state_dict()`` + ``load_state_dict()`` + iterable) as a savable dataset."""
    return StatefulDataset(obj)
