"""Writes the golden state files ``tests/golden/*.msgpack`` (run once per format change).

Usage: ``python tests/golden/make_golden.py``. Each file is a state saved by this
version of savable_loader from a pipeline of ``tests/pipelines.py`` built with fixed
seeds; ``tests/test_golden.py`` restores each into a freshly built loader and checks the
continuation against an uninterrupted run, so a file pins both the format and the
meaning of a state. Committed files must keep loading in later versions; rewrite them
only together with a deliberate ``FORMAT_VERSION`` bump.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from pipelines import RandomCounter, Squares  # noqa: E402

from savable_loader import RankState, SavableDataLoader, WorkerConfig, save_state  # noqa: E402


@dataclass(frozen=True)
class Golden:
    """One golden file: how to build its loader and where its state was saved.

    Attributes:
        name: File name without ``.msgpack``.
        build: Builds the loader of a rank (``rank``, ``world_size``).
        taken: Items each rank took before saving, in rank order (``-1``: one whole
            epoch, then the state is saved between epochs).
    """

    name: str
    build: Callable[[int, int], SavableDataLoader]
    taken: tuple[int, ...]

    @property
    def path(self) -> Path:
        return HERE / f"{self.name}.msgpack"


def _no_workers(rank: int, world_size: int) -> SavableDataLoader:
    return SavableDataLoader(RandomCounter(20), batch_size=2, seed=7)


def _two_workers(rank: int, world_size: int) -> SavableDataLoader:
    return SavableDataLoader(RandomCounter(18, uneven=True), batch_size=2, num_workers=2, seed=3)


def _between_epochs(rank: int, world_size: int) -> SavableDataLoader:
    return SavableDataLoader(RandomCounter(12), batch_size=3, num_workers=2, seed=5)


def _two_ranks(rank: int, world_size: int) -> SavableDataLoader:
    return SavableDataLoader(
        Squares(30),
        batch_size=4,
        shuffle=True,
        seed=11,
        worker_config=WorkerConfig(rank=rank, world_size=world_size),
    )


GOLDENS = (
    Golden("rank_0_workers", _no_workers, (5,)),
    Golden("rank_2_workers_mid_epoch", _two_workers, (7,)),
    Golden("rank_between_epochs", _between_epochs, (-1,)),
    Golden("global_2_ranks", _two_ranks, (2, 3)),
)


def saved_state(golden: Golden, rank: int) -> RankState:
    """Builds rank ``rank``'s loader, takes its items and returns its saved state."""
    with golden.build(rank, len(golden.taken)) as loader:
        taken = golden.taken[rank]
        if taken < 0:
            for _ in loader:
                pass
        else:
            iterator = iter(loader)
            for _ in range(taken):
                next(iterator)
        return loader.save_state_rank()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for golden in GOLDENS:
        states = [saved_state(golden, rank) for rank in range(len(golden.taken))]
        save_state(states if golden.name.startswith("global") else states[0], golden.path)
        logging.info("wrote %s", golden.path.relative_to(HERE.parent.parent))


if __name__ == "__main__":
    main()
