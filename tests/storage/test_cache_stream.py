"""Reading a download as it arrives (NOTE [ Reading a download ] in
``storage/cache/download.py``): a stream's reader that downloads a large file into the cache
gets its first bytes before the last ones land, reads what a fault-free whole download
would give, sees a failed or changed download as an error it retries, and leaves a valid
entry behind even when it stops early."""

from __future__ import annotations

import io
import itertools
import os
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from s3_server import S3, S3FS_WARNINGS
from stage_harness import check_stage
from test_storage_faults import CUT, SLOW_DOWN, _NoWaits, _through

from savable_loader import StorageError, WorkerContext
from savable_loader.datasets import RetryPolicy, TarSource
from savable_loader.storage.cache.download import (
    FIRST_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    STREAM_MIN_BYTES,
    Changed,
)
from savable_loader.storage.cache.node import FileCache
from savable_loader.storage.retry import is_transient
from savable_loader.testing.proxy import FaultProxy

ONE = WorkerContext(0, 1, 0, 0, 0, None)
SIZE = STREAM_MIN_BYTES + 3 * 2**20 + 12_345  # 7 MB and change: four ranges


def _memory_file(body: bytes) -> tuple[Any, str]:
    fs = fsspec.filesystem("memory")
    url = f"memory://stream-{uuid.uuid4().hex}/file.bin"
    fs.pipe_file(url, body)
    return fs, url


class Gated:
    """A filesystem whose byte ranges after the first wait for ``gate`` (then fail with
    ``error``, or the last comes back ``short`` by some bytes or with ``extra`` ones);
    records the ranges asked and the files downloaded whole."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self.gate = threading.Event()
        self.ranges: list[tuple[int, int]] = []
        self.error: BaseException | None = None
        self.short = 0
        self.extra = b""
        self.whole: list[str] = []

    def info(self, url: str) -> dict[str, Any]:
        return self.fs.info(url)  # type: ignore[no-any-return]

    def get_file(self, url: str, path: str) -> None:
        self.whole.append(url)
        self.fs.get_file(url, path)

    def cat_file(self, url: str, start: int, end: int) -> bytes:
        self.ranges.append((start, end))
        if start > 0:
            if not self.gate.wait(10):
                raise TimeoutError("the test never opened the gate")
            if self.error is not None:
                raise self.error
        data: bytes = self.fs.cat_file(url, start=start, end=end)
        if end >= self.fs.info(url)["size"]:
            data = data[: len(data) - self.short] + self.extra
        return data


def _gated(tmp_path: Path) -> tuple[bytes, str, Gated, FileCache]:
    """A random file of SIZE bytes behind a :class:`Gated` filesystem, and a cache."""
    body = os.urandom(SIZE)
    fs, url = _memory_file(body)
    return body, url, Gated(fs), FileCache(tmp_path, 2**30, 0)


def test_the_first_bytes_are_read_before_the_download_ends(tmp_path: Path) -> None:
    body, url, gated, cache = _gated(tmp_path)
    with cache.open(url, lambda: gated, stream=True) as file:
        assert file.read(1000) == body[:1000]  # only the first range has landed
        assert gated.ranges[0] == (0, FIRST_CHUNK_BYTES)
        assert len(gated.ranges) <= 2  # the second waits at the gate
        opener = threading.Timer(0.2, gated.gate.set)
        opener.start()
        assert file.read() == body[1000:]  # waits for the rest
        opener.join()
    # Ranges doubling from 1 MiB, the last one asking one byte past the end.
    ends = [end for _, end in gated.ranges]
    assert ends == [2**20, 3 * 2**20, 7 * 2**20, SIZE + 1]
    assert max(b - a for a, b in gated.ranges) <= MAX_CHUNK_BYTES
    stats = cache.stats
    assert (stats.misses, stats.bytes_downloaded) == (1, SIZE)
    assert stats.wait_seconds >= 0.1  # the reader's wait for the gated ranges
    # A valid entry: the next open reads the local copy.
    with cache.open(url, lambda: gated, stream=True) as file:
        assert file.read() == body
    assert cache.stats.hits == 1
    cache.close()


def test_seeks_and_lines_read_the_download_as_a_local_file(tmp_path: Path) -> None:
    lines = b"".join(b"%08d\n" % i for i in range(SIZE // 9))
    fs, url = _memory_file(lines)
    gated = Gated(fs)
    gated.gate.set()
    cache = FileCache(tmp_path, 2**30, 0)
    with cache.open(url, lambda: gated, stream=True) as file:
        assert file.readline() == b"00000000\n"
        file.seek(9 * 500_000)  # past the first range
        assert file.readline() == b"00500000\n"
        assert file.seek(-9, io.SEEK_END) == len(lines) - 9
        assert file.read() == lines[-9:]
        assert file.read() == b""
        with pytest.raises(ValueError, match="negative seek"):
            file.seek(-1)
    cache.close()


@pytest.mark.parametrize("fault", ["error", "short", "long"])
def test_a_failed_or_changed_download_is_an_error_after_the_bytes_before_it(
    tmp_path: Path, fault: str
) -> None:
    body, url, gated, cache = _gated(tmp_path)
    if fault == "error":
        gated.error = ConnectionResetError("reset by the test")
    elif fault == "short":
        gated.short = 10
    else:
        gated.extra = b"x"
    gated.gate.set()
    retry = RetryPolicy(attempts=3, base_delay=0.001, max_delay=0.001)
    with cache.open(url, lambda: gated, stream=True, retry=retry) as file:
        assert file.read(FIRST_CHUNK_BYTES) == body[:FIRST_CHUNK_BYTES]
        if fault == "error":  # each range is retried by the download, not by the reader
            with pytest.raises(StorageError, match="3 attempts failed") as error:
                file.read()
            assert not is_transient(error.value)
        else:  # a changed file: the reader's retry opens it anew
            with pytest.raises(Changed) as changed:
                file.read()
            assert is_transient(changed.value)
    # Nothing half-written is left as an entry, and no temp file.
    assert not list(tmp_path.glob("*.data"))
    assert not list(tmp_path.glob(".tmp-*"))
    gated.error, gated.short, gated.extra = None, 0, b""
    with cache.open(url, lambda: gated, stream=True) as file:  # the retry's open
        assert file.read() == body
    cache.close()


def test_a_reader_that_stops_early_leaves_the_entry_to_the_download(tmp_path: Path) -> None:
    body, url, gated, cache = _gated(tmp_path)
    with cache.open(url, lambda: gated, stream=True) as file:
        assert file.read(10) == body[:10]
    gated.gate.set()
    deadline = time.monotonic() + 10
    while not list(tmp_path.glob("*.json")) and time.monotonic() < deadline:
        time.sleep(0.01)
    with cache.open(url, lambda: gated, stream=True) as file:
        assert file.read() == body
    assert (cache.stats.misses, cache.stats.hits) == (1, 1)
    cache.close()


def test_small_files_and_other_opens_download_whole_first(tmp_path: Path) -> None:
    fs, small = _memory_file(os.urandom(STREAM_MIN_BYTES - 1))
    _, large = _memory_file(os.urandom(SIZE))
    gated = Gated(fs)
    gated.gate.set()
    cache = FileCache(tmp_path, 2**30, 0)
    for url, stream in ((small, True), (large, False)):
        with cache.open(url, lambda: gated, stream=stream) as file:
            file.read()
            file.fileno()  # the entry's own file: a memory map can read it
    assert (gated.ranges, gated.whole) == ([], [small, large])  # whole, no byte ranges
    cache.close()


def _tar_bytes(shard: int, samples: int, size: int) -> bytes:
    """A tar shard of ``samples`` samples of ``size`` random bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for sample in range(samples):
            for ext, data in (("bin", os.urandom(size)), ("id", b"%d" % sample)):
                info = tarfile.TarInfo(f"{shard:02d}{sample:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _shards(count: int, samples: int, size: int) -> str:
    """Tar shards (:func:`_tar_bytes`) in memory://, each large enough to stream."""
    fs = fsspec.filesystem("memory")
    root = f"memory://shards-{uuid.uuid4().hex}"
    for shard in range(count):
        body = _tar_bytes(shard, samples, size)
        assert len(body) >= STREAM_MIN_BYTES
        fs.pipe_file(f"{root}/shard-{shard}.tar", body)
    return f"{root}/*.tar"


def test_a_tar_source_streams_its_shards_through_the_cache(tmp_path: Path) -> None:
    pattern = _shards(3, 40, 150_000)  # 6 MB shards
    plain = [s["bin"] for s in TarSource(pattern, split="files").cursor(ONE)]
    cached = TarSource(pattern, split="files", cache_dir=tmp_path, prefetch=0)
    assert [s["bin"] for s in cached.cursor(ONE)] == plain
    stats = cached.cache_stats()
    assert stats is not None
    assert (stats.misses, stats.hits) == (3, 0)
    # Every shard becomes an entry; the last one's download thread commits it (fsync,
    # renames) after the reader read its last byte.
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("*.json"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(list(tmp_path.glob("*.json"))) == 3
    cached.close_cache()


def test_a_retried_stream_through_a_failing_download_equals_a_fault_free_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pattern = _shards(2, 40, 150_000)
    plain = [s["bin"] for s in TarSource(pattern, split="files").cursor(ONE)]
    calls = {"n": 0}
    original = fsspec.implementations.memory.MemoryFileSystem.cat_file

    def flaky(self: Any, path: str, start: int | None = None, end: int | None = None) -> bytes:
        calls["n"] += 1
        if start and calls["n"] % 3 == 0:  # a range after the first, now and then
            raise ConnectionResetError("reset by the test")
        return original(self, path, start=start, end=end)  # type: ignore[no-any-return]

    monkeypatch.setattr(fsspec.implementations.memory.MemoryFileSystem, "cat_file", flaky)
    retry = RetryPolicy(attempts=20, base_delay=0.001, max_delay=0.002)
    cached = TarSource(pattern, split="files", cache_dir=tmp_path, prefetch=0, retry=retry)
    assert [s["bin"] for s in cached.cursor(ONE)] == plain
    cached.close_cache()
    # Without retries the reader's error names the shard.
    calls["n"] = 0
    fresh = TarSource(
        pattern,
        split="files",
        cache_dir=tmp_path / "other",
        prefetch=0,
        retry=RetryPolicy(attempts=1),
    )
    with pytest.raises(StorageError, match=r"shard-0\.tar"):
        list(fresh.cursor(ONE))
    fresh.close_cache()


def test_a_loader_reading_downloads_as_they_arrive_resumes_exactly(tmp_path: Path) -> None:
    pattern = _shards(3, 30, 150_000)
    caches = itertools.count()

    def build() -> TarSource:  # a cache of its own each time: every loader downloads
        folder = tmp_path / f"cache-{next(caches)}"  # removed with tmp_path, not left in /tmp
        return TarSource(pattern, shuffle_shards=True, seed=4, cache_dir=folder, prefetch=0)

    check_stage(build, num_workers=2, batch_size=4, num_points=2)


# -- from S3, under faults ------------------------------------------------------------------


@pytest.fixture
def faulty(
    s3: S3, endpoint_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[FaultProxy, dict[str, Any]]]:
    """A proxy in front of the module's S3 server and options through it, with botocore's
    and s3fs's retries off so that the faults reach the download (as test_storage_faults)."""
    import s3fs  # NOTE [ Heavy imports last ] in conftest.py

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setattr(s3fs.core, "asyncio", _NoWaits())
    with FaultProxy(endpoint_url, seed=3) as proxy:
        yield (
            proxy,
            {
                **_through(s3, proxy),
                "config_kwargs": {"retries": {"total_max_attempts": 1}},
            },
        )


@S3FS_WARNINGS
def test_shards_from_s3_stream_through_the_cache_under_faults(
    s3: S3, faulty: tuple[FaultProxy, dict[str, Any]], tmp_path: Path
) -> None:
    proxy, options = faulty
    local = tmp_path / "local"
    local.mkdir()
    for shard in range(2):
        body = _tar_bytes(shard, 35, 150_000)  # 5 MB: read as it downloads
        assert len(body) >= STREAM_MIN_BYTES
        (local / f"shard-{shard}.tar").write_bytes(body)
        s3.put(f"big/shard-{shard}.tar", body)
    plain = [s["bin"] for s in TarSource(str(local / "*.tar"), split="files").cursor(ONE)]
    proxy.slow_down, proxy.cut = SLOW_DOWN, CUT
    retry = RetryPolicy(attempts=30, base_delay=0.001, max_delay=0.002)
    source = TarSource(
        s3.url("big/*.tar"),
        split="files",
        cache_dir=tmp_path / "cache",
        prefetch=0,
        retry=retry,
        storage_options=options,
    )
    assert [s["bin"] for s in source.cursor(ONE)] == plain
    assert proxy.stats.slow_downs + proxy.stats.cuts > 0
    stats = source.cache_stats()
    assert stats is not None
    assert stats.bytes_downloaded >= sum(p.stat().st_size for p in local.glob("*.tar"))
    source.close_cache()
