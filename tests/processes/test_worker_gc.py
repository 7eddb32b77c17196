"""A worker's garbage collector skips what the worker inherited (NOTE [ Inherited objects
are frozen ] in ``savable_loader/_worker/wrapper.py``)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest

from savable_loader import SavableDataLoader
from savable_loader.datasets import IndexedDataset

INHERITED = 100_000


def _freeze_count(index: int) -> int:
    return gc.get_freeze_count()


def _cycle_collected(index: int) -> int:
    """How many objects a full collection frees after the worker drops a cycle of its own."""
    gc.collect()
    cycle: list[Any] = []
    cycle.append(cycle)
    del cycle
    return gc.collect()


def _unfreeze(worker_id: int) -> None:
    gc.unfreeze()


def _items(fn: Callable[[int], int], **kwargs: Any) -> list[int]:
    with SavableDataLoader(
        IndexedDataset(range(4)).map(fn), batch_size=None, num_workers=2, **kwargs
    ) as loader:
        return list(loader)


def test_a_forked_worker_freezes_the_objects_it_inherits() -> None:
    inherited = [[i] for i in range(INHERITED)]  # tracked by the collector, here
    counts = _items(_freeze_count, multiprocessing_context="fork")
    assert len(inherited) == INHERITED
    assert gc.get_freeze_count() == 0  # the main process is left alone
    assert all(count >= INHERITED for count in counts)


def test_a_worker_still_collects_the_cycles_it_makes() -> None:
    assert _items(_cycle_collected) == [1, 1, 1, 1]


@pytest.mark.slow
def test_worker_init_fn_can_undo_the_freeze() -> None:
    assert _items(_freeze_count, worker_init_fn=_unfreeze) == [0, 0, 0, 0]
