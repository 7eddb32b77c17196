"""``Filter``: keeps the items a predicate accepts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ...config import WorkerContext
from ...errors import ConfigError
from ...state.names import qualified_name
from ..protocol.cursor import Cursor, TransformCursor
from ..protocol.elastic import ReshardPlan
from ..protocol.stage import fluent
from .transform import Transform

__all__ = ["Filter"]

T = TypeVar("T")


@fluent("filter")
class Filter(Transform[T]):
    """Keeps the items of ``source`` for which ``predicate(item)`` is true.

    Args:
        source: The stage (or dataset) to filter.
        predicate: Returns whether to keep an item; it may draw from the global
            generators (the loader's checkpoints capture them).

    Raises:
        ConfigError: ``predicate`` is not callable.

    State:
        The parent's state: Filter adds nothing. Restore replays nothing. Elastic
        when its source is (NOTE [ Elastic resume ]).
    """

    keyed = True

    bounded_by_parent = True

    def __init__(self, source: Any, predicate: Callable[[T], bool]) -> None:
        super().__init__(source)
        if not callable(predicate):
            raise ConfigError(f"Filter needs a callable, got {type(predicate).__name__}")
        self.predicate = predicate

    def config(self) -> dict[str, Any]:
        return {
            "type": "Filter",
            "predicate": qualified_name(self.predicate),
            "source": self.source.config(),
        }

    def describe_own(self) -> str:
        return f"filter({getattr(self.predicate, '__name__', type(self.predicate).__name__)})"

    def cursor_over(self, parent: Cursor[Any], context: WorkerContext) -> Cursor[T]:
        return _FilterCursor(self.predicate, parent, context)

    def reshard(self, plan: ReshardPlan) -> dict[str, Any]:
        """Elastic when the source is: a filter adds no state (NOTE [ Elastic resume ])."""
        return {"parent": self.source.reshard(plan.parents())}


class _FilterCursor(TransformCursor[T]):
    passes_keys = True

    def __init__(
        self, predicate: Callable[[T], bool], parent: Cursor[T], context: WorkerContext
    ) -> None:
        super().__init__(parent, context)
        self.predicate = predicate

    def __next__(self) -> T:
        while True:
            item: T = next(self.parent)
            if self.predicate(item):
                return item

    def end_epoch(self) -> None:
        self.parent.end_epoch()
