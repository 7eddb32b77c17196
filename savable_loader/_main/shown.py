"""What the loader shows of its arguments (``loader.dataset``, ``sampler``,
``batch_sampler``, ``collate_fn``, ...) and what torch's ``DataLoader`` underneath reads
instead.

NOTE [ What the loader shows of its arguments ]
Torch's ``DataLoader`` underneath reads the worker wrapper, an ``IterableDataset`` it does
not batch, and starts workers with the loader's own ``worker_init_fn``. Code that reads a
loader's attributes (Lightning, Accelerate, a script's ``len(loader.dataset)``, a DDP
loop's ``loader.sampler.set_epoch``) must see what torch's ``DataLoader`` shows instead,
and code that rebuilds a loader from them must build the same loader again. So the loader
keeps two sets of values for the attributes torch's iterators read:

- what it shows, set after ``DataLoader.__init__`` with ``object.__setattr__`` (torch
  guards some of them): ``dataset`` (the user's), ``sampler`` and ``batch_sampler`` (the
  user's, or the ones torch builds over the same arguments: ``Pipeline.sampler``, the
  very objects the loader draws each epoch's order from), ``batch_size`` (None beside a
  ``batch_sampler``, as torch reports), ``drop_last``, ``collate_fn`` (the user's, or
  torch's default for the batching: ``default_collate``, or ``default_convert`` without
  a batch size), ``worker_init_fn`` (the user's, None by default), ``generator`` (the
  user's, None by default), ``persistent_workers`` (as passed) and, from torch 2.6,
  ``in_order``;
- what torch's iterators need (:func:`torch_arguments`): the worker wrapper, torch's
  endless placeholder sampler and no batch sampler (torch batches whenever there is
  one), an identity ``collate_fn`` (torch hands on every event as it is), the loader's
  ``WorkerInit`` around the user's current ``worker_init_fn``, the generator torch draws
  the workers' base seed from (derived from ``seed`` and the rank, or a copy of the
  user's generator as it stood before the epoch's draws), and ``persistent_workers``
  True with workers (the loader stops them itself at every epoch's end when the user
  passed False: NOTE [ Workers per epoch ] in ``_main/iterator.py``).

``Stream._torch_iterator`` puts the second set in place while ``DataLoader.__iter__``
builds or resets torch's iterator, which keeps what it read, and the first back right
after. So ``loader.sampler.set_epoch(epoch)`` reaches a ``DistributedSampler`` itself,
``isinstance(loader.sampler, DistributedSampler)`` holds, ``len(loader.dataset)`` is the
dataset's, and a loader rebuilt as ``type(loader)(loader.dataset, sampler=...,
batch_size=loader.batch_size, ...)`` (Lightning injecting a ``DistributedSampler``) is
the same pipeline with that sampler. Lightning records the dataset each ``__init__`` of
the chain passed on (``__dataset``), the last being the wrapper given to
``DataLoader.__init__``, and rebuilds over that record: the loader points it back at the
user's dataset, or Lightning would take the wrapper, an ``IterableDataset``, and inject
no sampler.

NOTE [ A collate_fn set later ]
Torch lets ``loader.collate_fn`` be set after ``__init__`` and reads it whenever it
starts workers (or, without workers, at every ``iter()``). The loader batches inside the
pipeline (``Batch``), so setting it changes the pipeline's ``Batch`` and the fingerprint
(``Pipeline.use_collate``). If the stream is running, the loader first stops it keeping
its position, as after a pipeline error (NOTE [ Errors stop the stream ] in
``_main/iterator.py``): the next batch handed on is the first collated by the new function,
prefetched ones included, and a state saved from then on carries the new function's
name, so a script that sets it the same way before restoring resumes exactly. Torch
differs in two ways, both unsavable: its running workers keep the old function until
they restart, and persistent ones forever. A dataset that cannot save its position
cannot have the function changed while the stream runs (``ConfigError``). Setting
torch's default back restores the pipeline as built with ``collate_fn=None``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .._channel import torch_compat as _torch_compat

if TYPE_CHECKING:
    from .pipeline import Pipeline

__all__ = ["SWAPPED", "PicklesOwnGenerators", "shown_arguments", "torch_arguments"]

#: The attributes torch's iterators read that show something else to the user.
SWAPPED = (
    "dataset",
    "sampler",
    "batch_sampler",
    "batch_size",
    "drop_last",
    "generator",
    "persistent_workers",
)


def shown_arguments(
    pipeline: Pipeline,
    batch_sampler: Any,
    batch_size: int | None,
    drop_last: bool,
    in_order: bool,
    generator: Any,
    persistent_workers: bool,
) -> dict[str, Any]:
    """The attributes the loader shows, by name (NOTE [ What the loader shows of its
    arguments ]).

    Args:
        pipeline: The loader's pipeline (its dataset, samplers and collate function as
            torch shows them).
        batch_sampler: The loader's ``batch_sampler=`` argument; ``batch_size``,
            ``drop_last``, ``in_order`` (shown only where torch has the attribute, 2.6
            on: the loader passes True to torch), ``generator`` and
            ``persistent_workers`` likewise.
    """
    shown = {
        "dataset": pipeline.dataset,
        "sampler": pipeline.sampler,
        "batch_sampler": pipeline.batch_sampler,
        "batch_size": None if batch_sampler is not None else batch_size,
        "drop_last": drop_last,
        "collate_fn": pipeline.collate_fn,
        "generator": generator,
        "persistent_workers": persistent_workers,
    }
    if _torch_compat.in_order_argument():
        shown["in_order"] = in_order
    return shown


class PicklesOwnGenerators:
    """Pickles the loader with its own generators (``_own_generator`` and the one torch
    reads) as their states, and builds them again on unpickling.

    NOTE [ A loader sent to a spawned process ]
    ``torch.multiprocessing`` sends a tensor to another process through shared memory,
    and a ``torch.Generator`` pickles as its state tensor, which a spawned process fails
    to map ("unable to resize file"): a loader that holds one cannot be an argument of
    ``mp.spawn`` (Lightning's ``ddp_spawn``). Torch's ``DataLoader`` holds none unless
    given ``generator=``; this loader always holds two of its own, so they travel as
    bytes instead. A ``generator=`` of the user's travels as torch sends it, as with
    torch's loader.
    """

    __dict__: dict[str, Any]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_for_torch"] = dict(state["_for_torch"])
        state["_own_generator"] = _as_bytes(state["_own_generator"])
        state["_for_torch"]["generator"] = _as_bytes(state["_for_torch"]["generator"])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["_own_generator"] = _as_generator(state["_own_generator"])
        state["_for_torch"]["generator"] = _as_generator(state["_for_torch"]["generator"])
        self.__dict__.update(state)


class _GeneratorState(bytes):
    """A pickled loader's own generator (NOTE [ A loader sent to a spawned process ])."""


def _as_bytes(generator: Any) -> Any:
    if type(generator) is not torch.Generator or generator.device.type != "cpu":
        return generator
    return _GeneratorState(generator.get_state().numpy().tobytes())


def _as_generator(value: Any) -> Any:
    if not isinstance(value, _GeneratorState):
        return value
    generator = torch.Generator()
    generator.set_state(torch.frombuffer(bytearray(value), dtype=torch.uint8))
    return generator


def torch_arguments(loader: Any) -> dict[str, Any]:
    """What torch's ``DataLoader.__init__`` set on ``loader`` for the attributes in
    :data:`SWAPPED`: the values its iterators need (NOTE [ What the loader shows of its
    arguments ])."""
    return {name: loader.__dict__[name] for name in SWAPPED}
