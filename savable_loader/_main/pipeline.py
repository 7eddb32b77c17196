"""How the loader's arguments become its pipeline: the source, its batching, and what the
main process draws at every epoch (NOTE [ Epoch orders ] in ``_main/sampling.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, default_collate, default_convert

from ..config import WorkerContext
from ..datasets.adapt import as_stage
from ..datasets.adapters.datapipes import is_datapipe
from ..datasets.global_view import global_view
from ..datasets.index.indexed import IndexedDataset
from ..datasets.index.sampled import SampledDataset
from ..datasets.protocol.stage import Stage
from ..datasets.transforms.batch import Batch
from ..errors import ConfigError
from ..rng import Purpose, seed_for
from ..state.names import QualName, qualified_name
from .sampling import EpochPlanner

if TYPE_CHECKING:
    from .._resume.layout import Layout

__all__ = ["Pipeline", "base_seed_generator", "build_pipeline"]


def base_seed_generator(seed: int, rank: int) -> torch.Generator:
    """The generator torch draws its workers' base seed from when the loader has no
    ``generator=`` (NOTE [ Seeds ] in ``rng/keys.py``)."""
    return torch.Generator().manual_seed(seed_for(Purpose.BASE_SEED, seed, rank))


@dataclass(frozen=True)
class Pipeline:
    """What the loader reads and how.

    Attributes:
        source: The pipeline as a stage (what ``SavableDataLoader.source`` shows).
        root: ``source`` with its batching.
        planner: Draws each epoch's base seed and order in the main process; None when
            the loader draws nothing there (no ``sampler``, ``batch_sampler`` or
            ``generator``).
        dataset: The loader's ``dataset`` argument.
        collate_fn: What ``loader.collate_fn`` shows when built: the ``collate_fn``
            argument, else torch's default for the batching, as torch shows it.
        sampler: What ``loader.sampler`` shows: the ``sampler`` argument, or the one
            torch's ``DataLoader`` builds over these arguments.
        batch_sampler: What ``loader.batch_sampler`` shows, likewise.
    """

    source: Stage[Any]
    root: Batch
    planner: EpochPlanner | None
    dataset: Any
    collate_fn: Callable[[Any], Any]
    sampler: Any
    batch_sampler: Any

    def use_collate(self, collate_fn: Any, layout: Layout, *, running: bool) -> Layout:
        """Makes ``root`` batch with ``collate_fn`` from the next start of the workers and
        returns ``layout`` with it (NOTE [ A collate_fn set later ]).

        Raises:
            ConfigError: ``collate_fn`` is not callable, or the workers run (``running``)
                and the dataset cannot save the position they would restart from.
        """
        if not callable(collate_fn):
            raise ConfigError(f"collate_fn must be callable, got {collate_fn!r}")
        if running and (problem := self.root.not_savable()) is not None:
            raise ConfigError(
                "collate_fn can change while the loader streams only when the dataset can "
                f"save its position, which the workers restart from ({problem}); pass it "
                "to SavableDataLoader(...) or set it before the first iteration"
            )
        if not self.sampled and collate_fn is _default_collate(self.root.batch_size):
            collate_fn = None  # as built_pipeline builds it
        self.root.collate_fn = collate_fn
        return dataclasses.replace(layout)

    def batches(self, contexts: list[WorkerContext], *, drop_last: bool) -> int:
        """Batches a rank yields per epoch over its workers' ``contexts``, for map-style
        datasets (as ``len()`` of torch's ``DataLoader``). For an iterable dataset with a
        ``__len__``, torch's figure from that length: the batches of ``len(dataset)``
        items, which the data may not keep to, as with torch.

        Raises:
            TypeError: The pipeline is iterable and the dataset has no length: its epoch
                ends when it does.
        """
        planner = self.planner
        if planner is not None and planner.index_sampler is not None:
            return len(planner.index_sampler)
        read = self.root.source  # a pipeline read by position is an IndexedDataset too
        if getattr(read, "endless", False):
            raise TypeError(f"{self.source.describe()} is endless: it has no len()")
        if isinstance(read, IndexedDataset):
            return read.rank_batches(contexts, drop_last=drop_last)
        items, size = self.iterable_length(), self.root.batch_size
        if size is None:
            return items
        return items // size if drop_last else -(-items // size)

    def iterable_length(self) -> int:
        """``len(dataset)`` of an iterable dataset, which ``len(loader)`` is computed from.

        Raises:
            TypeError: The dataset has no length: its epoch ends when it does.
        """
        if not hasattr(type(self.dataset), "__len__"):
            raise TypeError(f"{self.source.describe()} has no len(); the epoch ends when it does")
        return len(self.dataset)

    @property
    def iterable(self) -> bool:
        """The pipeline's epoch is the dataset's own, not an order of indices (``batches``
        counts it from ``iterable_length``)."""
        planner = self.planner
        drawn = planner is not None and planner.index_sampler is not None
        return not drawn and not isinstance(self.root.source, IndexedDataset)

    @property
    def sampled(self) -> bool:
        """The order comes from a sampler read in the main process."""
        return isinstance(self.source, SampledDataset)

    @property
    def drawn_each_epoch(self) -> bool:
        """The main process draws something the workers read every epoch (a sampler's
        order, or a DataPipe's seed: NOTE [ DataPipes ] in ``datasets/adapters/datapipes.py``), so
        the workers start anew every epoch."""
        return self.sampled or is_datapipe(self.dataset)


def _default_collate(batch_size: int | None) -> Callable[[Any], Any]:
    """Torch's ``collate_fn`` for a loader batching ``batch_size`` items (None: none)."""
    return default_convert if batch_size is None else default_collate


def _torch_probe(dataset: Any, **arguments: Any) -> DataLoader[Any]:
    """Torch's own ``DataLoader`` over the same arguments: it refuses what torch refuses,
    with torch's message (as a :class:`ConfigError`, which is a ``ValueError`` as torch's
    is), and builds the sampler torch would read. Building it draws nothing."""
    try:
        return DataLoader(dataset, num_workers=0, **arguments)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def build_pipeline(
    dataset: Any,
    *,
    batch_size: int | None,
    shuffle: bool | None,
    sampler: Any,
    batch_sampler: Any,
    drop_last: bool,
    collate_fn: Callable[[Any], Any] | None,
    generator: torch.Generator | None,
    seed: int,
    draws_every_epoch: bool,
) -> Pipeline:
    """Builds the loader's pipeline (NOTE [ Samplers are sources ] in
    ``datasets/index/sampled.py``).

    Raises:
        ConfigError: Torch refuses the combination of arguments (torch's own message; a
            ``ValueError`` as torch's is), ``batch_size`` is a bool (also beside a
            ``batch_sampler``, which torch would let pass: NOTE [ Arguments the state
            must carry ] in ``_main/arguments.py``), or ``dataset`` cannot be read savably.
    """
    if isinstance(batch_size, bool):
        # Torch's own message, which it gives for a bool without a batch_sampler.
        raise ConfigError(
            f"batch_size should be a positive integer value, but got batch_size={batch_size}"
        )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ConfigError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    probe = _torch_probe(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        sampler=sampler,
        batch_sampler=batch_sampler,
        drop_last=drop_last,
        generator=generator,
    )
    # Torch's own default, which ``loader.collate_fn`` shows.
    shown = collate_fn or (default_collate if probe.batch_sampler is not None else default_convert)
    drawn = sampler is not None or batch_sampler is not None or generator is not None
    source = as_stage(dataset, shuffle=None if drawn else shuffle, seed=seed)
    if not drawn or not isinstance(source, IndexedDataset):
        # Torch's default passed explicitly (as code that rebuilds a loader from its
        # attributes passes it) is the default: the same fingerprint (``Layout.matches``).
        collate_fn = None if collate_fn is _default_collate(batch_size) else collate_fn
        # NOTE [ Pipelines read by position ] in datasets/global_view.py.
        viewed = global_view(source)
        root = Batch(viewed, batch_size=batch_size, drop_last=drop_last, collate_fn=collate_fn)
        planner = None
        if generator is not None:
            planner = EpochPlanner(
                None, generator, batched=False, draws_every_epoch=draws_every_epoch
            )
        return Pipeline(source, root, planner, dataset, shown, probe.sampler, probe.batch_sampler)
    batched = probe.batch_sampler is not None
    index_sampler = probe.batch_sampler if batched else probe.sampler
    planner = EpochPlanner(
        index_sampler, generator, batched=batched, draws_every_epoch=draws_every_epoch
    )
    sampled = SampledDataset(
        dataset, order=planner.order, batched=batched, sampler=_describe(index_sampler)
    )
    root = Batch(sampled, batch_size=None, collate_fn=shown)
    return Pipeline(sampled, root, planner, dataset, shown, probe.sampler, probe.batch_sampler)


def _describe(index_sampler: Any) -> QualName:
    """What identifies the sampler in the pipeline's fingerprint."""
    kinds = [qualified_name(type(index_sampler))]
    inner = getattr(index_sampler, "sampler", None)
    if inner is not None:
        kinds.append(qualified_name(type(inner)))
    options = "".join(
        f" {attribute}={value}"
        for attribute in ("batch_size", "drop_last")
        if isinstance(value := getattr(index_sampler, attribute, None), (bool, int))
    )

    def joined(names: list[str]) -> str:
        return (f"{names[0]}({names[1]})" if len(names) > 1 else names[0]) + options

    return QualName(joined([str(kind) for kind in kinds]), joined([kind.raw for kind in kinds]))
