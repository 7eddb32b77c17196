"""Elastic resume in one process: a save restored onto other numbers of workers and ranks.

Ranks are simulated with explicit ``WorkerConfig(rank=r, world_size=R)`` loaders, which
iterate without torch.distributed;
``tests/distributed/test_elastic_distributed.py`` runs real ranks.
Items are dataset indices, so the accounting is exact: what the old layout consumed plus
what the new one delivers in the rest of the epoch is every position of the old layout's
epoch once (``N`` items padded to a multiple of its ranks, the first items of the order
coming again), plus the fewest next positions of the cyclic order that give every new
rank as many (NOTE [ Elastic indexed order ]).
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from pipelines import RandomCounter

from savable_loader import (
    ApproximateResumeWarning,
    RankState,
    SavableDataLoader,
    StateError,
    StateMismatchError,
    WorkerConfig,
    WorkerContext,
)
from savable_loader.datasets import IndexedDataset, TokenSource
from savable_loader.testing import assert_elastic

N = 101
BATCH = 4
SEED = 7


def _odd_tens(index: int) -> bool:
    return index % 10 != 3


def _plus_zero(index: int) -> int:
    return index


def indexed() -> Any:
    return IndexedDataset(list(range(N)), shuffle=True, seed=SEED).map(_plus_zero).filter(_odd_tens)


def _everything(index: int) -> bool:
    return True


def _order(shuffle: bool = True, epoch: int = 0) -> list[int]:
    """The order of ``range(N)`` in ``epoch`` (what one rank reads)."""
    cursor = IndexedDataset(list(range(N)), shuffle=shuffle, seed=SEED).cursor(
        WorkerContext(0, 1, 0, 0, SEED, None)
    )
    cursor.restore(None)
    for _ in range(epoch):
        cursor.end_epoch()
    return list(cursor)


def _padded(
    ranks: int, keep: Callable[[int], bool] = _odd_tens, shuffle: bool = True, epoch: int = 0
) -> Counter:
    """The items of ``epoch`` on ``ranks`` ranks: ``N`` padded to a multiple of ``ranks``."""
    order = _order(shuffle, epoch)
    return Counter(x for p in range(-(-N // ranks) * ranks) if keep(x := order[p % N]))


def _assert_accounted(got: Counter, old_ranks: int, new_ranks: list[int], epoch: int = 0) -> None:
    """``got`` holds every position of the old layout's padded epoch once, and beyond it
    only the next positions of the cyclic order, fewer than each reshard's new ranks."""
    base = _padded(old_ranks, epoch=epoch)
    assert not base - got, "items of the epoch were lost"
    order, start = _order(epoch=epoch), -(-N // old_ranks) * old_ranks
    allowed = Counter(
        x for i in range(sum(r - 1 for r in new_ranks)) if _odd_tens(x := order[(start + i) % N])
    )
    assert not (got - base) - allowed, "items beyond the next padding positions"


def _loader(build: Callable[[], Any], workers: int, rank: int = 0, ranks: int = 1) -> Any:
    return SavableDataLoader(
        build(),
        batch_size=BATCH,
        num_workers=workers,
        seed=SEED,
        worker_config=WorkerConfig(rank=rank, world_size=ranks),
    )


def _ids(batch: Any) -> list[int]:
    if isinstance(batch, (list, tuple)):  # (ids, draws) collated
        batch = batch[0]
    return [int(x) for x in batch]


def _save(
    build: Callable[[], Any], workers: int, ranks: int, steps: list[int]
) -> tuple[list[int], list[RankState]]:
    """Runs ``ranks`` loaders ``steps[r]`` batches into epoch 0; returns consumed ids and
    states (a step count past the epoch ends it: the state is between epochs)."""
    consumed: list[int] = []
    states = []
    for rank in range(ranks):
        with _loader(build, workers, rank, ranks) as loader:
            stream = iter(loader)
            for _ in range(steps[rank]):
                batch = next(stream, None)
                if batch is None:
                    break
                consumed += _ids(batch)
            states.append(loader.save_state_rank())
    return consumed, states


def _resume(
    build: Callable[[], Any], states: list[RankState], workers: int, ranks: int, **kw: Any
) -> tuple[list[int], list[list[int]]]:
    """Restores ``states`` onto ``ranks`` x ``workers``; returns the ids of the rest of the
    epoch over all ranks and each rank's next epoch."""
    rest: list[int] = []
    following = []
    for rank in range(ranks):
        with _loader(build, workers, rank, ranks) as loader:
            loader.restore_state_rank(states, **kw)
            rest += [i for batch in loader for i in _ids(batch)]
            following.append([i for batch in loader for i in _ids(batch)])
    return rest, following


def _fresh_epoch(build: Callable[[], Any], workers: int, ranks: int, epoch: int) -> list[list[int]]:
    epochs = []
    for rank in range(ranks):
        with _loader(build, workers, rank, ranks) as loader:
            for _ in range(epoch):
                for _ in loader:
                    pass
            epochs.append([i for batch in loader for i in _ids(batch)])
    return epochs


LAYOUTS = [
    # (old workers, old ranks, steps per old rank, new workers, new ranks)
    (2, 1, [5], 3, 1),
    (3, 1, [7], 2, 1),
    (0, 1, [4], 2, 1),
    (2, 1, [3], 0, 1),
    (2, 2, [3, 2], 3, 3),
    (3, 3, [2, 2, 1], 2, 1),
    (2, 1, [6], 2, 3),
    (2, 2, [0, 0], 3, 1),
    (2, 2, [1, 0], 2, 2),
]


@pytest.mark.parametrize(("old_w", "old_r", "steps", "new_w", "new_r"), LAYOUTS)
def test_rest_of_epoch_exactly_once_and_next_epoch_as_fresh(old_w, old_r, steps, new_w, new_r):
    consumed, states = _save(indexed, old_w, old_r, steps)
    rest, following = _resume(indexed, states, new_w, new_r)
    if consumed:
        _assert_accounted(Counter(consumed + rest), old_r, [new_r])
    else:  # nothing read: the new layout starts the epoch afresh, padded its own way
        assert Counter(rest) == _padded(new_r)
    assert following == _fresh_epoch(indexed, new_w, new_r, epoch=1)


@pytest.mark.parametrize(("old_w", "new_w"), [(2, 3), (0, 2), (3, 0)])
def test_between_epochs_resumes_at_the_next_epoch_as_fresh(old_w, new_w):
    consumed, states = _save(noisy, old_w, 2, [99, 99])
    assert Counter(i for i in consumed) == _padded(2, keep=_everything)
    assert all(state.between_epochs for state in states)
    rest, following = _resume(noisy, states, new_w, 1)
    # Between epochs, iterating starts epoch 1 directly: "rest" is epoch 1 here.
    assert [rest] == _fresh_epoch(noisy, new_w, 1, epoch=1)
    assert following == _fresh_epoch(noisy, new_w, 1, epoch=2)


def _full_batches(loader: Any) -> list[Any]:
    return [batch if isinstance(batch, torch.Tensor) else batch[1] for batch in loader]


@pytest.mark.parametrize("name", ["limited", "seeded_draws"])
def test_between_epochs_a_limit_and_a_seeded_map_start_the_next_epoch_as_fresh(name):
    build = {"limited": limited, "seeded_draws": seeded_draws}[name]
    _, states = _save(build, 2, 2, [99, 99])
    assert all(state.between_epochs for state in states)
    for rank in range(3):
        with _loader(build, 3, rank, 3) as loader:
            loader.restore_state_rank(states)
            resumed = [_full_batches(loader) for _ in range(2)]
        with _loader(build, 3, rank, 3) as loader:
            for _ in loader:
                pass
            fresh = [_full_batches(loader) for _ in range(2)]
        assert len(resumed[0]) == len(fresh[0]), f"rank {rank}: epoch length"
        for got, want in zip(resumed, fresh, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), f"rank {rank}"


def test_a_save_before_any_item_resumes_as_a_fresh_run_on_the_new_layout():
    _, states = _save(seeded_draws, 2, 2, [0, 0])
    with _loader(seeded_draws, 3) as loader:
        loader.restore_state_rank(states)
        resumed = _full_batches(loader)
    with _loader(seeded_draws, 3) as loader:
        fresh = _full_batches(loader)
    assert all(torch.equal(a, b) for a, b in zip(resumed, fresh, strict=True))


def _draws(build: Callable[[], Any], loader: Any) -> list[float]:
    return [float(x) for batch in loader for x in batch[1]]


def test_between_epochs_the_next_epoch_draws_as_a_fresh_run():
    _, states = _save(noisy, 2, 2, [99, 99])
    with _loader(noisy, 3) as loader:
        loader.restore_state_rank(states)
        resumed = _draws(noisy, loader)
    with _loader(noisy, 3) as loader:
        for _ in loader:
            pass
        fresh = _draws(noisy, loader)
    assert resumed == fresh


def dropping() -> Any:
    return IndexedDataset(list(range(N)), shuffle=True, seed=SEED)


def test_drop_last_drops_only_what_the_new_layout_cannot_fill():
    def build_loader(workers: int, rank: int, ranks: int) -> SavableDataLoader:
        return SavableDataLoader(
            dropping(),
            batch_size=BATCH,
            num_workers=workers,
            seed=SEED,
            drop_last=True,
            worker_config=WorkerConfig(rank=rank, world_size=ranks),
        )

    consumed: list[int] = []
    states = []
    for rank in range(2):
        with build_loader(2, rank, 2) as loader:
            stream = iter(loader)
            for _ in range(3):
                consumed += _ids(next(stream))
            states.append(loader.save_state_rank())
    rest: list[int] = []
    for rank in range(3):
        with build_loader(3, rank, 3) as loader:
            loader.restore_state_rank(states)
            batches = [_ids(batch) for batch in loader]
            assert all(len(batch) == BATCH for batch in batches)
            rest += [i for batch in batches for i in batch]
    assert not set(consumed) & set(rest)
    assert len(set(consumed + rest)) == len(consumed) + len(rest)
    # Each new worker drops at most one incomplete batch.
    assert N - len(consumed) - len(rest) < 3 * 3 * BATCH


def test_resharding_twice_in_one_epoch_composes():
    consumed, states = _save(indexed, 2, 2, [2, 3])
    second: list[int] = []
    middle = []
    for rank in range(3):
        with _loader(indexed, 3, rank, 3) as loader:
            loader.restore_state_rank(states)
            stream = iter(loader)
            for _ in range(rank + 1):
                second += _ids(next(stream))
            middle.append(loader.save_state_rank())
    rest, following = _resume(indexed, middle, 0, 1)
    _assert_accounted(Counter(consumed + second + rest), 2, [3, 1])
    assert following == _fresh_epoch(indexed, 0, 1, epoch=1)


def _noisy(index: int) -> tuple[int, float]:
    return index, float(torch.rand(()))  # draws from the worker's global generator


def noisy() -> Any:
    return IndexedDataset(list(range(N)), shuffle=True, seed=SEED).map(_noisy)


def test_global_generators_of_later_epochs_match_a_fresh_run():
    _, states = _save(noisy, 2, 1, [4])
    with _loader(noisy, 3) as loader:
        loader.restore_state_rank(states)
        for _ in loader:
            pass
        resumed = [batch for batch in loader]
    fresh = []
    with _loader(noisy, 3) as loader:
        for _ in loader:
            pass
        fresh = [batch for batch in loader]
    assert len(resumed) == len(fresh)
    for got, want in zip(resumed, fresh, strict=True):
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1], want[1])


def _augment(index: int, rng: np.random.Generator) -> int:
    return index * 1000 + int(rng.integers(1000))


def seeded() -> Any:
    return IndexedDataset(list(range(N)), seed=SEED).map(_augment, seed=3)


def test_seeded_map_is_elastic_and_its_next_epoch_matches_a_fresh_run():
    consumed, states = _save(seeded, 2, 2, [2, 2])
    rest, following = _resume(seeded, states, 3, 1)
    # 2 ranks read 102 positions (item 0 twice); one rank needs no more.
    assert Counter(i // 1000 for i in consumed + rest) == Counter([*range(N), 0])
    assert following == _fresh_epoch(seeded, 3, 1, epoch=1)


def limited() -> Any:
    # Over a filter a limit is read stream by stream: 20 items each.
    keep_all = functools.partial(operator.is_not, None)
    return IndexedDataset(list(range(N)), shuffle=True, seed=SEED).filter(keep_all).limit(20)


def test_limit_splits_what_the_old_streams_had_left():
    # 2 workers x 20 items: 40 per epoch; 3 batches of 4 consumed, 28 left.
    consumed, states = _save(limited, 2, 1, [3])
    rest, following = _resume(limited, states, 3, 1)
    assert len(consumed) == 12
    assert len(rest) == 28
    assert len(set(consumed + rest)) == 40
    assert following == _fresh_epoch(limited, 3, 1, epoch=1)


def limited_by_position() -> Any:
    return IndexedDataset(list(range(N)), shuffle=True, seed=SEED).limit(20)


def test_a_limit_read_by_position_moves_its_first_n_items_to_another_layout():
    # NOTE [ Limit by position ]: 20 items an epoch in all; 3 batches of 4 consumed, 8 left.
    consumed, states = _save(limited_by_position, 2, 1, [3])
    rest, following = _resume(limited_by_position, states, 3, 1)
    assert (len(consumed), len(rest)) == (12, 8)
    first = [int(x) for x in SavableDataLoader(limited_by_position(), batch_size=None)]
    assert sorted(consumed + rest) == sorted(first)
    assert following == _fresh_epoch(limited_by_position, 3, 1, epoch=1)


def tokens_source(tmp_path: Any) -> Callable[[], Any]:
    path = tmp_path / "tokens.bin"
    np.arange(4000, dtype=np.uint16).tofile(path)

    def build() -> Any:
        return TokenSource(str(path), seq_len=15, dtype="uint16", shuffle=True, seed=SEED).map(
            _first_token
        )

    return build


def _first_token(window: Any) -> int:
    return int(window["input_ids"][0]) if isinstance(window, dict) else int(window[0])


def test_token_source_is_elastic(tmp_path):
    build = tokens_source(tmp_path)
    consumed, states = _save(build, 2, 1, [5])
    rest, _ = _resume(build, states, 3, 2)
    everything = [i for epoch in _fresh_epoch(build, 0, 1, epoch=0) for i in epoch]
    assert Counter(consumed + rest) == Counter(everything)


def shuffled() -> Any:
    """A window shuffle over a stream (a filter reads as one): not elastic."""
    source = IndexedDataset(list(range(N)), seed=SEED).filter(_everything)
    return source.shuffle(buffer_size=8, seed=1)


def test_a_shuffle_over_a_map_style_source_is_read_by_position_and_elastic():
    """NOTE [ Pipelines read by position ]: the same global batches on every layout of
    one global batch, and a save on one goes on with them on the others."""

    def build(rank: int, world_size: int, num_workers: int, batch_size: int) -> Any:
        stage = IndexedDataset(list(range(48)), shuffle=True, seed=SEED).shuffle(
            buffer_size=8, seed=1
        )
        return SavableDataLoader(
            stage,
            batch_size=batch_size,
            num_workers=num_workers,
            seed=SEED,
            worker_config=WorkerConfig(rank=rank, world_size=world_size),
        )

    report = assert_elastic(build, [(2, 1, 4), (1, 0, 8), (4, 0, 2)], save_steps=[2, 5, 6])
    assert report.restores > 0


def test_a_shuffle_buffer_is_not_elastic_and_the_error_says_why_and_what_to_do():
    _, states = _save(shuffled, 2, 1, [3])
    with _loader(shuffled, 3) as loader, pytest.raises(StateMismatchError) as info:
        loader.restore_state_rank(states)
    message = str(info.value)
    assert "num_workers was 2 when the state was saved and is 3 now" in message
    assert "shuffle(buffer_size=8, seed=1)" in message
    assert "buffer" in message
    assert "approximate=True" in message


def test_approximate_restarts_the_interrupted_epoch_and_says_so():
    _, states = _save(shuffled, 2, 1, [3])
    with _loader(shuffled, 3) as loader:
        with pytest.warns(ApproximateResumeWarning, match="restarts epoch 0"):
            loader.restore_state_rank(states, approximate=True)
        epochs = [[i for batch in loader for i in _ids(batch)] for _ in range(2)]
    fresh = [_fresh_epoch(shuffled, 3, 1, epoch=e)[0] for e in range(2)]
    assert epochs == fresh


def test_a_users_own_dataset_is_not_elastic():
    with SavableDataLoader(RandomCounter(40), batch_size=2, num_workers=2) as loader:
        next(iter(loader))
        state = loader.save_state_rank()
    with (
        SavableDataLoader(RandomCounter(40), batch_size=2, num_workers=3) as loader,
        pytest.raises(StateMismatchError, match="RandomCounter: its state is your dataset's"),
    ):
        loader.restore_state_rank(state)


def test_one_rank_of_several_cannot_reshard_alone():
    _, states = _save(indexed, 2, 2, [1, 1])
    with (
        _loader(indexed, 3, 0, 2) as loader,
        pytest.raises(StateMismatchError, match="restore the list of every rank's state"),
    ):
        loader.restore_state_rank(states[0])


def test_ranks_in_different_epochs_are_refused():
    _, states = _save(indexed, 2, 2, [99, 1])
    with _loader(indexed, 2, 0, 2) as loader:
        for _ in loader:
            pass
        next(iter(loader))
        ahead = loader.save_state_rank()  # rank 0 already in epoch 1
    assert ahead.epoch != states[1].epoch
    with _loader(indexed, 3) as loader, pytest.raises(StateMismatchError, match="different epochs"):
        loader.restore_state_rank([ahead, states[1]])


def test_states_of_another_pipeline_are_refused():
    _, states = _save(indexed, 2, 1, [1])
    with _loader(shuffled, 3) as loader, pytest.raises(StateMismatchError, match="fingerprint"):
        loader.restore_state_rank(states)


def test_a_malformed_consumed_record_is_refused():
    _, states = _save(indexed, 2, 1, [2])
    with _loader(indexed, 3) as loader:
        moved = loader.reshard(states, rank=0)
    worker = moved.workers[0]
    assert worker.checkpoint is not None
    plain = moved.to_plain()
    inner = plain["workers"][0]["checkpoint"]["state"]["parent"]["parent"]["parent"]
    inner["done"] = [inner["done_below"]]  # below is by definition not consumed
    with _loader(indexed, 3) as loader, pytest.raises(StateError, match="done_below"):
        loader.restore_state_rank(plain)  # refused at the door, before any worker starts


def test_same_layout_list_restores_each_rank_its_own_state():
    consumed, states = _save(indexed, 2, 2, [2, 1])
    rest, _ = _resume(indexed, states, 2, 2)
    assert Counter(consumed + rest) == _padded(2)  # 101 items padded to 102 on 2 ranks


def test_reshard_does_not_disturb_the_callers_generators():
    _, states = _save(noisy, 2, 1, [3])
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with warnings.catch_warnings(), _loader(noisy, 3) as loader:
        loader.reshard(states, rank=0)
    assert torch.equal(torch.get_rng_state(), before)


def test_json_lines_through_the_loader(tmp_path):
    import json

    ids = iter(range(10_000))
    for f in range(7):
        lines = [json.dumps({"id": next(ids)}) for _ in range(5 + 3 * f)]
        (tmp_path / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    everything = set(range(next(ids)))

    def build() -> Any:
        from savable_loader.datasets import JsonLinesSource

        return JsonLinesSource(str(tmp_path / "*.jsonl"), shuffle_shards=True, seed=2).map(
            _record_id
        )

    consumed, states = _save(build, 2, 2, [3, 2])
    rest, following = _resume(build, states, 3, 1)
    assert Counter(consumed + rest) == Counter(everything)
    assert following == _fresh_epoch(build, 3, 1, epoch=1)


def _record_id(record: dict[str, int]) -> int:
    return record["id"]


@pytest.mark.parametrize(("build", "workers"), [(indexed, 0), (indexed, 3), (noisy, 2)])
def test_a_resharded_stream_resumes_exactly(build, workers):
    """The shared harness, from an elastic restore: every later save restores exactly."""
    from savable_loader.testing import assert_resumes_exactly

    _, states = _save(build, 2, 2, [3, 2])

    def restored() -> SavableDataLoader:
        loader = SavableDataLoader(
            build(),
            batch_size=BATCH,
            num_workers=workers,
            seed=SEED,
            worker_config=WorkerConfig(checkpoint_share=1.0),
        )
        loader.restore_state_rank(states)
        return loader

    # With three workers one chain of two items (fresh checkpoints of two workers, the
    # restored one of the third) does for chains of 1 and 3 items (tests/resume/test_resume.py).
    report = assert_resumes_exactly(
        restored,
        epochs=2,
        num_points=3,
        last_items=True,
        chain_items=(2,) if workers >= 3 else (1, 3),
        inline_chains=True,
    )
    assert report.restores >= 4


def _seeded_draw(index: int, rng: np.random.Generator) -> tuple[int, float]:
    return index, float(rng.random())


def seeded_draws() -> Any:
    return IndexedDataset(list(range(N)), seed=SEED).map(_seeded_draw, seed=5)


@pytest.mark.parametrize("build", [noisy, seeded_draws])
def test_the_rest_of_the_epoch_repeats_no_draw_of_the_saved_run(build):
    """New stream w must not hand its items the draws old stream w made at the start."""
    head_draws: list[float] = []
    with _loader(build, 2) as loader:
        stream = iter(loader)
        for _ in range(4):
            head_draws += [float(x) for x in next(stream)[1]]
        state = loader.save_state_rank()
    with _loader(build, 3) as loader:
        loader.restore_state_rank(state)
        rest_draws = _draws(build, loader)
    assert len(head_draws) == 16
    assert not set(head_draws) & set(rest_draws)


class _Flaky:
    """Raises when the item at ``index`` is mapped in the main process (the reshard's
    replay), never in a worker."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, item: int) -> int:
        from torch.utils.data import get_worker_info

        if item == self.index and get_worker_info() is None:
            raise ValueError("decoder broke")
        return item


def test_a_replay_that_raises_during_the_reshard_is_a_state_error():
    def build() -> Any:
        return IndexedDataset(list(range(N)), seed=SEED).filter(_odd_tens).map(_Flaky(5))

    with SavableDataLoader(
        build(),
        batch_size=BATCH,
        num_workers=1,
        seed=SEED,
        # A budget no wait can fill: the worker's only checkpoint is the one it takes at
        # start-up, before the item that raises. With 0.0001 a worker slowed for a second
        # (a loaded machine, torch 2.4's first tensor) earned a checkpoint past that item,
        # and the replay never reached it (NOTE [ Checkpoint policy ] in _worker/ring.py).
        worker_config=WorkerConfig(checkpoint_share=1e-12),
    ) as loader:
        stream = iter(loader)
        for _ in range(6):
            next(stream)
        state = loader.save_state_rank()
    assert state.workers[0].replay > 0  # the checkpoint stands before the item that raises
    with (
        _loader(build, 2) as loader,
        pytest.raises(StateError, match=r"replaying \d+ batch\(es\) of rank 0 worker 0") as info,
    ):
        loader.restore_state_rank(state)
    assert isinstance(info.value.__cause__, ValueError)


def _save_at_last_batch(
    workers: int, ahead: int | None
) -> tuple[list[int], list[int], list[RankState]]:
    """Two ranks each take every batch of epoch 0 without asking for the next one (so
    without StopIteration: their workers' ends are not handed on); rank ``ahead``, if
    any, then ends the epoch and takes one batch of epoch 1. Returns the ids of epoch 0,
    those of epoch 1 and the states."""
    epoch_0: list[int] = []
    epoch_1: list[int] = []
    states = []
    for rank in range(2):
        with _loader(indexed, workers, rank, 2) as loader:
            count = sum(1 for _ in loader)
        with _loader(indexed, workers, rank, 2) as loader:
            stream = iter(loader)
            epoch_0 += [i for _ in range(count) for i in _ids(next(stream))]
            if rank == ahead:
                assert next(stream, None) is None
                epoch_1 += _ids(next(iter(loader)))
            states.append(loader.save_state_rank())
    return epoch_0, epoch_1, states


@pytest.mark.parametrize(
    ("old_w", "ahead", "new_w", "new_r"),
    [(2, 1, 3, 3), (2, 0, 2, 1), (0, 1, 2, 3), (3, 0, 0, 1)],
)
def test_a_rank_right_after_its_last_batch_next_to_ranks_in_the_next_epoch(
    old_w, ahead, new_w, new_r
):
    """NOTE [ A rank at its last batch ] in _elastic.py: it stands at the start of
    epoch 1, as the rank that began it started from."""
    epoch_0, head, states = _save_at_last_batch(old_w, ahead)
    assert Counter(epoch_0) == _padded(2)
    behind = states[1 - ahead]
    assert (behind.epoch, behind.between_epochs, states[ahead].epoch) == (0, False, 1)
    rest, following = _resume(indexed, states, new_w, new_r)
    _assert_accounted(Counter(head + rest), 2, [new_r], epoch=1)
    assert following == _fresh_epoch(indexed, new_w, new_r, epoch=2)


@pytest.mark.parametrize(("old_w", "new_w", "new_r"), [(2, 3, 3), (0, 2, 1)])
def test_every_rank_right_after_its_last_batch_resumes_at_the_next_epoch(old_w, new_w, new_r):
    epoch_0, _, states = _save_at_last_batch(old_w, None)
    assert Counter(epoch_0) == _padded(2)
    assert not any(state.between_epochs for state in states)
    rest, following = _resume(indexed, states, new_w, new_r)
    assert rest == []  # nothing of epoch 0 left, no padding added: the next iter() is epoch 1
    assert following == _fresh_epoch(indexed, new_w, new_r, epoch=1)


def test_a_state_moved_with_seed_each_item_holds_no_generator_bytes():
    """NOTE [ Items seeded one by one ]: the rest of a resharded epoch needs no salted
    generators either, so its states stay small."""

    def build(rank: int, ranks: int) -> SavableDataLoader:
        return SavableDataLoader(
            list(range(N)),
            batch_size=BATCH,
            num_workers=0,
            seed=SEED,
            seed_each_item=True,
            worker_config=WorkerConfig(rank=rank, world_size=ranks),
        )

    states = []
    for rank in range(2):
        with build(rank, 2) as loader:
            iterator = iter(loader)
            next(iterator)
            states.append(loader.save_state_rank())
    with build(0, 1) as loader:
        loader.restore_state_rank(states)
        moved = loader.save_state_rank()
        next(iter(loader))
        after = loader.save_state_rank()
    for state in (moved, after):
        assert [w.checkpoint.rng for w in state.workers if w.checkpoint] == [None]
