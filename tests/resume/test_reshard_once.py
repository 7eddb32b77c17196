"""An elastic restore brings the saved streams to their positions once, whatever the
number of new ranks (NOTE [ One reshard per restore ] in ``_resume/elastic.py``): with
``src_rank`` one rank computes every new rank's state, and the replays and item reads
that costs are those of a single new rank's. The states it hands out resume exactly.

Checkpoints are made rare (``checkpoint_share`` tiny), so every saved worker stands
batches past its checkpoint and a restore must replay it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_elastic import BATCH, SEED, N, _assert_accounted, _fresh_epoch, _ids, _odd_tens

from savable_loader import RankState, SavableDataLoader, StateMismatchError, WorkerConfig
from savable_loader._resume import elastic
from savable_loader._resume.compat import states_for_layout
from savable_loader.datasets import IndexedDataset
from savable_loader.state.files import encode_state

OLD_RANKS, OLD_WORKERS, NEW_WORKERS = 2, 2, 2


class Counted:
    """``range(N)`` that counts its reads."""

    reads = 0

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        Counted.reads += 1
        return index


def _same(index: int) -> int:
    return index


def filtered() -> Any:
    """test_elastic's ``indexed()`` over a counted dataset: the same items, in order."""
    return IndexedDataset(Counted(), shuffle=True, seed=SEED).map(_same).filter(_odd_tens)


def deterministic() -> Any:
    """Items that draw from no generator: a replay counts positions, reads nothing."""
    return IndexedDataset(Counted(), shuffle=True, seed=SEED, deterministic_items=True)


def _loader(build: Callable[[], Any], workers: int, rank: int, ranks: int) -> SavableDataLoader:
    config = WorkerConfig(rank=rank, world_size=ranks, checkpoint_share=1e-9)
    return SavableDataLoader(
        build(), batch_size=BATCH, num_workers=workers, seed=SEED, worker_config=config
    )


def _save(build: Callable[[], Any], steps: list[int]) -> tuple[list[int], list[RankState]]:
    consumed: list[int] = []
    states = []
    for rank, count in enumerate(steps):
        with _loader(build, OLD_WORKERS, rank, OLD_RANKS) as loader:
            stream = iter(loader)
            for _ in range(count):
                batch = next(stream, None)
                if batch is None:
                    break
                consumed += _ids(batch)
            states.append(loader.save_state_rank())
    return consumed, states


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the pipeline runs a reshard starts in the main process and what it reads."""
    counts: Counter[str] = Counter()
    original = elastic.PipelineRuntime

    class Counting(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            counts["runs"] += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(elastic, "PipelineRuntime", Counting)
    return counts


def _reshard_cost(
    build: Callable[[], Any], states: list[RankState], ranks: int, runs: Counter[str]
) -> tuple[int, int, list[RankState]]:
    """(runs, item reads, states) of restoring ``states`` onto ``ranks`` ranks, computed
    on one rank as ``restore_state_global(src_rank=0)`` does."""
    runs.clear()
    Counted.reads = 0
    with _loader(build, NEW_WORKERS, 0, ranks) as loader:
        new = states_for_layout(states, loader.layout, approximate=False)
    return runs["runs"], Counted.reads, new


@pytest.mark.parametrize("steps", [[3, 2], [6, 4]])
def test_replays_do_not_grow_with_the_new_ranks(runs: Counter[str], steps: list[int]) -> None:
    _, states = _save(filtered, steps)
    assert all(w.replay > 0 for s in states for w in s.workers), "a worker was not behind"
    single = _reshard_cost(filtered, states, 1, runs)
    costs = {ranks: _reshard_cost(filtered, states, ranks, runs) for ranks in (4, 8)}
    for ranks, (count, reads, _) in costs.items():
        assert (count, reads) == single[:2], f"onto {ranks} ranks"
    # Each saved stream is run once: the one that looked for its epoch's end is not
    # replayed again.
    assert single[0] == OLD_RANKS * OLD_WORKERS
    # A replay reads each item it passes once, plus at most a few (the look-ahead batch
    # and what the filter drops) beyond what the old layout consumed.
    assert single[1] <= 2 * sum(steps) * BATCH


def test_replays_of_deterministic_items_read_at_most_one_batch(runs: Counter[str]) -> None:
    _, states = _save(deterministic, [3, 2])
    assert all(w.replay > 0 for s in states for w in s.workers)
    count, reads, _ = _reshard_cost(deterministic, states, 8, runs)
    assert count == OLD_RANKS * OLD_WORKERS
    assert reads <= BATCH  # the batch that tells the stream has not ended its epoch


def test_every_new_rank_gets_the_state_its_own_restore_computes(runs: Counter[str]) -> None:
    consumed, states = _save(filtered, [3, 2])
    *_, new = _reshard_cost(filtered, states, 8, runs)
    for rank in range(8):
        with _loader(filtered, NEW_WORKERS, rank, 8) as loader:
            alone = loader.reshard(states, rank=rank)
        assert new[rank].to_plain() == alone.to_plain()
    rest: list[int] = []
    following = []
    for rank in range(8):
        with _loader(filtered, NEW_WORKERS, rank, 8) as loader:
            loader.restore_state_rank(new[rank])
            rest += [i for batch in loader for i in _ids(batch)]
            following.append([i for batch in loader for i in _ids(batch)])
    _assert_accounted(Counter(consumed + rest), OLD_RANKS, [8])
    assert following == _fresh_epoch(filtered, NEW_WORKERS, 8, epoch=1)


def test_a_save_at_the_last_batch_is_computed_once_too(runs: Counter[str]) -> None:
    """Every rank handed on its last batch: the ends found once serve every new rank."""
    _, states = _save(filtered, [99, 99])
    single = _reshard_cost(filtered, states, 1, runs)
    assert _reshard_cost(filtered, states, 8, runs)[:2] == single[:2]


class Noisy:
    """A map-style dataset whose items draw from torch's global generator."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> float:
        return index + float(torch.rand(1))


def _sampled(workers: int) -> SavableDataLoader:
    generator = torch.Generator()
    generator.manual_seed(0)
    return SavableDataLoader(
        Noisy(),
        batch_size=4,
        num_workers=workers,
        generator=generator,
        worker_config=WorkerConfig(checkpoint_share=1e-9),
    )


def test_a_pipeline_that_is_not_elastic_is_refused_before_anything_replays(
    runs: Counter[str],
) -> None:
    """The loader draws a sampler's order; replayed alone in the main process it cannot."""
    with _sampled(2) as loader:
        stream = iter(loader)
        for _ in range(3):
            next(stream)
        state = loader.save_state_rank()
    assert any(w.replay > 0 for w in state.workers)
    runs.clear()
    with _sampled(3) as loader, pytest.raises(StateMismatchError, match="not elastic"):
        loader.restore_state_rank([state])
    assert runs["runs"] == 0


def test_a_reshard_between_epochs_saves_no_generator_bytes() -> None:
    """Nothing of the resumed epoch was read: its generators are named by the epoch."""
    _, states = _save(deterministic, [99, 99])
    assert all(s.between_epochs for s in states)
    with _loader(deterministic, 3, 0, 3) as loader:
        moved = loader.reshard(states, rank=0)
    for worker in moved.workers:
        assert worker.checkpoint is not None
        assert worker.checkpoint.rng is None
        assert worker.checkpoint.seeded_epoch == 1
    assert len(encode_state(moved)) < 1024
