"""A Blend read by position (NOTE [ Blend by position ] in datasets/blend_positions.py):
its epochs are laid out from the seed, the epoch, the sources' lengths and the weights, so
every layout of one global batch gets the same global batches, and a state moves to
another layout. Ranks are simulated in one process with ``WorkerConfig(rank=r, ...)``."""

from __future__ import annotations

import functools
import itertools
import operator
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from savable_loader import SavableDataLoader, StateError, StateMismatchError
from savable_loader.datasets import Blend, IndexedDataset, TokenSource
from savable_loader.datasets.transforms.blend_positions import (
    BLOCK,
    LEAF,
    BlendOrder,
    block_counts,
    segments,
)
from savable_loader.testing import (
    Shape,
    assert_elastic,
    assert_resumes_exactly,
    digest,
    elastic_builder,
)

SEED = 11
LAYOUTS = [Shape(2, 0, 4), Shape(4, 0, 2), Shape(1, 0, 8)]


def _augment(index: Any, rng: np.random.Generator) -> dict[str, Any]:
    return {
        "index": int(index[0]) if hasattr(index, "__len__") else int(index),
        "draw": rng.random(),
    }


def _mixed(tmp_path: Path, stop: str) -> Callable[[], Any]:
    tokens = tmp_path / "tokens.bin"
    np.arange(10_000, 10_000 + 16 * 4, dtype=np.uint16).tofile(tokens)  # 16 windows of 4

    def build() -> Any:
        words = IndexedDataset(list(range(28)), shuffle=True, seed=SEED)
        windows = TokenSource(str(tokens), seq_len=4, dtype="uint16", shuffle=True, seed=SEED)
        return Blend([words, windows], weights=[0.6, 0.4], seed=3, stop=stop).map(_augment, seed=5)

    return build


def _builder(dataset: Callable[[], Any], **loader: Any) -> Any:
    return elastic_builder(dataset, seed=SEED, collate_fn=list, **loader)


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_a_blend_gives_the_same_global_batches_on_every_layout_and_restores(tmp_path, stop):
    report = assert_elastic(_builder(_mixed(tmp_path, stop)), LAYOUTS, save_steps=[0, 2, 5])
    # all_exhausted: 28 + 16 items; first_exhausted: the windows run out first (16 / 0.4
    # per unit of weight against 28 / 0.6), with 0.6 * 16 / 0.4 = 24 words. Both divide by
    # every number of ranks: no layout pads its epoch (which would differ by layout).
    items = 44 if stop == "all_exhausted" else 40
    assert report.steps == (-(-items // 8),) * 2
    assert report.restores > 0


@pytest.mark.slow
def test_a_blend_gives_the_same_global_batches_with_workers(tmp_path):
    layouts = [Shape(2, 0, 4), Shape(4, 1, 2), Shape(1, 2, 8)]
    report = assert_elastic(_builder(_mixed(tmp_path, "all_exhausted")), layouts, save_steps=[2])
    assert report.restores == 4


def _keep_all(item: Any) -> bool:
    return True


def test_a_composed_pipeline_of_a_blend_gives_the_same_global_batches(tmp_path):
    mixed = _mixed(tmp_path, "all_exhausted")
    report = assert_elastic(
        _builder(lambda: mixed().shuffle(buffer_size=6, seed=2).limit(40).repeat(2)),
        LAYOUTS,
        save_steps=[1, 7],
    )
    assert report.steps == (10, 10)  # two passes of 40 items a Repeat epoch


def test_a_blend_over_a_filter_reads_as_a_stream_and_is_refused_on_another_layout(tmp_path):
    keep = functools.partial(operator.is_not, None)

    def build() -> Any:
        return Blend(
            [IndexedDataset(list(range(30))).filter(keep), IndexedDataset(list(range(9)))],
            weights=[1, 1],
            seed=1,
        )

    loaders = [_builder(build)(rank, 2, 0, 4) for rank in range(2)]
    states = []
    for loader in loaders:
        next(iter(loader))
        states.append(loader.save_state_rank())
        loader.close()
    with _builder(build)(0, 4, 0, 2) as moved, pytest.raises(StateMismatchError, match="Blend"):
        moved.restore_state_rank(states)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_blend_read_by_position_resumes_exactly(tmp_path, workers):
    assert_resumes_exactly(
        lambda: SavableDataLoader(
            _mixed(tmp_path, "all_exhausted")(), batch_size=3, num_workers=workers, collate_fn=list
        ),
        epochs=2,
        inline_chains=workers > 0,
        interruptions=workers == 0,
    )


# -- weights -------------------------------------------------------------------------------


def _weighted(weights: list[float], allow: bool = False) -> SavableDataLoader[Any]:
    sources = [IndexedDataset(list(range(20))), IndexedDataset(list(range(100, 112)))]
    blend = Blend(sources, weights=weights, seed=2, stop="all_exhausted", allow_weight_change=allow)
    return SavableDataLoader(blend, batch_size=4, collate_fn=list)


def test_a_weight_change_mid_epoch_is_refused_and_between_epochs_applies():
    with _weighted([0.5, 0.5]) as loader:
        stream = iter(loader)
        next(stream)
        middle = loader.save_state_rank()
        for _ in stream:
            pass
        between = loader.save_state_rank()
    with _weighted([0.8, 0.2]) as loader, pytest.raises(StateError, match="allow_weight_change"):
        loader.restore_state_rank(middle)
    with (
        _weighted([0.8, 0.2], allow=True) as loader,
        pytest.raises(StateError, match="in the middle of an epoch"),
    ):
        loader.restore_state_rank(middle)
    with _weighted([0.8, 0.2], allow=True) as loader:
        loader.restore_state_rank(between)
        resumed = [x for batch in loader for x in batch]
    with _weighted([0.8, 0.2]) as fresh:
        for _ in fresh:
            pass
        expected = [x for batch in fresh for x in batch]
    assert resumed == expected  # epoch 1 laid out with the new weights
    assert sorted(resumed) == [*range(20), *range(100, 112)]


# -- the layout of an epoch ----------------------------------------------------------------


def test_segments_mix_in_proportion_until_the_first_source_runs_out():
    (first,) = segments([50, 70, 30], [0.7, 0.2, 0.1], "first_exhausted")
    # 50 / 0.7 = 71.4 is the fewest items per unit of weight: all 50 go, with
    # round(0.2 * 50 / 0.7) = 14 and round(0.1 * 50 / 0.7) = 7 of the others.
    assert first.counts == (50, 14, 7)
    layout = segments([50, 70, 30], [0.7, 0.2, 0.1], "all_exhausted")
    # Then 56 and 23 left: 23 / 0.1 < 56 / 0.2, so the third runs out with 46 of the
    # second, whose last 10 make the last segment.
    assert [s.counts for s in layout] == [(50, 14, 7), (0, 46, 23), (0, 10, 0)]
    assert [s.before for s in layout] == [(0, 0, 0), (50, 14, 7), (50, 60, 30)]
    assert segments([5, 0], [1, 1], "first_exhausted") == []  # an empty source: empty epoch
    assert [s.counts for s in segments([5, 9], [0, 1], "all_exhausted")] == [(0, 9)]


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_every_position_has_one_source_item_read_in_order_from_any_place(stop):
    lengths, weights = [3 * LEAF + 5, 700, 11], [0.5, 0.3, 0.2]
    order = BlendOrder(7, segments(lengths, weights, stop))
    sources, places = order.locate(0, list(range(order.length)))
    for source in range(3):
        mine = places[sources == source]
        assert list(mine) == list(range(len(mine)))  # each source's items in their order
    if stop == "all_exhausted":
        assert Counter(sources.tolist()) == Counter(dict(enumerate(lengths)))
    picked = np.random.default_rng(0).permutation(order.length)[:300].tolist()
    again = BlendOrder(7, segments(lengths, weights, stop)).locate(0, picked)
    assert again[0].tolist() == sources[picked].tolist()
    assert again[1].tolist() == places[picked].tolist()
    other = BlendOrder(7, segments(lengths, weights, stop)).locate(1, list(range(order.length)))
    assert other[0].tolist() != sources.tolist()  # each epoch its own order


def test_a_position_of_a_trillion_item_epoch_is_found_without_walking_it():
    (layout,) = segments([10**12, 3 * 10**11], [0.7, 0.3], "first_exhausted")
    assert layout.counts == (7 * 10**11, 3 * 10**11)
    order = BlendOrder(1, [layout])
    sources, places = order.locate(0, [0, 5 * 10**11, order.length - 1])
    assert all(
        0 <= p < (10**12 if s == 0 else 3 * 10**11) for s, p in zip(sources, places, strict=True)
    )


# -- endless streams under a limit (NOTE [ Endless streams by position ]) ------------------


def test_an_endless_blend_under_a_limit_is_read_by_position_on_every_layout():
    def build() -> Any:
        a = IndexedDataset(list(range(30)), shuffle=True, seed=1).map(_augment, seed=4)
        b = IndexedDataset(list(range(100, 111))).map(_augment, seed=4)
        return Blend([a, b], weights=[2, 1], seed=3, stop="never").limit(16)

    report = assert_elastic(_builder(build), LAYOUTS, epochs=3, save_steps=[1, 3, 5])
    assert report.steps == (2, 2, 2)


def test_an_endless_repeat_under_a_limit_cuts_one_stream_into_epochs_on_every_layout():
    def build() -> Any:
        return IndexedDataset(list(range(12)), shuffle=True, seed=1).repeat().limit(8)

    report = assert_elastic(_builder(build), LAYOUTS, epochs=3, save_steps=[0, 2, 4])
    assert report.steps == (1, 1, 1)
    with SavableDataLoader(build(), batch_size=None) as loader:
        epochs = [[int(x) for x in loader] for _ in range(3)]
    with SavableDataLoader(IndexedDataset(list(range(12)), shuffle=True, seed=1)) as whole:
        stream = [int(x) for _ in range(2) for x in whole]
    assert [x for epoch in epochs for x in epoch] == stream  # consecutive cuts of the passes


def _endless() -> Any:
    sources = [IndexedDataset(list(range(30)), shuffle=True, seed=1), IndexedDataset([100, 101])]
    return Blend(sources, weights=[2, 1], seed=3, stop="never").map(_augment, seed=4)


def _endless_steps(shape: Shape, steps: int, states: Any = None) -> list[list[str]]:
    """The first ``steps`` global batches of every rank of ``shape`` (after ``states``)."""
    per_rank = []
    for rank in range(shape.ranks):
        with _builder(_endless)(rank, shape.ranks, shape.num_workers, shape.batch_size) as loader:
            if states is not None:
                loader.restore_state_rank(states)
            per_rank.append(list(itertools.islice(iter(loader), steps)))
    return [
        sorted(digest(item) for batch in step for item in batch)
        for step in zip(*per_rank, strict=True)
    ]


def test_an_endless_blend_without_a_limit_gives_the_same_global_batches_and_moves():
    # NOTE [ Endless streams by position ]: one epoch of ENDLESS positions.
    reference = _endless_steps(LAYOUTS[0], 12)
    for shape in [*LAYOUTS[1:], Shape(1, 2, 8)]:
        assert _endless_steps(shape, 12) == reference, shape
    states = []
    for rank in range(2):
        with _builder(_endless)(rank, 2, 0, 4) as loader:
            stream = iter(loader)
            for _ in range(5):
                next(stream)
            states.append(loader.save_state_rank())
    for shape in LAYOUTS[1:]:
        assert _endless_steps(shape, 7, states) == reference[5:], shape
    with pytest.raises(TypeError, match="endless"):
        len(SavableDataLoader(_endless(), batch_size=4))


def test_an_endless_blocks_counts_hold_the_weights_to_one_item():
    counts = block_counts([0.7, 0.2, 0.1, 0.0])
    assert sum(counts) == BLOCK
    assert counts[3] == 0
    assert all(abs(c - BLOCK * w) <= 1 for c, w in zip(counts, [0.7, 0.2, 0.1, 0.0], strict=True))
