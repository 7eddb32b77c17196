"""Shuffle: exact resume with global randomness around it, permutations, locality,
replay bound, state size, errors."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from stage_harness import check_stage

from savable_loader import ConfigError, StateError, WorkerContext, rng
from savable_loader.datasets import Cursor, Stage
from savable_loader.datasets.index.indexed import IndexedDataset
from savable_loader.datasets.transforms.map import Map
from savable_loader.datasets.transforms.shuffle import Shuffle

#: In process, alone and as stream 1 of 2 (NOTE [ Stages in process ] in stage_harness.py).
LAYOUTS = ["alone", "sharded"]
CONTEXT = WorkerContext(rank=0, world_size=1, worker_id=0, num_workers=0, seed=0, batch_size=None)


def _upstream(x: int) -> dict[str, Any]:
    return {"x": x, "py": random.random(), "np": float(np.random.rand()), "t": torch.rand(1)}


def _downstream(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "down": random.randint(0, 1 << 30), "dn": float(np.random.randn())}


def _pipeline(n: int = 37, buffer_size: int = 5, seed: int = 4) -> Stage[dict[str, Any]]:
    source = IndexedDataset(list(range(n)), shuffle=True, seed=1).map(_upstream)
    return source.shuffle(buffer_size=buffer_size, seed=seed).map(_downstream)


@pytest.mark.parametrize("batch_size", [2, None])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_resumes_exactly_with_global_randomness_up_and_downstream(
    layout: str, batch_size: int | None
) -> None:
    check_stage(_pipeline, num_workers=0, sharded=layout == "sharded", batch_size=batch_size)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nested_shuffles_resume_exactly(layout: str) -> None:
    def build() -> Stage[Any]:
        inner = IndexedDataset(list(range(29))).map(_upstream).shuffle(buffer_size=3, seed=1)
        return inner.shuffle(buffer_size=4, seed=2).map(_downstream)

    check_stage(build, num_workers=0, sharded=layout == "sharded", batch_size=None)


_END = ("end",)


def _entries(cursor: Cursor[Any], n: int) -> list[Any]:
    """The next ``n`` items of ``cursor`` as (x, draws) tuples, an epoch end as _END."""
    out: list[Any] = []
    for _ in range(n):
        try:
            item = next(cursor)
        except StopIteration:
            out.append(_END)
            continue
        out.append((item["x"], item["py"], item["np"], float(item["t"]), item["down"]))
    return out


def test_every_save_point_of_a_cursor_resumes_exactly() -> None:
    """As the loader does: restore, apply the saved global generators, then read."""
    stage = _pipeline(n=23, buffer_size=4)
    rng.seed_globals(11)
    stream = _entries(stage.cursor(CONTEXT), 3 * 24)
    assert stream.count(_END) == 3
    for k in range(len(stream)):
        rng.seed_globals(11)
        cursor = stage.cursor(CONTEXT)
        assert _entries(cursor, k) == stream[:k]
        saved, generators = msgpack.unpackb(msgpack.packb(cursor.state())), rng.capture()
        rng.seed_globals(99)  # the restoring process's generators differ until applied
        fresh = stage.cursor(CONTEXT)
        fresh.restore(saved)
        rng.apply(generators)
        assert _entries(fresh, len(stream) - k) == stream[k:], k


def test_an_epoch_is_a_permutation_of_the_parent_epoch_per_worker() -> None:
    for worker in range(3):
        context = WorkerContext(0, 1, worker, 3, 0, None)
        parent = IndexedDataset(list(range(50))).cursor(context)
        expected = sorted(parent)
        cursor = Shuffle(IndexedDataset(list(range(50))), buffer_size=8, seed=0).cursor(context)
        epochs = [list(cursor) for _ in range(3)]
        assert all(sorted(epoch) == expected for epoch in epochs)
        assert epochs[0] != epochs[1] != epochs[2]
    seeds = [list(Shuffle(range(50), buffer_size=8, seed=s).cursor(CONTEXT)) for s in (0, 1)]
    assert seeds[0] != seeds[1]


def test_items_move_only_within_their_window() -> None:
    cursor = Shuffle(IndexedDataset(list(range(103))), buffer_size=10, seed=3).cursor(CONTEXT)
    out = list(cursor)
    assert all(x // 10 == i // 10 for i, x in enumerate(out))
    assert out[100:] != []
    assert sorted(out[100:]) == [100, 101, 102]
    assert out != list(range(103))


class _Counting:
    def __init__(self) -> None:
        self.reads = 0

    def __call__(self, x: int) -> int:
        self.reads += 1
        return x


def _counted(buffer_size: int) -> tuple[Cursor[int], _Counting]:
    counting = _Counting()
    stage = Shuffle(Map(range(30), counting), buffer_size=buffer_size, seed=0)
    return stage.cursor(CONTEXT), counting


@pytest.mark.parametrize("buffer_size", [1, 4, 7, 30, 31])
def test_a_restore_rereads_at_most_buffer_size_parent_items(buffer_size: int) -> None:
    full = list(_counted(buffer_size)[0])
    for k in range(31):
        cursor, before = _counted(buffer_size)
        head = [next(cursor) for _ in range(k)]
        restored, after = _counted(buffer_size)
        restored.restore(cursor.state())
        assert after.reads == 0, "restore must not read the parent"
        assert head + list(restored) == full
        replayed = before.reads + after.reads - 30
        assert 0 <= replayed <= buffer_size
        window_start = (k - 1) // buffer_size * buffer_size
        assert replayed == (min(buffer_size, 30 - window_start) if k else 0), k


def _state_size(item_size: int) -> int:
    data = [bytes([i % 256]) * item_size for i in range(40)]
    cursor = Shuffle(IndexedDataset(data), buffer_size=16, seed=0).cursor(CONTEXT)
    for _ in range(21):
        next(cursor)
    state = cursor.state()
    assert not any(leaf in data for leaf in _leaves(state))
    return len(msgpack.packb(state, use_bin_type=True))


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


def test_state_holds_no_samples_and_does_not_grow_with_item_size() -> None:
    small, large = _state_size(10), _state_size(100_000)
    assert small == large < 12_000


def _cursor(n: int = 10, buffer_size: int = 4) -> Cursor[int]:
    return Shuffle(IndexedDataset(list(range(n))), buffer_size=buffer_size, seed=0).cursor(CONTEXT)


def test_state_shape_and_between_epochs() -> None:
    cursor = _cursor()
    assert cursor.state() == {
        "parent": {"epoch": 0, "pos": 0},
        "epoch": 0,
        "window": 0,
        "emitted": 0,
        "rng": None,
    }
    for _ in range(6):
        next(cursor)
    state = cursor.state()
    assert (state["parent"], state["window"], state["emitted"]) == ({"epoch": 0, "pos": 4}, 1, 2)
    assert set(state["rng"]) == {"python", "python_gauss", "numpy_key", "numpy_pos"} | {
        "numpy_has_gauss",
        "numpy_gauss",
        "torch",
    }
    list(cursor)
    assert cursor.state()["parent"] == {"epoch": 1, "pos": 0}
    assert cursor.state()["epoch"] == 1
    assert cursor.state()["rng"] is None


def test_end_epoch_never_skips_a_parent_epoch() -> None:
    for k in range(11):
        cursor = _cursor()
        for _ in range(k):
            next(cursor)
        state = cursor.state()
        cursor.end_epoch()
        assert cursor.state()["parent"] == {"epoch": 1, "pos": 0}, k
        restored = _cursor()
        restored.restore(state)
        restored.end_epoch()
        assert restored.state() == cursor.state()
        assert sorted(restored) == list(range(10))


def test_describe_and_config() -> None:
    stage = Shuffle(IndexedDataset([1, 2]), buffer_size=3, seed=9)
    assert str(stage).endswith(".shuffle(buffer_size=3, seed=9)")
    assert stage.config()["type"] == "Shuffle"
    assert stage.config()["buffer_size"] == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"buffer_size": 0, "seed": 0}, "buffer_size"),
        ({"buffer_size": 2.0, "seed": 0}, "buffer_size"),
        ({"buffer_size": True, "seed": 0}, "buffer_size"),
        ({"buffer_size": 2, "seed": None}, "seed"),
        ({"buffer_size": 2, "seed": "1"}, "seed"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Shuffle(IndexedDataset([1]), **kwargs)


def _saved() -> dict[str, Any]:
    cursor = _cursor()
    for _ in range(5):
        next(cursor)
    return dict(cursor.state())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"emitted": -1}, "emitted"),
        ({"window": "1"}, "window"),
        ({"extra": 1}, "extra"),
        ({"rng": {"python": b""}}, "rng"),
        ({"emitted": 9}, "buffer_size is 4"),
        ({"rng": None}, "without its generators"),
    ],
)
def test_malformed_states_are_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(StateError, match=match):
        _cursor().restore({**_saved(), **change})
    with pytest.raises(StateError, match="Shuffle: malformed"):
        _cursor().restore([1])


def test_a_parent_that_changed_its_stream_is_detected() -> None:
    state = _saved()
    short = Shuffle(IndexedDataset(list(range(5))), buffer_size=4, seed=0).cursor(CONTEXT)
    short.restore({**state, "emitted": 3})
    with pytest.raises(StateError, match="does not reproduce"):
        next(short)
