"""Hugging Face ``Trainer``: ``resume_from_checkpoint`` restores the loader's position.

Install with the ``transformers`` extra (``python3 -m pip install ".[transformers]"`` from
a checkout).
Use :class:`SavableTrainer` in place of ``transformers.Trainer`` with
``TrainingArguments(..., ignore_data_skip=True)``; ``trainer.train(resume_from_checkpoint=...)``
then continues the data stream where the checkpoint left it, without reading the skipped
batches again.

NOTE [ What the Trainer does with a loader on resume ]
``Trainer`` (transformers 5) builds its train loader in ``get_train_dataloader`` and
passes it through ``accelerator.prepare``, which would re-create a ``SavableDataLoader``
(NOTE [ What Accelerate does with a loader ] in ``accelerate.py``). On a resume it counts
the epochs and steps done from ``trainer_state.json`` and, unless
``ignore_data_skip=True``, calls Accelerate's ``skip_first_batches``, which re-creates the
loader again and reads every skipped batch. :class:`SavableTrainer`:

1. builds a :class:`TrainerSavableDataLoader` from ``train_dataset`` and the
   ``TrainingArguments`` (batch size, collator with unused columns removed, workers,
   ``dataloader_drop_last``, ``data_seed`` or ``seed``); ``prepare()`` leaves it as is;
2. requires ``ignore_data_skip=True``, so that nothing is skipped: with it the Trainer
   starts the resumed epoch's step count at 0 and asks for a whole epoch, gets the
   batches the loader has left in it, then a ``StopIteration`` it handles as the epoch's
   end (the steps it did not get are not trained, and ``global_step`` stays exact);
3. adds :class:`SavableLoaderCallback`, whose ``on_save`` writes every rank's state
   (``save_state_global``, a collective: the Trainer calls ``on_save`` on every process)
   to ``savable_loader_state.msgpack`` in the checkpoint folder, and which restores it
   (``restore_state_global``) at ``on_train_begin``, after the Trainer read the
   checkpoint and before the first batch.

The Trainer reads ``len(loader)`` batches per epoch and never asks for one more, so the
loader never sees the end of a full epoch: each ``iter()`` of a
:class:`TrainerSavableDataLoader` moves on to the next epoch at its first ``next()`` when
the current one has nothing left, as a new iterator of torch's ``DataLoader`` would.

Limits: ``gradient_accumulation_steps`` must divide the batches of an epoch for a
mid-epoch resume (the resumed epoch's count starts at 0, so its last, shorter
accumulation would not step the optimizer; the callback refuses such a resume); the
per-step ``epoch`` fraction the Trainer logs in the resumed epoch counts from that
epoch's restart; hyperparameter search runs are not covered (the callback writes under
``output_dir``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ..distributed import restore_state_global, save_state_global
from ..errors import ConfigError, StateFileNotFoundError
from ..state.files import load_state, save_state
from ._processes import warn_if_single_process
from .accelerate import AccelerateSavableDataLoader

try:
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, get_last_checkpoint
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "savable_loader.integrations.hf_trainer needs Hugging Face transformers: "
        'python3 -m pip install ".[transformers]" in a checkout of savable_loader'
    ) from error

__all__ = ["STATE_FILE", "SavableLoaderCallback", "SavableTrainer", "TrainerSavableDataLoader"]

#: The loader's state file in a checkpoint folder.
STATE_FILE = "savable_loader_state.msgpack"

_FIX = (
    "on a CPU machine, pass TrainingArguments(..., use_cpu=True) so that the Trainer "
    "trains on every process (DDP over gloo)"
)


class _EpochIterator(Iterator[Any]):
    """Starts at its first ``next()`` and moves past an epoch it finds exhausted."""

    def __init__(self, start: Callable[[], Iterator[Any]]) -> None:
        self._start = start
        self._inner: Iterator[Any] | None = None

    def __next__(self) -> Any:
        if self._inner is not None:
            return next(self._inner)
        self._inner = self._start()
        try:
            return next(self._inner)
        except StopIteration:
            self._inner = self._start()
            return next(self._inner)


class TrainerSavableDataLoader(AccelerateSavableDataLoader):
    """An :class:`~savable_loader.integrations.accelerate.AccelerateSavableDataLoader`
    whose each ``iter()`` gives an epoch as the ``Trainer`` reads it (NOTE [ What the
    Trainer does with a loader on resume ]). Takes the same arguments.

    Raises:
        ConfigError: As :class:`~savable_loader.SavableDataLoader`.
    """

    #: The ``Trainer`` reports its processes as ``args.world_size``, which
    #: :class:`SavableLoaderCallback` compares with the loader's ranks.
    _checks_processes = False

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """Returns an iterator over one epoch, each batch on the process's device."""
        self._check_usable()
        return _EpochIterator(super().__iter__)


def _is_hf_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is a Hugging Face ``datasets.Dataset`` (imported if so)."""
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(dataset, datasets.Dataset)


def _loaders(trainer_loader: Any) -> list[TrainerSavableDataLoader]:
    return [trainer_loader] if isinstance(trainer_loader, TrainerSavableDataLoader) else []


def _check_accumulation(loader: TrainerSavableDataLoader, accumulation: int, step: int) -> None:
    """Refuses a mid-epoch resume whose last accumulation would not step the optimizer."""
    try:
        batches = len(loader)
    except TypeError:  # no length: the Trainer counts by max_steps
        return
    updates = -(-batches // accumulation)
    if batches % accumulation and step % updates:
        raise ConfigError(
            f"cannot resume exactly at optimizer step {step}, inside an epoch: "
            f"gradient_accumulation_steps is {accumulation} and an epoch has {batches} "
            "batches, which it does not divide, so the resumed epoch's last accumulation "
            "would not step the optimizer where an uninterrupted run does; make "
            "gradient_accumulation_steps divide the batches per epoch"
        )


class SavableLoaderCallback(transformers.TrainerCallback):
    """Saves the train loader's state into each checkpoint and restores it on resume.

    :class:`SavableTrainer` adds it; ``on_save`` and the restore are collectives when
    several processes train.
    """

    def __init__(self) -> None:
        #: The checkpoint folder ``train()`` resumes from, set by :class:`SavableTrainer`.
        self.resume_folder: str | None = None

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Writes every rank's loader state to the new checkpoint folder."""
        for loader in _loaders(kwargs.get("train_dataloader")):
            states = save_state_global(loader, global_dst_rank=0)
            if states is not None:
                folder = os.path.join(
                    args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
                )
                save_state(states, os.path.join(folder, STATE_FILE))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Restores the loader from the checkpoint ``train()`` resumes from.

        Raises:
            StateFileNotFoundError: The checkpoint holds no loader state (saved without
                this callback, or interrupted while saving).
            ConfigError: The checkpoint stands mid-epoch and ``gradient_accumulation_steps``
                does not divide the epoch's batches (NOTE [ What the Trainer does with a
                loader on resume ], limits).

        Warns:
            SingleProcessTrainerWarning: ``args.world_size`` is 1 (``parallel_mode``
                ``NOT_PARALLEL``) while the loader shards over several ranks, or
                ``WORLD_SIZE`` counts several (NOTE [ A trainer that sees one process ] in
                ``_processes.py``).
        """
        for loader in _loaders(kwargs.get("train_dataloader")):
            warn_if_single_process(loader, args.world_size, "TrainingArguments.world_size", _FIX)
        folder, self.resume_folder = self.resume_folder, None
        if folder is None:
            return
        for loader in _loaders(kwargs.get("train_dataloader")):
            _check_accumulation(loader, args.gradient_accumulation_steps, state.global_step)
            path = os.path.join(folder, STATE_FILE)
            if not os.path.exists(path):
                raise StateFileNotFoundError(
                    f"{path} does not exist: the checkpoint was saved without "
                    "SavableLoaderCallback or interrupted while saving; resume from a "
                    "checkpoint a SavableTrainer saved",
                    path,
                )
            states = load_state(path)
            restore_state_global(loader, states if isinstance(states, list) else [states])


class SavableTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` that trains from a :class:`TrainerSavableDataLoader` and
    resumes it exactly (NOTE [ What the Trainer does with a loader on resume ]).

    Takes the ``Trainer``'s arguments; ``args.ignore_data_skip`` must be True. Override
    :meth:`get_train_dataloader` to build the loader yourself (return a
    :class:`TrainerSavableDataLoader`).

    Raises:
        ConfigError: ``args.ignore_data_skip`` is False.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.args.ignore_data_skip:
            raise ConfigError(
                "SavableTrainer needs TrainingArguments(ignore_data_skip=True): the loader "
                "restores its position itself, and the Trainer's skipping would re-create "
                "it and read the skipped batches again"
            )
        self._loader_callback = SavableLoaderCallback()
        self.add_callback(self._loader_callback)

    def get_train_dataloader(self) -> TrainerSavableDataLoader:
        """Returns a :class:`TrainerSavableDataLoader` over ``train_dataset``, built from
        the ``TrainingArguments`` as the ``Trainer`` builds its own loader."""
        import torch

        if self.train_dataset is None:
            raise ConfigError("SavableTrainer: training requires a train_dataset")
        dataset = self.train_dataset
        collator = self.data_collator
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        args = self.args
        map_style = not isinstance(dataset, torch.utils.data.IterableDataset)
        loader = TrainerSavableDataLoader(
            dataset,
            batch_size=self._train_batch_size,
            shuffle=True if map_style else None,
            collate_fn=collator,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            drop_last=args.dataloader_drop_last,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            prefetch_factor=args.dataloader_prefetch_factor,
            persistent_workers=args.dataloader_persistent_workers,
            seed=args.data_seed if args.data_seed is not None else args.seed,
        )
        prepared: TrainerSavableDataLoader = self.accelerator.prepare(loader)
        return prepared

    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> TrainOutput:
        """Runs ``Trainer.train``; from a checkpoint, the loader resumes from its state."""
        if resume_from_checkpoint is True:
            # None: the Trainer raises that output_dir holds no checkpoint.
            last = get_last_checkpoint(self.args.output_dir)  # type: ignore[no-untyped-call]
            resume_from_checkpoint = last or True
        if isinstance(resume_from_checkpoint, str):
            self._loader_callback.resume_folder = resume_from_checkpoint
        return super().train(resume_from_checkpoint, *args, **kwargs)
