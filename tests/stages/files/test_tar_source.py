"""TarSource: WebDataset-style samples, exact resume, a state that seeks, errors, S3."""

from __future__ import annotations

import gzip
import io
import logging
import re
import tarfile
from pathlib import Path
from typing import Any

import msgpack
import pytest
from s3_server import S3, S3FS_WARNINGS
from sample_files import tar_bytes, tar_member, tar_shard
from stage_harness import check_stage

from savable_loader import ConfigError, SavableDataLoader, StateError, StorageError, WorkerContext
from savable_loader.datasets.files.tar import TarSource

pytestmark = [S3FS_WARNINGS]

slow = pytest.mark.slow
#: In process, alone and as stream 1 of 2 (NOTE [ Stages in process ] in stage_harness.py):
#: a source's reads with worker processes are test_resumes_exactly[2-False]'s.
LAYOUTS = ["alone", "sharded"]
LENGTHS = [4, 2, 7, 1, 5]  # samples per shard


def _context(rank: int = 0, world_size: int = 1, worker_id: int = 0, num_workers: int = 0):
    return WorkerContext(rank, world_size, worker_id, num_workers, 0, None)


def _write(folder: Path, lengths: list[int] = LENGTHS) -> list[str]:
    """Writes one shard per length (every other one .tar.gz); returns every key."""
    for shard, count in enumerate(lengths):
        gz = shard % 2 == 1
        name = f"data-{shard:03d}.tar" + (".gz" if gz else "")
        (folder / name).write_bytes(tar_shard(shard, count, "w:gz" if gz else "w"))
    return [f"shard{shard}/{i:04d}" for shard, count in enumerate(lengths) for i in range(count)]


def _keys(cursor: Any) -> list[str]:
    return [sample["__key__"] for sample in cursor]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    _write(tmp_path)
    return tmp_path


# Samples.


def test_samples_group_members_by_key(folder: Path) -> None:
    cursor = TarSource(str(folder / "*.tar*")).cursor(_context())
    first = next(cursor)
    assert first == {
        "__key__": "shard0/0000",
        "__url__": str(folder / "data-000.tar"),
        "txt": b"0:0",
        "cls.json": b'{"cls": 0}',
    }
    rest = list(cursor)
    assert [first["__key__"]] + [s["__key__"] for s in rest] == _write(folder)
    assert rest[3]["__url__"] == str(folder / "data-001.tar.gz")


def _odd_members(long_key: str) -> list[tuple[tarfile.TarInfo, Any]]:
    return [
        tar_member("folder", b"", tarfile.DIRTYPE),
        tar_member("a.txt", b"A"),
        tar_member("README", b"no extension"),
        tar_member(".hidden", b"no key"),
        tar_member("a.link", b"", tarfile.SYMTYPE),
        tar_member("a.seg.png", b"S"),
        tar_member(f"{long_key}.txt", b"L"),
        tar_member("b.txt", b"B"),
    ]


def test_odd_members_are_passed_over_and_long_names_kept(tmp_path: Path) -> None:
    long_key = "deep/" * 30 + "sample"
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        path = tmp_path / f"odd-{fmt}.tar"
        path.write_bytes(tar_bytes(_odd_members(long_key), format=fmt))
        source = TarSource(str(path))
        samples = list(source.cursor(_context()))
        assert [{k: v for k, v in s.items() if k != "__url__"} for s in samples] == [
            {"__key__": "a", "txt": b"A", "seg.png": b"S"},
            {"__key__": long_key, "txt": b"L"},
            {"__key__": "b", "txt": b"B"},
        ]
        cursor = source.cursor(_context())
        next(cursor)
        again = source.cursor(_context())
        again.restore(cursor.state())  # at the long name's first (extended) header
        assert _keys(again) == [long_key, "b"]


def test_a_repeated_extension_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "dup.tar"
    path.write_bytes(tar_bytes([tar_member("a.txt", b"1"), tar_member("a.txt", b"2")]))
    with pytest.raises(ConfigError, match=r"sample 'a' holds 'txt' twice"):
        next(TarSource(str(path)).cursor(_context()))


def test_an_empty_file_has_no_samples(tmp_path: Path) -> None:
    (tmp_path / "0.tar").write_bytes(b"")
    (tmp_path / "1.tar").write_bytes(tar_bytes([]))
    (tmp_path / "2.tar").write_bytes(tar_shard(2, 2))
    assert _keys(TarSource(str(tmp_path / "*.tar")).cursor(_context())) == [
        "shard2/0000",
        "shard2/0001",
    ]


class _CountedFile(io.FileIO):
    """A local file that counts the bytes read from it."""

    read_bytes = 0

    def read(self, size: int = -1) -> bytes:
        data = super().read(size)
        self.read_bytes += len(data or b"")
        return data or b""


def test_local_shards_are_counted_from_their_headers_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    long_key = "deep/" * 30 + "sample"
    big = [tar_member(f"s{i:03d}.{ext}", bytes([i]) * 20_000) for i in range(40) for ext in "ab"]
    shards = {
        "big.tar": (tar_bytes(big), 40),
        "gnu.tar": (tar_bytes(_odd_members(long_key), format=tarfile.GNU_FORMAT), 3),
        "pax.tar": (tar_bytes(_odd_members(long_key), format=tarfile.PAX_FORMAT), 3),
        "empty.tar": (b"", 0),
        "none.tar": (tar_bytes([]), 0),
    }
    for name, (body, _) in shards.items():
        (tmp_path / name).write_bytes(body)
    source = TarSource(str(tmp_path / "*.tar"))
    opened: dict[str, _CountedFile] = {}

    def counted_open(url: str) -> _CountedFile:
        opened[url] = _CountedFile(url)
        return opened[url]

    monkeypatch.setattr(source, "open", counted_open)
    counts = dict(zip(source.urls, source.sample_counts(), strict=True))
    expected = {str(tmp_path / name): count for name, (_, count) in shards.items()}
    assert counts == expected
    # The same counts as reading each shard through (a file without a fileno: remote).
    read_through = {
        url: source.count_items(io.BytesIO(Path(url).read_bytes()), url) for url in source.urls
    }
    assert read_through == expected
    # A local file is read header to header: the members' 1.6 MB are seeked over.
    assert opened[str(tmp_path / "big.tar")].read_bytes < len(shards["big.tar"][0]) // 20


# Exact resume through the loader.


# Shuffled shards in two workers: test_composed_with_map_and_filter_resumes_exactly[2],
# the same source under a map and a filter.
@pytest.mark.parametrize(
    ("num_workers", "shuffle"), [(0, False), (0, True), pytest.param(2, False, marks=slow)]
)
def test_resumes_exactly(folder: Path, num_workers: int, shuffle: bool) -> None:
    pattern = str(folder / "*.tar*")
    check_stage(lambda: TarSource(pattern, shuffle_shards=shuffle, seed=2), num_workers=num_workers)


def _decode(sample: dict[str, Any]) -> dict[str, Any]:
    return {"key": sample["__key__"], "text": sample["txt"].decode(), "size": len(sample["txt"])}


def _even_size(item: dict[str, Any]) -> bool:
    return item["size"] % 2 == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_composed_with_map_and_filter_resumes_exactly(folder: Path, layout: str) -> None:
    pattern = str(folder / "*.tar*")
    check_stage(
        lambda: TarSource(pattern, shuffle_shards=True).map(_decode).filter(_even_size),
        num_workers=0,
        sharded=layout == "sharded",
        batch_size=None,
    )


# What an epoch holds.


@pytest.mark.parametrize("split", ["samples", "files"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_worker_together_yields_every_sample_once(
    tmp_path: Path, shuffle: bool, split: Any
) -> None:
    expected = _write(tmp_path)
    source = TarSource(str(tmp_path / "*"), shuffle_shards=shuffle, split=split)
    at = {"shard": 0} if split == "files" else {"taken": 0, "file": 0, "at": 0}
    for epoch in range(2):
        seen = []
        for worker in range(3):
            cursor = source.cursor(_context(worker_id=worker, num_workers=3))
            cursor.restore({"epoch": epoch, **at, "offset": 0})
            seen += _keys(cursor)
        assert sorted(seen) == expected


@slow
def test_one_loader_epoch_over_three_workers_yields_every_sample_once(tmp_path: Path) -> None:
    expected = _write(tmp_path)
    with SavableDataLoader(TarSource(str(tmp_path / "*")), batch_size=None, num_workers=3) as it:
        assert sorted(sample["__key__"] for sample in it) == expected


def test_ranks_cover_the_shards_disjointly(tmp_path: Path) -> None:
    expected = _write(tmp_path)
    source = TarSource(str(tmp_path / "*"), shuffle_shards=True, seed=4, split="files")
    per_stream = [
        _keys(source.cursor(_context(rank, 2, worker, 2))) for rank in (0, 1) for worker in (0, 1)
    ]
    assert sorted(key for keys in per_stream for key in keys) == expected
    assert all(per_stream)


def test_a_worker_without_a_shard_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write(tmp_path, [1])
    with caplog.at_level(logging.WARNING, logger="savable_loader"):
        cursor = TarSource(str(tmp_path / "*"), split="files").cursor(_context(1, 2))
    assert list(cursor) == []
    assert "1 files for 2 streams (2 ranks x 1 workers): rank 1 worker 0" in caplog.text


# The state.


def test_state_is_small_plain_and_holds_no_sample(folder: Path) -> None:
    cursor = TarSource(str(folder / "*")).cursor(_context())
    sizes = []
    for sample in cursor:
        state = cursor.state()
        assert set(state) == {"epoch", "taken", "file", "at", "offset"}
        assert all(type(value) is int for value in state.values())
        sizes.append(len(msgpack.packb(state)))
        assert sample["txt"] not in msgpack.packb(state)
    assert max(sizes) < 200


@pytest.mark.parametrize("split", ["samples", "files"])
def test_a_shard_done_moves_the_state_to_the_next_one(folder: Path, split: Any) -> None:
    cursor = TarSource(str(folder / "*"), split=split).cursor(_context())
    field = "shard" if split == "files" else "file"
    for _ in range(LENGTHS[0] - 1):
        next(cursor)
    assert cursor.state()[field] == 0
    assert cursor.state()["offset"] > 0
    next(cursor)
    moved = {"shard": 1} if split == "files" else {"taken": LENGTHS[0], "file": 1, "at": 0}
    assert cursor.state() == {"epoch": 0, **moved, "offset": 0}
    assert cursor.file is None


@pytest.mark.parametrize("compressed", [False, True])
def test_restore_seeks_to_the_next_sample(tmp_path: Path, compressed: bool) -> None:
    path = tmp_path / ("big.tar.gz" if compressed else "big.tar")
    data = tar_shard(0, 3000)
    path.write_bytes(tar_shard(0, 3000, "w:gz") if compressed else data)
    source = TarSource(str(path))
    cursor = source.cursor(_context())
    for _ in range(2500):
        next(cursor)
    state = cursor.state()
    offset = state["offset"]
    expected = next(cursor)
    with tarfile.open(fileobj=io.BytesIO(data[offset:]), mode="r|") as tar:
        assert tar.next().name == "shard0/2500.txt"
    # Zeros before the offset read as the end of the archive from its start, so only a
    # reader that seeks finds sample 2500.
    damaged = bytes(offset) + data[offset:]
    with tarfile.open(fileobj=io.BytesIO(damaged), mode="r|") as tar:
        assert tar.next() is None
    path.write_bytes(gzip.compress(damaged) if compressed else damaged)
    restored = source.cursor(_context())
    restored.restore(state)
    assert next(restored) == expected
    assert len(_keys(restored)) == 499
    assert list(source.cursor(_context())) == []


@pytest.mark.parametrize(
    "state",
    [
        {"epoch": 0, "taken": 0, "file": 0, "at": 0},
        {"epoch": 0, "taken": 0, "file": 0, "at": 0, "offset": -512},
        {"epoch": 0, "taken": 0, "file": 0, "at": 0, "offset": 0, "line": 0},
        {"epoch": 0.5, "taken": 0, "file": 0, "at": 0, "offset": 0},
        "0:0:0",
    ],
)
def test_malformed_states_are_refused(folder: Path, state: object) -> None:
    with pytest.raises(StateError, match=r"^TarSource: malformed state"):
        TarSource(str(folder / "*")).cursor(_context()).restore(state)


# Description and errors.


def test_config_and_description(folder: Path) -> None:
    source = TarSource(str(folder / "*.tar"), shuffle_shards=True, seed=9)
    assert str(source) == "TarSource(3 files, shuffle_shards=True, seed=9)"
    assert source.config() == {
        "type": "TarSource",
        "urls": [str(folder / f"data-{shard:03d}.tar") for shard in (0, 2, 4)],
        "shuffle_shards": True,
        "seed": 9,
        "split": "samples",
    }


def test_an_empty_glob_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"matches no file"):
        TarSource(str(tmp_path / "*.tar"))


def test_a_missing_shard_is_a_storage_error_naming_it(folder: Path) -> None:
    source = TarSource(str(folder / "*"))
    (folder / "data-000.tar").unlink()
    missing = str(folder / "data-000.tar")
    with pytest.raises(StorageError, match=rf"^Cannot read {re.escape(missing)}: not found"):
        next(source.cursor(_context()))


def test_a_truncated_shard_is_a_storage_error_and_a_retry_starts_the_sample_again(
    tmp_path: Path,
) -> None:
    data = tar_shard(0, 3)
    path = tmp_path / "bad.tar"
    path.write_bytes(data[: 2048 + 512 + 3])  # cut in the 2nd sample's first data block
    cursor = TarSource(str(path)).cursor(_context())
    assert next(cursor)["__key__"] == "shard0/0000"
    with pytest.raises(StorageError, match=r"bad\.tar"):
        next(cursor)
    with pytest.raises(StorageError, match=r"bad\.tar"):
        next(cursor)
    assert cursor.file is None


# S3, through a loopback moto server.


def test_s3_shards_resume_exactly(s3: S3) -> None:
    for shard, count in enumerate(LENGTHS):
        suffix, mode = (".tar.gz", "w:gz") if shard % 2 else (".tar", "w")
        s3.put(f"shards/data-{shard:03d}{suffix}", tar_shard(shard, count, mode))
    s3.use_environment()
    pattern = s3.url("shards/data-*")
    assert len(TarSource(pattern).urls) == 5
    report = check_stage(
        lambda: TarSource(pattern, shuffle_shards=True).map(_decode),
        num_workers=0,
        batch_size=None,
    )
    assert report.items_per_epoch == [sum(LENGTHS)] * 2
