"""IndexedDataset, Map and Filter as stages: exact resume, state shape, errors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from stage_harness import check_stage

from savable_loader import ConfigError, SavableDataLoader, StateError, WorkerContext
from savable_loader.datasets.index.indexed import IndexedDataset
from savable_loader.datasets.transforms.filter import Filter
from savable_loader.datasets.transforms.map import Map

#: In process, alone and as stream 1 of 2 (NOTE [ Stages in process ] in stage_harness.py).
LAYOUTS = ["alone", "sharded"]
CONTEXT = WorkerContext(rank=0, world_size=1, worker_id=0, num_workers=0, seed=0, batch_size=None)


def _noisy(x: int) -> dict[str, object]:
    return {"x": x, "py": random.random(), "np": float(np.random.rand()), "t": torch.rand(1)}


def _augment(x: int, rng: np.random.Generator) -> dict[str, object]:
    return {"x": x, "noise": float(rng.normal())}


def _odd_sum(item: dict[str, object]) -> bool:
    return int(item["x"]) % 3 != 0  # type: ignore[call-overload]


def _pipeline() -> Filter[dict[str, object]]:
    return IndexedDataset(list(range(40)), shuffle=True, seed=3).map(_noisy).filter(_odd_sum)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_indexed_map_filter_resume_exactly(layout: str) -> None:
    check_stage(_pipeline, num_workers=0, sharded=layout == "sharded")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_seeded_map_resumes_exactly_and_needs_no_global_generators(layout: str) -> None:
    check_stage(
        lambda: Map(IndexedDataset(list(range(30))), _augment, seed=7),
        num_workers=0,
        sharded=layout == "sharded",
    )


def _read(stage, n: int) -> list[object]:
    cursor = stage.cursor(CONTEXT)
    return [next(cursor) for _ in range(n)]


def test_seeded_map_draws_depend_on_position_only() -> None:
    stage = Map(IndexedDataset(list(range(10))), _augment, seed=1)
    first = _read(stage, 6)
    cursor = stage.cursor(CONTEXT)
    for _ in range(3):
        next(cursor)
    state = cursor.state()
    assert state == {"parent": {"epoch": 0, "pos": 3}, "epoch": 0, "position": 3}
    np.random.seed(123)  # global generators play no part
    other = stage.cursor(CONTEXT)
    other.restore(state)
    assert [next(other) for _ in range(3)] == first[3:6]
    assert _read(Map(IndexedDataset(list(range(10))), _augment, seed=2), 6) != first


def test_map_and_filter_add_nothing_to_the_state() -> None:
    cursor = _pipeline().cursor(CONTEXT)
    next(cursor)
    assert set(cursor.state()) == {"parent"}
    assert set(cursor.state()["parent"]) == {"parent"}
    assert set(cursor.state()["parent"]["parent"]) == {"epoch", "pos", "order"}


def test_epochs_move_on_and_end_epoch_drops_the_rest() -> None:
    cursor = IndexedDataset(list(range(5))).map(lambda x: x * 10).cursor(CONTEXT)
    assert list(cursor) == [0, 10, 20, 30, 40]
    assert cursor.state() == {"parent": {"epoch": 1, "pos": 0}}
    next(cursor)
    cursor.end_epoch()
    assert cursor.state() == {"parent": {"epoch": 2, "pos": 0}}


def test_str_reads_like_the_fluent_calls() -> None:
    text = str(IndexedDataset(list(range(4)), shuffle=True).map(_augment, seed=2).filter(_odd_sum))
    assert (
        text
        == "IndexedDataset(4 items, shuffle=True, seed=0).map(_augment, seed=2).filter(_odd_sum)"
    )


def test_configs_name_functions_and_sources() -> None:
    config = _pipeline().config()
    assert config["type"] == "Filter"
    assert config["predicate"].endswith("_odd_sum")
    assert config["source"]["fn"].endswith("_noisy")
    assert config["source"]["source"]["type"] == "IndexedDataset"


def test_another_function_is_another_pipeline() -> None:
    first = SavableDataLoader(IndexedDataset(list(range(4))).map(_noisy))
    second = SavableDataLoader(IndexedDataset(list(range(4))).map(_augment, seed=0))
    assert first.fingerprint != second.fingerprint


@pytest.mark.parametrize(
    "state",
    [
        {"epoch": 0, "pos": 1},
        {"parent": {"epoch": -1, "pos": 0}},
        {"parent": {"epoch": 0, "pos": "1"}},
        {"parent": {"epoch": 0, "pos": 1}, "extra": 1},
        [1, 2],
    ],
)
def test_malformed_states_are_refused_naming_the_stage(state: object) -> None:
    cursor = IndexedDataset(list(range(4))).filter(bool).cursor(CONTEXT)
    with pytest.raises(StateError, match=r"^(IndexedDataset|Filter): malformed state"):
        cursor.restore(state)


def test_seeded_map_state_is_validated() -> None:
    cursor = Map(IndexedDataset([1]), _augment, seed=1).cursor(CONTEXT)
    with pytest.raises(StateError, match=r"^Map: malformed state \(position"):
        cursor.restore({"parent": {"epoch": 0, "pos": 0}, "epoch": 0, "position": -2})


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ConfigError, match="callable"):
        Map(IndexedDataset([1]), 3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="seed"):
        Map(IndexedDataset([1]), _augment, seed="x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="callable"):
        Filter(IndexedDataset([1]), None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="neither"):
        Map(object(), _noisy)
