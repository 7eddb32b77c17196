"""Limit and Repeat: epoch semantics, exact resume, skip equal to reading, errors."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from stage_harness import check_stage

from savable_loader import ConfigError, StateError, WorkerContext, rng
from savable_loader.datasets import Cursor, Stage
from savable_loader.datasets.files.tokens import TokenSource
from savable_loader.datasets.index.indexed import IndexedDataset
from savable_loader.datasets.protocol.base import SavableDataset
from savable_loader.datasets.transforms.limit import Limit
from savable_loader.datasets.transforms.repeat import Repeat

#: In process, alone and as stream 1 of 2 (NOTE [ Stages in process ] in stage_harness.py).
LAYOUTS = ["alone", "sharded"]
CONTEXT = WorkerContext(rank=0, world_size=1, worker_id=0, num_workers=0, seed=0, batch_size=None)


def _noisy(x: int) -> dict[str, object]:
    return {"x": x, "py": random.random(), "np": float(np.random.rand()), "t": torch.rand(1)}


def _indexed(n: int, *, shuffle: bool = True) -> IndexedDataset[int]:
    return IndexedDataset(list(range(n)), shuffle=shuffle, seed=4)


def _epochs(stage: Stage[Any], count: int, context: WorkerContext = CONTEXT) -> list[list[Any]]:
    cursor = stage.cursor(context)
    return [list(cursor) for _ in range(count)]


def _flat(lists: Iterable[list[Any]]) -> list[Any]:
    return [item for items in lists for item in items]


# -- exact resume through the loader ---------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_limit_over_a_noisy_map_resumes_exactly(layout: str) -> None:
    check_stage(
        lambda: _indexed(20).map(_noisy).limit(5), num_workers=0, sharded=layout == "sharded"
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_repeat_over_a_noisy_map_resumes_exactly(layout: str) -> None:
    check_stage(
        lambda: _indexed(7).map(_noisy).repeat(3), num_workers=0, sharded=layout == "sharded"
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_endless_repeat_cut_by_limit_resumes_exactly(layout: str) -> None:
    check_stage(
        lambda: _indexed(5).map(_noisy).repeat().limit(7),
        num_workers=0,
        sharded=layout == "sharded",
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_skipping_chains_resume_exactly_with_replay(layout: str) -> None:
    # Adaptive checkpoints over cheap items: restores replay, through skip().
    check_stage(
        lambda: _indexed(9).limit(4).repeat(3).limit(10),
        num_workers=0,
        sharded=layout == "sharded",
        batch_size=None,
        dense=False,
        num_points=10,
    )


def _tokens(tmp_path: Path) -> TokenSource:
    for i, size in enumerate([70, 45]):
        (np.arange(size, dtype=np.uint16) + 100 * i).tofile(tmp_path / f"t{i}.bin")
    return TokenSource(f"{tmp_path}/*.bin", seq_len=8, shuffle=True, seed=2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_source_limit_repeat_resumes_exactly(tmp_path: Path, layout: str) -> None:
    _tokens(tmp_path)
    check_stage(
        lambda: (
            TokenSource(f"{tmp_path}/*.bin", seq_len=8, shuffle=True, seed=2).limit(5).repeat(3)
        ),
        num_workers=0,
        sharded=layout == "sharded",
    )


def test_token_source_limit_repeat_reads_first_windows_of_each_epoch(tmp_path: Path) -> None:
    source = _tokens(tmp_path)
    windows = [[w.tolist() for w in epoch] for epoch in _epochs(source, 6)]
    stage = source.limit(5).repeat(3)
    assert str(stage) == "TokenSource(2 files, seq_len=8).limit(5).repeat(3)"
    got = [[w.tolist() for w in epoch] for epoch in _epochs(stage, 2)]
    assert got == [_flat(w[:5] for w in windows[e : e + 3]) for e in (0, 3)]


# -- semantics -------------------------------------------------------------------------


def test_limit_yields_the_first_n_of_each_source_epoch() -> None:
    source = _epochs(_indexed(10), 3)
    cursor = _indexed(10).limit(3).cursor(CONTEXT)
    assert [list(cursor) for _ in range(3)] == [epoch[:3] for epoch in source]
    assert cursor.state() == {"parent": {"epoch": 3, "pos": 0, "order": 2}, "count": 0}
    next(cursor)
    assert cursor.state() == {"parent": {"epoch": 3, "pos": 1, "order": 2}, "count": 1}


def test_limit_ends_with_a_shorter_source_epoch() -> None:
    assert _epochs(_indexed(2, shuffle=False).limit(5), 2) == [[0, 1], [0, 1]]
    assert _epochs(_indexed(4).limit(0), 2) == [[], []]


def test_limit_counts_per_worker() -> None:
    contexts = [WorkerContext(0, 1, w, 2, 0, None) for w in range(2)]
    assert [len(_epochs(_indexed(20).limit(3), 1, c)[0]) for c in contexts] == [3, 3]


def test_repeat_joins_source_epochs() -> None:
    source = _epochs(_indexed(4), 6)
    cursor = _indexed(4).repeat(3).cursor(CONTEXT)
    assert [list(cursor) for _ in range(2)] == [_flat(source[0:3]), _flat(source[3:6])]
    assert cursor.state() == {"parent": {"epoch": 6, "pos": 0, "order": 2}, "passes": 0}
    for _ in range(5):
        next(cursor)
    assert cursor.state() == {"parent": {"epoch": 7, "pos": 1, "order": 2}, "passes": 1}


def test_endless_repeat_cut_by_limit_continues_one_stream() -> None:
    # NOTE [ Ending an endless epoch ]: the source is not moved to its next epoch.
    endless = _indexed(5).repeat().cursor(CONTEXT)
    stream = [next(endless) for _ in range(28)]
    epochs = _epochs(_indexed(5).repeat().limit(7), 4)
    assert [len(epoch) for epoch in epochs] == [7, 7, 7, 7]
    assert _flat(epochs) == stream


def test_finite_repeat_cut_by_limit_starts_at_the_next_source_epoch() -> None:
    source = _epochs(_indexed(5), 4)
    epochs = _epochs(_indexed(5).repeat(2).limit(7), 2)
    assert epochs == [source[0] + source[1][:2], source[2] + source[3][:2]]


def test_end_epoch_drops_the_rest() -> None:
    limit = _indexed(6).limit(4).cursor(CONTEXT)
    next(limit)
    limit.end_epoch()
    assert limit.state() == {"parent": {"epoch": 1, "pos": 0, "order": 2}, "count": 0}
    repeat = _indexed(6).repeat(3).cursor(CONTEXT)
    for _ in range(8):
        next(repeat)
    repeat.end_epoch()
    assert repeat.state() == {"parent": {"epoch": 2, "pos": 0, "order": 2}, "passes": 0}
    endless = _indexed(6).repeat().cursor(CONTEXT)
    for _ in range(8):
        next(endless)
    endless.end_epoch()
    assert endless.state() == {"parent": {"epoch": 1, "pos": 2, "order": 2}, "passes": 0}


# -- skip equals reading -----------------------------------------------------------------


def _read(cursor: Cursor[Any], k: int) -> int:
    """Reads up to k items; returns how many (fewer: the epoch ended, as skip() says)."""
    for count in range(k):
        try:
            next(cursor)
        except StopIteration:
            return count
    return k


PIPELINES = {
    "limit": lambda: _indexed(10).limit(4),
    "limit-longer-than-source": lambda: _indexed(3).limit(5),
    "limit-of-limit": lambda: _indexed(10).limit(6).limit(4),
    "repeat": lambda: _indexed(4).repeat(3),
    "repeat-endless": lambda: _indexed(9).repeat(),
    "repeat-of-short-limit": lambda: _indexed(3).limit(5).repeat(2),
    "limit-of-repeat": lambda: _indexed(4).repeat(3).limit(9),
    "limit-of-endless": lambda: _indexed(10).repeat().limit(6),
    "repeat-of-repeat": lambda: _indexed(2).repeat(2).repeat(2),
}
SHARDED = WorkerContext(rank=1, world_size=2, worker_id=1, num_workers=2, seed=0, batch_size=2)


@pytest.mark.parametrize("context", [CONTEXT, SHARDED], ids=["single", "sharded"])
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_skip_leaves_the_state_reading_leaves(name: str, context: WorkerContext) -> None:
    stage = PIPELINES[name]()
    for start in range(0, 16, 3):
        for k in range(0, 30):
            read, skipped = stage.cursor(context), stage.cursor(context)
            _read(read, start)
            _read(skipped, start)
            assert skipped.skip(k) == _read(read, k), (start, k)
            assert skipped.state() == read.state(), (start, k)
            assert [next(skipped, None) for _ in range(12)] == [next(read, None) for _ in range(12)]


class _Countdown(SavableDataset[int]):
    """A user's dataset with a skip() that does not say how far it went: the loader reads
    instead (NOTE [ A dataset's skip ] in ``datasets/adapt.py``)."""

    def __init__(self, length: int) -> None:
        self.length, self.epoch, self.pos = length, 0, 0

    def __iter__(self) -> Iterator[int]:
        while self.pos < self.length:
            self.pos += 1
            yield 100 * self.epoch + self.pos - 1
        self.epoch, self.pos = self.epoch + 1, 0

    def save_state(self) -> Any:
        return [self.epoch, self.pos]

    def restore_state(self, state: Any | None) -> None:
        self.epoch, self.pos = state or (0, 0)

    def skip(self, n: int) -> None:
        self.pos = min(self.pos + n, self.length)


@pytest.mark.parametrize("k", range(8))
def test_limit_skip_over_an_uncounted_source_keeps_the_stream(k: int) -> None:
    for build in (lambda: Limit(_Countdown(3), 5), lambda: Repeat(_Countdown(3), 2)):
        read, skipped = build().cursor(CONTEXT), build().cursor(CONTEXT)
        _read(read, k)
        skipped.skip(k)
        assert [next(skipped, None) for _ in range(10)] == [next(read, None) for _ in range(10)]


@pytest.mark.parametrize("k", range(0, 14, 3))
@pytest.mark.parametrize("name", ["limit", "repeat"])
def test_skip_through_a_drawing_map_makes_the_same_draws(name: str, k: int) -> None:
    stage = (
        _indexed(5).map(_noisy).limit(3) if name == "limit" else _indexed(5).map(_noisy).repeat(2)
    )
    rng.seed_globals(0)
    read = stage.cursor(CONTEXT)
    passed = _read(read, k)
    after_read = [next(read, None) for _ in range(4)], _noisy(-1)
    rng.seed_globals(0)
    skipped = stage.cursor(CONTEXT)
    assert skipped.skip(k) == passed
    after_skip = [next(skipped, None) for _ in range(4)], _noisy(-1)
    assert repr(after_skip) == repr(after_read)


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stage", [_indexed(0).repeat(), _indexed(5).limit(0).repeat(), _indexed(0).repeat(2).repeat()]
)
def test_endless_repeat_of_an_empty_epoch_raises(stage: Stage[Any]) -> None:
    cursor = stage.cursor(CONTEXT)
    with pytest.raises(ConfigError, match="yielded nothing"):
        next(cursor)
    with pytest.raises(ConfigError, match="yielded nothing"):
        stage.cursor(CONTEXT).skip(3)


def test_endless_repeat_of_an_empty_epoch_raises_after_a_restore() -> None:
    cursor = _indexed(0).repeat().cursor(CONTEXT)
    cursor.restore({"parent": {"epoch": 4, "pos": 0, "order": 2}, "passes": 2})
    with pytest.raises(ConfigError, match="rank 0 worker 0"):
        next(cursor)


def test_finite_repeat_of_an_empty_shard_is_empty() -> None:
    assert _epochs(_indexed(0).repeat(3), 2) == [[], []]


@pytest.mark.parametrize("n", [-1, 1.5, True, "3", None])
def test_limit_refuses_bad_n(n: object) -> None:
    with pytest.raises(ConfigError, match="int n >= 0"):
        Limit(_indexed(3), n)  # type: ignore[arg-type]


@pytest.mark.parametrize("times", [0, -2, 2.0, True, "2"])
def test_repeat_refuses_bad_times(times: object) -> None:
    with pytest.raises(ConfigError, match="times"):
        Repeat(_indexed(3), times)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("stage", "state", "match"),
    [
        (
            _indexed(3).limit(2),
            {"parent": {"epoch": 0, "pos": 0, "order": 2}, "count": 3},
            "exceeds n=2",
        ),
        (
            _indexed(3).limit(2),
            {"parent": {"epoch": 0, "pos": 0, "order": 2}},
            r"Limit: malformed state \(count",
        ),
        (
            _indexed(3).limit(2),
            {"parent": {"epoch": 0, "pos": 0, "order": 2}, "count": -1},
            "malformed",
        ),
        (
            _indexed(3).repeat(2),
            {"parent": {"epoch": 0, "pos": 0, "order": 2}, "passes": 2},
            "not below",
        ),
        (
            _indexed(3).repeat(),
            {"parent": {"epoch": 0, "pos": 0, "order": 2}, "passes": "1"},
            "Repeat: malformed",
        ),
    ],
)
def test_malformed_states_are_refused(stage: Stage[Any], state: object, match: str) -> None:
    with pytest.raises(StateError, match=match):
        stage.cursor(CONTEXT).restore(state)


def test_describe_and_config() -> None:
    stage = _indexed(4).limit(3).repeat()
    assert str(stage).endswith(".limit(3).repeat()")
    assert str(_indexed(4).repeat(2)).endswith(".repeat(2)")
    config = stage.config()
    assert config["type"] == "Repeat"
    assert config["times"] is None
    assert config["source"]["type"] == "Limit"
    assert config["source"]["n"] == 3
    assert config["source"]["source"]["type"] == "IndexedDataset"
