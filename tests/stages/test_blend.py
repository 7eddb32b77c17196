"""Blend: exact resume under every stop rule, proportions, epoch accounting, weights."""

from __future__ import annotations

import collections
import random
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from stage_harness import check_stage

from savable_loader import ConfigError, SavableDataLoader, StateError, WorkerContext, rng
from savable_loader.datasets import Cursor, Stage
from savable_loader.datasets.index.indexed import IndexedDataset
from savable_loader.datasets.transforms.blend import Blend

CONTEXT = WorkerContext(rank=0, world_size=1, worker_id=0, num_workers=0, seed=0, batch_size=None)


def _noisy(x: int) -> dict[str, Any]:
    return {"x": x, "py": random.random(), "np": float(np.random.rand()), "t": torch.rand(1)}


def _down(item: Any) -> dict[str, Any]:
    x = item["x"] if isinstance(item, dict) else item
    return {"x": x, "down": random.randint(0, 1 << 30), "dn": float(np.random.randn())}


def _sources(a: int = 20, b: int = 11) -> list[Stage[Any]]:
    return [
        IndexedDataset(list(range(a)), shuffle=True, seed=2).map(_noisy),
        IndexedDataset(list(range(100, 100 + b))).shuffle(buffer_size=3, seed=1),
    ]


def _pipeline(stop: Any) -> Stage[Any]:
    if stop == "never":
        # An endless Blend inside a finite one, whose epoch end leaves it where it stands.
        endless = Blend(_sources(7, 6), weights=[0.6, 0.4], seed=5, stop="never")
        finite = IndexedDataset(list(range(200, 230)))
        return Blend([endless, finite], weights=[0.5, 0.5], seed=6).map(_down)
    return Blend(_sources(), weights=[0.7, 0.3], seed=5, stop=stop).map(_down)


STOPS = ["first_exhausted", "all_exhausted", "never"]


@pytest.mark.parametrize("batch_size", [2, None])
@pytest.mark.parametrize("stop", STOPS)
def test_resumes_exactly(stop: str, batch_size: int | None) -> None:
    check_stage(lambda: _pipeline(stop), num_workers=0, batch_size=batch_size)


@pytest.mark.parametrize("stop", STOPS)
def test_resumes_exactly_sharded(stop: str) -> None:
    """Stream 1 of 2, in process (NOTE [ Stages in process ] in stage_harness.py)."""
    check_stage(lambda: _pipeline(stop), num_workers=0, sharded=True)


def _entries(cursor: Cursor[Any], n: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(n):
        try:
            out.append(str(sorted(next(cursor).items())))
        except StopIteration:
            out.append("end")
    return out


@pytest.mark.parametrize("stop", STOPS)
def test_every_save_point_of_a_cursor_resumes_exactly(stop: str) -> None:
    stage = _pipeline(stop)
    rng.seed_globals(3)
    stream = _entries(stage.cursor(CONTEXT), 80)
    assert "end" in stream
    for k in range(0, len(stream), 3):
        rng.seed_globals(3)
        cursor = stage.cursor(CONTEXT)
        _entries(cursor, k)
        saved, generators = msgpack.unpackb(msgpack.packb(cursor.state())), rng.capture()
        fresh = stage.cursor(CONTEXT)
        fresh.restore(saved)
        rng.apply(generators)
        assert _entries(fresh, len(stream) - k) == stream[k:], k


def _blend(sizes: list[int], weights: list[float], stop: Any, **kw: Any) -> Blend[int]:
    sources = [IndexedDataset(list(range(1000 * i, 1000 * i + n))) for i, n in enumerate(sizes)]
    return Blend(sources, weights=weights, seed=kw.pop("seed", 0), stop=stop, **kw)


def test_proportions_follow_the_weights() -> None:
    cursor = _blend([50, 70, 30], [0.7, 0.2, 0.1], "never").cursor(CONTEXT)
    counts = collections.Counter(next(cursor) // 1000 for _ in range(20_000))
    # Fixed seed; the bound is ~9 standard deviations wide.
    for source, weight in enumerate([0.7, 0.2, 0.1]):
        assert abs(counts[source] / 20_000 - weight) < 0.03


def test_first_exhausted_ends_with_the_first_source_and_restarts_all() -> None:
    cursor = _blend([10, 40], [0.5, 0.5], "first_exhausted").cursor(CONTEXT)
    for epoch in range(3):
        items = list(cursor)
        first = [x for x in items if x < 1000]
        second = [x - 1000 for x in items if x >= 1000]
        assert first == list(range(10)), epoch  # the source that ended the epoch
        assert second == list(range(len(second)))  # a fresh prefix of the other
        assert 0 < len(second) < 40
        assert cursor.state()["sources"] == [{"epoch": epoch + 1, "pos": 0}] * 2


def test_all_exhausted_yields_every_item_once_per_epoch() -> None:
    cursor = _blend([10, 25, 4, 6], [0.1, 0.5, 0.2, 0.0], "all_exhausted").cursor(CONTEXT)
    epochs = []
    for epoch in range(3):
        epochs.append(list(cursor))
        assert sorted(epochs[-1]) == [*range(10), *range(1000, 1025), *range(2000, 2004)]
        assert cursor.state()["sources"] == [{"epoch": epoch + 1, "pos": 0}] * 4
    assert cursor.state()["exhausted"] == [False] * 4
    assert epochs[0] != epochs[1] != epochs[2], "the draws are keyed by the epoch"


def test_never_runs_on_through_source_epochs() -> None:
    cursor = _blend([3, 5], [0.5, 0.5], "never").cursor(CONTEXT)
    items = [next(cursor) for _ in range(100)]
    assert [x for x in items if x < 1000][:9] == [0, 1, 2] * 3
    assert [x - 1000 for x in items if x >= 1000][:10] == [0, 1, 2, 3, 4] * 2
    position = cursor.state()["position"]
    cursor.end_epoch()  # an endless epoch has no rest: nothing moves
    assert cursor.state()["position"] == position


def test_never_with_an_empty_source_raises_rather_than_spins() -> None:
    cursor = _blend([3, 0], [0.5, 0.5], "never").cursor(CONTEXT)
    with pytest.raises(ConfigError, match=r"source 1 .* empty"):
        [next(cursor) for _ in range(50)]


def test_end_epoch_moves_every_source_once() -> None:
    cursor = _blend([4, 30], [0.5, 0.5], "all_exhausted").cursor(CONTEXT)
    for _ in range(12):
        next(cursor)
    assert cursor.state()["exhausted"] == [True, False]
    cursor.end_epoch()
    assert cursor.state()["sources"] == [{"epoch": 1, "pos": 0}] * 2
    assert (cursor.state()["position"], cursor.state()["epoch"]) == (0, 1)


def _saved(weights: list[float]) -> dict[str, Any]:
    cursor = _blend([30, 30], weights, "first_exhausted").cursor(CONTEXT)
    for _ in range(7):
        next(cursor)
    return dict(cursor.state())


def test_restoring_with_other_weights_is_refused_naming_both() -> None:
    cursor = _blend([30, 30], [0.9, 0.1], "first_exhausted").cursor(CONTEXT)
    with pytest.raises(StateError, match=r"\[0\.5, 0\.5\].*\[0\.9, 0\.1\].*allow_weight_change"):
        cursor.restore(_saved([0.5, 0.5]))


def test_allow_weight_change_applies_the_new_weights_from_the_position_on() -> None:
    saved = _saved([0.5, 0.5])
    changed = _blend([30, 30], [0.9, 0.1], "first_exhausted", allow_weight_change=True)
    cursor = changed.cursor(CONTEXT)
    cursor.restore(saved)
    assert cursor.state()["weights"] == [0.9, 0.1]
    expected = _blend([30, 30], [0.9, 0.1], "first_exhausted").cursor(CONTEXT)
    expected.restore({**saved, "weights": [0.9, 0.1]})
    assert list(cursor) == list(expected)


def test_weights_are_not_in_the_fingerprint() -> None:
    first = _blend([5, 5], [0.5, 0.5], "first_exhausted")
    second = _blend([5, 5], [0.9, 0.1], "first_exhausted")
    assert "weights" not in str(first.config())
    assert SavableDataLoader(first).fingerprint == SavableDataLoader(second).fingerprint
    assert str(first) == (
        "Blend([IndexedDataset(5 items, shuffle=False, seed=0), "
        "IndexedDataset(5 items, shuffle=False, seed=0)], weights=[0.5, 0.5])"
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"sources": [{"epoch": 0, "pos": 0}]}, "sources has 1 entries but this Blend has 2"),
        ({"exhausted": [False] * 3}, "exhausted has 3 entries"),
        ({"weights": [0.5, 0.5, 0.0]}, "weights has 3 entries"),
        ({"position": -1}, "position"),
        ({"extra": 0}, "extra"),
    ],
)
def test_malformed_states_are_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(StateError, match=match):
        _blend([30, 30], [0.5, 0.5], "first_exhausted").cursor(CONTEXT).restore(
            {**_saved([0.5, 0.5]), **change}
        )


def test_draws_depend_on_the_seed() -> None:
    one = list(_blend([20, 20], [0.5, 0.5], "all_exhausted", seed=1).cursor(CONTEXT))
    two = list(_blend([20, 20], [0.5, 0.5], "all_exhausted", seed=2).cursor(CONTEXT))
    assert one != two
    assert sorted(one) == sorted(two)


@pytest.mark.parametrize(
    ("sources", "kwargs", "match"),
    [
        ([], {"weights": [], "seed": 0}, "non-empty"),
        ([[1]], {"weights": [1, 2], "seed": 0}, "1 sources but 2 weights"),
        ([[1], [2]], {"weights": [1, -1], "seed": 0}, "non-negative"),
        ([[1], [2]], {"weights": [0, 0], "seed": 0}, "not all zero"),
        ([[1], [2]], {"weights": [1, float("nan")], "seed": 0}, "finite"),
        ([[1], [2]], {"weights": [1, "a"], "seed": 0}, "numbers"),
        ([[1]], {"weights": 1.0, "seed": 0}, "list of numbers"),
        ([[1]], {"weights": [1], "seed": 0.5}, "seed"),
        ([[1]], {"weights": [1], "seed": 0, "stop": "last"}, "stop"),
    ],
)
def test_bad_arguments_are_refused(sources: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Blend(sources, **kwargs)
