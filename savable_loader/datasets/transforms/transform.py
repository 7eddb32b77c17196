"""The base of the stages that read one parent stage."""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from ...config import WorkerContext
from ..adapt import as_stage
from ..protocol.cursor import AnyState, Cursor
from ..protocol.stage import Stage

__all__ = ["Transform"]

T = TypeVar("T")


class Transform(Stage[T]):
    """A stage reading one parent stage.

    Args:
        source: The parent: a stage, any :class:`~savable_loader.SavableDataset`, a
            Stateful iterable or a map-style dataset (see ``as_stage``).
    """

    #: Yields at most as many items as its parent in an epoch (a map, a filter): its
    #: parent's :meth:`items_left` bounds its own.
    bounded_by_parent: ClassVar[bool] = False

    def __init__(self, source: Any) -> None:
        self.source: Stage[Any] = as_stage(source)

    def cursor(self, context: WorkerContext) -> Cursor[T]:
        """Returns :meth:`cursor_over` the source's new cursor."""
        return self.cursor_over(self.source.cursor(context), context)

    def cursor_over(self, parent: Cursor[Any], context: WorkerContext) -> Cursor[T]:
        """Returns this stage's cursor reading ``parent``: over the source's cursor for
        :meth:`cursor`, over :class:`~savable_loader.datasets.protocol.cursor.AnyState` to check a
        saved state (NOTE [ States checked at the door ] in ``datasets/protocol/stage.py``). A
        transform implements it, or overrides :meth:`cursor` instead (its part of a state is then
        left to its cursor in the worker)."""
        raise NotImplementedError(
            f"{type(self).__name__} implements neither cursor() nor cursor_over()"
        )

    def checking_cursor(self, context: WorkerContext) -> Cursor[T] | None:
        """This stage's cursor over a parent that takes any state, when it is built by
        :meth:`cursor_over` (NOTE [ States checked at the door ] in
        ``datasets/protocol/stage.py``)."""
        own = type(self)
        if own.cursor is not Transform.cursor or own.cursor_over is Transform.cursor_over:
            return None
        return self.cursor_over(AnyState(context), context)

    def items_left(self, state: Any, context: WorkerContext) -> int | None:
        if not self.bounded_by_parent or not isinstance(state, dict) or "parent" not in state:
            return None
        return self.source.items_left(state["parent"], context)

    @property
    def children(self) -> tuple[Stage[Any], ...]:
        return (self.source,)

    def describe(self) -> str:
        return f"{self.source.describe()}.{self.describe_own()}"

    def describe_own(self) -> str:
        """Describes this stage alone, as the fluent call that adds it."""
        return f"{type(self).__name__.lower()}()"
