"""What torch's ``DataLoader`` iterates: the wrapper that runs the pipeline in a worker.

Torch runs underneath with ``batch_size=None`` over :class:`WorkerWrapper`. In each
worker process (or in the main process without workers) the wrapper starts one
:class:`~savable_loader._worker.runtime.PipelineRuntime` on first use and, with workers, the
command thread that answers the loader's saves (NOTE [ Command channel ] in
``_channel/commands.py``); every ``iter()`` torch makes of it is one epoch of that runtime's
events (NOTE [ Events ] in ``_channel/events.py``). Torch calls :class:`WorkerInit` as the
worker's ``worker_init_fn``: it shows the user's dataset to ``get_worker_info()`` (NOTE
[ The worker's dataset ] in ``_channel/torch_compat.py``) and runs the user's ``worker_init_fn``
(NOTE [ worker_init_fn errors ] in ``_channel/events.py``).

NOTE [ Inherited objects are frozen ]
A forked worker inherits every object of the main process: a training script's model,
tokenizer and metadata, often millions of objects. Python's cyclic collector in the
worker would walk all of them in each full collection, writing to every object's header,
so the worker copies the pages it shares with its parent (copy-on-write) and spends CPU
on objects it never uses; a worker that allocates a lot (an S3 client, decoding JSON)
runs such collections early. So :class:`WorkerInit` calls ``gc.freeze()`` first, as
Python's documentation advises for forked children: what exists when the worker starts
moves to the collector's permanent generation (an O(1) move that touches no object),
and the worker's collections see only what the worker itself creates. Measured in
``tests/stages/test_composed.py``'s S3 check with 2 workers per loader, whose main process held
1.5 million extra objects: 10.3 s, and 3.9 s with the freeze (3.6 s without the extra
objects). A worker's ``gc.get_objects()`` therefore lists only the objects it created;
``gc.unfreeze()`` in ``worker_init_fn`` undoes it.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from .._channel import torch_compat as _torch_compat
from .._channel.commands import CommandServer, check_stacks_signal, register_stacks
from .._channel.events import FAILED_INIT, IDLE, PRODUCING, STARTING, Event, Failure, Progress
from ..errors import WorkerError
from ..storage import object_store
from .runtime import PipelineRuntime, RuntimeSpec, WorkerStart

__all__ = ["WorkerAnswers", "WorkerInit", "WorkerWrapper"]

_WORKER_SWITCH_INTERVAL = 0.001


class WorkerWrapper(IterableDataset[Event]):
    """Starts a :class:`PipelineRuntime` per process and yields its events.

    The loader sets :attr:`spec` before torch starts the workers, so every start method
    carries it (and the command pipes) into the worker.

    It is what torch's iterators read as ``loader.dataset`` while they are built (NOTE
    [ What the loader shows of its arguments ] in ``_main/shown.py``), and it answers for the
    user's dataset there: ``len()`` is the user's dataset's (a ``TypeError`` for a dataset
    without one, as with torch), and an attribute the wrapper does not have is read from
    the user's dataset.
    """

    def __init__(self, spec: RuntimeSpec) -> None:
        self.spec = spec
        self.runtime: PipelineRuntime | None = None
        self.progress = Progress()
        #: What the user's ``worker_init_fn`` raised in this worker, if it did.
        self.init_failure: Failure | None = None
        self._serving = False

    def __len__(self) -> int:
        return len(self.spec.dataset)

    def __getattr__(self, name: str) -> Any:
        # Reached only for what the wrapper lacks; "spec" is missing only while an
        # unpickled copy (spawn) is being built, and dunders stay the wrapper's own.
        if name == "spec" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.spec.dataset, name)

    def __iter__(self) -> Iterator[Event]:
        if self.init_failure is not None:
            self.progress.enter(IDLE, 0)
            if not self._serving:
                self._serve_failed_init()
            return iter((self.init_failure.event(),))
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
        seq = self._start_of(worker_id).delivered
        return Failure.of(error, worker_id, seq, starting=True, in_main=info is None).event()

    def _start_of(self, worker_id: int) -> WorkerStart:
        return self.spec.starts[worker_id] if self.spec.starts else WorkerStart()

    def _serve_failed_init(self) -> None:
        """Answers commands in a worker whose ``worker_init_fn`` raised (NOTE
        [ worker_init_fn errors ] in ``_channel/events.py``): it stands at its start."""
        info = get_worker_info()
        channel = self.spec.channel
        self._serving = True
        if info is None or channel is None:
            return
        answers = WorkerAnswers(info.id, self.progress, self._start_of(info.id))
        answers.init_failure = self.init_failure
        server = CommandServer(channel, info.id, answers)
        server.start()
        server.ready()

    def _start(self) -> PipelineRuntime:
        info = get_worker_info()
        if info is None:
            return PipelineRuntime(self.spec, 0, in_main=True)
        progress = self.progress = Progress()
        progress.enter(STARTING, 0)
        channel = self.spec.channel
        if channel is None:
            return PipelineRuntime(self.spec, info.id, in_main=False, progress=progress)
        # NOTE [ Command channel ] in _channel/commands.py: a command thread waits for the
        # GIL at most this long while the worker runs Python code (default 5 ms).
        sys.setswitchinterval(min(sys.getswitchinterval(), _WORKER_SWITCH_INTERVAL))
        answers = WorkerAnswers(info.id, progress, self._start_of(info.id))
        server = CommandServer(channel, info.id, answers)
        server.start()
        try:
            answers.runtime = PipelineRuntime(self.spec, info.id, in_main=False, progress=progress)
        except BaseException:
            server.fail(traceback.format_exc())
            raise
        server.ready()
        return answers.runtime


class WorkerAnswers:
    """How a worker answers the loader's commands: one method per ``Command``, named as
    its value (NOTE [ Command channel ] in ``_channel/commands.py``).

    Args:
        worker_id: The worker.
        progress: What the worker is doing now.
        start: Where the worker stands when it starts.
    """

    def __init__(self, worker_id: int, progress: Progress, start: WorkerStart) -> None:
        self.worker_id = worker_id
        self.start = start
        self._progress = progress
        #: The running pipeline, once it started; None before, or after a failed init.
        self.runtime: PipelineRuntime | None = None
        #: What the user's ``worker_init_fn`` raised, when it did.
        self.init_failure: Failure | None = None

    def checkpoint(self, delivered: int) -> Any:
        """The newest checkpoint at or before ``delivered``, as a dict."""
        if self.runtime is not None:
            return self.runtime.checkpoint_for(delivered).model_dump()
        start, failure = self.start, self.init_failure
        if start.cut and failure is not None and delivered == start.delivered + 1:
            # A cut this worker could not make (NOTE [ A new iter() starts an epoch ]):
            # the loader raises the hook's error as torch would.
            return {FAILED_INIT: dataclasses.asdict(dataclasses.replace(failure, error=None))}
        if delivered != start.delivered:
            raise WorkerError(
                f"worker {self.worker_id} failed in worker_init_fn and stands at "
                f"{start.delivered}, not {delivered}"
            )
        return None if start.checkpoint is None else start.checkpoint.model_dump()

    def stats(self) -> Any:
        """The worker's figures."""
        if self.runtime is not None:
            return self.runtime.stats()
        return {"pid": os.getpid(), "seq": self.start.delivered}

    def progress(self) -> Any:
        """What the worker is doing now."""
        return self._progress.report()


class WorkerInit:
    """What torch calls as ``worker_init_fn`` in every worker of a loader.

    It makes ``get_worker_info().dataset`` the user's dataset (NOTE [ The worker's
    dataset ] in ``_channel/torch_compat.py``), then runs the user's ``worker_init_fn`` and keeps
    what it raises for the wrapper to report (NOTE [ worker_init_fn errors ] in
    ``_channel/events.py``).

    Args:
        user_fn: The user's ``worker_init_fn``, or None.
    """

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn
        object_store.installed()  # asked here, in the main process: the workers inherit it

    def __call__(self, worker_id: int) -> None:
        gc.freeze()  # NOTE [ Inherited objects are frozen ]
        object_store.allow_in_worker()  # NOTE [ A client outside the GIL ]
        info = get_worker_info()
        wrapper = info.dataset if info is not None else None
        if not isinstance(wrapper, WorkerWrapper):
            raise WorkerError(f"internal error: the worker iterates {wrapper!r}; please report")
        _torch_compat.set_worker_dataset(info, wrapper.spec.dataset)
        channel = wrapper.spec.channel
        if channel is not None:  # NOTE [ Stacks of a hung worker ] in _channel/commands.py
            register_stacks(channel, worker_id)
        if self.user_fn is None:
            return
        try:
            self.user_fn(worker_id)
            if channel is not None:
                check_stacks_signal(channel, worker_id)
        except Exception as error:
            seq = wrapper._start_of(worker_id).delivered
            wrapper.init_failure = Failure.of(
                error, worker_id, seq, starting=True, in_main=False, in_init=True
            )
