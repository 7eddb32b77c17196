"""Hugging Face Accelerate: a loader whose position rides in ``accelerator.save_state``.

Install with the ``accelerate`` extra (``python3 -m pip install ".[accelerate]"`` from a
checkout). Build an :class:`AccelerateSavableDataLoader` after the ``Accelerator``, pass
it through ``accelerator.prepare(...)`` with the model and optimizer (it comes back
unchanged) and register it with ``accelerator.register_for_checkpointing(loader)``;
``accelerator.load_state(folder)`` then puts the data stream back where
``accelerator.save_state(folder)`` left it, on one process or on several.

NOTE [ What Accelerate does with a loader ]
Accelerate (1.x) treats every ``DataLoader`` given to ``prepare()`` as a recipe: it
builds a new loader over ``loader.dataset`` (``DataLoaderShard``, or
``DataLoaderDispatcher``, the default for an ``IterableDataset``, which reads every batch
on rank 0 and scatters slices), with its own sampler, ``even_batches`` and RNG
synchronization. A ``SavableDataLoader`` shows its ``dataset`` and arguments as torch's
``DataLoader`` does (NOTE [ What the loader shows of its arguments ] in ``_main/shown.py``),
so a plain one comes out of ``prepare()`` as Accelerate's own loader over the dataset:
it reads the data as torch's would, but nothing saves its position exactly any more. Its
resume helper, ``skip_first_batches``, re-creates the loader too and reads the skipped
batches again.

The supported path, and the rule: a ``SavableDataLoader`` must not be re-created by
Accelerate. :class:`AccelerateSavableDataLoader` carries ``_is_accelerate_prepared``,
the mark ``Accelerator.prepare_data_loader`` reads to leave a loader it already prepared
as it is (it still records it in ``accelerator._dataloaders``, for which ``save_state``
writes nothing of its own: its ``dataset`` is no ``IterableDatasetShard`` and it has no
``use_stateful_dataloader``).
What the loader then does itself, in place of Accelerate's wrapper:

1. **Sharding.** It shards by ``torch.distributed`` rank (initialized by the
   ``Accelerator``, so build the loader after it), equal batch counts per rank for a
   map-style dataset, as ``even_batches`` would. ``split_batches`` and
   ``dispatch_batches`` do not apply: ``batch_size`` is per process.
2. **Device placement.** Each batch goes to ``PartialState().device`` with Accelerate's
   ``send_to_device`` (``device_placement=False`` turns this off).
3. **The state.** ``register_for_checkpointing`` makes ``save_state`` call
   ``state_dict()`` on every process but write the file on the main process only
   (``accelerate.utils.save``), so rank 1's ``{"rank_1": ...}`` would be lost and rank 1
   would find no entry of its own on resume. ``state_dict()`` here gathers every rank's
   entry (``all_gather_object`` over the loader's group; ``save_state`` runs on every
   process, so every rank is there), and ``load_state_dict()``, run on every process by
   ``load_state``, takes its own.

Not done: the loader is not added to Accelerate's ``GradientState``, so under
``accelerator.accumulate()`` the end of an epoch does not force a gradient sync
(``gradient_accumulation_steps`` counts across epochs instead); and
``accelerator.skip_first_batches`` must not be called on it (nothing needs skipping).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..distributed import every_rank_state_dict as _every_rank
from ..loader import SavableDataLoader
from ._processes import warn_if_single_process

try:
    from accelerate.state import AcceleratorState, PartialState, is_initialized
    from accelerate.utils import send_to_device
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "savable_loader.integrations.accelerate needs Hugging Face Accelerate: "
        'python3 -m pip install ".[accelerate]" in a checkout of savable_loader'
    ) from error

__all__ = ["AccelerateSavableDataLoader", "every_rank_state_dict"]

_FIX = (
    "on a CPU machine, build the Accelerator with cpu=True (or start the script with "
    "`accelerate launch --cpu`) so that it trains on every process"
)


def every_rank_state_dict(loader: SavableDataLoader[Any]) -> dict[str, Any]:
    """Every rank's entry of ``loader``'s state: ``{"rank_0": ..., "rank_1": ...}``.

    For a trainer that writes its checkpoint on the main process only. A collective over
    the loader's ``data_parallel_group`` when ``torch.distributed`` is initialized with
    more than one rank (every rank calls it); this rank's own entry otherwise.

    Raises:
        SavableLoaderError: Saving failed on some rank (every rank raises, naming it).
    """
    return _every_rank(loader, lambda: SavableDataLoader.state_dict(loader))


class _PlacedIterator(Iterator[Any]):
    """The loader's iterator, each batch sent to the process's device."""

    def __init__(self, inner: Iterator[Any], device: Any) -> None:
        self._inner = inner
        self._device = device

    def __next__(self) -> Any:
        return send_to_device(next(self._inner), self._device)


class AccelerateSavableDataLoader(SavableDataLoader[Any]):
    """A :class:`~savable_loader.SavableDataLoader` for Hugging Face Accelerate.

    Takes the same arguments, plus ``device_placement``. ``accelerator.prepare()``
    returns it unchanged; register it with ``accelerator.register_for_checkpointing``
    so that ``save_state`` / ``load_state`` carry every rank's position (NOTE [ What
    Accelerate does with a loader ]). Build it after the ``Accelerator``, which
    initializes ``torch.distributed``.

    Args:
        dataset: As :class:`~savable_loader.SavableDataLoader`.
        *args: As :class:`~savable_loader.SavableDataLoader`.
        device_placement: Send each batch to ``PartialState().device``, as a loader
            prepared by Accelerate does.
        **kwargs: As :class:`~savable_loader.SavableDataLoader`.

    Raises:
        ConfigError: As :class:`~savable_loader.SavableDataLoader`.

    Warns:
        SingleProcessTrainerWarning: The ``Accelerator`` reports one process while the
            loader shards over several ranks, or ``WORLD_SIZE`` counts several (NOTE [ A
            trainer that sees one process ] in ``_processes.py``).
    """

    #: Read by ``Accelerator.prepare_data_loader``: a loader it leaves as it is.
    _is_accelerate_prepared = True
    #: Whether ``__init__`` compares the ``Accelerator``'s processes with the loader's
    #: ranks (the Hugging Face ``Trainer``'s loader leaves it to the ``Trainer``).
    _checks_processes = True

    def __init__(
        self, dataset: Any, *args: Any, device_placement: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(dataset, *args, **kwargs)
        self._device_placement = device_placement
        if self._checks_processes and is_initialized():
            # NOTE [ A trainer that sees one process ] in _processes.py
            processes = AcceleratorState().num_processes
            warn_if_single_process(self, processes, "accelerator.num_processes", _FIX)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """Returns an iterator over the stream, each batch on the process's device."""
        inner = super().__iter__()
        if not self._device_placement:
            return inner
        return _PlacedIterator(inner, PartialState().device)

    def state_dict(self) -> dict[str, Any]:
        """Returns every rank's state, ``{"rank_<r>": <encoded state>, ...}``.

        A collective when several ranks run: ``accelerator.save_state`` calls it on
        every process and writes what the main process got.

        Raises:
            SavableLoaderError: Saving failed on some rank (every rank raises, naming it).
        """
        return every_rank_state_dict(self)
