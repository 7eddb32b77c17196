"""A loader as far as its states are concerned: its pipeline, what identifies it, and
where it stands in the job."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from torch.utils.data import default_collate, default_convert

from .config import WorkerContext
from .datasets.batch import Batch
from .errors import UnsavableDatasetError
from .state.fingerprint import fingerprint
from .state.names import named, qualified_name

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """What a state is checked against and resharded for.

    Building it checks that every stream of the job gets data (``Stage.check_layout``).

    Attributes:
        root: The loader's pipeline with its batching.
        seed: The loader seed.
        rank: This loader's rank.
        world_size: Ranks of the job.
        num_workers: Workers per rank.
    """

    root: Batch
    seed: int
    rank: int
    world_size: int
    num_workers: int

    def __post_init__(self) -> None:
        context = WorkerContext(
            self.rank, self.world_size, 0, self.num_workers, self.seed, self.batch_size
        )
        self.root.check_layout(context)

    @property
    def batch_size(self) -> int | None:
        """Items per batch (None: no batching)."""
        return self.root.batch_size

    @functools.cached_property
    def fingerprint(self) -> str:
        """The fingerprint a state of this loader carries (NOTE [ Pipeline fingerprint ]
        in ``state/fingerprint.py``)."""
        return self.fingerprint_for(self.num_workers)

    def check_savable(self) -> None:
        """Raises :class:`~savable_loader.UnsavableDatasetError` when a position in the
        pipeline cannot be saved (NOTE [ Datasets without a position ] in
        ``datasets/adapt.py``)."""
        problem = self.root.not_savable()
        if problem is not None:
            raise UnsavableDatasetError(problem)

    @functools.cached_property
    def callables(self) -> dict[str, str]:
        """The names of the functions and classes the pipeline is built from, by where
        they stand in its config (``RankState.callables``)."""
        return named(self._tree(self.num_workers))

    def fingerprint_for(self, num_workers: int, batch_size: int | None = None) -> str:
        """The fingerprint of this pipeline and loader had it ``num_workers`` workers (and
        ``batch_size``, by default its own)."""
        return fingerprint(self._tree(num_workers, batch_size))

    def matches(
        self, saved: str, num_workers: int, batch_size: int | None = None, **loader: Any
    ) -> bool:
        """Whether ``saved`` is this pipeline's fingerprint with ``num_workers`` workers
        and ``batch_size`` (by default its own) and the ``loader`` arguments given
        (``drop_last``), also as a version before NOTE [ Names from a script ]
        (``state/names.py``) wrote it from a script."""
        own = num_workers == self.num_workers and batch_size in (None, self.batch_size)
        if saved == (self.fingerprint if own and not loader else None):
            return True
        tree = self._tree(num_workers, batch_size)
        tree = {**tree, "loader": {**tree["loader"], **loader}}
        trees = [tree]
        if self.root.collate_fn is None:
            # Saved with torch's default passed explicitly, before that meant None.
            default = default_convert if self.batch_size is None else default_collate
            name = qualified_name(default, unnamed="?")
            trees.append({**tree, "loader": {**tree["loader"], "collate_fn": name}})
        return any(saved in (fingerprint(t), fingerprint(t, raw_names=True)) for t in trees)

    def saved_with_file_split(self, saved: str, num_workers: int) -> bool:
        """Whether ``saved`` is this pipeline's fingerprint with its file sources built
        with ``split="files"`` (NOTE [ Shard listing and assignment ] in
        ``datasets/sharded.py``): a state saved before ``split="samples"`` existed."""
        tree = _without_sample_split(self._tree(num_workers))
        return saved in (fingerprint(tree), fingerprint(tree, raw_names=True))

    def _tree(self, num_workers: int, batch_size: int | None = None) -> dict[str, Any]:
        root = self.root
        collate = root.collate_fn
        return {
            "dataset": root.source.config(),
            "loader": {
                "batch_size": root.batch_size if batch_size is None else batch_size,
                "drop_last": root.drop_last,
                "seed": self.seed,
                "num_workers": num_workers,
                "collate_fn": None if collate is None else qualified_name(collate, unnamed="?"),
            },
        }


def _without_sample_split(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {
            key: _without_sample_split(value)
            for key, value in tree.items()
            if not (key == "split" and value == "samples")
        }
    if isinstance(tree, list):
        return [_without_sample_split(value) for value in tree]
    return tree
