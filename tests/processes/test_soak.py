"""Soak: many save/restore cycles stay exact, and saving every step does not grow memory.

The figures of the memory test are written to stderr (``pytest -s tests/processes/test_soak.py``)
and recorded in docs/explanation/reliability.md.
"""

from __future__ import annotations

import gc
import random
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from pipelines import RandomCounter

from savable_loader import SavableDataLoader
from savable_loader.testing import digest, roundtrip

pytestmark = pytest.mark.slow

WORKERS = 4
EPOCHS = 5
CYCLES = 30
SEED = 20261122
MEMORY_STEPS = 2000
WARM_UP_STEPS = 200
#: Largest RSS growth accepted per process between warm-up and the end.
MAX_GROWTH_MB = 10.0


def _loader(n: int = 34, batch_size: int | None = 2) -> SavableDataLoader:
    """Shards of 34, 37, 40 and 43 items: 78 batches an epoch, 390 in five. The 30 seeded
    cycles fall 3 to 8 in every epoch, 18 of them into a fresh loader, as with 120-item
    shards, which cost three times as many batches."""
    return SavableDataLoader(
        RandomCounter(n, uneven=True), batch_size=batch_size, num_workers=WORKERS, seed=7
    )


def _items(loader: SavableDataLoader) -> Iterator[str]:
    """The loader's stream, epoch after epoch, from wherever it stands (endless)."""
    while True:
        for item in loader:
            yield digest(item)


def test_thirty_save_restore_cycles_over_five_epochs_are_exact() -> None:
    with _loader() as reference_loader:
        reference = [digest(item) for _ in range(EPOCHS) for item in reference_loader]
    rng = random.Random(SEED)
    points = sorted(rng.sample(range(len(reference)), CYCLES))
    got: list[str] = []
    loader = _loader()
    try:
        stream = _items(loader)
        fresh = same = 0
        for point in points:
            while len(got) < point:
                got.append(next(stream))
            state = roundtrip(loader.save_state_rank())
            if rng.random() < 0.7:  # a new loader, as after a crash
                loader.close()
                loader = _loader()
                fresh += 1
            else:  # the same, running loader
                same += 1
            loader.restore_state_rank(state)
            stream = _items(loader)
        while len(got) < len(reference):
            got.append(next(stream))
    finally:
        loader.close()
    assert got == reference
    assert fresh >= 5, fresh
    assert same >= 5, same


def _rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as file:
        for line in file:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _measure(loader: SavableDataLoader) -> dict[str, float]:
    gc.collect()
    figures = {"main": _rss_mb()}
    for worker, stats in enumerate(loader.worker_stats()):
        figures[f"worker {worker}"] = _rss_mb(stats["pid"])
    return figures


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_saving_every_step_for_two_thousand_steps_does_not_grow_memory() -> None:
    loader = _loader(n=400, batch_size=None)
    try:
        stream = _items(loader)
        states: Any = None
        for _ in range(WARM_UP_STEPS):
            next(stream)
            states = loader.save_state_rank()
        before = _measure(loader)
        for _ in range(MEMORY_STEPS - WARM_UP_STEPS):
            next(stream)
            states = loader.save_state_rank()
        after = _measure(loader)
        assert states.workers[0].delivered > 0
    finally:
        loader.close()
    lines = [
        f"  {name}: {before[name]:.1f} MB after {WARM_UP_STEPS} steps, {after[name]:.1f} MB "
        f"after {MEMORY_STEPS} ({after[name] - before[name]:+.1f} MB)"
        for name in before
    ]
    sys.stderr.write("\nRSS, save_state_rank() every step:\n" + "\n".join(lines) + "\n")
    for name in before:
        growth = after[name] - before[name]
        assert growth < MAX_GROWTH_MB, f"{name} grew {growth:.1f} MB"
