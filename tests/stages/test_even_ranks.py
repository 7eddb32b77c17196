"""Every rank takes as many steps per epoch (issue 13): an indexed source pads or cuts
its epoch as ``DistributedSampler`` does, and a layout that leaves a rank without data
is refused when the loader is built.

Ranks are simulated in one process with ``WorkerConfig(rank=r, world_size=R)``.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from savable_loader import ConfigError, SavableDataLoader, WorkerConfig, WorkerContext
from savable_loader.datasets import IndexedDataset
from savable_loader.testing import assert_resumes_exactly

BATCH = 4
SEED = 5


def _loader(n: int, rank: int, ranks: int, workers: int, **options: Any) -> SavableDataLoader:
    even = options.pop("even", "pad")
    shuffle = options.pop("shuffle", False)
    source = IndexedDataset(list(range(n)), shuffle=shuffle, seed=SEED, even=even)
    return SavableDataLoader(
        source,
        batch_size=BATCH,
        num_workers=workers,
        seed=SEED,
        worker_config=WorkerConfig(rank=rank, world_size=ranks),
        **options,
    )


def _epoch(loader: SavableDataLoader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def _sampler(n: int, rank: int, ranks: int, even: str) -> Counter[int]:
    sampler = DistributedSampler(
        list(range(n)), num_replicas=ranks, rank=rank, shuffle=False, drop_last=even == "drop"
    )
    return Counter(sampler)


def _order(n: int, epoch: int) -> list[int]:
    """Epoch ``epoch``'s shuffled order of ``range(n)``, as one rank reads it."""
    cursor = IndexedDataset(list(range(n)), shuffle=True, seed=SEED).cursor(
        WorkerContext(0, 1, 0, 0, SEED, None)
    )
    cursor.restore({"epoch": epoch, "pos": 0, "order": 2})
    return list(cursor)


LAYOUTS = [(9, 2), (10, 3), (7, 3), (13, 2), (3, 3), (2, 3), (8, 1), (9, 1)]


# "drop" with fewer items than ranks is refused (test_a_rank_without_items_is_refused...).
CASES = [(n, r, even) for n, r in LAYOUTS for even in ("pad", "drop") if even == "pad" or n >= r]


@pytest.mark.parametrize(("n", "ranks", "even"), CASES)
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_yield_as_many_batches_and_the_items_of_distributed_sampler(
    n, ranks, even, drop_last
):
    batches = []
    for rank in range(ranks):
        with _loader(n, rank, ranks, 0, even=even, drop_last=drop_last) as loader:
            epoch = _epoch(loader)
            assert len(loader) == len(epoch), f"rank {rank}: len(loader)"
            batches.append(len(epoch))
            items = Counter(i for batch in epoch for i in batch)
            if drop_last:
                assert all(len(batch) == BATCH for batch in epoch)
                assert not items - _sampler(n, rank, ranks, even)
            else:
                # As DistributedSampler(shuffle=False): the same items, the same repeats.
                assert items == _sampler(n, rank, ranks, even), f"rank {rank}"
    assert batches == [batches[0]] * ranks


@pytest.mark.parametrize(("n", "ranks"), [(9, 2), (10, 3), (23, 3)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_with_workers_and_shuffle_ranks_still_yield_as_many_batches(n, ranks, drop_last):
    seen: Counter[int] = Counter()
    batches = []
    for rank in range(ranks):
        with _loader(n, rank, ranks, 2, shuffle=True, drop_last=drop_last) as loader:
            epochs = [_epoch(loader) for _ in range(2)]
            assert [len(loader)] * 2 == [len(epoch) for epoch in epochs], f"rank {rank}"
            batches.append([len(epoch) for epoch in epochs])
            seen += Counter(i for batch in epochs[1] for i in batch)
    assert batches == [batches[0]] * ranks
    if not drop_last:
        # Epoch 1's order, padded by its first items (DistributedSampler with shuffle
        # repeats the start of its permutation the same way).
        order = _order(n, 1)
        assert seen == Counter(order[p % n] for p in range(-(-n // ranks) * ranks))


def test_nine_items_two_ranks_batch_four():
    """The issue's example: rank 0 had two batches and rank 1 one."""
    epochs = []
    for rank in range(2):
        with _loader(9, rank, 2, 0) as loader:
            epochs.append(_epoch(loader))
            assert len(loader) == 2
    assert epochs == [[[0, 2, 4, 6], [8]], [[1, 3, 5, 7], [0]]]
    with _loader(9, 1, 2, 0, even="drop") as loader:
        assert _epoch(loader) == [[1, 3, 5, 7]]


@pytest.mark.parametrize(("n", "ranks"), [(2, 3), (1, 2)])
def test_a_rank_without_items_is_refused_when_built(n, ranks):
    with pytest.raises(ConfigError) as info:
        _loader(n, ranks - 1, ranks, 0, even="drop")
    message = str(info.value)
    assert f"rank {ranks - 1}" in message
    assert f"{n} items over {ranks} rank" in message
    assert 'use even="pad"' in message


@pytest.mark.parametrize(("ranks", "even"), [(1, "pad"), (2, "pad"), (2, "drop")])
def test_an_empty_dataset_yields_no_batch_as_with_torch(ranks, even):
    """Torch's ``DataLoader`` over an empty map-style dataset has length 0 and yields
    nothing, every epoch; so does the loader, on every rank, and its state restores."""
    assert len(DataLoader([], batch_size=BATCH)) == 0
    for rank in range(ranks):
        with _loader(0, rank, ranks, 0, even=even) as loader:
            assert len(loader) == 0
            assert _epoch(loader) == _epoch(loader) == []
            state = loader.save_state_rank()
        with _loader(0, rank, ranks, 0, even=even) as loader:
            loader.restore_state_rank(state)
            assert _epoch(loader) == []


def test_a_map_style_dataset_given_to_the_loader_pads_too():
    lengths = []
    for rank in range(3):
        loader = SavableDataLoader(
            list(range(10)), batch_size=BATCH, worker_config=WorkerConfig(rank=rank, world_size=3)
        )
        with loader:
            lengths.append(sum(len(batch) for batch in loader))
    assert lengths == [4, 4, 4]


def test_even_is_checked_and_only_drop_changes_the_fingerprint():
    with pytest.raises(ConfigError, match='even must be "pad" or "drop"'):
        IndexedDataset([1, 2], even="cut")  # type: ignore[arg-type]
    assert IndexedDataset([1]).config() == {**IndexedDataset([1], even="pad").config()}
    assert "even" not in IndexedDataset([1]).config()
    assert IndexedDataset([1], even="drop").config()["even"] == "drop"


@pytest.mark.parametrize(("workers", "even"), [(0, "pad"), (2, "pad"), (2, "drop")])
def test_a_padded_rank_resumes_exactly(workers, even):
    # Rank 1 of 2 over 9 items: its last batch holds a padded item (with "pad").
    build = partial(_loader, 9, 1, 2, workers, shuffle=True, even=even)
    report = assert_resumes_exactly(
        build, epochs=2, num_points=4, last_items=True, inline_chains=True
    )
    assert report.restores > 0


def test_a_map_style_dataset_with_more_workers_than_batches_is_served_as_torch_serves_it():
    """Not refused: torch's DataLoader gives a worker without a batch nothing to do, and
    so does the loader (5 items in batches of 2: 3 batches for 4 workers)."""
    options = {"batch_size": 2, "num_workers": 4, "persistent_workers": True}
    torchs = torch.utils.data.DataLoader(list(range(5)), **options)
    expected = [[batch.tolist() for batch in torchs] for _ in range(2)]
    build = partial(SavableDataLoader, list(range(5)), **options)
    with build() as loader:
        assert len(loader) == len(torchs) == 3
        assert [[batch.tolist() for batch in loader] for _ in range(2)] == expected
    report = assert_resumes_exactly(build, epochs=2, points=[1, 3, 4], chain_items=())
    assert report.restores > 0


def test_the_state_of_a_padded_epoch_names_its_length():
    with _loader(9, 1, 2, 0) as loader:
        next(iter(loader))
        state = loader.save_state_rank()
    (worker,) = state.workers
    assert worker.checkpoint is not None
    assert worker.checkpoint.state["parent"]["length"] == 10
    with _loader(8, 0, 1, 0) as loader:  # one rank: the state is as before
        next(iter(loader))
        (worker,) = loader.save_state_rank().workers
    assert worker.checkpoint is not None
    assert "length" not in worker.checkpoint.state["parent"]


def test_a_legacy_state_without_length_continues_padded_on_its_layout():
    cursor = IndexedDataset(list(range(9))).cursor(WorkerContext(1, 2, 0, 0, 0, None))
    cursor.restore({"epoch": 0, "pos": 3})
    assert list(cursor) == [7, 0]
    with pytest.raises(Exception, match="positions"):
        cursor.restore({"epoch": 0, "pos": 0, "length": 9})


def test_torch_tensor_batches_are_unchanged_on_one_rank():
    with _loader(9, 0, 1, 0) as loader:
        batches = list(loader)
    assert [b.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert all(isinstance(b, torch.Tensor) for b in batches)


def _save(n: int, ranks: int, steps: list[int], even: str) -> tuple[list[int], list[Any]]:
    consumed: list[int] = []
    states = []
    for rank in range(ranks):
        with _loader(n, rank, ranks, 0, even=even) as loader:
            stream = iter(loader)
            for _ in range(steps[rank]):
                consumed += next(stream).tolist()
            states.append(loader.save_state_rank())
    return consumed, states


def _rest(n: int, states: list[Any], ranks: int, workers: int, even: str) -> list[list[int]]:
    rests = []
    for rank in range(ranks):
        with _loader(n, rank, ranks, workers, even=even) as loader:
            loader.restore_state_rank(states)
            rests.append([i for batch in loader for i in batch.tolist()])
    return rests


@pytest.mark.parametrize("workers", [0, 2])
def test_elastic_rest_of_a_padded_epoch_is_padded_for_the_new_ranks(workers):
    # 11 items on 2 ranks: 12 positions, the 12th repeats item 0. Each rank reads one
    # batch: positions 0..7. Left: 8, 9, 10, 11 (item 0); 3 new ranks need 6: positions
    # 12 and 13 (items 1 and 2, the cyclic order going on).
    consumed, states = _save(11, 2, [1, 1], "pad")
    rests = _rest(11, states, 3, workers, "pad")
    assert [len(rest) for rest in rests] == [2, 2, 2]
    assert Counter(consumed) + Counter(i for rest in rests for i in rest) == Counter(
        [*range(11), 0, 1, 2]
    )


def test_elastic_rest_of_a_cut_epoch_is_cut_for_the_new_ranks():
    # 11 items on 2 ranks with "drop": 10 positions. Rank 0 reads 0, 2, 4, 6; left:
    # 1, 3, 5, 7, 8, 9; 4 new ranks read 4 of them, the last two are left out.
    consumed, states = _save(11, 2, [1, 0], "drop")
    rests = _rest(11, states, 4, 0, "drop")
    assert consumed == [0, 2, 4, 6]
    assert rests == [[1], [3], [5], [7]]


def _jsonl_files(folder: Any, count: int) -> str:
    for file in range(count):
        (folder / f"part-{file}.jsonl").write_text(f'{{"id": {file}}}\n')
    return str(folder / "*.jsonl")


@pytest.mark.parametrize(
    ("ranks", "workers", "rank", "named"),
    [
        (2, 2, 1, "rank 1 worker 1"),  # streams 0, 1, 2 read; rank 1's worker 1 not
        (2, 2, 0, "rank 1 worker 1"),  # rank 0 has files but refuses too: no hang
        (4, 0, 3, "rank 3 worker 0"),
        (1, 4, 0, "rank 0 worker 3"),
    ],
)
def test_a_files_split_with_more_streams_than_files_is_refused_when_built(
    tmp_path, ranks, workers, rank, named
):
    from savable_loader.datasets import JsonLinesSource

    source = JsonLinesSource(_jsonl_files(tmp_path, 3), split="files")
    with pytest.raises(ConfigError) as info:
        SavableDataLoader(
            source,
            batch_size=None,
            num_workers=workers,
            worker_config=WorkerConfig(rank=rank, world_size=ranks),
        )
    message = str(info.value)
    assert named in message
    assert f"3 files for {ranks * max(workers, 1)} streams" in message
    assert "use at most 3 streams" in message


def test_a_blend_checks_each_of_its_sources(tmp_path):
    from savable_loader.datasets import JsonLinesSource

    files = JsonLinesSource(_jsonl_files(tmp_path, 1), split="files")
    blend = IndexedDataset(list(range(10))).blend([files], weights=[1, 1], seed=0)
    with pytest.raises(ConfigError, match="rank 0 worker 1 would read no file"):
        SavableDataLoader(blend, batch_size=None, num_workers=2)
    with SavableDataLoader(blend, batch_size=None, num_workers=0) as loader:
        assert len(list(loader)) > 0
