"""What the loader handed on, worker by worker: its bookkeeping of the stream.

NOTE [ Worker order ]
With ``in_order=True`` torch hands out events in round-robin order over workers,
skipping workers whose epoch ended, and every epoch starts at worker 0. The loader
records, per worker, the events it handed on (``delivered``), whether the worker's epoch
ended, and which worker comes next. After a restore the first event must come from the
saved next worker ``k``, while worker identities (the shards of
``get_worker_info().id``) stay put: in the first resumed epoch each live worker before
``k`` yields one placeholder, which the loader drops, so torch's own round-robin lands on
``k``. Workers whose epoch had ended yield nothing in that epoch. From the next epoch on
nothing differs from an uninterrupted run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._channel.events import END
from .._resume.layout import Layout
from .._version import __version__
from .._worker.runtime import WorkerStart
from ..errors import SavableLoaderError
from ..state.models import FORMAT_VERSION, Checkpoint, OrderState, RankState, WorkerState

__all__ = ["Book"]


@dataclass
class Book:
    """What the loader handed on (NOTE [ Worker order ]).

    Attributes:
        epoch: The current epoch (the one in progress, or the last one ended).
        delivered: Per worker, the events handed on (end markers included).
        ended: Per worker, whether its end of the current epoch was handed on.
        next_worker: The worker whose event comes next in torch's round-robin.
        resume: Per worker, the checkpoint it starts from when the workers start next
            (None: the pipeline's beginning); not part of the comparison of two books.
    """

    epoch: int
    delivered: list[int]
    ended: list[bool]
    next_worker: int
    resume: list[Checkpoint | None] = field(compare=False)
    #: The workers whose epoch the loader cut (NOTE [ A new iter() starts an epoch ] in
    #: ``_main/iterator.py``) and that have not yet confirmed the cut with a checkpoint.
    cutting: list[int] = field(default_factory=list, compare=False)

    @classmethod
    def fresh(cls, workers: int) -> Book:
        return cls(0, [0] * workers, [False] * workers, 0, [None] * workers)

    @classmethod
    def of(cls, state: RankState) -> Book:
        return cls(
            state.epoch,
            [w.delivered for w in state.workers],
            [w.ended for w in state.workers],
            state.next_worker,
            [w.checkpoint for w in state.workers],
        )

    def copy(self) -> Book:
        return Book(
            self.epoch,
            list(self.delivered),
            list(self.ended),
            self.next_worker,
            list(self.resume),
            list(self.cutting),
        )

    def unmoved(self, started: Book, workers: list[int]) -> dict[int, Checkpoint | None]:
        """The start checkpoints of those of ``workers`` that handed nothing on since the
        book stood at ``started``: their position, without asking them."""
        return {
            w: started.resume[w]
            for w in workers
            if self.epoch == started.epoch and self.delivered[w] == started.delivered[w]
        }

    def starts(self, *, new_epoch: bool, idle: bool = False) -> tuple[WorkerStart, ...]:
        """How every worker starts from here (NOTE [ Worker order ]); ``idle`` workers
        produce nothing in the epoch (NOTE [ A cut before a sampler's next order ] in
        ``_main/stops.py``)."""
        return tuple(
            WorkerStart(
                checkpoint=self.resume[w],
                delivered=self.delivered[w],
                skip_epoch=self.ended[w] or idle,
                placeholder=w < self.next_worker and not self.ended[w],
                new_epoch=new_epoch,
                cut=w in self.cutting,
            )
            for w in range(len(self.delivered))
        )

    def state(
        self, checkpoints: list[Checkpoint | None], layout: Layout, order: OrderState | None
    ) -> RankState:
        """The saved state of this position, with each worker's checkpoint and how the
        epoch's order was drawn."""
        return RankState(
            format_version=FORMAT_VERSION,
            library_version=__version__,
            fingerprint=layout.fingerprint,
            rank=layout.rank,
            world_size=layout.world_size,
            num_workers=layout.num_workers,
            batch_size=layout.batch_size,
            seed=layout.seed,
            epoch=self.epoch,
            next_worker=0 if self.all_ended() else self.next_worker,
            workers=tuple(
                WorkerState(
                    worker_id=w,
                    delivered=self.delivered[w],
                    ended=self.ended[w],
                    checkpoint=checkpoints[w],
                )
                for w in range(len(self.delivered))
            ),
            order=order,
            callables=layout.callables,
        )

    def all_ended(self) -> bool:
        return all(self.ended)

    def unended(self) -> list[int]:
        return [w for w, ended in enumerate(self.ended) if not ended]

    def start_epoch(self) -> None:
        self.epoch += 1
        self.ended = [False] * len(self.ended)
        self.next_worker = 0

    def cut_epoch(self) -> None:
        """Starts the next epoch before every worker ended this one: the unended workers
        will drop the rest of it, each counting the cut as one event once it confirms
        (:meth:`settle_cut`; NOTE [ A new iter() starts an epoch ] in ``_main/iterator.py``)."""
        self.cutting = self.unended()
        self.start_epoch()

    def settle_cut(self) -> None:
        """Counts the cut of every cutting worker as an event handed on."""
        for worker_id in self.cutting:
            self.delivered[worker_id] += 1
        self.cutting = []

    def hand_on(self, worker_id: int, seq: int, kind: int) -> None:
        """Records that event ``seq`` of ``worker_id`` (an item or an END) was handed on."""
        if seq != self.delivered[worker_id] or self.ended[worker_id]:
            raise SavableLoaderError(
                f"internal error: worker {worker_id} sent event {seq} but the loader expected "
                f"{self.delivered[worker_id]} (ended={self.ended[worker_id]}); please report"
            )
        self.delivered[worker_id] = seq + 1
        if kind == END:
            self.ended[worker_id] = True
        workers = len(self.ended)
        for step in range(1, workers + 1):
            candidate = (worker_id + step) % workers
            if not self.ended[candidate]:
                self.next_worker = candidate
                return
        self.next_worker = 0
