"""What torch's ``DataLoader`` iterates: the wrapper that runs the pipeline in a worker.

Torch runs underneath with ``batch_size=None`` over :class:`WorkerWrapper`. In each
worker process (or in the main process without workers) the wrapper starts one
:class:`~savable_loader._runtime.PipelineRuntime` on first use and, with workers, the
command thread that answers the loader's saves (NOTE [ Command channel ] in
``_commands.py``); every ``iter()`` torch makes of it is one epoch of that runtime's
events (NOTE [ Events ] in ``_events.py``).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator

from torch.utils.data import IterableDataset, get_worker_info

from ._commands import CommandServer
from ._events import IDLE, PRODUCING, STARTING, Event, Failure, Progress
from ._runtime import PipelineRuntime, RuntimeSpec

__all__ = ["WorkerWrapper"]

_WORKER_SWITCH_INTERVAL = 0.001


class WorkerWrapper(IterableDataset[Event]):
    """Starts a :class:`PipelineRuntime` per process and yields its events.

    The loader sets :attr:`spec` before torch starts the workers, so every start method
    carries it (and the command pipes) into the worker.
    """

    def __init__(self, spec: RuntimeSpec) -> None:
        self.spec = spec
        self.runtime: PipelineRuntime | None = None
        self.progress = Progress()

    def __iter__(self) -> Iterator[Event]:
        try:
            if self.runtime is None:
                self.progress.enter(STARTING, 0)
                self.runtime = self._start()
            else:
                # Beginning an epoch counts as producing its first event.
                self.progress.enter(PRODUCING, self.runtime.seq)
            return self.runtime.epoch()
        except Exception as error:
            # NOTE [ Pipeline errors ]: a start that failed is one ERROR event too.
            self.progress.enter(IDLE, 0)
            if self.runtime is not None:
                self.runtime.failed = True
                return iter((self.runtime.failure(error, starting=True),))
            return iter((self._start_failure(error),))

    def close(self) -> None:
        """Releases what the pipeline of this process holds open, and forgets it."""
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            runtime.close()

    def _start_failure(self, error: Exception) -> Event:
        info = get_worker_info()
        worker_id = info.id if info is not None else 0
        starts = self.spec.starts
        seq = starts[worker_id].delivered if starts else 0
        return Failure.of(error, worker_id, seq, starting=True, in_main=info is None).event()

    def _start(self) -> PipelineRuntime:
        info = get_worker_info()
        if info is None:
            return PipelineRuntime(self.spec, 0, in_main=True)
        progress = self.progress = Progress()
        progress.enter(STARTING, 0)
        channel = self.spec.channel
        if channel is None:
            return PipelineRuntime(self.spec, info.id, in_main=False, progress=progress)
        # NOTE [ Command channel ] in _commands.py: a command thread waits for the GIL at
        # most this long while the worker runs Python code (default 5 ms).
        sys.setswitchinterval(min(sys.getswitchinterval(), _WORKER_SWITCH_INTERVAL))
        holder: list[PipelineRuntime] = []
        server = CommandServer(
            channel.commands[info.id],
            channel.results[info.id],
            {
                "checkpoint": lambda args: holder[0].checkpoint_for(args["delivered"]).model_dump(),
                "stats": lambda args: holder[0].stats(),
            },
            immediate={"progress": lambda args: progress.report()},
        )
        server.start()
        try:
            holder.append(PipelineRuntime(self.spec, info.id, in_main=False, progress=progress))
        except BaseException:
            server.fail(traceback.format_exc())
            raise
        server.ready()
        return holder[0]
