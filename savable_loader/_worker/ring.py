"""A worker's checkpoint ring and the policy that fills it.

NOTE [ Checkpoint policy ]
After producing an event, the worker may record a checkpoint (its pipeline's state and
its three global generators) in a ring. It measures what a checkpoint costs and earns a
budget of ``checkpoint_share`` of its wall time between events (producing the event,
handing the previous one to torch, waiting for the task); it records one whenever the
budget covers the cost (measured in the thread's CPU time, so waits for the GIL do not
count). Expensive items are therefore all checkpointed (a restore recomputes nothing)
and cheap items are checkpointed every few milliseconds (a restore recomputes a few
milliseconds of work). A checkpoint is always recorded at start-up and after an END,
and at least every ``CHECKPOINT_GAP`` events, which bounds what a restore replays (NOTE
[ Counter bounds ] in ``state/bounds.py``).
Retention is by sequence number: a worker produces an event only for a task, and torch
keeps at most ``prefetch_factor * num_workers`` tasks in flight (the item in the user's
hand is already counted as delivered), so the consumer is at most that many events
behind a worker. The ring keeps every checkpoint within ``prefetch_factor * num_workers
+ 2`` events (a margin of two) of the newest, plus the newest one before that window.
Should a save ever ask for an older position, the worker answers with an error, never
with an approximate checkpoint. The ring's lock is held only to append or pick an entry,
never while the pipeline produces an item, so the command thread answers a save within
an IPC round trip.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import rng
from ..state.bounds import CHECKPOINT_GAP
from ..state.models import Checkpoint, RngState

__all__ = ["CheckpointRing", "Entry"]

_MAX_BUDGET_CHECKPOINTS = 4
_COST_WINDOW = 9


@dataclass(frozen=True)
class Entry:
    """A ring entry: the pipeline's state (a plain copy) and the generators as taken;
    the generators become bytes only when a save asks for the entry."""

    seq: int
    state: Any
    rng: rng.RngSnapshot | RngState

    def to_checkpoint(self) -> Checkpoint:
        state = self.rng if isinstance(self.rng, RngState) else self.rng.to_state()
        return Checkpoint(seq=self.seq, state=self.state, rng=state)


class CheckpointRing:
    """The checkpoints a worker keeps for saves (NOTE [ Checkpoint policy ]).

    Args:
        max_lag: How many events the consumer can be behind the worker.
        share: Largest share of the worker's time spent taking checkpoints.
    """

    def __init__(self, *, max_lag: int, share: float) -> None:
        self.max_lag = max_lag
        self.share = share
        self.taken = 0
        self._lock = threading.Lock()
        self._ring: collections.deque[Entry] = collections.deque()
        self._costs: collections.deque[float] = collections.deque(maxlen=_COST_WINDOW)
        self._cost = 0.0
        self._budget = 0.0
        #: Events since the last checkpoint.
        self._since = 0

    @property
    def cost(self) -> float:
        """The median cost of a checkpoint, in seconds of CPU time."""
        return self._cost

    def take(self, capture: Callable[[], Entry]) -> None:
        """Records ``capture()`` and measures what it cost."""
        # CPU time of this thread: wall time would count waits for the GIL held by
        # torch's queue feeder thread, which pickles the previous batch meanwhile.
        began = time.thread_time()
        self.record(capture())
        self._since = 0
        self._costs.append(time.thread_time() - began)
        costs = sorted(self._costs)
        self._cost = costs[len(costs) // 2]
        self.taken += 1

    def forget_costs(self) -> None:
        """Drops the costs measured so far (the first capture runs cold)."""
        self._costs.clear()

    def maybe_take(self, elapsed: float, capture: Callable[[], Entry]) -> None:
        """Takes a checkpoint if the budget earned over ``elapsed`` seconds covers one."""
        self._budget = min(
            self._budget + elapsed * self.share, _MAX_BUDGET_CHECKPOINTS * self._cost
        )
        self._since += 1
        if self._budget >= self._cost:
            self.take(capture)
            self._budget -= self._cost
        elif self._since >= CHECKPOINT_GAP:  # NOTE [ Counter bounds ] in state/bounds.py
            self.take(capture)

    def record(self, entry: Entry) -> None:
        """Appends ``entry`` (replacing one of the same ``seq``) and drops what no save
        can ask for any more."""
        with self._lock:
            if self._ring and self._ring[-1].seq == entry.seq:
                self._ring.pop()
            self._ring.append(entry)
            bound = entry.seq - self.max_lag
            while len(self._ring) >= 2 and self._ring[1].seq <= bound:
                self._ring.popleft()

    def find(self, delivered: int) -> tuple[Entry | None, int | None]:
        """The newest entry at or before ``delivered`` (None if none), and the oldest seq."""
        with self._lock:
            entry = next((e for e in reversed(self._ring) if e.seq <= delivered), None)
            oldest = self._ring[0].seq if self._ring else None
        return entry, oldest

    def entries(self) -> list[Entry]:
        """A copy of the ring's entries, oldest first."""
        with self._lock:
            return list(self._ring)
