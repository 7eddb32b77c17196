"""What the loader shows of its sampling and batching arguments (``loader.sampler``,
``batch_size``, ``drop_last``, ``collate_fn``, ``worker_init_fn``), while torch's
``DataLoader`` underneath reads the worker wrapper, an ``IterableDataset`` it does not
batch.

NOTE [ What the loader shows of its arguments ]
``DataLoader`` guards ``sampler``, ``batch_sampler``, ``batch_size``, ``drop_last``,
``dataset`` and ``persistent_workers`` after ``__init__``; the loader sets those it shows
with ``object.__setattr__``, to values torch's iterators work with:

- ``sampler`` is a :class:`SamplerView`. Torch's iterator reads it as its index sampler
  (``DataLoader._index_sampler`` is ``sampler`` while ``batch_sampler`` is None) and only
  iterates it: it yields None forever, as torch's placeholder for an iterable dataset
  does. Every other attribute is the user's sampler's, read and written through the view:
  ``loader.sampler.set_epoch(epoch)`` (what DDP scripts and Lightning call) reaches a
  ``DistributedSampler``, and ``len(loader.sampler)``, ``loader.sampler.num_replicas`` are
  its own. The sampler behind the view is ``sampler=``; else the one the loader draws its
  order from: the ``.sampler`` inside ``batch_sampler=`` (or the batch sampler itself when
  it has none), or with ``generator=`` alone the ``RandomSampler`` or
  ``SequentialSampler`` torch builds. Otherwise there is none, and the view has only what
  torch's placeholder has.
- ``batch_size`` (None beside a ``batch_sampler``, as torch reports) and ``drop_last``:
  torch's iterators read ``drop_last`` only when they batch, and they do not.
- ``collate_fn`` is the user's, or torch's default for the batching (``default_collate``,
  or ``default_convert`` without a batch size), as torch shows it, and ``worker_init_fn``
  the user's (None by default). While the stream builds torch's iterators, which read
  both, they are an identity function (torch hands it every event) and the loader's
  ``WorkerInit`` around the user's function (``Stream._torch_iterator``). Code that
  rebuilds a loader from its attributes (Lightning, Accelerate) so passes the user's
  functions, and a ``worker_init_fn`` set later runs, as with torch, in the workers
  started next, inside the loader's.

Four stay what torch underneath needs:

- ``batch_sampler`` is None: torch's iterators batch whenever it is not None
  (``DataLoader._auto_collation``), fetching as many of the wrapper's events per step as
  the batch has indices. The user's batch sampler is reached through ``loader.sampler``
  (``loader.sampler.set_epoch`` calls its ``set_epoch``, or its sampler's).
- ``persistent_workers`` is ``num_workers > 0``: ``DataLoader.__iter__`` and torch's
  iterator read it to keep the workers, which the loader stops itself at every epoch's end
  when the user passed False (NOTE [ Workers per epoch ] in ``_iterator.py``).
- ``generator`` is what torch draws the workers' base seed from: derived from ``seed`` and
  the rank, or a copy of the user's generator as it stood before the epoch's draws.
- ``dataset`` is the worker wrapper torch sends to the workers; the user's dataset is
  ``loader.source`` or, for a map-style dataset, ``loader.source.data``.

NOTE [ A collate_fn set later ]
Torch lets ``loader.collate_fn`` be set after ``__init__`` and reads it whenever it
starts workers (or, without workers, at every ``iter()``). The loader batches inside the
pipeline (``Batch``), so setting it changes the pipeline's ``Batch`` and the fingerprint
(``Pipeline.use_collate``). If the stream is running, the loader first stops it keeping
its position, as after a pipeline error (NOTE [ Errors stop the stream ] in
``_iterator.py``): the next batch handed on is the first collated by the new function,
prefetched ones included, and a state saved from then on carries the new function's
name, so a script that sets it the same way before restoring resumes exactly. Torch
differs in two ways, both unsavable: its running workers keep the old function until
they restart, and persistent ones forever. A dataset that cannot save its position
cannot have the function changed while the stream runs (``ConfigError``). Setting
torch's default back restores the pipeline as built with ``collate_fn=None``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import Sampler

from . import _torch_compat

if TYPE_CHECKING:
    from ._sampling import EpochPlanner

__all__ = ["SamplerView", "shown_arguments"]

_NONE = "the loader has no sampler=, batch_sampler= or generator= to show"


class SamplerView(Sampler[None]):
    """``loader.sampler``: yields None forever, as torch's placeholder for an iterable
    dataset does, and is otherwise the user's sampler (NOTE [ What the loader shows of its
    arguments ]).

    Args:
        target: The user's sampler, or None when there is none.
    """

    def __init__(self, target: Any) -> None:
        object.__setattr__(self, "_target", target)

    def __iter__(self) -> Iterator[None]:
        while True:
            yield None

    def __len__(self) -> int:
        target = self.__dict__["_target"]
        if target is None:
            raise TypeError(f"object of type {type(self).__name__!r} has no len(): {_NONE}")
        return len(target)

    def __getattr__(self, name: str) -> Any:
        target = self.__dict__.get("_target")
        if target is None or name.startswith("__"):  # copy and pickle probe dunder names
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(target, name)

    def __setattr__(self, name: str, value: Any) -> None:
        target = self.__dict__.get("_target")
        if target is None:
            object.__setattr__(self, name, value)
        else:
            setattr(target, name, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__.get('_target')!r})"


def shown_arguments(
    planner: EpochPlanner | None,
    sampler: Any,
    batch_sampler: Any,
    batch_size: int | None,
    drop_last: bool,
    in_order: bool,
    collate_fn: Any,
) -> dict[str, Any]:
    """The attributes the loader sets after ``DataLoader.__init__``, by name (NOTE [ What
    the loader shows of its arguments ]).

    Args:
        planner: The loader's epoch planner (``_sampling.py``), or None.
        sampler: The loader's ``sampler=`` argument; ``batch_sampler``, ``batch_size``,
            ``drop_last`` and ``in_order`` likewise (``in_order`` shown only where torch
            has the attribute, 2.6 on: the loader passes True to torch).
        collate_fn: What ``loader.collate_fn`` shows (``Pipeline.collate_fn``).
    """
    target = sampler if sampler is not None else None if planner is None else planner.sampler
    shown = {
        "sampler": SamplerView(target),
        "batch_size": None if batch_sampler is not None else batch_size,
        "drop_last": drop_last,
        "collate_fn": collate_fn,
    }
    if _torch_compat.in_order_argument():
        shown["in_order"] = in_order
    return shown
