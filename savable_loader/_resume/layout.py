"""A loader as far as its states are concerned: its pipeline, what identifies it, and
where it stands in the job."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from torch.utils.data import default_collate, default_convert

from ..config import WorkerContext
from ..datasets.transforms.batch import Batch
from ..errors import ConfigError, UnsavableDatasetError
from ..state.fingerprint import fingerprint
from ..state.names import named, qualified_name

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
        seed_each_item: NOTE [ Items seeded one by one ] in ``rng/keys.py``.

    Raises:
        ConfigError: With ``seed_each_item``, a stage's items have no place in the global
            stream to seed them by.
    """

    root: Batch
    seed: int
    rank: int
    world_size: int
    num_workers: int
    seed_each_item: bool = False

    def __post_init__(self) -> None:
        self.root.check_layout(self.context(0))
        unkeyed = self.root.unkeyed() if self.seed_each_item else None
        if unkeyed is not None:
            raise ConfigError(
                f"seed_each_item=True seeds the global generators by each item's place in "
                f"the global stream, and the items of {unkeyed} have none (its own "
                "iterator decides what comes next); pass a map-style dataset or build the "
                "pipeline from the library's sources, or leave seed_each_item off"
            )

    def context(self, worker_id: int, rank: int | None = None) -> WorkerContext:
        """What worker ``worker_id`` of ``rank`` (by default this loader's) is told."""
        return WorkerContext(
            self.rank if rank is None else rank,
            self.world_size,
            worker_id,
            self.num_workers,
            self.seed,
            self.batch_size,
            self.seed_each_item,
        )

    @property
    def batch_size(self) -> int | None:
        """Items per batch (None: no batching)."""
        return self.root.batch_size

    @functools.cached_property
    def fingerprint(self) -> str:
        """The fingerprint a state of this loader carries (NOTE [ Pipeline fingerprint ]
        in ``state/fingerprint.py``)."""
        return self.fingerprint_for(self.num_workers)

    def root_for(self, batch_size: int | None) -> Batch:
        """The pipeline batched by ``batch_size``: what the workers of a state saved with
        it ran, replayed when the state moves onto this layout."""
        if batch_size == self.batch_size:
            return self.root
        root = self.root
        return Batch(
            root.source, batch_size=batch_size, drop_last=root.drop_last, collate_fn=root.collate_fn
        )

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

    def argument_change(
        self, saved: str, num_workers: int, batch_size: int | None = None
    ) -> str | None:
        """The message naming the boolean loader argument (``drop_last``,
        ``seed_each_item``) whose other value makes ``saved`` this pipeline's fingerprint,
        both values and the fix; None when neither does."""
        for name, current in (
            ("drop_last", self.root.drop_last),
            ("seed_each_item", self.seed_each_item),
        ):
            tree = self._tree(num_workers, batch_size)
            tree["loader"][name] = not current
            if name == "seed_each_item" and current:
                del tree["loader"][name]  # named only when set
            if saved in (fingerprint(tree), fingerprint(tree, raw_names=True)):
                return (
                    f"{name} was {not current} when the state was saved and is {current} "
                    f"now; build the loader with {name}={not current}"
                )
        return None

    def saved_with_file_split(self, saved: str, num_workers: int) -> bool:
        """Whether ``saved`` is this pipeline's fingerprint with its file sources built
        with ``split="files"`` (NOTE [ Shard listing and assignment ] in
        ``datasets/files/sharded.py``): a state saved before ``split="samples"`` existed."""
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
                # Named only when set, so states saved before it keep their fingerprint.
                **({"seed_each_item": True} if self.seed_each_item else {}),
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
