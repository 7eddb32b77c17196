"""The one runtime that drives a pipeline's cursor tree: in every worker, in the main
process without workers, and in an elastic restore that brings a saved stream up to date.

NOTE [ The runtime ]
A :class:`PipelineRuntime` builds the cursor tree of the loader's pipeline (batching
included) for one worker, restores it from a checkpoint (the tree's state and the
worker's global generators), replays the events the consumer had already received with
the tree's ``skip`` (NOTE [ The cursor contract ] in ``datasets/protocol/cursor.py``), and then
produces events (NOTE [ Events ] in ``_channel/events.py``), taking checkpoints as NOTE
[ Checkpoint policy ] in ``_worker/ring.py`` says. The event numbering is NOTE [ Sequence
numbers ] in ``state/models.py``. Without workers (NOTE [ No workers ])
and in an elastic restore it runs under generators of its own (NOTE [ Own generators ] in
``rng/generators.py``), so the process's draws and the pipeline's never mix.

NOTE [ No workers ]
With ``num_workers=0`` the pipeline runs in the main process. Its generator states are
kept apart from the training loop's and swapped in around each event (NOTE [ Own
generators ] in ``rng/generators.py``), so draws the training loop makes from ``random``,
``numpy.random`` or torch between batches change nothing in the data stream, and a
restore is exact without restoring the trainer's generators. A save captures the
pipeline's state on the spot: there is no prefetch. The state is read under the
pipeline's generators too, as it is restored under them: a dataset whose ``state_dict()``
holds ``torch.get_rng_state()`` saves the pipeline's generator, not the training loop's.

NOTE [ Going on after an error ]
Torch's ``DataLoader`` takes a batch's indices from the sampler before it reads them, so
when ``dataset[i]`` (or ``__getitems__``, or ``collate_fn``) raises, the exception, of its
own type, reaches the training loop and the next ``next()`` goes on with the next batch:
a loop that catches the error and continues loses that batch and nothing else. A map-style
dataset read by the loader (``IndexedDataset`` over ``data[i]``, or a sampler's batches,
under the loader's batching) does the same: its cursor moves past a batch's indices
before reading them (``Cursor.goes_on_after_error``), so when the read raises, the
worker takes a checkpoint at once and sends an ERROR event that is counted like an item
(``Failure.goes_on``); the loader hands it on as the exception, of the original type and
also a ``DatasetError`` (``_channel/events.py``), and keeps reading. A save after it restores
after it, and because the worker checkpointed right after the failed batch, no replay
ever reads that batch again: a restore up to it starts from a checkpoint before it and
stops short of it, one past it starts from that checkpoint or a later one. A plain
``IterableDataset`` (no position: NOTE [ Datasets without a position ] in
``datasets/adapt.py``) goes on too, as torch's worker goes on with its iterator: a
generator that raised is finished, so that worker's epoch ends; an ``__iter__`` that
raised ends it as well, where torch's worker would fail on every later batch. A savable
pipeline of any other kind keeps the rule of NOTE [ Pipeline errors ] in
``_channel/events.py``: its position stays before the item, which the same iterator's next() retries
(the position it would go on from is the dataset's own, which the loader cannot vouch for).

NOTE [ Fresh workers ]
A worker that starts from no checkpoint (the start of a run) restores nothing: its new
cursors already stand at the start of epoch 0, and a dataset your ``worker_init_fn``
configured (torch's way of sharding an ``IterableDataset``: set a range on
``get_worker_info().dataset``) keeps what the hook set. Restoring the pipeline's initial
state there would put back what the object held in the main process and undo the hook
(every worker reading the whole range). A worker that starts from a checkpoint restores
it after the hook ran, as torchdata's ``StatefulDataLoader`` loads a worker's state after
``worker_init_fn``: the saved position wins, and it was saved from a hooked object. In
the main process (no workers, no hook) a start from no checkpoint restores the initial
state, so ``restore_state_rank(None)`` starts a reused object over.

NOTE [ Interrupts ]
A ``KeyboardInterrupt`` (Ctrl-C) or ``SystemExit`` raised while the pipeline produces an
item, in ``__getitem__``, a map or ``collate_fn``, passes through as it is: it is not an
error of the data. Without workers it may leave the cursor tree halfway through the item,
so the runtime stops taking checkpoints of the tree; the loader (``_next`` in
``loader.py``) then stops the stream as after an error, keeping the position after the
last item handed on, from the ring's newest checkpoint and a replay. The same iterator,
or a save and restore, goes on from there, retrying the interrupted item; a new
``iter()`` starts the next epoch, as it does after any item.

NOTE [ Generators per epoch ]
A worker's global generators (``random``, ``numpy.random``, torch) are seeded from
``(seed, rank, worker id, epoch)`` for every epoch: at start-up for epoch 0, and right
after a worker ends an epoch for the next one, before the checkpoint that follows the
END, so a restore from that checkpoint starts the next epoch from the same seed. A
worker restored between epochs seeds its generators again as the epoch begins, which
changes nothing for its own states and gives states saved before this rule existed the
same next epoch as a run today. An epoch's draws therefore depend only on the layout and
the epoch, not on what earlier epochs drew, so after a restore onto another layout (NOTE
[ Elastic resume ] in ``datasets/protocol/elastic.py``) the next epochs draw exactly what a fresh
run on that layout draws. Epoch 0 keeps the seed it always had. Because the seeding is a
function of the layout and the epoch, a checkpoint taken before anything drew from the
generators records only the epoch they were seeded for, and a restore seeds them again
(NOTE [ Untouched generators ] in ``rng/generators.py``): a pipeline that never draws from them
saves no generator bytes, and nobody has to declare it.

NOTE [ Torch's worker seeds ]
With the loader's ``generator=`` set, the workers' generators are seeded as torch seeds
them: torch draws a base seed from that generator when it starts the workers and seeds
worker ``w`` from it before ``worker_init_fn`` runs; the runtime keeps what it finds at
start-up (torch's seeding and whatever ``worker_init_fn`` did) instead of seeding per
epoch. Persistent workers are seeded once and their generators run on across epochs;
otherwise the workers of every epoch are new and seeded anew (NOTE [ Epoch orders ] in
``_main/sampling.py``). A restore puts back the checkpoint's generators as always. Those
seeds come from torch's base seed and the user's ``worker_init_fn``, which a restoring
process cannot recompute, so these checkpoints always hold the generators' bytes.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .. import rng
from .._channel.commands import CommandChannel
from .._channel.events import (
    CHECKPOINTING,
    END,
    IDLE,
    ITEM,
    PLACEHOLDER,
    PRODUCING,
    Event,
    Failure,
    Progress,
)
from ..config import WorkerContext
from ..datasets.files.access import release_caches, storage_stats
from ..datasets.protocol.stage import Stage
from ..errors import DatasetError, StateError, WorkerError
from ..plain import plain_copy
from ..state.models import Checkpoint, RngState
from .ring import CheckpointRing, Entry

__all__ = ["PipelineRuntime", "RuntimeSpec", "WorkerStart", "epoch_rng_state", "epoch_seed"]

logger = logging.getLogger(__name__)

_END = object()


@dataclass(frozen=True)
class WorkerStart:
    """How one worker starts: from which checkpoint, to which position.

    Attributes:
        checkpoint: Checkpoint to restore, or None for the pipeline's initial state.
        delivered: Sequence number the consumer wants next (replay up to it).
        skip_epoch: The worker already ended the current epoch: produce nothing in it.
        placeholder: Yield one placeholder first (worker order after a restore).
        new_epoch: The worker starts at the beginning of an epoch (after a restore
            between epochs): seed its generators for it (NOTE [ Generators per epoch ]).
        cut: The loader began a new epoch before this worker ended the current one: it
            replays to ``delivered``, drops the rest of that epoch and counts the cut as
            one event (NOTE [ A new iter() starts an epoch ] in ``_main/iterator.py``).
    """

    checkpoint: Checkpoint | None = None
    delivered: int = 0
    skip_epoch: bool = False
    placeholder: bool = False
    new_epoch: bool = False
    cut: bool = False


@dataclass
class RuntimeSpec:
    """Everything a worker needs to run the pipeline; pickled into each worker.

    Attributes:
        root: The loader's pipeline with its batching (``datasets.batch.Batch``).
        seed: The loader seed.
        rank: This loader's rank.
        world_size: Number of ranks.
        num_workers: Worker processes (0: the pipeline runs in the main process).
        batch_size: Items per batch (sources shard in blocks of it).
        checkpoint_share: NOTE [ Checkpoint policy ] in ``_worker/ring.py``.
        max_lag: How many events the consumer can be behind a worker.
        starts: How each worker starts; empty: every worker from the beginning.
        epoch: The loader epoch the workers start in (NOTE [ Generators per epoch ]).
        channel: The command channel, with workers.
        torch_seeds: The workers' global generators are seeded as torch seeds them, from
            the base seed the loader's ``generator`` gave (NOTE [ Torch's worker seeds ]).
        fresh_seeds: With ``torch_seeds``: torch seeded these workers for the epoch they
            start in (it drew a new base seed), rather than their generators continuing.
        dataset: What the user passed as ``dataset=``, an object of the pipeline above;
            pickled with it, so in a worker it is the very object that worker's pipeline
            reads (NOTE [ The worker's dataset ] in ``_channel/torch_compat.py``).
        seed_each_item: NOTE [ Items seeded one by one ] in ``rng/keys.py``.
    """

    root: Stage[Any]
    seed: int
    rank: int
    world_size: int
    num_workers: int
    batch_size: int | None
    checkpoint_share: float
    max_lag: int
    starts: tuple[WorkerStart, ...] = ()
    epoch: int = 0
    channel: CommandChannel | None = field(default=None)
    torch_seeds: bool = False
    fresh_seeds: bool = True
    dataset: Any = None
    seed_each_item: bool = False

    def context(self, worker_id: int) -> WorkerContext:
        """What worker ``worker_id``'s pipeline is told about where it runs."""
        return WorkerContext(
            rank=self.rank,
            world_size=self.world_size,
            worker_id=worker_id,
            num_workers=self.num_workers,
            seed=self.seed,
            batch_size=self.batch_size,
            seed_each_item=self.seed_each_item,
        )


def epoch_seed(seed: int, rank: int, worker_id: int, epoch: int) -> int:
    """The seed of a worker's global generators at the start of ``epoch``
    (NOTE [ Generators per epoch ])."""
    if epoch == 0:
        return rng.seed_for(rng.Purpose.WORKER_EPOCH, seed, rank, worker_id)
    return rng.seed_for(rng.Purpose.WORKER_EPOCH, seed, rank, worker_id, epoch)


def epoch_rng_state(
    seed: int, rank: int, worker_id: int, epoch: int, salt: int | None = None
) -> RngState:
    """The global generators' state :func:`epoch_seed` gives (with ``salt`` also in the
    key: the rest of an epoch resumed on another layout), without touching this
    process's generators."""
    base = epoch_seed(seed, rank, worker_id, epoch)
    generators = rng.OwnGenerators.seeded(
        base if salt is None else rng.seed_for(rng.Purpose.WORKER_SALT, base, salt)
    )
    return generators.snapshot.to_state()


class PipelineRuntime:
    """Drives one worker's cursor tree (NOTE [ The runtime ]).

    Args:
        spec: The loader's description of the pipeline and of every worker's start.
        worker_id: This worker's id (0 without workers).
        in_main: True when it runs in the main process (no workers, or an elastic
            restore): the pipeline then runs under generators of its own.
        progress: Where the worker reports what it is doing (NOTE [ Watchdog ]).

    Raises:
        StateError: The start asks for a position before its checkpoint.
        Exception: Whatever the pipeline raises while it is restored.
    """

    def __init__(
        self,
        spec: RuntimeSpec,
        worker_id: int,
        *,
        in_main: bool,
        progress: Progress | None = None,
    ) -> None:
        self.spec = spec
        self.worker_id = worker_id
        self.in_main = in_main
        self.progress = progress or Progress()
        self.ring = CheckpointRing(max_lag=spec.max_lag, share=spec.checkpoint_share)
        self.generators = rng.OwnGenerators(rng.capture()) if in_main else None
        #: NOTE [ Torch's worker seeds ]: the generators as torch seeded this worker.
        self.torch_seeded = rng.capture() if spec.torch_seeds and not in_main else None
        #: The pipeline raised (NOTE [ Pipeline errors ]): its state is no checkpoint.
        self.failed = False
        self.replayed = 0
        #: NOTE [ Untouched generators ] in rng/generators.py: the generators right after their
        #: seeding for an epoch, while nothing has drawn from them; else None.
        self._seeded: rng.Seeded | None = None
        self._first_epoch = True
        start = spec.starts[worker_id] if spec.starts else WorkerStart()
        self._start = start
        self.root = spec.root.cursor(spec.context(worker_id))
        checkpoint = start.checkpoint
        self.seq = checkpoint.seq if checkpoint is not None else 0
        #: The loader epoch of the last epoch() call; the first call is spec.epoch.
        self._epoch = spec.epoch - 1
        # NOTE [ Untouched generators ] in rng/generators.py: the epoch the generators are seeded
        # for here, or None when they come from the checkpoint's bytes or from torch.
        seeded: int | None
        if checkpoint is None:
            seeded = 0 if self.torch_seeded is None else None
        else:
            seeded = checkpoint.seeded_epoch
        with self._scope():
            if checkpoint is not None:
                self.root.restore(copy.deepcopy(checkpoint.state))
            elif in_main:
                self.root.restore(None)
            # A worker starting fresh restores nothing: its new cursors stand at the
            # start, and what worker_init_fn configured stays (NOTE [ Fresh workers ]).
            if seeded is not None:
                rng.seed_globals(epoch_seed(spec.seed, spec.rank, worker_id, seeded))
            elif checkpoint is not None and checkpoint.rng is not None:
                rng.apply(rng.RngSnapshot.from_state(checkpoint.rng))
        if seeded is not None:
            self._mark_seeded(seeded)
        if self.torch_seeded is not None and start.new_epoch and spec.fresh_seeds:
            # NOTE [ Torch's worker seeds ]: this worker starts an epoch as torch seeded
            # it. Its first checkpoints say so at once: a save answered before epoch()
            # runs must not hand back the generators of the epoch's end instead.
            rng.apply(self.torch_seeded)
        if checkpoint is not None:
            generators = self._seeded.snapshot if self._seeded is not None else checkpoint.rng
            if generators is not None:  # one of the two: Checkpoint checks it
                self.ring.record(Entry(checkpoint.seq, checkpoint.state, generators))
        # The ring holds a checkpoint before the command server reports ready. The first
        # capture runs cold (first calls, caches), so a second one measures the cost.
        self.ring.take(self._capture)
        self.ring.forget_costs()
        self.ring.take(self._capture)
        if start.delivered < self.seq:
            raise StateError(
                f"worker {worker_id}: delivered {start.delivered} is before its checkpoint "
                f"{self.seq}"
            )
        self._replay_target = start.delivered
        if start.cut:
            self._cut()

    def _cut(self) -> None:
        """Replays to the start's position, drops the rest of that epoch and stands at the
        next one's start, the cut counted as one event, then checkpoints there: the loader
        asks for that checkpoint before it hands anything on (NOTE [ A new iter() starts
        an epoch ] in ``_main/iterator.py``)."""
        self.catch_up()
        with self._scope():
            self.root.end_epoch()
        self.seq += 1
        self._replay_target = self.seq
        self._seed_epoch(self.spec.epoch, starting=True)
        self.ring.take(self._capture)

    def _scope(self) -> rng.Scope:
        """This runtime made the active seedings (NOTE [ Seeded windows ] in ``rng/generators.py``)
        and, in the main process, the pipeline's own generators applied."""
        return rng.Scope(self, self.generators)

    def epoch_of(self, snapshot: rng.RngSnapshot) -> int | None:
        """The epoch whose untouched seeding ``snapshot`` equals (NOTE [ Seeded windows ]
        in ``rng/generators.py``), or None."""
        seeded = self._seeded
        return seeded.snapshot.seeded_epoch if seeded and seeded.matches(snapshot) else None

    def seeded_for(self, epoch: int) -> rng.RngSnapshot:
        """This worker's generators as seeded for ``epoch``, the process's left alone.

        Raises:
            StateError: The generators are seeded as torch seeds them: no epoch says what
                they are (a state saved without ``generator=`` restored with it).
        """
        if self.torch_seeded is not None:
            raise StateError(
                f"worker {self.worker_id}: the state names the generators as seeded for "
                f"epoch {epoch}, but this loader seeds them from its generator=; restore "
                "it into a loader built as the one that saved it"
            )
        seed = epoch_seed(self.spec.seed, self.spec.rank, self.worker_id, epoch)
        return rng.OwnGenerators.seeded(seed).snapshot

    # -- events ---------------------------------------------------------------------

    def epoch(self) -> Iterator[Event]:
        """Starts an epoch: returns the generator of this worker's events for it."""
        first, self._first_epoch = self._first_epoch, False
        self._epoch += 1
        if first and self._start.skip_epoch:
            if self._replay_target != self.seq:
                raise StateError(
                    f"worker {self.worker_id} ended its epoch but would replay "
                    f"{self._replay_target - self.seq} events"
                )
            self.progress.enter(IDLE, self.seq)
            return iter(())
        if first and self._start.new_epoch:
            self._seed_epoch(self._epoch, starting=True)
        if first:
            self.catch_up()
        return self._run(placeholder=first and self._start.placeholder)

    def catch_up(self) -> Any:
        """Replays the events between the checkpoint and the consumer's position with the
        tree's ``skip``; returns the tree's state there.

        Raises:
            StateError: The pipeline ended before the position: it does not reproduce
                the stream it saved.
        """
        replay = self._replay_target - self.seq
        if replay <= 0:
            return self._state()
        began = time.perf_counter()
        with self._scope():
            passed = self.root.skip(replay)
        if passed < replay:
            raise StateError(
                f"invalid loader state: workers[{self.worker_id}]"
                f".delivered is {self._replay_target}, but the pipeline ended {passed} "
                f"batches after the checkpoint at seq {self.seq}, so at most "
                f"{self.seq + passed} is reachable: the position lies past the end of the "
                "data, or the pipeline does not reproduce the stream it saved. Restore a "
                "state saved by the same pipeline over the same data"
            )
        self.seq += replay
        self.replayed += replay
        logger.debug(
            "worker %d replayed %d events in %.1f ms",
            self.worker_id,
            replay,
            (time.perf_counter() - began) * 1e3,
        )
        self.ring.take(self._capture)
        return self._state()

    def _run(self, *, placeholder: bool) -> Iterator[Event]:
        try:
            yield from self._produce(placeholder=placeholder)
        except BaseException as error:
            if not isinstance(error, (Exception, GeneratorExit)):
                # A KeyboardInterrupt mid-item may leave the tree anywhere: its state is no
                # checkpoint, and a save answers from the ring (NOTE [ Interrupts ]).
                self.failed = True
            raise

    def _produce(self, *, placeholder: bool) -> Iterator[Event]:
        progress = self.progress
        if placeholder:
            progress.enter(IDLE, self.seq)
            yield (self.worker_id, -1, PLACEHOLDER, None)
        mark = time.perf_counter()
        while True:
            progress.enter(PRODUCING, self.seq)
            failed: Exception | None = None
            try:
                with self._scope():
                    item = next(self.root, _END)
            except Exception as error:
                if not self.root.goes_on_after_error():
                    self.failed = True
                    progress.enter(IDLE, self.seq)
                    yield self.failure(error, starting=False)
                    return
                item, failed = None, error  # NOTE [ Going on after an error ]
            now = time.perf_counter()
            # Worker time since the previous event: producing this one, plus torch
            # sending the previous one and waiting for this task.
            elapsed, mark = now - mark, now
            seq = self.seq
            self.seq += 1
            # NOTE [ Checkpoint faults ] in _events.py: the checkpoint after an event.
            progress.enter(CHECKPOINTING, seq, end=item is _END)
            try:
                if item is _END:
                    self._seed_epoch(self._epoch + 1)
                    self.ring.take(self._capture)
                elif failed is not None:
                    self.ring.take(self._capture)  # no replay crosses a failed read
                elif not self.in_main:
                    self.ring.maybe_take(elapsed, self._capture)
            except Exception as error:
                self.failed = True
                progress.enter(IDLE, seq)
                yield Failure.of(
                    error,
                    self.worker_id,
                    seq,
                    starting=False,
                    in_main=self.in_main,
                    checkpoint="end" if item is _END else "item",
                ).event()
                return
            progress.enter(IDLE, self.seq)
            if item is _END:
                yield (self.worker_id, seq, END, None)
                return
            if failed is not None:
                failure = Failure.of(
                    failed, self.worker_id, seq, starting=False, in_main=self.in_main, goes_on=True
                )
                yield failure.event()
                continue
            yield (self.worker_id, seq, ITEM, item)

    def _seed_epoch(self, epoch: int, *, starting: bool = False) -> None:
        """Seeds the pipeline's global generators for ``epoch`` (NOTE [ Generators per epoch ]);
        with torch's seeds, only as torch seeded a worker of a new epoch (NOTE [ Torch's
        worker seeds ])."""
        if self.torch_seeded is not None:
            if starting and self.spec.fresh_seeds:
                rng.apply(self.torch_seeded)
                self.ring.take(self._capture)  # the epoch starts from these, not the END's
            return
        with self._scope():
            rng.seed_globals(epoch_seed(self.spec.seed, self.spec.rank, self.worker_id, epoch))
        self._mark_seeded(epoch)

    def _mark_seeded(self, epoch: int) -> None:
        """Keeps the generators as just seeded for ``epoch`` (NOTE [ Untouched generators ]
        in ``rng/generators.py``)."""
        snapshot = self.generators.snapshot if self.generators is not None else rng.capture()
        self._seeded = rng.Seeded(snapshot, epoch)

    def failure(self, error: Exception, *, starting: bool) -> Event:
        """The ERROR event for ``error`` (NOTE [ Pipeline errors ])."""
        failure = Failure.of(
            error, self.worker_id, self.seq, starting=starting, in_main=self.in_main
        )
        return failure.event()

    def close(self) -> None:
        """Releases what the pipeline holds open (files, and this process's caches, whose
        held entries are then evicted to their limit); logs the storage figures."""
        storage = storage_stats(self.spec.root)
        if storage is not None:
            logger.debug("worker %d storage: %s", self.worker_id, storage)
        self.root.close()
        release_caches(self.spec.root)

    # -- checkpoints ----------------------------------------------------------------

    def _capture(self) -> Entry:
        seeded = self._seeded
        if seeded is not None and self.spec.seed_each_item:
            # NOTE [ Items seeded one by one ] in rng/keys.py: what the generators hold
            # between items is never drawn from, so the epoch's seeding stands for them.
            return Entry(self.seq, plain_copy(self._state()), seeded.snapshot)
        snapshot = self.generators.snapshot if self.generators is not None else rng.capture()
        if seeded is not None:
            # NOTE [ Untouched generators ] in rng/generators.py: the seeded snapshot stands for an
            # equal capture; the first draw ends the comparisons until the next seeding.
            if seeded.matches(snapshot):
                snapshot = seeded.snapshot
            else:
                self._seeded = None
        return Entry(self.seq, plain_copy(self._state()), snapshot)

    def _state(self) -> Any:
        """The tree's state, read under the pipeline's generators (NOTE [ No workers ])."""
        with self._scope():
            return self.root.state()

    @staticmethod
    def _checkpoint(entry: Entry) -> Checkpoint:
        """The saved form of ``entry``: the generators' epoch when they are untouched
        (NOTE [ Untouched generators ] in ``rng/generators.py``), else their bytes."""
        generators = entry.rng
        if isinstance(generators, rng.RngSnapshot) and generators.seeded_epoch is not None:
            return Checkpoint(
                seq=entry.seq, state=entry.state, rng=None, seeded_epoch=generators.seeded_epoch
            )
        return entry.to_checkpoint()

    def checkpoint_for(self, delivered: int) -> Checkpoint:
        """Returns the newest checkpoint at or before sequence number ``delivered``.

        Raises:
            WorkerError: ``delivered`` lies outside what the ring can answer.
        """
        if self.in_main and delivered == self.seq and not self.failed:
            try:
                self.ring.take(self._capture)
            except Exception as error:
                raise DatasetError(
                    f"{type(error).__name__}: {error} (raised in the main process by the "
                    f"pipeline's save_state() while the loader saved its position after "
                    f"{delivered} events); nothing moved: the loader goes on where it stands",
                    worker_id=self.worker_id,
                    index=delivered,
                ) from error
        entry, oldest = self.ring.find(delivered)
        if entry is None or delivered > max(self.seq, self._replay_target):
            raise WorkerError(
                f"worker {self.worker_id} holds no checkpoint for position {delivered} "
                f"(oldest kept: {oldest}, produced: {self.seq})"
            )
        return self._checkpoint(entry)

    def stats(self) -> dict[str, Any]:
        """Figures for benchmarks and debugging."""
        ring = self.ring.entries()
        return {
            "pid": os.getpid(),
            "seq": self.seq,
            "ring_entries": len(ring),
            "checkpoint_cost_s": self.ring.cost,
            "checkpoints_taken": self.ring.taken,
            "replayed": self.replayed,
            "storage": storage_stats(self.spec.root),
            "checkpoint_bytes": (
                len(msgpack.packb(self._checkpoint(ring[-1]).model_dump(), use_bin_type=True))
                if ring
                else 0
            ),
        }
