"""The global stream: what each global step holds is a function of the seed and the global
position alone, on every layout (ranks x workers x per-rank batch size) of one global batch.

Ranks are simulated in one process with ``WorkerConfig(rank=r, world_size=R)`` loaders.
:func:`assert_elastic` compares the global batches of layouts and restores saves across
them; the tests below also account for the items of a restore onto another global batch,
check the draws of ``seed_each_item`` and of a seeded map item by item, the messages of
refused restores, and :func:`split_batch`. ``N`` items make a half-full last global step,
and divide by every number of ranks used, so no layout pads its epoch.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pipelines import RandomCounter
from torch.utils.data import Dataset, IterableDataset, default_collate

from savable_loader import (
    ConfigError,
    RankState,
    SavableDataLoader,
    StateMismatchError,
    WorkerConfig,
)
from savable_loader.datasets import IndexedDataset, Map, TableSource, TokenSource
from savable_loader.testing import (
    ElasticMismatch,
    Shape,
    assert_elastic,
    assert_resumes_exactly,
    digest,
    elastic_builder,
    split_batch,
)

N = 44
SEED = 11
MAP_SEED = 5
SEQ = 6
#: Saved on 2 ranks, restored onto 4 and 1, and chained 2 -> 4 -> 1 (global batch 8).
LAYOUTS = [Shape(2, 0, 4), Shape(4, 0, 2), Shape(1, 0, 8)]
#: The same global batch with workers: the restored layouts start worker processes.
WORKER_LAYOUTS = [Shape(2, 0, 4), Shape(4, 1, 2), Shape(1, 2, 8)]

Build = Callable[[int, int, int, int], SavableDataLoader[Any]]


def _builder(dataset: Callable[[], Any], **loader: Any) -> Build:
    """``build(rank, ranks, workers, batch)`` of ``assert_elastic`` over ``dataset()``."""
    return elastic_builder(dataset, seed=SEED, **loader)


# -- pipelines -----------------------------------------------------------------------------


def _augment(index: int, rng: np.random.Generator) -> dict[str, Any]:
    return {"index": index, "draw": float(rng.random())}


def seeded_map() -> Any:
    return IndexedDataset(list(range(N)), shuffle=True, seed=SEED).map(_augment, seed=MAP_SEED)


class Plain(Dataset[int]):
    """A map-style dataset of its indices: the loader serves it (``shuffle=True``)."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class Draws(Dataset[dict[str, Any]]):
    """A map-style dataset whose items draw from all three global generators."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "py": random.random(),
            "np": float(np.random.rand()),
            "torch": torch.rand(()),
        }


def _tokens(tmp_path: Path) -> Callable[[], Any]:
    path = tmp_path / "tokens.bin"
    np.arange(N * SEQ + 3, dtype=np.uint16).tofile(path)  # N windows and a dropped tail
    return lambda: TokenSource(str(path), seq_len=SEQ, dtype="uint16", shuffle=True, seed=SEED)


def _row_and_image(row: dict[str, Any]) -> tuple[int, bytes]:
    return row["__row__"], row["image"]


def _table(tmp_path: Path) -> Callable[[], Any]:
    (tmp_path / "files").mkdir()
    lines = []
    for i in range(N):
        (tmp_path / "files" / f"{i}.bin").write_bytes(b"image %d" % i)
        lines.append(json.dumps({"id": i, "image": f"files/{i}.bin"}) + "\n")
    (tmp_path / "rows.jsonl").write_text("".join(lines))
    table = str(tmp_path / "rows.jsonl")
    return lambda: TableSource(table, files="image", shuffle=True, seed=SEED, threads=0).map(
        _row_and_image
    )


def _noise(window: Any) -> dict[str, Any]:
    return {"tokens": torch.as_tensor(window), "noise": torch.rand(())}


def _elastic_build(name: str, tmp_path: Path) -> Build:
    if name == "seeded_map":
        return _builder(seeded_map)
    if name == "seeded_map_drop_last":
        return _builder(seeded_map, drop_last=True)
    if name == "map_style_shuffled_by_the_loader":
        return _builder(Plain, shuffle=True)
    if name == "tokens":
        return _builder(_tokens(tmp_path))
    if name == "table":
        return _builder(_table(tmp_path), collate_fn=list)
    if name == "seed_each_item":
        return _builder(Draws, shuffle=True, seed_each_item=True)
    if name == "tokens_seed_each_item":
        tokens = _tokens(tmp_path)
        return _builder(lambda: Map(tokens(), _noise), seed_each_item=True)
    raise AssertionError(name)


# -- every rank of a layout in one process -------------------------------------------------


def _loaders(build: Build, shape: Shape) -> list[SavableDataLoader[Any]]:
    return [
        build(rank, shape.ranks, shape.num_workers, shape.batch_size) for rank in range(shape.ranks)
    ]


def _global_epoch(loaders: list[SavableDataLoader[Any]]) -> list[tuple[str, ...]]:
    """The global batches of the next epoch: per step, every rank's items' digests, sorted."""
    per_rank = [list(loader) for loader in loaders]
    assert len({len(batches) for batches in per_rank}) == 1, "ranks yield unequal epochs"
    return [
        tuple(sorted(digest(item) for batch in step for item in split_batch(batch)))
        for step in zip(*per_rank, strict=True)
    ]


def _close(loaders: list[SavableDataLoader[Any]]) -> None:
    for loader in loaders:
        loader.close()


def _save_after(build: Build, shape: Shape, steps: int, states: Any = None) -> list[RankState]:
    """Every rank's state after ``steps`` batches (after restoring ``states``, if any)."""
    loaders = _loaders(build, shape)
    try:
        for loader in loaders:
            if states is not None:
                loader.restore_state_rank(states)
            stream = iter(loader)
            for _ in range(steps):
                next(stream)
        return [loader.save_state_rank() for loader in loaders]
    finally:
        _close(loaders)


# -- one global stream on every layout -----------------------------------------------------


@pytest.mark.parametrize(
    ("name", "steps"),
    [
        ("seeded_map", 6),  # N = 44 over a global batch of 8: 5 full steps and one of 4
        ("seeded_map_drop_last", 5),  # every layout drops positions 40 to 43
        ("map_style_shuffled_by_the_loader", 6),
        ("tokens", 6),
        ("table", 6),
        ("seed_each_item", 6),
        ("tokens_seed_each_item", 6),
    ],
)
def test_every_layout_of_one_global_batch_gives_the_same_global_batches_and_restores(
    tmp_path, name, steps
):
    report = assert_elastic(_elastic_build(name, tmp_path), LAYOUTS)
    assert report.steps == (steps, steps)
    # Saves mid-epoch, after the last step and after the next epoch's first step, each
    # restored onto 4 and 1 ranks, and chained 2 -> 4 -> 1.
    assert report.restores == 12


@pytest.mark.parametrize("name", ["seeded_map", "seed_each_item"])
def test_layouts_with_workers_give_the_same_global_batches_and_restores(tmp_path, name):
    # One save mid-epoch, restored onto both layouts and chained: every restore onto a
    # layout with workers starts their processes.
    report = assert_elastic(_elastic_build(name, tmp_path), WORKER_LAYOUTS, save_steps=[2])
    assert report.restores == 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["seeded_map", "seed_each_item", "tokens", "table"])
def test_layouts_with_workers_restore_after_the_last_step_and_the_next_epochs_first(tmp_path, name):
    report = assert_elastic(_elastic_build(name, tmp_path), WORKER_LAYOUTS)
    assert report.restores == 12


def test_a_save_after_any_step_of_two_epochs_continues_the_global_stream():
    # Every step: the first, mid-epoch, the last of an epoch (before its StopIteration),
    # the first of the next; chained onto the last layout each time.
    report = assert_elastic(_builder(seeded_map), LAYOUTS, save_steps=range(11))
    assert report.restores == 11 * 2 + 10 * 2


@pytest.mark.parametrize("name", ["seeded_map", "seed_each_item"])
def test_a_save_between_epochs_continues_with_the_next_epoch_on_every_layout(tmp_path, name):
    build = _elastic_build(name, tmp_path)
    loaders = _loaders(build, LAYOUTS[0])
    try:
        reference = [_global_epoch(loaders), _global_epoch(loaders)]
    finally:
        _close(loaders)
    loaders = _loaders(build, LAYOUTS[0])
    try:
        _global_epoch(loaders)  # every rank met its StopIteration
        states = [loader.save_state_rank() for loader in loaders]
    finally:
        _close(loaders)
    assert all(state.between_epochs for state in states)
    for shape in LAYOUTS[1:]:
        loaders = _loaders(build, shape)
        try:
            for loader in loaders:
                loader.restore_state_rank(states)
            assert _global_epoch(loaders) == reference[1], shape
        finally:
            _close(loaders)


def test_a_repeat_of_whole_shards_gives_the_same_global_batches_without_restores():
    # 48 items: every worker's shard is whole batches on each layout, so the passes line up.
    def repeated() -> Any:
        return IndexedDataset(list(range(48)), shuffle=True, seed=SEED).map(_augment, seed=MAP_SEED)

    build = _builder(lambda: repeated().repeat(2))
    report = assert_elastic(build, [Shape(2, 0, 4), Shape(1, 2, 8)], save_steps=())
    assert report.steps == (12, 12)


def _keep_all(item: Any) -> bool:
    return True


def test_a_repeat_over_a_stream_restored_onto_another_layout_is_refused_with_the_fixes():
    # Over a filter a repeat reads as a stream and is not elastic: refused before anything
    # replays (over a map-style source it is read by position, NOTE [ Repeat by position ]).
    build = _builder(lambda: seeded_map().filter(_keep_all).repeat(2))
    states = _save_after(build, LAYOUTS[0], steps=3)
    with pytest.raises(StateMismatchError) as info:
        _save_after(build, LAYOUTS[1], 0, states)
    message = str(info.value)
    assert "world_size was 2 when the state was saved and is 4 now" in message
    assert "batch_size was 4 when the state was saved and is 2 now" in message
    assert "repeat(2): its passes count one worker's passes over its own shard" in message
    assert "approximate=True" in message
    assert "build the loader with batch_size=4" in message


def test_a_repeat_of_uneven_shards_gives_the_same_global_batches_with_workers():
    """Read by position (NOTE [ Repeat by position ]): a pass's last batch no longer
    takes the next pass's first items of one worker's shard."""
    build = _builder(lambda: seeded_map().repeat(2))
    report = assert_elastic(build, [Shape(2, 1, 4), Shape(1, 2, 8), Shape(4, 0, 2)])
    assert report.restores > 0


def test_a_limit_gives_the_same_global_batches_on_every_layout_and_n_items_in_all():
    """Read by position (NOTE [ Limit by position ]): the epoch's first 12 positions."""
    build = _builder(lambda: seeded_map().limit(12))
    report = assert_elastic(build, [*LAYOUTS, Shape(2, 2, 4)], save_steps=[1, 2])
    assert report.steps == (2, 2)  # 12 items a global batch of 8: one full step, one of 4
    loaders = _loaders(build, Shape(4, 1, 2))
    try:
        epoch = _global_epoch(loaders)
    finally:
        _close(loaders)
    with _builder(seeded_map)(0, 1, 0, 12) as whole:
        first = [digest(item) for item in split_batch(next(iter(whole)))]
    assert sorted(d for step in epoch for d in step) == sorted(first)


def test_assert_elastic_catches_a_stream_that_depends_on_the_layout():
    def build(rank: int, ranks: int, workers: int, batch: int) -> SavableDataLoader[Any]:
        return SavableDataLoader(
            Plain(),
            shuffle=True,
            batch_size=batch,
            num_workers=workers,
            seed=SEED + ranks,  # another order on each number of ranks
            worker_config=WorkerConfig(rank=rank, world_size=ranks),
        )

    with pytest.raises(ElasticMismatch) as info:
        assert_elastic(build, LAYOUTS)
    assert (info.value.layout, info.value.epoch, info.value.step) == (LAYOUTS[1], 0, 0)
    with pytest.raises(ValueError, match="one global batch size"):
        assert_elastic(build, [Shape(2, 0, 4), Shape(1, 0, 4)])


# -- a restore onto another global batch ---------------------------------------------------

M = 50  # 25 items for each of 2 ranks; a global step of 2 x 4 reads the next 8 positions


def _ids(batch: Any) -> list[int]:
    return [int(x) for x in batch]


def _indexed_loader(
    shuffle: bool, rank: int, ranks: int, workers: int, batch: int | None = 4
) -> SavableDataLoader[Any]:
    return SavableDataLoader(
        IndexedDataset(list(range(M)), shuffle=shuffle, seed=SEED),
        batch_size=batch,
        num_workers=workers,
        seed=SEED,
        worker_config=WorkerConfig(rank=rank, world_size=ranks),
    )


def _canonical_order(shuffle: bool) -> list[int]:
    """Epoch 0's positions as one rank reads them, item by item."""
    with _indexed_loader(shuffle, 0, 1, 0, batch=None) as loader:
        return [int(x) for x in loader]


@pytest.mark.parametrize(
    ("shuffle", "steps", "workers", "batch"),
    [
        (False, 1, 0, 4),
        (True, 1, 0, 4),
        (False, 2, 0, 4),
        (True, 2, 0, 4),
        (True, 4, 0, 4),
        (True, 2, 2, 4),
        (True, 2, 0, 3),  # another per-rank batch size too: 3 x 3 items a step
    ],
)
def test_a_restore_onto_another_global_batch_delivers_the_rest_once_then_the_new_epochs(
    shuffle, steps, workers, batch
):
    consumed: list[int] = []
    states: list[RankState] = []
    for rank in range(2):
        with _indexed_loader(shuffle, rank, 2, 0) as loader:
            stream = iter(loader)
            consumed += [i for _ in range(steps) for i in _ids(next(stream))]
            states.append(loader.save_state_rank())
    rest: list[int] = []
    following: list[list[list[int]]] = []
    for rank in range(3):
        with _indexed_loader(shuffle, rank, 3, workers, batch) as loader:
            loader.restore_state_rank(states)
            rest += [i for batch in loader for i in _ids(batch)]
            following.append([_ids(batch) for batch in loader])
    order = _canonical_order(shuffle)
    assert Counter(consumed) == Counter(order[: 8 * steps])  # the first global steps
    # Every item left once; the fewest next positions of the cyclic order (the first items
    # again) so that 3 ranks read as many: 42 and 18 items need none, 34 need two.
    left = order[8 * steps :]
    padding = [order[p % M] for p in range(M, M + (-len(left)) % 3)]
    assert Counter(rest) == Counter(left + padding)
    fresh: list[list[list[int]]] = []
    for rank in range(3):
        with _indexed_loader(shuffle, rank, 3, workers, batch) as loader:
            for _ in loader:
                pass
            fresh.append([_ids(batch) for batch in loader])
    assert following == fresh


# -- seed_each_item ------------------------------------------------------------------------


def _plain(item: dict[str, Any]) -> dict[str, Any]:
    return {
        key: value.item() if isinstance(value, torch.Tensor) else value
        for key, value in item.items()
    }


def _items(
    build: Build, shape: Shape, epochs: int = 1, states: list[RankState] | None = None
) -> list[list[dict[str, Any]]]:
    """Every item of each epoch over all ranks, as plain values (after restoring
    ``states``, if given: then the first epoch is the rest of the saved one)."""
    loaders = _loaders(build, shape)
    try:
        for loader in loaders:
            if states is not None:
                loader.restore_state_rank(states)
        return [
            [_plain(item) for loader in loaders for batch in loader for item in split_batch(batch)]
            for _ in range(epochs)
        ]
    finally:
        _close(loaders)


def _by_index(items: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    by_index = {item["index"]: item for item in items}
    assert len(by_index) == len(items), "an index came twice"
    return by_index


def seeded_each_item(**loader: Any) -> Build:
    return _builder(Draws, shuffle=True, seed_each_item=True, **loader)


@pytest.mark.parametrize("workers", [0, 1])
def test_seed_each_item_gives_an_index_the_same_draws_on_one_rank_and_on_four(workers):
    (one,) = _items(seeded_each_item(), Shape(1, 0, 8))
    (four,) = _items(seeded_each_item(), Shape(4, workers, 2))
    assert _by_index(four) == _by_index(one)
    for name in ("py", "np", "torch"):  # the draws are the item's own, not one for all
        assert len({item[name] for item in one}) == N, name


def test_seed_each_item_draws_anew_for_an_index_in_the_next_epoch():
    first, second = (_by_index(epoch) for epoch in _items(seeded_each_item(), Shape(2, 0, 4), 2))
    assert first.keys() == second.keys() == set(range(N))
    for index in range(N):
        for name in ("py", "np", "torch"):
            assert first[index][name] != second[index][name], (index, name)


@pytest.mark.parametrize("workers", [0, 2])
def test_seed_each_item_states_hold_no_generator_bytes(workers):
    def save(seed_each_item: bool) -> RankState:
        # A checkpoint at every batch: the workers' checkpoints stand mid-epoch.
        with SavableDataLoader(
            Draws(),
            shuffle=True,
            batch_size=4,
            num_workers=workers,
            seed=SEED,
            seed_each_item=seed_each_item,
            worker_config=WorkerConfig(rank=0, world_size=2, checkpoint_share=1.0),
        ) as loader:
            stream = iter(loader)
            for _ in range(6):
                next(stream)
            return loader.save_state_rank()

    seeded = save(True)
    assert len(seeded.workers) == max(workers, 1)
    for worker in seeded.workers:
        assert worker.checkpoint is not None
        assert worker.checkpoint.seq > 0  # taken after items drew from the generators
        assert worker.checkpoint.rng is None
        assert worker.checkpoint.seeded_epoch == 0
    # Without it, the same checkpoints hold what the generators drew to.
    assert all(w.checkpoint and w.checkpoint.rng is not None for w in save(False).workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_seed_each_item_states_after_a_restore_onto_another_layout_hold_no_generator_bytes(
    workers,
):
    saved = _save_after(seeded_each_item(), Shape(2, 0, 4), steps=2)
    # Right after the restore, and after a step of the rest of the epoch.
    for steps in (0, 1):
        states = _save_after(seeded_each_item(), Shape(3, workers, 4), steps, states=saved)
        checkpoints = [worker.checkpoint for state in states for worker in state.workers]
        assert len(checkpoints) == 3 * max(workers, 1)
        for checkpoint in checkpoints:
            assert checkpoint is not None
            assert (checkpoint.rng, checkpoint.seeded_epoch) == (None, 0)


def test_seed_each_item_keeps_every_items_draws_through_a_restore_onto_another_global_batch():
    (fresh,) = _items(seeded_each_item(), Shape(1, 0, 8))
    loaders = _loaders(seeded_each_item(), Shape(2, 0, 4))
    try:
        consumed = [_plain(item) for loader in loaders for item in split_batch(next(iter(loader)))]
        states = [loader.save_state_rank() for loader in loaders]
    finally:
        _close(loaders)
    # 36 items left: 3 ranks read 12 each, no padding.
    (rest,) = _items(seeded_each_item(), Shape(3, 0, 4), states=states)
    assert len(consumed) == 8
    assert _by_index(consumed + rest) == _by_index(fresh)


@pytest.mark.parametrize(("saved", "now"), [(True, False), (False, True)])
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_seed_each_item_difference_is_named_on_the_same_layout_and_another(saved, now, ranks):
    states = _save_after(_builder(Draws, seed_each_item=saved), Shape(2, 0, 4), steps=1)
    with pytest.raises(
        StateMismatchError,
        match=f"seed_each_item was {saved} when the state was saved and is {now} now; "
        f"build the loader with seed_each_item={saved}",
    ):
        _save_after(_builder(Draws, seed_each_item=now), Shape(ranks, 0, 4), 0, states)


def _first_draw(index: int) -> dict[str, Any]:
    return {"index": index, "first": torch.rand(())}


def _second_draw(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "second": torch.rand(())}


def _map_draw(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "mapped": torch.rand(())}


def test_two_maps_with_seed_each_item_draw_apart():
    def two_maps() -> Any:
        return (
            IndexedDataset(list(range(N)), shuffle=True, seed=SEED)
            .map(_first_draw)
            .map(_second_draw)
        )

    (items,) = _items(_builder(two_maps, seed_each_item=True), Shape(2, 0, 4))
    assert len(items) == N
    assert all(item["first"] != item["second"] for item in items)
    assert len({item["second"] for item in items}) == N


def test_a_map_with_seed_each_item_draws_apart_from_the_getitem_below_it():
    (items,) = _items(
        _builder(lambda: Map(Draws(), _map_draw), seed_each_item=True), Shape(2, 0, 4)
    )
    assert all(item["mapped"] != item["torch"] for item in items)


class _Numbers(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(8))


def _same(item: Any) -> Any:
    return item


@pytest.mark.parametrize(
    ("dataset", "name"),
    [
        (_Numbers(), "_Numbers"),
        (RandomCounter(8), "RandomCounter"),
        (Map(RandomCounter(8), _same), "RandomCounter"),
    ],
    ids=["torch_iterable", "savable_iterable", "map_over_an_iterable"],
)
def test_seed_each_item_refuses_items_without_a_place_in_the_global_stream(dataset, name):
    with pytest.raises(ConfigError, match="seed_each_item=True") as info:
        SavableDataLoader(dataset, batch_size=2, seed_each_item=True)
    assert f"the items of {name} have none" in str(info.value)


def test_seed_each_item_resumes_exactly_with_two_workers():
    def build() -> SavableDataLoader[Any]:
        return SavableDataLoader(
            Draws(), shuffle=True, batch_size=4, num_workers=2, seed=SEED, seed_each_item=True
        )

    # After items mid-epoch, the last of epoch 0 (before its StopIteration) and one of
    # epoch 1; plus the boundaries, peeks and breaks the harness adds.
    report = assert_resumes_exactly(
        build, epochs=2, points=(5, 11, 16), chain_items=(2,), inline_chains=True
    )
    assert report.items_per_epoch == [11, 11]
    assert report.restores >= len(report.save_points) >= 3


# -- the seeded map ------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 1])
def test_a_seeded_map_gives_an_item_the_same_generator_on_one_rank_and_on_four(workers):
    (one,) = _items(_builder(seeded_map), Shape(1, 0, 8))
    (four,) = _items(_builder(seeded_map), Shape(4, workers, 2))
    assert _by_index(four) == _by_index(one)
    assert len({item["draw"] for item in one}) == N


def test_a_seeded_map_draws_anew_for_an_index_in_the_next_epoch():
    first, second = (_by_index(epoch) for epoch in _items(_builder(seeded_map), Shape(2, 0, 4), 2))
    assert all(first[index]["draw"] != second[index]["draw"] for index in range(N))


def test_a_padded_position_gets_its_own_draw():
    def ten() -> Any:
        return IndexedDataset(list(range(10)), shuffle=True, seed=SEED, even="pad").map(
            _augment, seed=MAP_SEED
        )

    (one,) = _items(_builder(ten), Shape(1, 0, 2))
    (four,) = _items(_builder(ten), Shape(4, 0, 2))  # 12 positions: 2 indices twice
    as_pairs = Counter((item["index"], item["draw"]) for item in four)
    twice = [index for index, count in Counter(item["index"] for item in four).items() if count > 1]
    assert len(twice) == 2
    assert len(as_pairs) == 12, "an index read twice got one draw twice"
    # The epoch's positions keep the draws one rank gives them; the padding ones are new.
    assert not Counter((item["index"], item["draw"]) for item in one) - as_pairs
    assert {index for index, _ in as_pairs - Counter((i["index"], i["draw"]) for i in one)} == set(
        twice
    )


# -- refused restores name what differs ----------------------------------------------------


def _states(ranks: int, steps: int, **loader: Any) -> list[RankState]:
    states = []
    for rank in range(ranks):
        with SavableDataLoader(
            IndexedDataset(list(range(M)), seed=SEED),
            seed=SEED,
            worker_config=WorkerConfig(rank=rank, world_size=ranks),
            **loader,
        ) as saving:
            stream = iter(saving)
            for _ in range(steps):
                next(stream)
            states.append(saving.save_state_rank())
    return states


def _restore_onto_three_ranks(states: list[RankState], **loader: Any) -> None:
    with SavableDataLoader(
        IndexedDataset(list(range(M)), seed=SEED),
        seed=SEED,
        worker_config=WorkerConfig(rank=0, world_size=3),
        **loader,
    ) as restoring:
        restoring.restore_state_rank(states)


def test_a_state_saved_without_batches_is_refused_by_a_batching_loader():
    states = _states(2, 3, batch_size=None)
    with pytest.raises(StateMismatchError, match=r"batch_size was None .* and is 4 now"):
        _restore_onto_three_ranks(states, batch_size=4)


def test_a_state_saved_with_drop_last_names_drop_last_on_another_layout():
    states = _states(2, 1, batch_size=4, drop_last=True)
    with pytest.raises(
        StateMismatchError,
        match="drop_last was True when the state was saved and is False now; "
        "build the loader with drop_last=True",
    ):
        _restore_onto_three_ranks(states, batch_size=4, drop_last=False)


@pytest.mark.parametrize("as_list", [False, True])
def test_a_pipeline_that_is_not_elastic_names_the_batch_size_and_the_fix(as_list):
    with SavableDataLoader(RandomCounter(40), batch_size=2) as saving:
        next(iter(saving))
        state = saving.save_state_rank()
    with (
        SavableDataLoader(RandomCounter(40), batch_size=3) as restoring,
        pytest.raises(StateMismatchError) as info,
    ):
        restoring.restore_state_rank([state] if as_list else state)
    message = str(info.value)
    assert "batch_size was 2 when the state was saved and is 3 now" in message
    assert "RandomCounter" in message
    assert "build the loader with batch_size=2" in message


# -- split_batch ---------------------------------------------------------------------------


def _equal(a: Any, b: Any) -> bool:
    return digest(a) == digest(b)


def test_split_batch_cuts_tensors_and_arrays_along_their_first_dimension():
    batch = torch.arange(6).reshape(3, 2)
    assert all(_equal(a, b) for a, b in zip(split_batch(batch), batch, strict=True))
    assert len(split_batch(np.zeros((5, 2)))) == 5


def test_split_batch_gives_dicts_of_tensors_key_by_key():
    items = [{"x": torch.tensor([i, i]), "y": torch.tensor(i * 10)} for i in range(3)]
    got = split_batch(default_collate(items))
    assert [digest(item) for item in got] == [digest(item) for item in items]


def test_split_batch_gives_tuples_of_tensors_field_by_field():
    items = [(torch.tensor([i, -i]), torch.tensor(float(i))) for i in range(3)]
    got = split_batch(default_collate(items))
    assert len(got) == 3
    assert [digest(tuple(item)) for item in got] == [digest(item) for item in items]


def test_split_batch_follows_nested_tuple_fields():
    items = [(torch.tensor(float(i)), (torch.tensor(i), torch.tensor([i, i]))) for i in range(4)]
    got = split_batch(default_collate(items))
    assert len(got) == 4
    assert all(int(item[1][0]) == i for i, item in enumerate(got))
    assert all(torch.equal(item[1][1], torch.tensor([i, i])) for i, item in enumerate(got))


def test_split_batch_gives_a_list_of_strings_item_by_item():
    assert split_batch(default_collate(["a", "b", "c"])) == ["a", "b", "c"]
    got = split_batch(default_collate([{"id": i, "name": f"n{i}"} for i in range(3)]))
    assert [(int(item["id"]), item["name"]) for item in got] == [(0, "n0"), (1, "n1"), (2, "n2")]


def test_split_batch_takes_a_collate_fn_list_batch_as_its_items():
    items = [(i, b"bytes %d" % i) for i in range(3)]
    assert split_batch(list(items)) == items
    assert split_batch(["x", "y"]) == ["x", "y"]


def test_split_batch_takes_a_collate_fn_list_batch_of_dicts_as_its_items():
    items = [{"id": i, "name": f"n{i}"} for i in range(3)]
    assert split_batch(list(items)) == items


def test_split_batch_takes_a_collate_fn_list_batch_of_tensor_dicts_as_its_items():
    items = [{"x": torch.tensor([i, i, i])} for i in range(2)]
    assert [digest(item) for item in split_batch(list(items))] == [digest(i) for i in items]


def test_split_batch_gives_tuples_with_a_string_field_item_by_item():
    items = [(torch.tensor(i), f"caption {i}") for i in range(3)]
    got = split_batch(default_collate(items))
    assert len(got) == 3
    assert [(int(tensor), text) for tensor, text in got] == [(i, f"caption {i}") for i in range(3)]
