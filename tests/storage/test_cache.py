"""The node-local file cache of the file sources: exactness, reuse, eviction, prefetch."""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import pickle
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from s3_server import S3, S3FS_WARNINGS
from sample_files import tar_shard
from stage_harness import check_stage

from savable_loader import ConfigError, SavableDataLoader, StorageError, WorkerContext
from savable_loader.datasets import RetryPolicy
from savable_loader.datasets.files.jsonl import JsonLinesSource
from savable_loader.datasets.files.tar import TarSource
from savable_loader.storage.cache import evict as cache_evict
from savable_loader.storage.cache.node import FileCache, signature_of

pytestmark = [S3FS_WARNINGS]

LENGTHS = [5, 2, 7, 1, 4, 3]


def _context(rank: int = 0, world_size: int = 1, worker_id: int = 0, num_workers: int = 0):
    return WorkerContext(rank, world_size, worker_id, num_workers, 0, None)


def _lines(file: int, count: int) -> bytes:
    rows = [json.dumps({"id": file * 100 + i}) for i in range(count)]
    return "\n".join(rows).encode() + b"\n"


@pytest.fixture
def memory() -> Iterator[str]:
    """A fresh ``memory://`` folder with JSON lines (every other one gzip) and tar shards."""
    fs = fsspec.filesystem("memory")
    root = f"/cache-test-{uuid.uuid4().hex[:8]}"
    for file, count in enumerate(LENGTHS):
        suffix = ".jsonl.gz" if file % 2 else ".jsonl"
        data = _lines(file, count)
        fs.pipe_file(f"{root}/part-{file}{suffix}", gzip.compress(data) if file % 2 else data)
        fs.pipe_file(f"{root}/data-{file:03d}.tar", tar_shard(file, count))
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


def _build(kind: str, root: str, **kwargs: Any) -> Any:
    if kind == "jsonl":
        return JsonLinesSource(f"{root}/part-*", shuffle_shards=True, **kwargs)
    return TarSource(f"{root}/data-*", shuffle_shards=True, **kwargs).map(_decode)


def _decode(sample: dict[str, Any]) -> str:
    return str(sample["__key__"])


def _source(stage: Any) -> Any:
    return stage if isinstance(stage, JsonLinesSource | TarSource) else stage.children[0]


def _streams(stage: Any, epochs: int = 2) -> list[list[Any]]:
    """Every stream's items over ``epochs`` with 2 ranks x 2 workers."""
    out = []
    for rank in range(2):
        for worker in range(2):
            cursor = stage.cursor(_context(rank, 2, worker, 2))
            out.append([item for _ in range(epochs) for item in cursor])
            cursor.close()
    return out


# Exactness.


@pytest.mark.parametrize("kind", ["jsonl", "tar"])
@pytest.mark.parametrize("split", ["samples", "files"])
def test_the_stream_is_the_same_with_and_without_the_cache(
    memory: str, tmp_path: Path, kind: str, split: str
) -> None:
    plain = _streams(_build(kind, memory, split=split))
    cached = _build(kind, memory, split=split, cache_dir=tmp_path, prefetch=2)
    assert _streams(cached) == plain
    stats = _source(cached).cache_stats()
    assert stats.misses + stats.hits > 0
    assert stats.bytes_downloaded > 0
    _source(cached).close_cache()


@pytest.mark.parametrize("kind", ["jsonl", "tar"])
@pytest.mark.parametrize("split", ["samples", "files"])
def test_resumes_exactly_through_the_cache(
    memory: str, tmp_path: Path, kind: str, split: str
) -> None:
    check_stage(
        lambda: _build(kind, memory, split=split, cache_dir=tmp_path, cache_limit=10**6),
        num_workers=0,
        batch_size=None if kind == "tar" else 2,
    )
    assert list(tmp_path.glob("*.data"))


def test_workers_resume_exactly_through_the_cache(memory: str, tmp_path: Path) -> None:
    check_stage(
        lambda: JsonLinesSource(f"{memory}/part-*", cache_dir=tmp_path, prefetch=1),
        num_workers=2,
        num_points=3,
    )
    assert len(list(tmp_path.glob("*.data"))) == len(LENGTHS)


def test_s3_resumes_exactly_through_the_cache(s3: S3, tmp_path: Path) -> None:
    for file, count in enumerate(LENGTHS):
        s3.put(f"data/part-{file}.jsonl.gz", gzip.compress(_lines(file, count)))
    s3.use_environment()
    pattern = s3.url("data/*.jsonl.gz")
    check_stage(
        lambda: JsonLinesSource(pattern, shuffle_shards=True, cache_dir=tmp_path),
        num_workers=0,
        num_points=3,
    )
    assert len(list(tmp_path.glob("*.data"))) == len(LENGTHS)


# Reuse and invalidation.


def test_a_second_source_reuses_the_cache(memory: str, tmp_path: Path) -> None:
    first = JsonLinesSource(f"{memory}/part-*", cache_dir=tmp_path, prefetch=0)
    ids = [item["id"] for item in first.cursor(_context())]
    assert first.cache_stats().misses == len(LENGTHS)
    second = pickle.loads(pickle.dumps(JsonLinesSource(f"{memory}/part-*", cache_dir=tmp_path)))
    assert [item["id"] for item in second.cursor(_context())] == ids
    stats = second.cache_stats()
    assert (stats.bytes_downloaded, stats.misses, stats.hits) == (0, 0, len(LENGTHS))


def test_a_second_loader_with_workers_downloads_nothing(memory: str, tmp_path: Path) -> None:
    def loader() -> SavableDataLoader:
        source = JsonLinesSource(f"{memory}/part-*", cache_dir=tmp_path)
        return SavableDataLoader(source, batch_size=2, num_workers=2)

    with loader() as first:
        batches = [batch["id"].tolist() for batch in first]
    entries = {path: path.stat().st_ino for path in tmp_path.glob("*.data")}
    assert len(entries) == len(LENGTHS)
    with loader() as second:
        assert [batch["id"].tolist() for batch in second] == batches
    assert {path: path.stat().st_ino for path in tmp_path.glob("*.data")} == entries


def test_s3_a_new_etag_is_downloaded_again(s3: S3, tmp_path: Path) -> None:
    url = s3.put("data/a.jsonl", _lines(0, 3))
    source = JsonLinesSource(url, storage_options=s3.options(), cache_dir=tmp_path)
    assert [item["id"] for item in source.cursor(_context())] == [0, 1, 2]
    s3.put("data/a.jsonl", _lines(0, 3).replace(b'"id": 0', b'"id": 7'))  # same size
    again = JsonLinesSource(url, storage_options=s3.options(), cache_dir=tmp_path)
    assert [item["id"] for item in again.cursor(_context())] == [7, 1, 2]
    assert (again.cache_stats().misses, again.cache_stats().hits) == (1, 0)
    third = JsonLinesSource(url, storage_options=s3.options(), cache_dir=tmp_path)
    assert [item["id"] for item in third.cursor(_context())] == [7, 1, 2]
    assert (third.cache_stats().misses, third.cache_stats().hits) == (0, 1)


def test_a_source_in_use_pickles_without_its_threads_and_locks(memory: str, tmp_path: Path) -> None:
    source = JsonLinesSource(f"{memory}/part-*", cache_dir=tmp_path, prefetch=2)
    cursor = source.cursor(_context())
    first = [next(cursor)["id"] for _ in range(3)]
    copy = pickle.loads(pickle.dumps(source))  # as spawn sends it to a worker
    assert copy.cache_stats() is None
    again = copy.cursor(_context())
    assert [next(again)["id"] for _ in range(3)] == first
    assert copy.cache_stats().hits == 1
    cursor.close()
    again.close()
    source.close_cache()
    copy.close_cache()


def test_a_changed_remote_file_is_downloaded_again(memory: str, tmp_path: Path) -> None:
    source = JsonLinesSource(f"{memory}/part-*", cache_dir=tmp_path, prefetch=0)
    assert len(list(source.cursor(_context()))) == sum(LENGTHS)
    fsspec.filesystem("memory").pipe_file(f"{memory}/part-0.jsonl", _lines(0, 2))
    again = JsonLinesSource(f"{memory}/part-*", cache_dir=tmp_path, prefetch=0)
    ids = [item["id"] for item in again.cursor(_context())]
    assert ids[:3] == [0, 1, 100]
    stats = again.cache_stats()
    assert (stats.misses, stats.hits) == (1, len(LENGTHS) - 1)
    assert stats.bytes_downloaded == len(_lines(0, 2))


def test_local_paths_are_not_cached(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_bytes(_lines(0, 3))
    cache = tmp_path / "cache"
    source = JsonLinesSource(str(tmp_path / "a.jsonl"), cache_dir=cache)
    assert len(list(source.cursor(_context()))) == 3
    assert source.cache_stats() is None or source.cache_stats().misses == 0
    assert not list(cache.glob("*.data"))


# Eviction and atomic writes.


def _urls(root: str) -> list[str]:
    return [f"{root}/data-{file:03d}.tar" for file in range(len(LENGTHS))]


def test_eviction_keeps_the_folder_under_the_limit_and_spares_held_files(
    memory: str, tmp_path: Path
) -> None:
    fs = fsspec.filesystem("memory")
    urls = _urls(memory)
    sizes = [fs.info(url)["size"] for url in urls]
    limit = max(sizes) + 1  # one file
    one, two = FileCache(tmp_path, limit, 0), FileCache(tmp_path, limit, 0)
    held = one.open(urls[0], lambda: fs)
    for url in urls[1:]:
        with two.open(url, lambda: fs) as file:
            assert file.read() == fs.cat_file(url)
        assert one.path(urls[0], ".data").exists(), "a held file was evicted"
    assert held.read() == fs.cat_file(urls[0])
    held.close()
    total = sum(path.stat().st_size for path in tmp_path.glob("*.data"))
    assert total <= limit
    with two.open(urls[1], lambda: fs):
        pass
    assert not one.path(urls[0], ".data").exists()  # the least recently used went
    assert sum(path.stat().st_size for path in tmp_path.glob("*.data")) <= limit


def _signal_and_sleep(ready: Any) -> None:
    ready.set()  # the fork hooks have run
    time.sleep(30)


def test_a_forked_child_keeps_no_entry_its_parent_held(memory: str, tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")
    url = _urls(memory)[0]
    cache = FileCache(tmp_path, 10**6, 0)
    file = cache.open(url, lambda: fs)
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    child = context.Process(target=_signal_and_sleep, args=(ready,))
    child.start()
    try:
        assert ready.wait(10)
        FileCache(tmp_path, 1, 0).evict()
        assert cache.path(url, ".data").exists()  # the parent still reads it
        file.close()
        FileCache(tmp_path, 1, 0).evict()
        assert not cache.path(url, ".data").exists()  # the child held no copy of the lock
    finally:
        child.kill()
        child.join()


def test_a_file_over_the_limit_is_streamed_uncached(memory: str, tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")
    url = _urls(memory)[2]
    cache = FileCache(tmp_path, 100, 0)
    with cache.open(url, lambda: fs) as file:
        assert file.read() == fs.cat_file(url)
    assert (cache.stats.misses, cache.stats.bytes_downloaded) == (1, 0)
    assert not list(tmp_path.glob("*.data"))


class _Breaking:
    """A filesystem whose downloads fail after the first chunk."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def info(self, url: str) -> dict[str, Any]:
        return self.fs.info(url)  # type: ignore[no-any-return]

    def get_file(self, url: str, local: str) -> None:
        with open(local, "wb") as out:
            out.write(self.fs.cat_file(url)[:100])
        raise ConnectionError("connection reset mid-download")


def test_a_hit_of_a_listed_file_asks_for_no_filesystem(memory: str, tmp_path: Path) -> None:
    """A restart on a warm node: the listing's signature matches the entry, so the open
    builds no filesystem (in a forked worker, an S3 client: tens of ms before its first
    batch) and asks the store nothing."""
    fs = fsspec.filesystem("memory")
    url = _urls(memory)[1]
    with FileCache(tmp_path, 10**6, 0).open(url, lambda: fs) as file:
        expected = file.read()
    asked = []

    def fs_for() -> Any:
        asked.append(url)
        return fs

    known = signature_of(fs.info(url))
    with FileCache(tmp_path, 10**6, 0).open(url, fs_for, known=known) as file:
        assert file.read() == expected
    assert asked == []
    with FileCache(tmp_path, 10**6, 0).open(url, fs_for) as file:  # not listed: asks
        assert file.read() == expected
    assert asked == [url]


def test_a_failed_download_leaves_no_entry(memory: str, tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")
    url = _urls(memory)[2]
    cache = FileCache(tmp_path, 10**6, 0)
    with pytest.raises(ConnectionError):
        cache.open(url, lambda: _Breaking(fs))
    left = {path.name for path in tmp_path.iterdir()}
    assert not [name for name in left if name.endswith((".data", ".json"))]
    assert not [name for name in left if name.startswith(".tmp-")]
    with cache.open(url, lambda: fs) as file:
        assert file.read() == fs.cat_file(url)


class _Stalling(_Breaking):
    """A filesystem whose downloads write part of the file, then hang."""

    def get_file(self, url: str, local: str) -> None:
        with open(local, "wb") as out:
            out.write(self.fs.cat_file(url)[:100])
        Path(local + ".started").touch()
        time.sleep(60)


def _stall(directory: Path, url: str) -> None:
    stalling = _Stalling(fsspec.filesystem("memory"))
    FileCache(directory, 10**6, 0).open(url, lambda: stalling)


def test_a_download_killed_midway_leaves_no_entry(memory: str, tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")
    url = _urls(memory)[2]
    child = multiprocessing.get_context("fork").Process(target=_stall, args=(tmp_path, url))
    child.start()
    _wait(lambda: bool(list(tmp_path.glob("*.started"))))
    os.kill(child.pid or 0, signal.SIGKILL)
    child.join()
    left = {path.name for path in tmp_path.iterdir()}
    assert not [name for name in left if name.endswith((".data", ".json"))]
    cache = FileCache(tmp_path, 10**6, 0)  # the dead process's locks are gone with it
    with cache.open(url, lambda: fs) as file:
        assert file.read() == fs.cat_file(url)
    assert cache.stats.misses == 1


class _Slow(_Breaking):
    """A filesystem whose downloads take a while and are logged to a file."""

    def __init__(self, fs: Any, log: Path) -> None:
        super().__init__(fs)
        self.log = log

    def get_file(self, url: str, local: str) -> None:
        with open(self.log, "a") as log:
            log.write(f"{os.getpid()}\n")
        time.sleep(0.3)
        Path(local).write_bytes(self.fs.cat_file(url))


def _read_slowly(directory: Path, url: str, log: Path, out: Path) -> None:
    slow = _Slow(fsspec.filesystem("memory"), log)
    with FileCache(directory, 10**6, 0).open(url, lambda: slow) as f:
        out.write_bytes(f.read())


def test_processes_opening_one_file_at_once_download_it_once(memory: str, tmp_path: Path) -> None:
    url, cache, log = _urls(memory)[2], tmp_path / "cache", tmp_path / "downloads.log"
    context = multiprocessing.get_context("fork")
    outs = [tmp_path / f"out-{i}" for i in range(3)]
    children = [context.Process(target=_read_slowly, args=(cache, url, log, out)) for out in outs]
    for child in children:
        child.start()
    for child in children:
        child.join(30)
    assert [child.exitcode for child in children] == [0, 0, 0]
    assert len(log.read_text().split()) == 1
    data = fsspec.filesystem("memory").cat_file(url)
    assert [out.read_bytes() == data for out in outs] == [True, True, True]


def test_a_failed_download_is_retried_by_the_reader(
    memory: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = JsonLinesSource(f"{memory}/part-*", cache_dir=tmp_path, prefetch=0)
    real = source.filesystem(source.urls[0])
    calls: list[str] = []

    class BreaksOnce(_Breaking):
        """The first download breaks, the others do not."""

        def get_file(self, url: str, local: str) -> None:
            calls.append(url)
            if len(calls) == 1:
                super().get_file(url, local)
            else:
                self.fs.get_file(url, local)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.fs, name)

    monkeypatch.setattr(source, "filesystem", lambda url: BreaksOnce(real))
    source.retry = RetryPolicy(attempts=3, base_delay=0.0)
    assert len(list(source.cursor(_context()))) == sum(LENGTHS)
    assert len(calls) > 1  # the first broke, and was retried
    source.retry = RetryPolicy(attempts=1)
    calls.clear()
    for path in tmp_path.glob("*.json"):
        path.unlink()
    with pytest.raises(StorageError, match="mid-download"):
        list(source.cursor(_context()))


# Prefetching.


def _wait(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("split", ["samples", "files"])
def test_prefetch_downloads_the_next_files_before_they_are_opened(
    memory: str, tmp_path: Path, split: str
) -> None:
    source = JsonLinesSource(f"{memory}/part-*", cache_dir=tmp_path, prefetch=2, split=split)
    context = _context(0, 1, 0, 2) if split == "files" else _context()
    cursor = source.cursor(context)
    next(cursor)
    cache = source.file_cache()
    ahead = cursor.upcoming()
    assert len(ahead) == 2
    _wait(lambda: cache.stats.prefetched == 2)
    assert all(cache.path(url, ".data").exists() for url in ahead)
    assert (cache.stats.misses, cache.stats.hits) == (1, 0)
    mine = sum(LENGTHS[::2]) if split == "files" else sum(LENGTHS)
    assert len(list(cursor)) == mine - 1
    assert cache.stats.hits >= 2
    source.close_cache()
    assert not cache._threads


def test_prefetched_files_never_opened_are_let_go(memory: str, tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")
    urls = _urls(memory)
    cache = FileCache(tmp_path, 10**6, 1)
    for count, url in enumerate(urls[:3], 1):
        cache.want([url], lambda _: fs, {})
        _wait(lambda count=count: cache.stats.prefetched == count)
        _wait(lambda url=url: list(cache._pinned) == [url])
    other = FileCache(tmp_path, 1, 0)
    other.evict()  # every entry but the one still pinned goes
    assert [cache.path(url, ".data").exists() for url in urls[:3]] == [False, False, True]
    cache.close()
    other.evict()
    assert not list(tmp_path.glob("*.data"))


# Arguments.


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cache_dir": 3}, "cache_dir"),
        ({"cache_limit": 10}, "needs a cache_dir"),
        ({"cache_dir": "x", "cache_limit": 0}, "positive"),
        ({"cache_dir": "x", "cache_limit": 1.5}, "int"),
        ({"prefetch": -1}, "prefetch"),
        ({"prefetch": True}, "prefetch"),
    ],
)
def test_bad_cache_arguments_are_refused(memory: str, kwargs: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        JsonLinesSource(f"{memory}/part-*", **kwargs)


def test_the_cache_is_not_part_of_the_config(memory: str, tmp_path: Path) -> None:
    plain = TarSource(f"{memory}/data-*")
    cached = TarSource(f"{memory}/data-*", cache_dir=tmp_path, cache_limit=2**20, prefetch=4)
    assert cached.config() == plain.config()
    assert cached.cache_limit == 2**20
    assert JsonLinesSource(f"{memory}/part-*", cache_dir=tmp_path).cache_limit == 10 * 2**30


def _data_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.glob("*.data"))


def test_downloads_under_the_limit_scan_the_folder_once_and_the_limit_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``.usage`` record (NOTE [ File cache ]): downloads that keep the folder under
    the limit do not scan it; past the limit every download evicts, and after each
    closed read the entries take at most the limit."""
    fs = fsspec.filesystem("memory")
    root = f"memory://usage-{uuid.uuid4().hex}"
    urls = [f"{root}/f{i:02d}.bin" for i in range(30)]
    for url in urls:
        fs.pipe_file(url, bytes(1000))
    scans: list[int] = []
    original = cache_evict.evict_locked

    def counted(directory: Path, limit: int) -> None:
        scans.append(1)
        original(directory, limit)

    monkeypatch.setattr(cache_evict, "evict_locked", counted)
    cache = FileCache(tmp_path, 10_000, 0)
    for index, url in enumerate(urls):
        with cache.open(url, lambda: fs) as file:
            assert file.read() == bytes(1000)
        assert _data_bytes(tmp_path) <= 10_000
        if index == 9:
            assert len(scans) == 1, "ten downloads fill the limit: only the first scanned"
    assert len(scans) == 1 + 20  # every download past the limit evicts
    assert int((tmp_path / ".usage").read_text()) == _data_bytes(tmp_path) == 10_000


def test_a_damaged_usage_record_is_rebuilt_by_a_scan(tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")
    root = f"memory://usage-{uuid.uuid4().hex}"
    cache = FileCache(tmp_path, 10_000, 0)
    for index in range(3):
        fs.pipe_file(f"{root}/f{index}.bin", bytes(1000))
    with cache.open(f"{root}/f0.bin", lambda: fs):
        pass
    (tmp_path / ".usage").write_text("not a number")
    with cache.open(f"{root}/f1.bin", lambda: fs):
        pass
    assert int((tmp_path / ".usage").read_text()) == 2000
    (tmp_path / ".usage").write_text("0")  # an understated record is corrected in an hour
    old = time.time() - 7200
    os.utime(tmp_path / ".usage", (old, old))
    with cache.open(f"{root}/f2.bin", lambda: fs):
        pass
    assert int((tmp_path / ".usage").read_text()) == 3000
