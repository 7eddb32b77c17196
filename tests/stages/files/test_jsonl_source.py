"""JsonLinesSource: exact resume, sharding, a state that seeks, errors, S3."""

from __future__ import annotations

import bz2
import gzip
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import msgpack
import pytest
from s3_server import S3, S3FS_WARNINGS
from stage_harness import check_stage

from savable_loader import ConfigError, SavableDataLoader, StateError, StorageError, WorkerContext
from savable_loader.datasets.files.jsonl import JsonLinesSource

pytestmark = [S3FS_WARNINGS]

slow = pytest.mark.slow
#: In process, alone and as stream 1 of 2 (NOTE [ Stages in process ] in stage_harness.py):
#: a source's reads with worker processes are test_resumes_exactly[2-False]'s.
LAYOUTS = ["alone", "sharded"]
LENGTHS = [7, 3, 12, 1, 9]  # lines per file: uneven, so the workers' shards are too


def _context(rank: int = 0, world_size: int = 1, worker_id: int = 0, num_workers: int = 0):
    return WorkerContext(rank, world_size, worker_id, num_workers, 0, None)


def _lines(file: int, count: int) -> bytes:
    rows = [json.dumps({"id": file * 100 + i, "text": f"f{file} l{i}"}) for i in range(count)]
    if count > 2:
        rows.insert(2, "   ")  # blank lines are skipped
    return "\n".join(rows).encode() + b"\n"


def _write(folder: Path, lengths: list[int] = LENGTHS) -> list[int]:
    """Writes one file per length (every other one gzip, one bz2); returns every id."""
    for file, count in enumerate(lengths):
        data = _lines(file, count)
        if file == 3:
            (folder / f"part-{file}.jsonl.bz2").write_bytes(bz2.compress(data))
        elif file % 2:
            (folder / f"part-{file}.jsonl.gz").write_bytes(gzip.compress(data))
        else:
            (folder / f"part-{file}.jsonl").write_bytes(data)
    return [file * 100 + i for file, count in enumerate(lengths) for i in range(count)]


def _ids(cursor: Any) -> list[int]:
    return [item["id"] for item in cursor]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    _write(tmp_path)
    return tmp_path


# Exact resume through the loader.


# Shuffled shards in two workers: test_composed_with_map_and_filter_resumes_exactly[2],
# the same source under a map and a filter.
@pytest.mark.parametrize(
    ("num_workers", "shuffle"), [(0, False), (0, True), pytest.param(2, False, marks=slow)]
)
def test_resumes_exactly(folder: Path, num_workers: int, shuffle: bool) -> None:
    pattern = str(folder / "*.jsonl*")
    report = check_stage(
        lambda: JsonLinesSource(pattern, shuffle_shards=shuffle, seed=5), num_workers=num_workers
    )
    assert report.items_per_epoch[0] > 0


def _tag(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "double": item["id"] * 2}


def _not_seventh(item: dict[str, Any]) -> bool:
    return bool(item["id"] % 7)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_composed_with_map_and_filter_resumes_exactly(folder: Path, layout: str) -> None:
    pattern = str(folder / "*.jsonl*")
    check_stage(
        lambda: JsonLinesSource(pattern, shuffle_shards=True).map(_tag).filter(_not_seventh),
        num_workers=0,
        sharded=layout == "sharded",
    )


# What an epoch holds.


@pytest.mark.parametrize("split", ["samples", "files"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_one_epoch_of_every_worker_yields_every_line_once(
    tmp_path: Path, shuffle: bool, split: Any
) -> None:
    expected = _write(tmp_path)
    source = JsonLinesSource(str(tmp_path / "*"), shuffle_shards=shuffle, split=split)
    at = {"shard": 0} if split == "files" else {"taken": 0, "file": 0, "at": 0}
    for epoch in range(2):
        seen = []
        for worker in range(3):
            cursor = source.cursor(_context(worker_id=worker, num_workers=3))
            cursor.restore({"epoch": epoch, **at, "line": 0, "offset": 0})
            seen += _ids(cursor)
        assert sorted(seen) == expected


@slow
def test_one_loader_epoch_over_three_workers_yields_every_line_once(tmp_path: Path) -> None:
    expected = _write(tmp_path)
    loader = SavableDataLoader(JsonLinesSource(str(tmp_path / "*")), batch_size=None, num_workers=3)
    with loader:
        assert sorted(item["id"] for item in loader) == expected


def test_ranks_cover_the_files_disjointly(tmp_path: Path) -> None:
    expected = _write(tmp_path)
    source = JsonLinesSource(str(tmp_path / "*"), shuffle_shards=True, seed=1, split="files")
    per_rank = [
        _ids(source.cursor(_context(rank, 2, worker, 2))) for rank in (0, 1) for worker in (0, 1)
    ]
    assert sorted(i for ids in per_rank for i in ids) == expected
    assert all(per_rank), "5 files over 4 streams: every stream gets one"


def test_shuffled_file_order_depends_on_seed_and_epoch(tmp_path: Path) -> None:
    _write(tmp_path, [2] * 8)

    def firsts(seed: int) -> list[list[int]]:
        cursor = JsonLinesSource(str(tmp_path / "*"), shuffle_shards=True, seed=seed).cursor(
            _context()
        )
        return [[i // 100 for i in _ids(cursor)][::2] for _ in range(3)]

    orders = firsts(0)
    assert orders == firsts(0)
    assert orders != firsts(1)
    assert len({tuple(order) for order in orders}) == 3
    assert all(sorted(order) == list(range(8)) for order in orders)
    plain = JsonLinesSource(str(tmp_path / "*")).cursor(_context())
    assert [i // 100 for i in _ids(plain)][::2] == list(range(8))


def test_a_worker_without_a_file_yields_nothing_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(tmp_path, [3, 3])
    source = JsonLinesSource(str(tmp_path / "*"), split="files")
    with caplog.at_level(logging.WARNING, logger="savable_loader"):
        cursor = source.cursor(_context(worker_id=2, num_workers=3))
    assert list(cursor) == []
    assert "2 files for 3 streams" in caplog.text
    assert "worker 2" in caplog.text


# The state.


def test_state_is_small_plain_and_holds_no_sample(folder: Path) -> None:
    cursor = JsonLinesSource(str(folder / "*")).cursor(_context())
    sizes = []
    for _ in range(20):
        item = next(cursor)
        state = cursor.state()
        assert set(state) == {"epoch", "taken", "file", "at", "line", "offset"}
        assert all(type(value) is int for value in state.values())
        sizes.append(len(msgpack.packb(state)))
        assert item["text"].encode() not in msgpack.packb(state)
    assert max(sizes) < 200


def test_cursors_of_one_source_do_not_share_files(folder: Path) -> None:
    source = JsonLinesSource(str(folder / "*"))
    first, second = source.cursor(_context()), source.cursor(_context())
    interleaved = [(next(first)["id"], next(second)["id"]) for _ in range(10)]
    assert all(a == b for a, b in interleaved)
    assert first.file is not second.file


def test_end_epoch_closes_the_file_and_reads_nothing(folder: Path) -> None:
    cursor = JsonLinesSource(str(folder / "*")).cursor(_context())
    next(cursor)
    file = cursor.file
    cursor.end_epoch()
    assert cursor.state() == {"epoch": 1, "taken": 0, "file": 0, "at": 0, "line": 0, "offset": 0}
    assert file is not None
    assert file.closed
    assert cursor.file is None
    assert next(cursor)["id"] == 0


def _rchar() -> int:
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("rchar:")).split()[1])


@pytest.mark.parametrize("compressed", [False, True])
def test_restore_seeks_instead_of_reading_the_earlier_lines(
    tmp_path: Path, compressed: bool
) -> None:
    rows = b"".join(json.dumps({"id": i, "pad": "x" * 40}).encode() + b"\n" for i in range(40_000))
    path = tmp_path / ("big.jsonl.gz" if compressed else "big.jsonl")
    path.write_bytes(gzip.compress(rows) if compressed else rows)
    source = JsonLinesSource(str(path))
    cursor = source.cursor(_context())
    for _ in range(30_000):
        next(cursor)
    state = cursor.state()
    cursor.end_epoch()
    offset = state["offset"]
    assert state["line"] == 30_000
    assert offset == rows.index(b'{"id": 30000,')
    # The lines before the offset become one long line of garbage: reading or counting
    # them again would fail or land elsewhere; seeking lands on line 30000.
    damaged = b"#" * (offset - 1) + b"\n" + rows[offset:]
    path.write_bytes(gzip.compress(damaged) if compressed else damaged)

    restored = source.cursor(_context())
    restored.restore(state)
    before = _rchar() if os.path.exists("/proc/self/io") else None
    assert next(restored)["id"] == 30_000
    if before is not None and not compressed:
        assert _rchar() - before < offset // 10  # one buffer, not the file
    length = rows.index(b"\n", offset) + 1 - offset
    moved = {"line": 30_001, "offset": offset + length, "taken": 30_001, "at": 30_001}
    assert restored.state() == {**state, **moved}
    with pytest.raises(ConfigError, match="line 1: not valid JSON"):
        next(source.cursor(_context()))


def test_restore_after_the_last_line_of_a_file_moves_on(folder: Path) -> None:
    source = JsonLinesSource(str(folder / "*"))
    cursor = source.cursor(_context())
    ids = [next(cursor)["id"] for _ in range(7)]
    assert ids[-1] == 6  # the last line of the first file
    again = source.cursor(_context())
    again.restore(cursor.state())
    assert next(again)["id"] == next(cursor)["id"] == 100


@pytest.mark.parametrize(
    "state",
    [
        {"epoch": 0, "taken": 0, "file": 0, "at": 0, "line": 0},
        {"epoch": 0, "taken": -1, "file": 0, "at": 0, "line": 0, "offset": 0},
        {"epoch": 0, "taken": 0, "file": 0, "at": 0, "line": 0, "offset": "3"},
        {"epoch": 0, "taken": 0, "file": 0, "at": 0, "line": 0, "offset": 0, "pos": 1},
        {"epoch": 0, "taken": 0, "file": 0, "at": 0, "line": 0, "offset": 0, "rest": []},
        [0, 0, 0, 0],
    ],
)
def test_malformed_states_are_refused(folder: Path, state: object) -> None:
    cursor = JsonLinesSource(str(folder / "*")).cursor(_context())
    with pytest.raises(StateError, match=r"^JsonLinesSource: malformed state"):
        cursor.restore(state)


# Description and errors.


def test_config_and_description(folder: Path) -> None:
    given = [str(folder / "part-4.jsonl"), str(folder / "*.gz"), str(folder / "part-4.jsonl")]
    source = JsonLinesSource(given, seed=3)
    assert str(source) == "JsonLinesSource(2 files)"
    assert source.config() == {
        "type": "JsonLinesSource",
        "urls": [str(folder / "part-1.jsonl.gz"), str(folder / "part-4.jsonl")],
        "shuffle_shards": False,
        "seed": 3,
        "split": "samples",
    }
    shuffled = JsonLinesSource(str(folder / "part-0.jsonl"), shuffle_shards=True, seed=2)
    assert str(shuffled) == "JsonLinesSource(1 file, shuffle_shards=True, seed=2)"


def test_a_malformed_line_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"id": 1}\n\n{"id": \n{"id": 4}\n')
    cursor = JsonLinesSource(str(path)).cursor(_context())
    assert next(cursor) == {"id": 1}
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}, line 3: not valid JSON"
    ) as caught:
        next(cursor)
    assert isinstance(caught.value, ValueError)
    assert next(cursor) == {"id": 4}  # the position moved past the bad line


def test_a_line_nested_too_deep_is_a_config_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    path.write_bytes(b'{"id": 1}\n' + b"[" * 100_000 + b"]" * 100_000 + b'\n{"id": 3}\n')
    cursor = JsonLinesSource(str(path)).cursor(_context())
    assert next(cursor) == {"id": 1}
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}, line 2: JSON nested too deep"
    ):
        next(cursor)
    assert next(cursor) == {"id": 3}


@pytest.mark.parametrize("urls", [[], "NOWHERE/*.jsonl"])
def test_an_empty_match_is_refused(tmp_path: Path, urls: Any) -> None:
    if isinstance(urls, str):
        urls = str(tmp_path / urls)
    with pytest.raises(ConfigError, match=r"matches no file|at least one"):
        JsonLinesSource(urls)


def test_bad_arguments_are_refused(folder: Path) -> None:
    with pytest.raises(ConfigError, match="shuffle_shards"):
        JsonLinesSource(str(folder / "*"), shuffle_shards=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="seed"):
        JsonLinesSource(str(folder / "*"), seed="1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="str"):
        JsonLinesSource([3])  # type: ignore[list-item]


def test_a_missing_file_is_a_storage_error_naming_it(folder: Path) -> None:
    missing = str(folder / "absent.jsonl")
    with pytest.raises(StorageError, match=rf"^Cannot read {re.escape(missing)}: not found"):
        next(JsonLinesSource(missing).cursor(_context()))
    source = JsonLinesSource(str(folder / "*"))
    (folder / "part-0.jsonl").unlink()  # gone after the listing
    with pytest.raises(StorageError, match=r"part-0\.jsonl: not found"):
        next(source.cursor(_context()))


def test_a_corrupt_gzip_file_is_a_storage_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(gzip.compress(_lines(0, 50))[:40])
    with pytest.raises(StorageError, match=r"bad\.jsonl\.gz"):
        list(JsonLinesSource(str(path)).cursor(_context()))


def test_memory_urls() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    for file in range(3):
        fs.pipe_file(f"/jsonl-test/{file}.jsonl", _lines(file, 4))
    try:
        source = JsonLinesSource("memory://jsonl-test/*.jsonl")
        assert source.urls == tuple(f"memory:///jsonl-test/{file}.jsonl" for file in range(3))
        assert len(list(source.cursor(_context()))) == 12
    finally:
        fs.rm("/jsonl-test", recursive=True)


# S3, through a loopback moto server.


def _upload(s3: S3) -> str:
    for file, count in enumerate(LENGTHS):
        s3.put(f"data/part-{file}.jsonl.gz", gzip.compress(_lines(file, count)))
    s3.put("data/other.txt", b"not listed")
    return s3.url("data/*.jsonl.gz")


def test_s3_glob_resumes_exactly(s3: S3) -> None:
    pattern = _upload(s3)
    s3.use_environment()
    source = JsonLinesSource(pattern)
    assert source.urls == tuple(s3.url(f"data/part-{file}.jsonl.gz") for file in range(5))
    report = check_stage(lambda: JsonLinesSource(pattern, shuffle_shards=True), num_workers=0)
    assert report.items_per_epoch == [16, 16]  # 32 lines in batches of 2


def test_s3_with_storage_options(s3: S3) -> None:
    pattern = _upload(s3)
    source = JsonLinesSource(pattern, storage_options=s3.options())
    assert "storage_options" not in source.config()
    cursor = source.cursor(_context())
    head = [next(cursor)["id"] for _ in range(10)]
    state = cursor.state()
    again = source.cursor(_context())
    again.restore(state)
    assert head + _ids(again) == sorted(_ids(source.cursor(_context())))


def test_s3_missing_object_is_a_storage_error(s3: S3) -> None:
    options = s3.use_environment()
    url = s3.url("data/absent.jsonl")
    with pytest.raises(StorageError, match=rf"^Cannot read {re.escape(url)}: not found"):
        next(JsonLinesSource(url, storage_options=options).cursor(_context()))
    with pytest.raises(ConfigError, match="matches no file"):
        JsonLinesSource(s3.url("nothing/*.jsonl"))
