"""How the loader stops its stream and keeps its position: after an error (NOTE
[ Errors stop the stream ] in ``_main/iterator.py``) and when a new ``iter()`` cuts the
current epoch short (NOTE [ A new iter() starts an epoch ] there).

:class:`StreamStops` is a part of :class:`~savable_loader.SavableDataLoader`, kept apart
because it is one job: stopping the workers while the bookkeeping (``_main/book.py``) and the
checkpoints the workers hand back stay in agreement, so that the next stream starts
exactly where the last item handed on left the loader. It runs in the main process.

NOTE [ A cut before a sampler's next order ]
A loader reading a sampler sends each epoch's order to its workers with the pipeline
(NOTE [ Epoch orders ] in ``_main/sampling.py``), and a cut worker must replay the rest of the
old epoch's position under the old order before it drops it. So when the new epoch has
an order still to draw, the cut runs on *idle* workers first: they restore, replay, cut
and checkpoint, then produce nothing (as a worker whose epoch already ended); the loader
takes their checkpoints, stops them, draws the new order and starts the workers of the
new epoch from those checkpoints, as after an epoch's end. Other loaders cut and go on
with the same workers.
"""

from __future__ import annotations

from collections.abc import Callable

from .._channel.events import Failure
from .._resume.layout import Layout
from .._worker.wrapper import WorkerWrapper
from ..errors import SavableLoaderError, WorkerError
from ..state.models import Checkpoint
from .book import Book
from .sampling import EpochPlanner
from .stream import Hang, Stream

__all__ = ["StreamStops"]


class StreamStops:
    """The loader's ways of stopping its stream while keeping its position."""

    _stream: Stream | None
    _book: Book
    _started: Book
    _broken: str | None
    _wrapper: WorkerWrapper
    layout: Layout
    num_workers: int
    _planner: EpochPlanner | None
    _stop_stream: Callable[[], None]
    _start_stream: Callable[..., None]
    _current_checkpoints: Callable[[], list[Checkpoint | None]]

    def _cut_epoch(self) -> None:
        """Drops the rest of the current epoch and starts the next one on fresh workers,
        which confirm where they stand before anything is handed on (NOTE [ A new iter()
        starts an epoch ] in ``_main/iterator.py``).

        Raises:
            WorkerError: A worker died or hung; the loader stays where it stood.
            DatasetError: The pipeline raised while it dropped the epoch; likewise.
        """
        checkpoints = self._current_checkpoints()
        self._stop_stream()
        self._book.resume = checkpoints
        before = self._book.copy()
        self._book.cut_epoch()
        cutting = list(self._book.cutting)
        # NOTE [ A cut before a sampler's next order ]
        redraw = self._planner is not None and self._planner.needs_draw(self._book.epoch)
        try:
            self._start_stream(new_epoch=True, idle=redraw)
            self._book.settle_cut()
            stream = self._stream
            if stream is None:
                raise SavableLoaderError("internal error: no stream after a cut; please report")
            if self.num_workers == 0 and self._wrapper.runtime is None:
                _, _, _, failure = stream.next_event()  # the start failed: its ERROR event
                raise failure.raised(in_worker=False, epoch=before.epoch, lost=None)
            resume = self._book.resume
            known = {w: resume[w] for w in range(len(resume)) if w not in cutting}
            self._book.resume = list(stream.checkpoints(self._book.delivered, known))
            if redraw:
                self._stop_stream()
                self._start_stream(new_epoch=True)
        except BaseException:
            self._stop_stream()
            self._book = before
            self._started = before.copy()
            raise
        self._started = self._book.copy()

    def _raise_if_workers_died(self, error: BaseException, during: str) -> None:
        """Turns ``error`` into a :class:`WorkerError` (stopping the rest) if workers died."""
        stream = self._stream
        if stream is None or not (dead := stream.dead_workers(error)):
            return
        how = stream.how_they_died(dead)  # before the stop, which forgets the processes
        self._stop_stream()
        self._broken = (
            f"worker(s) {dead} died {during}, so the loader lost its position; restore a "
            "saved state with restore_state_rank() (or restore_state_rank(None) to start over)"
        )
        raise WorkerError(
            f"worker(s) {dead} died {during}{how}; restore the last saved state "
            f"(restore_state_rank) to resume ({error})"
        ) from error

    def _halt(self, hang: Hang | None = None) -> str | None:
        """Stops the stream after an error, keeping the position if the workers tell it,
        nothing was handed on, or a ``hang``'s workers never started (NOTE [ Workers that
        never started ] in _iterator.py); returns why it was lost, or None."""
        stream = self._stream
        if stream is None:
            return self._broken
        try:
            if self._book != self._started:
                self.layout.check_savable()  # no position to go back to
                known = self._book.unmoved(self._started, hang.unstarted if hang else [])
                if hang and not hang.answering and not set(hang.workers) <= set(known):
                    raise WorkerError(f"hung worker(s) {hang.workers} cannot answer")
                self._book.resume = stream.checkpoints(self._book.delivered, known)
        except Exception as error:  # a dead or hung worker: WorkerError, torch's RuntimeError
            self._broken = (
                f"after an error the loader could not get its workers' checkpoints ({error}); "
                "restore a saved state with restore_state_rank() (or restore_state_rank(None) "
                "to start over)"
            )
        stream.kill(hang.workers if hang else [])
        self._stop_stream()
        return self._broken

    def _raise_failure(self, failure: Failure) -> None:
        """Stops the stream and raises the error the pipeline raised."""
        lost = self._halt()
        raise failure.raised(in_worker=self.num_workers > 0, epoch=self._book.epoch, lost=lost)
