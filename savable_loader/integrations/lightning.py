"""PyTorch Lightning: a loader whose position rides in the ``Trainer``'s own checkpoint.

Install with the ``lightning`` extra (``python3 -m pip install ".[lightning]"`` from a
checkout). Return a :class:`LightningSavableDataLoader` from ``train_dataloader()`` and
pass :class:`SavableLoaderCallback` to the ``Trainer``; ``trainer.fit(...,
ckpt_path="last")`` then resumes the data stream exactly, on one process or with
``strategy="ddp"``.

NOTE [ What Lightning does with a stateful loader ]
Lightning (2.x) treats any train loader with ``state_dict()`` and ``load_state_dict()`` as
resumable: every rank calls ``state_dict()`` while it builds a checkpoint, and on a
resume that stopped mid-epoch it calls ``load_state_dict()`` before iterating. It does
not skip batches itself. Four things need care; the first three are handled here:

1. Only global rank 0 writes the checkpoint, so rank 1's ``{"rank_1": ...}`` is lost and
   rank 1 would get rank 0's entry on resume. ``state_dict()`` here gathers every rank's
   entry (``all_gather_object`` over the loader's group: every rank builds the
   checkpoint, so every rank is there), and ``load_state_dict()`` takes its own.
2. A loader with a length is read ``len(loader)`` times per epoch: Lightning never asks
   for the item after the last, so the loader never sees the epoch end. The next
   ``iter()`` starts the next epoch all the same (NOTE [ A new iter() starts an epoch ]
   in ``_main/iterator.py``), except the first one after a restore, which continues the
   restored epoch: restored from a checkpoint taken after an epoch's last batch, it has
   nothing left. Here the first ``next()`` of an iterator that finds its epoch already
   exhausted moves on to the next epoch, as a new iterator of torch's ``DataLoader``
   would. The iterator starts the stream at that first ``next()``, not at ``iter()``:
   Lightning calls ``iter()`` before it sets the sampler's epoch and before a restore
   made by the callback.
3. A checkpoint taken at the end of an epoch (the ``ModelCheckpoint`` default) is not a
   "restart" for Lightning, which then never calls ``load_state_dict()``: the loader
   would begin again at its first epoch. :class:`SavableLoaderCallback` takes the states
   from the checkpoint and restores the loaders Lightning left alone, at
   ``on_train_start``, before the first batch.
4. Lightning calls ``set_epoch`` on ``loader.sampler`` when it has one: the loader shows
   the sampler you gave (or torch's), so it reaches a ``DistributedSampler`` itself
   (NOTE [ What the loader shows of its arguments ] in ``_main/shown.py``).

With ``use_distributed_sampler=True`` and a map-style dataset under DDP, Lightning
re-creates the loader from its saved arguments with a ``DistributedSampler``, as for
torch's ``DataLoader``; the rebuilt loader draws its order from that sampler. Otherwise
the loader shards by rank itself.

A loader without a length (an ``IterableDataset`` that does not know its size) is read
one batch ahead by Lightning's fetcher, so a checkpoint's state stands one batch past the
last trained batch and a resume skips that batch: give the dataset a ``__len__``
(``len(loader)`` is then torch's figure from it; see the migration guide for data that
yields more batches than that).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..distributed import every_rank_state_dict
from ..errors import SavableLoaderError
from ..loader import SavableDataLoader
from ._processes import warn_if_single_process

try:
    import lightning.pytorch as pl
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "savable_loader.integrations.lightning needs PyTorch Lightning: "
        'python3 -m pip install ".[lightning]" in a checkout of savable_loader'
    ) from error

__all__ = ["LightningSavableDataLoader", "SavableLoaderCallback"]

_FIX = (
    "give the Trainer as many processes as the launcher starts (devices per machine and "
    'num_nodes, with strategy="ddp")'
)


class _EpochIterator:
    """An iterator that starts at its first ``next()`` and moves past an epoch it finds
    exhausted (NOTE [ What Lightning does with a stateful loader ], item 2)."""

    def __init__(self, loader: LightningSavableDataLoader) -> None:
        self._loader = loader
        self._inner: Iterator[Any] | None = None

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        if self._inner is not None:
            return next(self._inner)
        self._inner = SavableDataLoader.__iter__(self._loader)
        try:
            return next(self._inner)
        except StopIteration:
            self._inner = SavableDataLoader.__iter__(self._loader)
            return next(self._inner)


class LightningSavableDataLoader(SavableDataLoader[Any]):
    """A :class:`~savable_loader.SavableDataLoader` for PyTorch Lightning's ``Trainer``.

    Takes the same arguments. Its state goes into Lightning's checkpoint with every
    rank's entry, each ``iter()`` gives an epoch as Lightning reads it, and
    ``sampler.set_epoch`` reaches the sampler you passed (NOTE [ What Lightning does with
    a stateful loader ]). Use it with :class:`SavableLoaderCallback`.

    Raises:
        ConfigError: As :class:`~savable_loader.SavableDataLoader`.
    """

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        #: Whether Lightning restored this loader itself (the callback leaves it then).
        self._restored_by_trainer = False

    def __iter__(self) -> _EpochIterator:  # type: ignore[override]
        """Returns an iterator over one epoch as Lightning reads it (item 2 of the NOTE)."""
        self._check_usable()
        return _EpochIterator(self)

    def state_dict(self) -> dict[str, Any]:
        """Returns every rank's state, ``{"rank_<r>": <encoded state>, ...}``.

        A collective over the loader's ``data_parallel_group`` when ``torch.distributed``
        is initialized with more than one rank: Lightning calls it on every rank while
        it builds a checkpoint.

        Raises:
            SavableLoaderError: Saving failed on some rank (every rank raises, naming it).
        """
        return every_rank_state_dict(self, super().state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores this rank's entry of what :meth:`state_dict` returned.

        Raises:
            StateError: As :meth:`SavableDataLoader.load_state_dict`.
        """
        super().load_state_dict(state_dict)
        self._restored_by_trainer = True


def _stateful_train_loaders(trainer: pl.Trainer) -> list[Any]:
    """The train loaders with a state, in the order Lightning saves their states."""
    from lightning.pytorch.utilities import CombinedLoader

    loaders = trainer.train_dataloader
    if loaders is None:
        return []
    combined = loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders)
    flat = combined.flattened
    return [
        loader
        for loader in flat
        if callable(getattr(loader, "state_dict", None))
        and callable(getattr(loader, "load_state_dict", None))
    ]


def _check_processes(trainer: pl.Trainer, loaders: list[Any]) -> None:
    """Warns if ``trainer`` trains on one process while a loader shards over several ranks
    or the launcher started several (NOTE [ A trainer that sees one process ] in
    ``_processes.py``)."""
    for loader in loaders:
        if isinstance(loader, LightningSavableDataLoader):
            warn_if_single_process(loader, trainer.world_size, "the Trainer's world_size", _FIX)


class SavableLoaderCallback(pl.Callback):
    """Restores :class:`LightningSavableDataLoader` states Lightning does not restore.

    Lightning restores a train loader's state only when the checkpoint stopped mid-epoch;
    from a checkpoint taken at an epoch's end it starts the loader afresh (item 3 of
    NOTE [ What Lightning does with a stateful loader ]). This callback reads the states
    from the checkpoint and restores those loaders before the first batch.
    """

    def __init__(self) -> None:
        self._states: list[Any] | None = None

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Keeps the loader states of ``checkpoint`` for :meth:`on_train_start`."""
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        self._states = fit_loop.get("combined_loader") or None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Restores the loaders Lightning left at their start.

        Raises:
            SavableLoaderError: The checkpoint holds another number of loader states than
                the train loaders with a state.

        Warns:
            SingleProcessTrainerWarning: ``trainer.world_size`` is 1 while a loader shards
                over several ranks, or ``WORLD_SIZE`` counts several.
        """
        loaders = _stateful_train_loaders(trainer)
        _check_processes(trainer, loaders)
        states, self._states = self._states, None
        if states is None:
            return
        if len(loaders) != len(states):
            raise SavableLoaderError(
                f"the checkpoint holds {len(states)} loader states but the trainer has "
                f"{len(loaders)} train loaders with a state; return the same loaders as "
                "the run that saved it"
            )
        for loader, state in zip(loaders, states, strict=True):
            if isinstance(loader, LightningSavableDataLoader) and not loader._restored_by_trainer:
                loader.load_state_dict(state)
