"""Bounds on a state's counters, so that a restore never loops unboundedly.

NOTE [ Counter bounds ]
A state file is untrusted input, and some of its counters set how much work a restore
does: ``delivered - checkpoint.seq`` events are replayed (NOTE [ Sequence numbers ] in
``models.py``), and a restore onto another layout walks each new worker's pipeline
through every epoch before ``epoch`` (``_epoch_start`` in ``_resume/elastic.py``). Both are
bounded by what a save can leave, and a state beyond them is refused before anything
runs, naming the field:

- A replay of at most :data:`MAX_REPLAY` events (131,072). A worker records a checkpoint
  at least every :data:`CHECKPOINT_GAP` events (65,536) whatever its budget says
  (NOTE [ Checkpoint policy ] in ``_worker/ring.py``), and a save answers with the newest one
  at or before the consumer's position, so no save leaves more; before that rule, the
  budget alone (one checkpoint per few milliseconds of worker time) left far fewer,
  since an event crosses torch's worker queue, which costs tens of microseconds.
- An epoch of at most :data:`MAX_RESHARD_EPOCH` (65,536) for a restore onto another
  layout. A restore on the layout it was saved with never iterates epochs, so it takes
  any epoch below 2**63.
"""

from __future__ import annotations

from ..errors import StateFormatError
from .models import RankState

__all__ = ["CHECKPOINT_GAP", "MAX_COUNTER", "MAX_REPLAY", "MAX_RESHARD_EPOCH", "check_counters"]

#: The largest counter any run reaches (int64).
MAX_COUNTER = 2**63 - 1
#: A worker records a checkpoint at least every this many events.
CHECKPOINT_GAP = 1 << 16
#: The most events a restore replays from a worker's checkpoint.
MAX_REPLAY = 2 * CHECKPOINT_GAP
#: The latest epoch a restore onto another layout walks a pipeline to.
MAX_RESHARD_EPOCH = 1 << 16


def check_counters(state: RankState) -> None:
    """Refuses counters no run can reach: a hand-edited or corrupted state.

    Raises:
        StateFormatError: A counter is beyond int64, a worker without a checkpoint (one
            that never started) claims to have delivered events, or a worker's replay
            is beyond :data:`MAX_REPLAY` (NOTE [ Counter bounds ]).
    """
    counters = [("epoch", state.epoch)]
    for worker in state.workers:
        at = f"workers[{worker.worker_id}]"
        counters.append((f"{at}.delivered", worker.delivered))
        if worker.checkpoint is not None:
            counters.append((f"{at}.checkpoint.seq", worker.checkpoint.seq))
        elif worker.delivered or worker.ended:
            raise StateFormatError(
                f"invalid loader state: {at} has delivered={worker.delivered}, "
                f"ended={worker.ended} but no checkpoint; a worker without a checkpoint never "
                "started, so it delivered nothing. The state was edited or corrupted"
            )
    for name, value in counters:
        if value > MAX_COUNTER:
            raise StateFormatError(
                f"invalid loader state: {name} is {value}, beyond any run (at most 2**63-1); "
                "the state was edited or corrupted"
            )
    for worker in state.workers:
        if worker.replay > MAX_REPLAY:
            seq = worker.checkpoint.seq if worker.checkpoint is not None else 0
            raise StateFormatError(
                f"invalid loader state: workers[{worker.worker_id}].delivered is "
                f"{worker.delivered}, {worker.replay} events past its checkpoint at seq {seq}; "
                f"a save leaves at most {MAX_REPLAY} to replay (NOTE [ Counter bounds ]). "
                "The state was edited or corrupted"
            )
