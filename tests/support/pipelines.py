"""Datasets the tests share: savable pipelines that shard over workers and draw randomness."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from savable_loader import SavableDataset


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class RandomCounter(SavableDataset[dict[str, Any]]):
    """Counts 0..n-1, sharded by ``get_worker_info()``; each item draws from all three
    global generators. With ``uneven``, worker w's shard is ``n + 3 * w`` long instead,
    so workers end their epochs at different times. ``cost`` sleeps per item."""

    def __init__(self, n: int, *, uneven: bool = False, cost: float = 0.0) -> None:
        self.n = n
        self.uneven = uneven
        self.cost = cost
        self.pos = 0
        self.epoch = 0

    def config(self) -> dict[str, Any]:
        return {"type": "RandomCounter", "n": self.n, "uneven": self.uneven}

    def _positions(self) -> int:
        worker_id, _ = _worker()
        return self.n + 3 * worker_id if self.uneven else self.n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker_id, workers = _worker()
        while self.pos < self._positions():
            index = self.pos
            self.pos += 1
            if self.uneven or index % workers == worker_id:
                if self.cost:
                    time.sleep(self.cost)
                yield {
                    "index": index,
                    "worker": worker_id,
                    "epoch": self.epoch,
                    "py": random.random(),
                    "np": float(np.random.rand()),
                    "torch": torch.rand(3),
                }
        self.pos = 0
        self.epoch += 1

    def save_state(self) -> dict[str, int]:
        return {"pos": self.pos, "epoch": self.epoch}

    def restore_state(self, state: Any) -> None:
        state = state or {"pos": 0, "epoch": 0}
        self.pos, self.epoch = state["pos"], state["epoch"]


class SkippingCounter(RandomCounter):
    """A RandomCounter with an exact ``skip``: items draw randomness, so skip must too. It
    returns how many items it passed; at the end of the epoch it moves to the next one."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.skipped = 0

    def skip(self, n: int) -> int:
        iterator = iter(self)
        for passed in range(n):
            if next(iterator, None) is None:
                self.skipped += passed
                return passed
        self.skipped += n
        return n


class Squares(Dataset[dict[str, Any]]):
    """A map-style dataset whose items draw from torch's global generator."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index, "square": index * index, "noise": torch.rand(2)}


class StatefulCounter:
    """An iterable following torch's Stateful protocol (state_dict/load_state_dict)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker_id, workers = _worker()
        while self.pos < self.n:
            index = self.pos
            self.pos += 1
            if index % workers == worker_id:
                yield {"index": index, "noise": torch.rand(1)}
        self.pos = 0


class Stuck(RandomCounter):
    """Hangs (in a sleep) on item ``stuck_at`` of worker 0, like a worker stuck on I/O."""

    def __init__(self, n: int, stuck_at: int, seconds: float = 30.0) -> None:
        super().__init__(n)
        self.stuck_at = stuck_at
        self.seconds = seconds

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker_id, _ = _worker()
        for item in super().__iter__():
            if worker_id == 0 and item["index"] == self.stuck_at:
                time.sleep(self.seconds)
            yield item
