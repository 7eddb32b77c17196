"""A cache folder others can write, damaged entries, and what a close leaves behind:
planted links are refused and never followed, a damaged entry is downloaded again
instead of served, released prefetches are evicted, and no partial download outlives
the process that made it (NOTE [ File cache ] in ``storage/cache/node.py``)."""

from __future__ import annotations

import gzip
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from savable_loader import SavableDataLoader, StorageError, WorkerContext
from savable_loader.datasets import JsonLinesSource
from savable_loader.storage.cache.node import FileCache

ROWS = [{"id": index} for index in range(40)]
_LINES = "".join(f'{{"id": {row["id"]}}}\n' for row in ROWS).encode()


@pytest.fixture
def remote() -> Iterator[str]:
    """A ``memory://`` folder with ``part-{0..3}.jsonl.gz``, each all of :data:`ROWS`."""
    fs = fsspec.filesystem("memory")
    root = f"/cache-hostile-{uuid.uuid4().hex[:8]}"
    for index in range(4):
        fs.pipe_file(f"{root}/part-{index}.jsonl.gz", gzip.compress(_LINES, mtime=0))
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


def _read(source: Any) -> list[Any]:
    cursor = source.cursor(WorkerContext(0, 1, 0, 0, 0, None))
    try:
        return list(cursor)
    finally:
        cursor.close()
        source.close_cache()


# Planted links.


@pytest.mark.parametrize(
    "name", [".usage", ".over", ".evict.lock", ".lock", ".download", ".json", ".data"]
)
def test_a_planted_link_is_refused_and_never_followed(
    remote: str, tmp_path: Path, name: str
) -> None:
    url = f"{remote}/part-0.jsonl.gz"
    folder, victim = tmp_path / "cache", tmp_path / "victim"
    folder.mkdir()
    victim.write_bytes(b"not the cache's")
    os.utime(victim, (1_000_000, 1_000_000))
    entry = name in (".lock", ".download", ".json", ".data")
    planted = FileCache(folder, 10**6, 0).path(url, name) if entry else folder / name
    planted.symlink_to(victim)
    with pytest.raises(StorageError) as raised:
        _read(JsonLinesSource(url, cache_dir=folder))
    message = str(raised.value)
    assert f"The cache folder {folder} cannot be used" in message
    assert f"{planted}: it is a symbolic link, which the cache never follows" in message
    assert victim.read_bytes() == b"not the cache's"
    assert victim.stat().st_mtime == 1_000_000
    assert planted.is_symlink()
    assert os.readlink(planted) == str(victim)


def test_a_planted_link_to_a_missing_file_creates_nothing(remote: str, tmp_path: Path) -> None:
    folder, victim = tmp_path / "cache", tmp_path / "elsewhere" / "new"
    folder.mkdir()
    victim.parent.mkdir()
    (folder / ".evict.lock").symlink_to(victim)
    with pytest.raises(StorageError, match="symbolic link"):
        _read(JsonLinesSource(f"{remote}/part-0.jsonl.gz", cache_dir=folder))
    assert not victim.exists()


def test_the_cache_creates_nothing_others_can_write(remote: str, tmp_path: Path) -> None:
    folder = tmp_path / "new" / "cache"
    old = os.umask(0)  # the modes are the cache's own, not the umask's
    try:
        assert len(_read(JsonLinesSource(f"{remote}/part-*", cache_dir=folder))) == 4 * len(ROWS)
    finally:
        os.umask(old)
    made = [folder, *folder.iterdir()]
    assert len(made) > 10
    writable = {p.name: oct(p.stat().st_mode) for p in made if p.stat().st_mode & 0o022}
    assert not writable


def test_eviction_neither_counts_nor_removes_a_planted_entry(remote: str, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(bytes(10**6))
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / ("0" * 40 + ".data")).symlink_to(victim)
    (folder / ".tmp-planted").symlink_to(victim)
    os.utime(folder / ".tmp-planted", (1, 1), follow_symlinks=False)
    assert len(_read(JsonLinesSource(f"{remote}/part-*", cache_dir=folder))) == 4 * len(ROWS)
    assert len(list(folder.glob("*.data"))) == 5  # nothing evicted for the link's size
    assert (folder / ".tmp-planted").is_symlink()
    assert victim.stat().st_size == 10**6


# Damaged entries.


def _flip(path: Path) -> None:
    """Flips bytes in the middle of ``path`` in place: same size, same inode."""
    with open(path, "r+b") as file:
        file.seek(path.stat().st_size // 2)
        byte = file.read(4)
        file.seek(-len(byte), os.SEEK_CUR)
        file.write(bytes(b ^ 0xFF for b in byte))


def test_a_damaged_entry_is_downloaded_again_not_blamed_on_the_store(
    remote: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"{remote}/part-0.jsonl.gz"
    assert _read(JsonLinesSource(url, cache_dir=tmp_path)) == ROWS
    (data,) = tmp_path.glob("*.data")
    _flip(data)
    again = JsonLinesSource(url, cache_dir=tmp_path)
    cursor = again.cursor(WorkerContext(0, 1, 0, 0, 0, None))
    with caplog.at_level(logging.WARNING, logger="savable_loader.storage.cache.entries"):
        assert list(cursor) == ROWS
    stats = again.cache_stats()
    assert stats is not None
    assert (stats.misses, stats.hits) == (1, 0)
    cursor.close()
    again.close_cache()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "checksum" in warning
    assert url in warning
    third = JsonLinesSource(url, cache_dir=tmp_path)  # repaired: a hit
    assert _read(third) == ROWS


def test_a_damaged_prefetched_entry_is_repaired_before_it_is_read(
    remote: str, tmp_path: Path
) -> None:
    assert len(_read(JsonLinesSource(f"{remote}/part-*", cache_dir=tmp_path))) == 4 * len(ROWS)
    for data in tmp_path.glob("*.data"):
        _flip(data)
    source = JsonLinesSource(f"{remote}/part-*", cache_dir=tmp_path, prefetch=2, split="files")
    assert _read(source) == ROWS * 4


def test_an_entry_without_a_checksum_is_downloaded_again(remote: str, tmp_path: Path) -> None:
    """A sidecar an older release wrote records no checksum: its entry is downloaded once."""
    url = f"{remote}/part-0.jsonl.gz"
    assert _read(JsonLinesSource(url, cache_dir=tmp_path)) == ROWS
    (sidecar,) = tmp_path.glob("*.json")
    sidecar.write_text(sidecar.read_text().replace('"crc32"', '"old"'))
    again = JsonLinesSource(url, cache_dir=tmp_path)
    cursor = again.cursor(WorkerContext(0, 1, 0, 0, 0, None))
    assert list(cursor) == ROWS
    assert again.file_cache().stats.misses == 1  # type: ignore[union-attr]
    cursor.close()
    again.close_cache()


# Released prefetches.


def _wait(condition: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _data_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.data"))


def test_prefetched_entries_released_by_a_close_are_evicted(remote: str, tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")
    urls = [f"{remote}/part-{index}.jsonl.gz" for index in range(4)]
    limit = fs.info(urls[0])["size"] + 1  # one file
    cache = FileCache(tmp_path, limit, 2)
    file = cache.open(urls[0], lambda: fs)
    cache.want(urls[1:3], lambda _: fs, {})
    _wait(lambda: len(cache._pinned) == 2)
    file.close()  # the reader stops early: its file goes, the two pinned stay
    assert _data_bytes(tmp_path) > limit
    cache.close()
    assert _data_bytes(tmp_path) <= limit
    assert not (tmp_path / ".over").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_stopped_early_leaves_the_folder_under_its_limit(
    remote: str, tmp_path: Path, num_workers: int
) -> None:
    """With workers their exit releases and evicts; without, the loader's close does."""
    fs = fsspec.filesystem("memory")
    limit = fs.info(f"{remote}/part-0.jsonl.gz")["size"] + 1  # one file
    source = JsonLinesSource(
        f"{remote}/part-*", cache_dir=tmp_path, cache_limit=limit, prefetch=2, split="files"
    )
    context = "fork" if num_workers else None
    with SavableDataLoader(
        source, batch_size=4, num_workers=num_workers, multiprocessing_context=context
    ) as loader:
        for _ in zip(range(2), loader, strict=False):  # a break after two batches
            pass
        # Read and prefetched: two per process.
        _wait(lambda: len(list(tmp_path.glob("*.data"))) >= 2 * max(num_workers, 1))
    assert _data_bytes(tmp_path) <= limit
    assert not list(tmp_path.glob(".tmp-*"))


# Partial downloads at a close.


class _SlowMemory(MemoryFileSystem):
    """``slowmem://``: the memory filesystem, whose prefetch threads' downloads write a
    little and then hang (a large file on a slow link)."""

    protocol = "slowmem"

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return str(super()._strip_protocol(path.replace("slowmem://", "memory://", 1)))

    def get_file(self, rpath: str, lpath: str, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name != "cache-prefetch":
            super().get_file(rpath, lpath, *args, **kwargs)
            return
        with open(lpath, "wb") as out:
            out.write(self.cat_file(rpath)[:100])
        time.sleep(60)


@pytest.mark.timeout(60)
def test_closing_a_loader_with_prefetches_in_flight_leaves_no_partial_download(
    remote: str, tmp_path: Path
) -> None:
    fsspec.register_implementation("slowmem", _SlowMemory, clobber=True)
    pattern = remote.replace("memory://", "slowmem://") + "/part-*"
    source = JsonLinesSource(pattern, cache_dir=tmp_path, prefetch=2, split="files")
    loader = SavableDataLoader(source, batch_size=4, num_workers=2, multiprocessing_context="fork")
    with loader:
        iterator = iter(loader)
        next(iterator)
        _wait(lambda: len(list(tmp_path.glob(".tmp-*"))) == 2)  # one per worker here
        started = time.monotonic()
    assert time.monotonic() - started < 5
    assert not list(tmp_path.glob(".tmp-*"))
    assert len(list(tmp_path.glob("*.data"))) == 2  # the files read stay
