"""Torch's ``IterDataPipe`` read as torch's ``DataLoader`` reads one.

NOTE [ DataPipes ]
Torch's ``DataLoader`` does three things for an ``IterDataPipe`` that it does for no
other dataset, and the loader, which hands torch its worker wrapper instead, does them
itself:

- ``shuffle=`` switches the pipe's ``shuffle()`` steps on or off
  (``graph_settings.apply_shuffle_settings``) instead of being refused. The probe of the
  arguments (``_torch_probe`` in ``savable_loader/_main/pipeline.py``) is torch's own
  ``DataLoader`` and already does it, on the user's pipe, as torch does.
- Its ``sharding_filter()`` steps keep one item in ``workers * world_size`` in each
  worker, the worker ``w`` of rank ``r`` keeping share ``w * world_size + r``, torch's
  numbering (``shard``, from the pipe's cursor). Without it every worker would yield
  every item.
- Before every epoch it gives the pipe's random steps (``shuffle()``) one seed, the same
  in every worker and on every rank, so that they shuffle alike before the sharding
  filter splits the items (``seed_epoch``). Torch draws that seed from the loader's
  generator (the global one by default) and broadcasts it over the ranks; the loader
  derives it from its ``seed`` and the epoch, which every rank shares, and gives it in
  the main process before the epoch's workers start, so that the workers of a pipe
  start anew every epoch whatever ``persistent_workers`` says (as with a sampler). The
  order is therefore the loader's, reproducible from its seed, not torch's.

A pipe has no position of its own: it iterates, and saving raises, as for any
``IterableDataset`` without one (NOTE [ Datasets without a position ] in ``datasets/adapt.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from ...config import WorkerContext
from ...rng import Purpose, seed_for

try:  # torch may drop DataPipes one day; without them nothing here applies
    from torch.utils.data import IterDataPipe
    from torch.utils.data.graph_settings import apply_random_seed, apply_sharding
except ImportError:  # pragma: no cover - torch 2.4 to 2.13 have them
    IterDataPipe = None  # type: ignore[misc,assignment]

__all__ = ["is_datapipe", "seed_epoch", "shard"]


def is_datapipe(dataset: Any) -> bool:
    """Whether ``dataset`` is torch's ``IterDataPipe`` (NOTE [ DataPipes ])."""
    return IterDataPipe is not None and isinstance(dataset, IterDataPipe)


def shard(pipe: Any, context: WorkerContext) -> None:
    """Makes ``pipe``'s sharding filters keep this worker's share (NOTE [ DataPipes ])."""
    workers = max(context.num_workers, 1)
    share = context.worker_id * context.world_size + context.rank
    apply_sharding(pipe, workers * context.world_size, share)


def seed_epoch(pipe: Any, seed: int, epoch: int) -> None:
    """Seeds ``pipe``'s random steps for ``epoch`` alike everywhere (NOTE [ DataPipes ])."""
    generator = torch.Generator().manual_seed(seed_for(Purpose.DATAPIPE, seed, epoch))
    apply_random_seed(pipe, generator)
