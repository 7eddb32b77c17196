"""The iterator ``iter(loader)`` returns, and the stream's lifecycle: how epochs and
workers follow each other, and what an error does to the stream.

NOTE [ A new iter() starts an epoch ]
As with torch's ``DataLoader``, every ``iter(loader)`` (every ``for`` loop) begins a new
epoch, except the first ``iter()`` of a loader and the first after a restore
(``restore_state_rank``, ``restore_state_global``, ``load_state_dict``), which continue
from where the loader stands: the start of epoch 0, or the restored position, mid-epoch
or between epochs. So a peek (``next(iter(loader))``) followed by a ``for`` loop reads
the whole next epoch, a loop left with ``break`` is followed by a whole new epoch, and a
state saved mid-epoch (after a ``break`` too) restores to that mid-epoch position: a job
stopped at ``max_steps`` and restarted with more steps goes on where it stopped.

A new epoch begun before the current one ended *cuts* it. The loader asks every worker
for its checkpoint at the last item it handed on, stops the workers, and starts new ones
that restore it, replay up to it and drop the rest of the epoch with the cursor tree's
``end_epoch()`` (the library's sources skip it without reading; a dataset of yours begins
its next iteration with a new ``iter(dataset)`` from where it stands, as a persistent
torch worker would). Each counts the cut as one event (NOTE [ Sequence numbers ] in
``state/models.py``), seeds its generators for the new epoch and takes a checkpoint
there, which the loader fetches before ``iter()`` returns: from then on the bookkeeping
and the workers agree, and a state saved at any point, right after the cut too, restores
exactly. If a worker dies or the pipeline raises during the cut, the loader stays where
it stood and ``iter()`` raises. All iterators read the one stream: an older iterator
goes on with the new epoch, as iterators of torch's persistent workers share them.

NOTE [ Errors stop the stream ]
When the pipeline raises (an ERROR event, NOTE [ Pipeline errors ] in ``_channel/events.py``) or
anything else escapes torch's iterator, the loader stops the stream (workers, queues,
command pipes) before the error reaches the user, and keeps its bookkeeping, which stands
exactly after the last item handed on. It first asks the workers for checkpoints at that
position (no request when nothing was handed on since the stream started: the start
checkpoints still hold), so the loader is as if that position had been saved and
restored: the next iteration starts fresh workers that replay up to it and retry the
failing item, ``save_state_rank()`` saves it, and ``restore_state_rank()`` moves
anywhere else. If the position cannot be had (a worker died or hung), the loader is
*broken*: iterating or saving raises an error saying so, until a restore. An error from
the pipeline is raised as :class:`DatasetError` naming the worker and the item, chained
from the original exception (the object itself without workers; with workers a copy of
its type, and the worker's traceback in the message, as torch does); the library's own
errors (StateError, StorageError, ...) keep their type. An error of a map-style read
stops nothing: it is handed on in its turn and the stream goes on
(NOTE [ Going on after an error ] in ``_worker/runtime.py``).
NOTE [ Workers that never started ]
A worker can hang before any of the loader's code runs in it, in torch's start-up of the
process: a CPython without the fix of python/cpython#112275 (3.11.7 here) can deadlock
a child forked while another thread (a gloo thread of ``torch.distributed`` dropping a
finished collective's tensors) holds the interpreter's thread-state lock, and glibc can
leave a C++ static's ``atexit`` lock held the same way (pytorch/pytorch#130610); torch's
own ``DataLoader`` then waits forever. The watchdog finds such a worker after
``command_timeout`` (its stacks pipe never got a marker: NOTE [ Stacks of a hung worker ]
in ``_channel/commands.py``). It handed nothing on, so its position is the checkpoint it started
from, and the loader's position is kept whatever the other workers delivered. The
loader then stops the stream and starts it again from there, which replays exactly,
logging a warning; at most twice in a row, after which the ``WorkerError`` is raised as
for any hang. A save that meets such a worker returns the position (the workers start
again next).
NOTE [ Workers per epoch ]
With ``persistent_workers=False`` (torch's default) the workers of an epoch stop when it
ends and new ones start with the next, as with torch: each new worker starts from the
checkpoint its predecessor took at the end of the epoch (``Checkpoint`` at the END
event), exactly as after a restore between epochs, so the stream does not change. A
loader reading a sampler (NOTE [ Samplers are sources ] in ``datasets/index/sampled.py``)
starts its workers for every epoch whatever ``persistent_workers`` says, since each
epoch's order travels with the pipeline to the workers; its workers' generators follow
``persistent_workers`` all the same (NOTE [ Torch's worker seeds ] in ``_worker/runtime.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["LengthCheck", "LoaderIterator"]


@dataclass(frozen=True)
class LengthCheck:
    """Torch's warning when an iterator over an ``IterableDataset`` yields more than the
    dataset's length once ``len(loader)`` was read (torch compares the batches an iterator
    yields with ``len(dataset)``, and so does this).

    Attributes:
        length: ``len(dataset)`` when ``len(loader)`` was read.
        dataset: The user's dataset, named in the warning.
        num_workers: The loader's workers (the warning then suggests sharding).
    """

    length: int
    dataset: Any
    num_workers: int

    def check(self, yielded: int) -> None:
        if yielded <= self.length:
            return
        message = (
            f"Length of IterableDataset {self.dataset} was reported to be {self.length}"
            f"(when accessing len(dataloader)), but {yielded} samples have been fetched. "
        )
        if self.num_workers > 0:
            message += (
                "For multiprocessing data-loading, this could be caused by not properly "
                "configuring the IterableDataset replica at each worker. Please see "
                "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                "for examples."
            )
        warnings.warn(message, stacklevel=3)


class LoaderIterator(Iterator[Any]):
    """An iterator over a loader's stream for the current epoch (NOTE [ A new iter()
    starts an epoch ]).

    Args:
        next_item: The loader's next item; raises StopIteration when the epoch ends.
        length: Torch's check of an iterable dataset's length, as ``len(loader)`` left
            it when the iterator was made (None: no check, as before any ``len()``).
    """

    def __init__(self, next_item: Callable[[], Any], length: LengthCheck | None = None) -> None:
        self._next_item = next_item
        self._length = length
        self._yielded = 0
        self._done = False

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            item = self._next_item()
        except StopIteration:
            self._done = True
            raise
        self._yielded += 1
        if self._length is not None:
            self._length.check(self._yielded)
        return item
