"""The warning for a loader that shards by rank under a trainer that sees one process.

NOTE [ A trainer that sees one process ]
Launched on several processes (``torchrun``, ``accelerate launch``), a trainer can still
decide it trains on one: Accelerate on a CPU machine without ``cpu=True``, the Hugging
Face ``Trainer`` without ``use_cpu=True`` (its ``parallel_mode`` is then
``NOT_PARALLEL``), a Lightning ``Trainer`` whose ``devices`` count one process. Accelerate
and the ``Trainer`` initialize ``torch.distributed`` all the same, so the loader shards
the data by rank: each process trains a model of its own on its share of the data, the
checkpoints keep rank 0's model only, and nothing fails (after a resume every rank starts
from rank 0's weights, and a rank's losses differ from an uninterrupted run's, which looks
like the loader's fault). Where ``torch.distributed`` is not initialized (Lightning), each
process trains on all the data. The integrations compare what the trainer reports with
the loader's ``world_size`` and with the launcher's ``WORLD_SIZE``, and warn.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from ..errors import SingleProcessTrainerWarning


def _launched_processes() -> int:
    """The launcher's ``WORLD_SIZE`` (torchrun, ``accelerate launch``), 1 if unset."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def warn_if_single_process(loader: Any, processes: int, reported: str, fix: str) -> None:
    """Warns when the trainer reports one process but the loader shards over several
    ranks, or the launcher started several (NOTE [ A trainer that sees one process ]).

    Args:
        loader: A :class:`~savable_loader.SavableDataLoader`.
        processes: The number of processes the trainer reports.
        reported: What reports it, for the message (``accelerator.num_processes``).
        fix: The setting that makes the trainer train on every process.
    """
    if processes != 1:
        return
    if loader.world_size > 1:
        ranks = loader.world_size
        what = (
            f"the loader shards the data over {ranks} ranks (torch.distributed's world "
            f"size) but {reported} is 1: each process trains a model of its own on 1/{ranks} "
            "of the data, and a checkpoint keeps rank 0's model only"
        )
    elif (launched := _launched_processes()) > 1:
        what = (
            f"WORLD_SIZE is {launched} but {reported} is 1: each of the {launched} "
            "processes trains a model of its own on all the data"
        )
    else:
        return
    warnings.warn(f"{what}; {fix}", SingleProcessTrainerWarning, stacklevel=3)
