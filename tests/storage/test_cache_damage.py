"""A damaged or unusable cache folder: a damaged entry is downloaded again, and a folder
that cannot hold files is a StorageError naming it, never blamed on the store."""

from __future__ import annotations

import errno
import logging
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from savable_loader import StorageError, WorkerContext
from savable_loader.datasets import JsonLinesSource, TableSource, TokenSource
from savable_loader.storage.cache import node as cache_module
from savable_loader.storage.cache.entries import in_folder
from savable_loader.storage.cache.node import FileCache

ROWS = [{"id": index} for index in range(5)]


@pytest.fixture
def remote() -> Iterator[str]:
    """A ``memory://`` folder with one JSON-lines file of :data:`ROWS`."""
    fs = fsspec.filesystem("memory")
    root = f"/cache-damage-{uuid.uuid4().hex[:8]}"
    fs.pipe_file(
        f"{root}/part-0.jsonl", "".join(f'{{"id": {row["id"]}}}\n' for row in ROWS).encode()
    )
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


def _read(source: Any) -> list[Any]:
    cursor = source.cursor(WorkerContext(0, 1, 0, 0, 0, None))
    try:
        return list(cursor)
    finally:
        cursor.close()


def _only(folder: Path, suffix: str) -> Path:
    (path,) = [path for path in folder.iterdir() if path.name.endswith(suffix)]
    return path


@pytest.mark.parametrize(
    "sidecar",
    [b"[]", b"null", b'"text"', b"7", b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe\x00", b""],
    ids=["list", "null", "string", "number", "nested-too-deep", "not-utf8", "empty"],
)
def test_an_entry_with_a_damaged_sidecar_is_downloaded_again(
    remote: str, tmp_path: Path, sidecar: bytes
) -> None:
    fs = fsspec.filesystem("memory")
    url = f"{remote}/part-0.jsonl"
    first = FileCache(tmp_path, 10**6, 0)
    with first.open(url, lambda: fs) as file:
        expected = file.read()
    _only(tmp_path, ".json").write_bytes(sidecar)
    again = FileCache(tmp_path, 10**6, 0)
    with again.open(url, lambda: fs) as file:
        assert file.read() == expected
    assert (again.stats.misses, again.stats.bytes_downloaded) == (1, len(expected))
    third = FileCache(tmp_path, 10**6, 0)  # the download repaired the entry
    with third.open(url, lambda: fs) as file:
        assert file.read() == expected
    assert (third.stats.hits, third.stats.bytes_downloaded) == (1, 0)


def test_a_source_reads_through_a_damaged_sidecar(remote: str, tmp_path: Path) -> None:
    source = JsonLinesSource(f"{remote}/part-*", cache_dir=tmp_path)
    assert _read(source) == ROWS
    _only(tmp_path, ".json").write_text('["not", "a", "sidecar"]')
    assert _read(JsonLinesSource(f"{remote}/part-*", cache_dir=tmp_path)) == ROWS


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_a_cache_dir_that_cannot_be_a_folder_names_it(
    remote: str, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "taken"
    blocker.write_text("a file, not a folder")
    cache_dir = blocker if kind == "a file" else blocker / "cache"
    source = JsonLinesSource(f"{remote}/part-*", cache_dir=cache_dir)
    with caplog.at_level(logging.WARNING), pytest.raises(StorageError) as raised:
        _read(source)
    message = str(raised.value)
    assert f"The cache folder {cache_dir} cannot be used" in message
    assert "memory://" not in message  # the store is not blamed
    assert not [r for r in caplog.records if "retry" in r.getMessage()]  # not retried


@pytest.mark.parametrize("damaged", [".data", ".usage"])
def test_a_folder_in_place_of_a_cache_file_is_named(
    remote: str, tmp_path: Path, damaged: str
) -> None:
    url = f"{remote}/part-0.jsonl"
    assert _read(JsonLinesSource(url, cache_dir=tmp_path)) == ROWS
    sidecar = _only(tmp_path, ".json")
    sidecar.unlink()  # the entry is gone: the next read downloads
    path = sidecar.with_suffix(".data") if damaged == ".data" else tmp_path / ".usage"
    path.unlink()
    path.mkdir()
    with pytest.raises(
        StorageError, match=r"The cache folder .* cannot be used for memory://"
    ) as e:
        _read(JsonLinesSource(url, cache_dir=tmp_path))
    assert str(path) in str(e.value)
    assert "it is a folder" in str(e.value)


class _FullDisk:
    """Stands for a write that finds the disk full; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("kind", ["jsonl", "jsonl-streamed", "tokens", "table"])
def test_a_full_cache_disk_is_a_storage_error_naming_the_folder_at_once(
    remote: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A write that finds the disk full raises without a file name; it is still the
    cache's, not the store's, and no retry can mend it."""
    fs = fsspec.filesystem("memory")
    cache_dir = tmp_path / "cache"
    full_disk = _FullDisk()
    if kind.startswith("jsonl"):
        source: Any = JsonLinesSource(f"{remote}/part-*", cache_dir=cache_dir, split="files")
        if kind == "jsonl-streamed":  # read as it downloads (NOTE [ Reading a download ])
            monkeypatch.setattr(cache_module, "STREAM_MIN_BYTES", 1)
            monkeypatch.setattr(cache_module, "fetch_into", full_disk)
    elif kind == "tokens":
        fs.pipe_file(f"{remote[len('memory://') :]}/tokens.bin", bytes(64))
        source = TokenSource(f"{remote}/tokens.bin", seq_len=4, cache_dir=cache_dir)
    else:
        fs.pipe_file(f"{remote[len('memory://') :]}/a.bin", b"payload")
        table = tmp_path / "table.jsonl"
        table.write_text('{"file": "' + remote + '/a.bin"}\n')
        source = TableSource(table, files=["file"], cache_dir=cache_dir, threads=0)
    monkeypatch.setattr(cache_module, "commit", full_disk)  # the write of a whole download
    with pytest.raises(StorageError) as raised:
        _read(source)
    assert f"The cache folder {cache_dir} cannot be used for memory://" in str(raised.value)
    assert "no space left on device" in str(raised.value)
    assert full_disk.calls == 1


def test_errors_of_the_remote_file_are_not_the_caches(tmp_path: Path) -> None:
    assert in_folder(tmp_path, FileNotFoundError(errno.ENOENT, "gone", str(tmp_path / "x.data")))
    assert in_folder(tmp_path, OSError(errno.ENOSPC, "full"))
    assert not in_folder(tmp_path, FileNotFoundError(errno.ENOENT, "gone", "/bucket/x.jsonl"))
    assert not in_folder(tmp_path, FileNotFoundError(errno.ENOENT, "gone", f"{tmp_path}-other/x"))
    assert not in_folder(tmp_path, ValueError("not an OSError"))
    with pytest.raises(StorageError, match=r"Cannot read memory://.*missing\.jsonl: not found"):
        _read(JsonLinesSource(["memory:///nowhere/missing.jsonl"], cache_dir=tmp_path))


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_streamed_file_the_full_disk_cannot_keep_is_read_whole_and_a_warning_names_it(
    remote: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The disk fills only when the read download is to become an entry: the reader has
    every byte already, so it reads on; the warning is what tells the user."""
    monkeypatch.setattr(cache_module, "STREAM_MIN_BYTES", 1)  # NOTE [ Reading a download ]
    monkeypatch.setattr(cache_module, "commit", _FullDisk())
    source = JsonLinesSource(f"{remote}/part-*", cache_dir=tmp_path, split="files")
    with caplog.at_level(logging.WARNING, logger="savable_loader.storage.cache.entries"):
        assert _read(source) == ROWS
        # The download's thread warns once it tries to keep the file, which may be after
        # the reader returned: wait for it, bounded.
        deadline = time.monotonic() + 10
        while not _warnings(caplog) and time.monotonic() < deadline:
            time.sleep(0.02)
    (warning,) = _warnings(caplog)
    assert warning.startswith(f"The cache folder {tmp_path} cannot be used for memory://")
    assert warning.endswith(
        "no space left on device. The file is read from the store but not kept."
    )
    assert not list(tmp_path.glob("*.data"))


def test_an_eviction_the_folder_refuses_at_a_close_is_a_warning_naming_it(
    remote: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reader closing a file it read in full runs the eviction of a folder over its
    limit; that eviction failing must not fail the close."""
    fs = fsspec.filesystem("memory")
    root = remote[len("memory://") :]
    urls = [f"{remote}/{name}.bin" for name in ("a", "b")]
    for url in urls:
        fs.pipe_file(f"{root}/{url.rsplit('/', 1)[1]}", bytes(1000))
    cache = FileCache(tmp_path, 1500, 0)
    first, second = (cache.open(url, lambda: fs) for url in urls)  # both held: over the limit
    assert (tmp_path / ".over").exists()
    (tmp_path / ".evict.lock").unlink()
    (tmp_path / ".evict.lock").mkdir()
    with caplog.at_level(logging.WARNING, logger="savable_loader.storage.cache.evict"):
        assert first.read() == bytes(1000)
        first.close()
        second.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert warnings[0].startswith(f"The cache folder {tmp_path} cannot be used: ")
    assert warnings[0].endswith("it is a folder. The folder may stay over its limit.")
