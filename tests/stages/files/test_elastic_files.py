"""Elastic restores of the file sources with ``split="files"`` (NOTE [ Elastic file order ]
in ``datasets/files/reshard.py``); ``tests/stages/files/test_split_samples.py`` covers
``split="samples"``.

Each scenario reads a varying number of items from every stream of a saved layout
(none, part of a file, exactly one file, the whole epoch), reshards the states onto
another layout, and checks that the new streams read every item left exactly once,
that the next epoch is a fresh run's, and that a second reshard mid-way composes.
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest

from savable_loader import StateError, WorkerContext
from savable_loader.datasets.files.jsonl import JsonLinesSource
from savable_loader.datasets.files.sharded import ShardedSource
from savable_loader.datasets.files.tar import TarSource
from savable_loader.datasets.protocol.elastic import OldStream, ReshardPlan

JSONL_LENGTHS = [7, 3, 12, 1, 9, 4, 6, 2]  # lines per file
TAR_LENGTHS = [4, 2, 7, 1, 5, 3, 2]  # samples per shard

Layout = tuple[int, int]  # (world_size, num_workers); 0 workers reads in the main process


def _write_jsonl(folder: Path, lengths: Sequence[int]) -> None:
    """One file per length, every other one gzip; a blank line in the longer ones."""
    for file, count in enumerate(lengths):
        rows = [json.dumps({"id": file * 100 + i}) for i in range(count)]
        if count > 2:
            rows.insert(2, "  ")
        data = "\n".join(rows).encode() + b"\n"
        if file % 2:
            (folder / f"part-{file:02d}.jsonl.gz").write_bytes(gzip.compress(data))
        else:
            (folder / f"part-{file:02d}.jsonl").write_bytes(data)


def _write_tar(folder: Path, lengths: Sequence[int]) -> None:
    """One shard per length, every other one .tar.gz; two members per sample."""
    for shard, count in enumerate(lengths):
        gz = shard % 2 == 1
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz" if gz else "w") as tar:
            for i in range(count):
                for ext, data in (("txt", b"x" * (i + 1)), ("cls", b"%d" % i)):
                    info = tarfile.TarInfo(f"s{shard}/{i:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        name = f"data-{shard:03d}.tar" + (".gz" if gz else "")
        (folder / name).write_bytes(buffer.getvalue())


@dataclass(frozen=True)
class Kind:
    """How to build one file source and name its items."""

    name: str
    build: Callable[[Path, Sequence[int], bool], ShardedSource[Any]]
    lengths: Sequence[int]
    item: Callable[[Any], Any]  # a unique id
    file: Callable[[Any], Any]  # the file an item comes from


def _jsonl(folder: Path, lengths: Sequence[int], shuffle: bool) -> ShardedSource[Any]:
    _write_jsonl(folder, lengths)
    return JsonLinesSource(str(folder / "*"), shuffle_shards=shuffle, seed=3, split="files")


def _tar(folder: Path, lengths: Sequence[int], shuffle: bool) -> ShardedSource[Any]:
    _write_tar(folder, lengths)
    return TarSource(str(folder / "*"), shuffle_shards=shuffle, seed=3, split="files")


JSONL = Kind(
    "jsonl", _jsonl, JSONL_LENGTHS, lambda item: item["id"], lambda item: item["id"] // 100
)
TAR = Kind("tar", _tar, TAR_LENGTHS, lambda item: item["__key__"], lambda item: item["__url__"])


@pytest.fixture(params=[JSONL, TAR], ids=lambda kind: kind.name)
def kind(request: pytest.FixtureRequest) -> Kind:
    return request.param  # type: ignore[no-any-return]


def _every(kind: Kind, lengths: Sequence[int] | None = None) -> Counter[Any]:
    lengths = kind.lengths if lengths is None else lengths
    if kind is JSONL:
        return Counter(file * 100 + i for file, count in enumerate(lengths) for i in range(count))
    return Counter(f"s{shard}/{i:04d}" for shard, count in enumerate(lengths) for i in range(count))


def _contexts(layout: Layout) -> list[WorkerContext]:
    world_size, num_workers = layout
    return [
        WorkerContext(rank, world_size, worker, num_workers, 0, None)
        for rank in range(world_size)
        for worker in range(max(num_workers, 1))
    ]


def _epoch(cursor: Any) -> list[Any]:
    return list(cursor)


# What a stream reads before the save: nothing, part of its first file, exactly its first
# file, or the whole epoch (its cursor then stands at the start of the next one).
NONE, MID, FILE, ALL = "none", "mid", "file", "all"


def _read(stage: ShardedSource[Any], kind: Kind, context: WorkerContext, state: Any, how: str):
    """Restores a cursor for ``context`` at ``state``, reads as ``how`` says; returns the
    items read and the state after them (None when it read nothing from None)."""
    cursor = stage.cursor(context)
    cursor.restore(state)
    ahead = _epoch(cursor)
    cursor.restore(state)
    files = [kind.file(item) for item in ahead]
    first = next((i for i, f in enumerate(files) if f != files[0]), len(files))
    if how == ALL:
        read = _epoch(cursor)
        return read, cursor.state()
    count = {NONE: 0, MID: (first + 1) // 2, FILE: first}[how]
    read = [next(cursor) for _ in range(count)]
    return read, (None if state is None and not read else cursor.state())


def _roundtrip(state: Any) -> Any:
    return msgpack.unpackb(msgpack.packb(state))


def _reshard(
    stage: ShardedSource[Any], epoch: int, old: list[tuple[WorkerContext, Any]], layout: Layout
) -> list[tuple[WorkerContext, Any]]:
    streams = tuple(OldStream(context, state) for context, state in old)
    return [
        (new, _roundtrip(stage.reshard(ReshardPlan(epoch, streams, new))))
        for new in _contexts(layout)
    ]


def _fresh_epoch(stage: ShardedSource[Any], context: WorkerContext, epoch: int) -> list[Any]:
    cursor = stage.cursor(context)
    for _ in range(epoch):
        cursor.end_epoch()
    return _epoch(cursor)


def _check(
    stage: ShardedSource[Any],
    kind: Kind,
    layouts: Sequence[Layout],
    hows: Sequence[str],
    *,
    epoch: int = 0,
    every: Counter[Any] | None = None,
) -> None:
    """Reads per ``hows`` on ``layouts[0]``, reshards onto each next layout (reading per
    ``hows`` again before each further reshard), then checks the epoch and the next."""
    every = _every(kind) if every is None else every
    streams: list[tuple[WorkerContext, Any]] = []
    for context in _contexts(layouts[0]):
        if epoch:
            cursor = stage.cursor(context)
            for _ in range(epoch):
                cursor.end_epoch()
            streams.append((context, cursor.state()))
        else:
            streams.append((context, None))
    consumed: list[Any] = []
    for step, layout in enumerate(layouts[1:]):
        saved = []
        for i, (context, state) in enumerate(streams):
            read, after = _read(stage, kind, context, state, hows[(i + step) % len(hows)])
            consumed += [kind.item(item) for item in read]
            saved.append((context, after))
        streams = _reshard(stage, epoch, saved, layout)
        for _, state in streams:
            assert state["epoch"] == epoch
            assert len(msgpack.packb(state)) < 200
    rest = []
    for context, state in streams:
        cursor = stage.cursor(context)
        cursor.restore(state)
        rest += [kind.item(item) for item in _epoch(cursor)]
        assert cursor.state()["epoch"] == epoch + 1
        assert set(cursor.state()) == set(stage.cursor(context).state())  # the rest is gone
        assert [kind.item(i) for i in _epoch(cursor)] == [
            kind.item(i) for i in _fresh_epoch(stage, context, epoch + 1)
        ]
    assert Counter(consumed) + Counter(rest) == every
    assert len(consumed) + len(rest) == sum(every.values())  # nothing twice


SCENARIOS = {
    "1x2->3x1": [(1, 2), (3, 0)],
    "2x3->1x1": [(2, 3), (1, 0)],
    "2w->3w": [(1, 2), (1, 3)],
    "1x1->2x2": [(1, 0), (2, 2)],
    "3x1->2x1": [(3, 0), (2, 0)],
}


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("layouts", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_the_rest_of_the_epoch_is_read_once_and_the_next_is_fresh(
    tmp_path: Path, kind: Kind, layouts: list[Layout], shuffle: bool
) -> None:
    stage = kind.build(tmp_path, kind.lengths, shuffle)
    _check(stage, kind, layouts, [MID, NONE, FILE, ALL])
    _check(stage, kind, layouts, [FILE, MID, ALL], epoch=1)


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize(
    "layouts",
    [[(1, 2), (3, 0), (2, 2)], [(2, 3), (1, 2), (1, 0)], [(1, 0), (1, 3), (2, 1), (1, 2)]],
    ids=["grow-shrink", "shrink-shrink", "three-reshards"],
)
def test_a_second_reshard_in_the_resumed_epoch_composes(
    tmp_path: Path, kind: Kind, layouts: list[Layout], shuffle: bool
) -> None:
    stage = kind.build(tmp_path, kind.lengths, shuffle)
    _check(stage, kind, layouts, [MID, FILE, NONE, MID, ALL])
    _check(stage, kind, layouts, [ALL, MID, FILE], epoch=2)


@pytest.mark.parametrize("hows", [[NONE], [MID], [FILE], [ALL], [ALL, NONE]])
def test_uniform_progress(tmp_path: Path, kind: Kind, hows: list[str]) -> None:
    stage = kind.build(tmp_path, kind.lengths, True)
    _check(stage, kind, [(2, 2), (1, 3), (3, 0)], hows)


def test_fewer_files_than_streams(tmp_path: Path, kind: Kind) -> None:
    lengths = [3, 5, 2]
    stage = kind.build(tmp_path, lengths, True)
    every = _every(kind, lengths)
    _check(stage, kind, [(2, 3), (1, 4)], [MID, NONE, ALL], every=every)
    _check(stage, kind, [(1, 2), (2, 3), (1, 0)], [FILE, MID], every=every)
    _check(stage, kind, [(1, 0), (5, 0), (2, 2)], [MID], epoch=1, every=every)


def test_a_save_before_any_read_reshards_to_a_plain_state(tmp_path: Path, kind: Kind) -> None:
    stage = kind.build(tmp_path, kind.lengths, False)
    old = [(context, None) for context in _contexts((1, 2))]
    for context, state in _reshard(stage, 0, old, (3, 0)):
        assert state == stage.cursor(context).state()


def test_a_save_after_every_stream_finished_leaves_nothing(tmp_path: Path, kind: Kind) -> None:
    stage = kind.build(tmp_path, kind.lengths, True)
    old = []
    for context in _contexts((2, 2)):
        cursor = stage.cursor(context)
        _epoch(cursor)
        old.append((context, cursor.state()))
    for context, state in _reshard(stage, 0, old, (1, 3)):
        cursor = stage.cursor(context)
        cursor.restore(state)
        assert _epoch(cursor) == []
        assert [kind.item(i) for i in _epoch(cursor)] == [
            kind.item(i) for i in _fresh_epoch(stage, context, 1)
        ]


def test_a_begun_file_resumes_at_its_offset_and_line(tmp_path: Path) -> None:
    stage = JsonLinesSource(str(_written(tmp_path)), shuffle_shards=False, split="files")
    (context,) = _contexts((1, 0))
    cursor = stage.cursor(context)
    [next(cursor) for _ in range(5)]  # into part-00, past its blank line
    saved = cursor.state()
    (new, state), *_ = _reshard(stage, 0, [(context, saved)], (1, 2))
    assert state["started"] == [[0, saved["offset"], saved["line"]]]
    assert (state["offset"], state["line"]) == (saved["offset"], saved["line"])
    resumed = stage.cursor(new)
    resumed.restore(state)
    assert next(resumed)["id"] == next(cursor)["id"] == 5
    assert resumed.state()["line"] == cursor.state()["line"]


def _written(folder: Path) -> Path:
    _write_jsonl(folder, JSONL_LENGTHS)
    return folder / "*"


def _elastic_state(stage: ShardedSource[Any]) -> dict[str, Any]:
    """A resharded state of the first of two new streams, after a partial read."""
    contexts = _contexts((1, 2))
    old = []
    for context, how in zip(contexts, [MID, FILE], strict=True):
        old.append((context, _read(stage, JSONL, context, None, how)[1]))
    state: dict[str, Any] = _reshard(stage, 0, old, (1, 2))[0][1]
    return state


@pytest.mark.parametrize(
    "change",
    [
        {"done": None},
        {"started": None},
        {"done_below": 99},
        {"done": [5, 4]},
        {"done": [0]},
        {"done": [3, 3]},
        {"done": [-1]},
        {"started": [[2, 0]]},
        {"started": [[2, 0, 0, 0]]},
        {"started": [[1, 0, 0], [1, 0, 0]]},
        {"started": [[99, 0, 0]]},
        {"started": [[2, -5, 0]]},
        {"started": "[]"},
        {"shard": 9},
    ],
)
def test_malformed_elastic_states_are_refused(tmp_path: Path, change: dict[str, Any]) -> None:
    stage = JsonLinesSource(str(_written(tmp_path)), split="files")
    state = _elastic_state(stage)
    assert state["done_below"] == 0
    assert state["started"]
    broken = {key: value for key, value in {**state, **change}.items() if value is not None}
    cursor = stage.cursor(_contexts((1, 2))[0])
    with pytest.raises(StateError, match=r"^JsonLinesSource(: malformed state|, rank 0 worker 0)"):
        cursor.restore(broken)
    with pytest.raises(StateError, match=r"^JsonLinesSource"):
        stage.reshard(ReshardPlan(0, (OldStream(cursor.context, broken),), _contexts((1, 0))[0]))
    cursor.restore(state)  # a refused state leaves the cursor usable


def test_a_position_before_where_the_file_resumes_is_refused(tmp_path: Path) -> None:
    stage = JsonLinesSource(str(_written(tmp_path)), split="files")
    state = _elastic_state(stage)
    _, offset, _ = state["started"][0]
    assert state["offset"] == offset > 0
    cursor = stage.cursor(_contexts((1, 2))[0])
    with pytest.raises(StateError, match="lies before"):
        cursor.restore({**state, "offset": offset - 1})


def test_tar_started_entries_hold_place_and_offset(tmp_path: Path) -> None:
    stage = _tar(tmp_path, TAR_LENGTHS, False)
    (context,) = _contexts((1, 0))
    cursor = stage.cursor(context)
    next(cursor)
    state = _reshard(stage, 0, [(context, cursor.state())], (1, 2))[0][1]
    assert state["started"] == [[0, cursor.state()["offset"]]]
    with pytest.raises(StateError, match=r"started must hold \[place, offset\]"):
        stage.cursor(context).restore({**state, "started": [[0, 1, 0]]})


def test_saved_streams_that_disagree_or_stand_elsewhere_are_refused(
    tmp_path: Path, kind: Kind
) -> None:
    stage = kind.build(tmp_path, kind.lengths, False)
    (single,) = _contexts((1, 0))
    cursor = stage.cursor(single)
    next(cursor)
    (first, elastic), (second, _) = _reshard(stage, 0, [(single, cursor.state())], (1, 2))
    plain = stage.cursor(second).state()
    with pytest.raises(StateError, match="disagree on what was left of epoch 0"):
        _reshard(stage, 0, [(first, elastic), (second, plain)], (1, 0))
    with pytest.raises(StateError, match="stands in epoch 0 while the loader resumes epoch 1"):
        _reshard(stage, 1, [(single, cursor.state())], (1, 0))
    with pytest.raises(StateError, match="file 40 is past the stream's"):
        _reshard(stage, 0, [(single, {**cursor.state(), "shard": 40})], (1, 0))


def test_plain_states_restore_as_before(tmp_path: Path, kind: Kind) -> None:
    stage = kind.build(tmp_path, kind.lengths, True)
    (context,) = _contexts((1, 0))
    cursor = stage.cursor(context)
    [next(cursor) for _ in range(9)]
    state = cursor.state()
    expected = {"epoch", "shard", "offset"} | ({"line"} if kind is JSONL else set())
    assert set(state) == expected
    again = stage.cursor(context)
    again.restore(_roundtrip(state))
    assert again.state() == state
    assert [kind.item(i) for i in _epoch(again)] == [kind.item(i) for i in _epoch(cursor)]
