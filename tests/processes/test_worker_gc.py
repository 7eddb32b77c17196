"""What a worker inherits at its start: its garbage collector skips the inherited objects
(NOTE [ Inherited objects are frozen ] in ``savable_loader/_worker/wrapper.py``), and it
does not search ``sys.path`` again for what the main process already looked for."""

from __future__ import annotations

import gc
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import pytest

from savable_loader import SavableDataLoader
from savable_loader.datasets import IndexedDataset
from savable_loader.storage import object_store

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


def test_workers_inherit_whether_obstore_is_installed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main process looks for ``obstore`` once; a worker, forked after, does not
    search ``sys.path`` for it again before its first batch (about a millisecond each)."""
    searched = tmp_path / "searched"
    real_find_spec = importlib.util.find_spec

    def recording(name: str, *args: Any) -> Any:
        if name == "obstore":
            with open(searched, "a") as out:
                out.write(f"{os.getpid()}\n")
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", recording)
    object_store.installed.cache_clear()
    try:
        with SavableDataLoader(list(range(8)), batch_size=2, num_workers=2) as loader:
            assert len(list(loader)) == 4
    finally:
        object_store.installed.cache_clear()
    assert searched.read_text().split() == [str(os.getpid())]
