"""The one entry point from what a user passes to a pipeline of stages.

:func:`as_stage` is how everything becomes a stage: the loader calls it on its
``dataset`` argument and every transform on its source. A stage is kept as it is; a
:class:`~savable_loader.SavableDataset` is read through :class:`DatasetStage`; an
iterable that saves its own position (torch's Stateful protocol: Hugging Face datasets,
torchdata nodes) through ``from_stateful``; a map-style dataset through
``IndexedDataset``.

NOTE [ A dataset is its own position ]
A ``SavableDataset`` holds its position itself, so the cursor reading it reads the object
it was given, as torch's ``DataLoader`` iterates the dataset it is given: in a worker,
that worker's copy; without workers, your object. One object therefore serves one
reading at a time; where the library needs another reading of the same pipeline (an
approximate elastic restore computing where an epoch starts), it copies the pipeline
first.

NOTE [ Datasets without a position ]
A plain ``IterableDataset`` (no ``save_state``/``restore_state``, no ``state_dict``/
``load_state_dict``, nor an iterator with them: NOTE [ A position kept by the iterator ]
in ``datasets/adapters/stateful.py``) is read as torch's ``DataLoader`` reads it: ``iter(dataset)``
every epoch, in each worker over that worker's copy (so sharding with ``get_worker_info()``
works), batched in the worker. Its cursor's own state is None, so the workers'
checkpoints keep working, but no position can be restored from it: the loader refuses
to save (``Stage.not_savable``, raised by the loader as ``UnsavableDatasetError`` naming
the dataset and what to add), and after an error it goes on as torch's does
(NOTE [ Going on after an error ] in ``_worker/runtime.py``). Switching a ``DataLoader`` to
``SavableDataLoader`` therefore works before the dataset is made savable.

NOTE [ A dataset's skip ]
A ``SavableDataset`` may define ``skip(n)`` to pass ``n`` items faster than reading them
(exactly as reading would, draws from the global generators included). The cursor
contract needs to know how many it passed (NOTE [ The cursor contract ] in
``datasets/protocol/cursor.py``), so ``skip`` returns that number: ``n``, or fewer when the epoch
ended, in which case the dataset stands at the start of its next epoch, as after an iteration
ends. A ``skip`` that returns None cannot say where an epoch ended; the cursor asks
``skip(0)`` once to learn which kind it has, and reads instead of calling a ``skip`` that
returns None, which is always exact.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from typing import Any, TypeVar

from torch.utils.data import IterableDataset

from ..config import WorkerContext
from ..errors import ConfigError, SavableLoaderError, UnsavableDatasetError
from ..state.names import qualified_name
from .adapters.datapipes import is_datapipe, shard
from .adapters.stateful import StatefulDataset, is_stateful, iterator_is_stateful
from .index.indexed import IndexedDataset
from .protocol.base import SavableDataset
from .protocol.cursor import Cursor
from .protocol.stage import Stage

__all__ = ["DatasetStage", "UnsavableStage", "as_stage", "is_savable"]

T = TypeVar("T")


def is_savable(obj: Any) -> bool:
    """Whether ``obj`` follows the :class:`~savable_loader.SavableDataset` protocol."""
    return isinstance(obj, SavableDataset) or (
        isinstance(obj, IterableDataset)
        and callable(getattr(obj, "save_state", None))
        and callable(getattr(obj, "restore_state", None))
    )


def _is_map_style(obj: Any) -> bool:
    return (
        not isinstance(obj, IterableDataset)
        and hasattr(obj, "__getitem__")
        and hasattr(obj, "__len__")
    )


def as_stage(obj: Any, *, shuffle: bool | None = None, seed: int = 0) -> Stage[Any]:
    """Returns ``obj`` as a stage (see the module docstring).

    Args:
        obj: A stage, a ``SavableDataset``, a Stateful iterable, a map-style dataset or
            any other ``IterableDataset`` (NOTE [ Datasets without a position ]).
        shuffle: For a map-style dataset: a new seeded permutation every epoch.
        seed: Seed of that permutation.

    Raises:
        ConfigError: ``obj`` is none of these, or ``shuffle`` is set for an iterable.
    """
    if isinstance(obj, Stage):
        stage: Stage[Any] = obj
    elif is_savable(obj):
        stage = DatasetStage(obj)
    elif isinstance(obj, IterableDataset) and is_stateful(obj):
        stage = StatefulDataset(obj)
    elif _is_map_style(obj):
        return IndexedDataset(obj, shuffle=bool(shuffle), seed=seed)
    elif is_stateful(obj):
        stage = StatefulDataset(obj)
    elif isinstance(obj, IterableDataset) and not is_datapipe(obj) and iterator_is_stateful(obj):
        stage = StatefulDataset(obj)  # NOTE [ A position kept by the iterator ] in stateful.py
    elif isinstance(obj, IterableDataset):
        stage = UnsavableStage(obj)
    else:
        raise ConfigError(
            f"{type(obj).__name__} is neither a SavableDataset, a Stateful iterable nor a "
            "map-style dataset (__getitem__ and __len__)"
        )
    if shuffle and not is_datapipe(obj):  # NOTE [ DataPipes ] in datapipes.py
        raise ConfigError(
            f"shuffle=True applies to map-style datasets; {type(obj).__name__} is "
            "iterable: shuffle inside the pipeline (savable_loader.datasets)"
        )
    return stage


class DatasetStage(Stage[T]):
    """A stage over a user's :class:`~savable_loader.SavableDataset`.

    Args:
        dataset: The dataset; its cursor reads this object itself (NOTE [ A dataset is
            its own position ]).

    State:
        The dataset's own ``save_state()``, unchanged (tuples become lists). Restore is
        the dataset's ``restore_state``; ``skip(n)`` uses the dataset's ``skip`` when it
        has one and has not begun an epoch, and reads otherwise.
    """

    elastic_reason = (
        "its state is your dataset's own save_state(), which only your dataset can read"
    )
    elastic_fix = (
        "restore on the number of workers and ranks it was saved with, build the pipeline "
        "from IndexedDataset (or a map-style dataset), JsonLinesSource, TokenSource or "
        "TarSource, or pass approximate=True to restart the interrupted epoch on the new "
        "layout"
    )

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def config(self) -> dict[str, Any]:
        config = getattr(self.dataset, "config", None)
        if callable(config):
            return config()  # type: ignore[no-any-return]
        return {"type": qualified_name(type(self.dataset))}

    def describe(self) -> str:
        return type(self.dataset).__name__

    def cursor(self, context: WorkerContext) -> Cursor[T]:
        return _DatasetCursor(self.dataset, context)


class _DatasetCursor(Cursor[T]):
    stage_name = "DatasetStage"

    def __init__(self, dataset: Any, context: WorkerContext) -> None:
        super().__init__(context)
        self.dataset = dataset
        setup = getattr(dataset, "setup", None)
        if callable(setup):
            setup(context)
        self._items: Iterator[T] | None = None
        #: Whether the dataset's skip() says how far it went (None: not asked yet).
        self._counted: bool | None = None

    @property
    def name(self) -> str:
        return type(self.dataset).__name__

    def __next__(self) -> T:
        items = self._items if self._items is not None else self._begin()
        try:
            return next(items)
        except StopIteration:
            self._items = None
            raise

    def take(self, n: int) -> list[T]:
        items = self._items if self._items is not None else self._begin()
        taken = list(itertools.islice(items, n))
        if len(taken) < n:
            self._items = None  # the dataset's iteration ended: its next one is the next epoch
        return taken

    def end_epoch(self) -> None:
        """Drops the rest of the epoch without reading it: the next one begins with a new
        ``iter(dataset)`` from where the dataset stands, as torch's ``DataLoader`` begins
        a new iteration (NOTE [ A new iter() starts an epoch ] in ``_main/iterator.py``)."""
        self._items = None

    def _begin(self) -> Iterator[T]:
        """Begins the dataset's iteration of this epoch."""
        self._items = iter(self.dataset)
        return self._items

    def own_state(self) -> Any:
        return self.dataset.save_state()

    def restore_own(self, state: Any | None) -> None:
        self._items = None
        self.dataset.restore_state(copy.deepcopy(state))

    def skip_fast(self, n: int) -> int | None:
        """The dataset's own ``skip`` when it counts (NOTE [ A dataset's skip ])."""
        skip = getattr(self.dataset, "skip", None)
        if self._items is not None or not callable(skip):
            return None
        if self._counted is None:
            self._counted = type(skip(0)) is int
        if not self._counted:
            return None
        passed = skip(n)
        if type(passed) is not int or not 0 <= passed <= n:
            raise SavableLoaderError(
                f"{self.name}.skip({n}) returned {passed!r}; it must return how many items "
                f"it passed, 0 to {n}"
            )
        return passed


class UnsavableStage(DatasetStage[T]):
    """A stage over an ``IterableDataset`` that cannot save its position (NOTE [ Datasets
    without a position ]): it reads as torch reads it; a save raises.

    Args:
        dataset: The dataset; its cursor reads this object itself.

    State:
        None: there is no position to save. Restoring None starts a new iteration.
    """

    def not_savable(self) -> str:
        kind = type(self.dataset)
        return (
            f"{kind.__module__}.{kind.__qualname__} is an IterableDataset without a savable "
            "position, so this loader can iterate it but not save or restore where it "
            "stands; make it savable: subclass savable_loader.SavableDataset and add "
            "save_state()/restore_state() (plain data: where its iteration stands), or give "
            "it, or the iterator its __iter__ returns, state_dict()/load_state_dict()"
        )

    def cursor(self, context: WorkerContext) -> Cursor[T]:
        return _UnsavableCursor(self.dataset, context)


class _UnsavableCursor(_DatasetCursor[T]):
    stage_name = "UnsavableStage"

    def __init__(self, dataset: Any, context: WorkerContext) -> None:
        super().__init__(dataset, context)
        if is_datapipe(dataset):
            shard(dataset, context)

    def goes_on_after_error(self) -> bool:
        """As torch's worker goes on with its iterator after an error: a generator that
        raised is finished, so this worker's epoch ends; nothing here has a position to
        keep (NOTE [ Going on after an error ] in ``_worker/runtime.py``)."""
        return True

    def _begin(self) -> Iterator[T]:
        """An ``__iter__`` that raises ends this worker's epoch, as in torch (its worker
        made no fetcher), rather than raising again at every batch."""
        try:
            return super()._begin()
        except Exception:
            self._items = iter(())
            raise

    def own_state(self) -> Any:
        return None

    def restore_own(self, state: Any | None) -> None:
        if state is not None:
            raise UnsavableDatasetError(
                f"{self.name} has no savable position; it can only start over (state None)"
            )
        self._items = None
