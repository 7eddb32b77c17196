"""TokenSource through the node's file cache: memory-mapped cached files, the same windows
with or without it, O(files) requests per shuffled epoch, retries, and the storage figures
of ``worker_stats()`` (NOTE [ Lazy file access ], NOTE [ Prefetching token files ])."""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from s3_server import S3, S3FS_WARNINGS
from stage_harness import check_stage

from savable_loader import ConfigError, SavableDataLoader, StorageError, WorkerContext
from savable_loader.datasets import RetryPolicy
from savable_loader.datasets.files.jsonl import JsonLinesSource
from savable_loader.datasets.files.tokens import TokenSource
from savable_loader.storage import retry
from savable_loader.storage.cache.node import FileCache

pytestmark = [S3FS_WARNINGS]

SEQ = 8
SIZES = [203, 160, 97]  # tokens: 25, 20 and 12 windows; the last file is a .npy


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 2**16, size, dtype=np.uint16) for size in SIZES]


def _encoded(i: int, tokens: np.ndarray) -> tuple[str, bytes]:
    if i < len(SIZES) - 1:
        return f"part-{i}.bin", tokens.tobytes()
    buffer = io.BytesIO()
    np.save(buffer, tokens)
    return f"part-{i}.npy", buffer.getvalue()


def _local(tmp_path: Path) -> str:
    folder = tmp_path / "local"
    folder.mkdir()
    for i, tokens in enumerate(_arrays()):
        name, data = _encoded(i, tokens)
        (folder / name).write_bytes(data)
    return f"{folder}/part-*"


def _upload(s3: S3) -> str:
    for i, tokens in enumerate(_arrays()):
        s3.put("tokens/" + _encoded(i, tokens)[0], _encoded(i, tokens)[1])
    return s3.url("tokens/part-*")


@pytest.fixture
def memory() -> Iterator[str]:
    """The token files in a fresh ``memory://`` folder; yields their glob."""
    fs = fsspec.filesystem("memory")
    root = f"/token-cache-{uuid.uuid4().hex[:8]}"
    for i, tokens in enumerate(_arrays()):
        name, data = _encoded(i, tokens)
        fs.pipe_file(f"{root}/{name}", data)
    yield f"memory://{root}/part-*"
    fs.rm(root, recursive=True)


def _context() -> WorkerContext:
    return WorkerContext(0, 1, 0, 0, 0, None)


def _epochs(source: TokenSource, epochs: int = 2) -> list[list[int]]:
    cursor = source.cursor(_context())
    windows = [window.tolist() for _ in range(epochs) for window in cursor]
    cursor.close()
    return windows


def _batches(source: TokenSource, num_workers: int) -> list[list[list[int]]]:
    """Two epochs' batches. Workers persist across them: each starts its S3 clients once
    (a new loader still starts new workers, which read the node's cache anew)."""
    with SavableDataLoader(
        source, batch_size=2, num_workers=num_workers, persistent_workers=num_workers > 0
    ) as loader:
        return [batch.tolist() for _ in range(2) for batch in loader]


class _Counting:
    """Counts the S3 calls s3fs makes in this process while in use (``_call_s3`` is its
    one funnel to botocore)."""

    def __init__(self) -> None:
        import s3fs  # NOTE [ Heavy imports last ] in conftest.py

        self.calls: list[str] = []
        self._s3fs = s3fs
        self._real = s3fs.S3FileSystem._call_s3

    def __enter__(self) -> _Counting:
        real, calls = self._real, self.calls

        async def counted(fs: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(str(method))
            return await real(fs, method, *args, **kwargs)

        self._s3fs.S3FileSystem._call_s3 = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self._s3fs.S3FileSystem._call_s3 = self._real  # type: ignore[method-assign]


# Exactness.


@pytest.mark.parametrize("num_workers", [0, 2])
def test_s3_cached_uncached_and_local_windows_are_equal(
    s3: S3, tmp_path: Path, num_workers: int
) -> None:
    pattern, options = _upload(s3), s3.options()

    def build(urls: str, **kwargs: Any) -> TokenSource:
        return TokenSource(urls, seq_len=SEQ, shuffle=True, seed=3, **kwargs)

    local = _batches(build(_local(tmp_path)), num_workers)
    assert sum(len(batch) for batch in local) == 2 * sum(size // SEQ for size in SIZES)
    assert _batches(build(pattern, storage_options=options), num_workers) == local
    cached = build(pattern, storage_options=options, cache_dir=tmp_path / "cache", prefetch=2)
    assert _batches(cached, num_workers) == local
    assert len(list((tmp_path / "cache").glob("*.data"))) == len(SIZES)


def test_s3_resumes_exactly_through_the_cache(s3: S3, tmp_path: Path) -> None:
    pattern, options = _upload(s3), s3.options()
    # One recipe for every loader of the check: a stage is a recipe no iteration changes,
    # and building it lists and sizes the files (a fifth of a second against moto), which
    # test_s3_cached_uncached_and_local_windows_are_equal does for each source it builds.
    recipe = TokenSource(
        pattern, seq_len=SEQ, shuffle=True, storage_options=options, cache_dir=tmp_path
    )
    check_stage(lambda: recipe, num_workers=0)


def test_workers_resume_exactly_through_the_cache(memory: str, tmp_path: Path) -> None:
    check_stage(
        lambda: TokenSource(memory, seq_len=SEQ, shuffle=True, cache_dir=tmp_path, prefetch=1),
        num_workers=2,
        dense=False,
        num_points=3,
    )


def test_the_cache_is_not_part_of_the_config(memory: str, tmp_path: Path) -> None:
    plain = TokenSource(memory, seq_len=SEQ)
    cached = TokenSource(
        memory, seq_len=SEQ, cache_dir=tmp_path, cache_limit=2**20, prefetch=4, retry=None
    )
    assert cached.config() == plain.config()
    assert str(cached) == str(plain)


def test_a_file_the_cache_cannot_map_is_read_by_range(memory: str, tmp_path: Path) -> None:
    plain = _epochs(TokenSource(memory, seq_len=SEQ, shuffle=True))
    over = TokenSource(memory, seq_len=SEQ, shuffle=True, cache_dir=tmp_path, cache_limit=100)
    assert _epochs(over) == plain
    stats = over.cache_stats()
    # Every file over the limit: an open that caches nothing, then one range request of
    # SEQ uint16 tokens per window read (NOTE [ Direct reads ] in counted_reads.py).
    assert stats.misses == len(SIZES) + len(plain)
    assert stats.bytes_downloaded == len(plain) * SEQ * 2
    over.close_cache()


# Reuse.


def test_a_restart_downloads_nothing(s3: S3, tmp_path: Path) -> None:
    pattern, options = _upload(s3), s3.options()
    first = TokenSource(
        pattern, seq_len=SEQ, shuffle=True, storage_options=options, cache_dir=tmp_path
    )
    windows = _epochs(first)
    stats = first.cache_stats()
    assert (stats.misses + stats.hits, stats.misses + stats.prefetched) == (3, 3)  # prefetch=2
    assert stats.bytes_downloaded == sum(len(_encoded(i, a)[1]) for i, a in enumerate(_arrays()))
    first.close_cache()
    again = TokenSource(
        pattern, seq_len=SEQ, shuffle=True, storage_options=options, cache_dir=tmp_path
    )
    assert _epochs(again) == windows
    stats = again.cache_stats()
    assert (stats.bytes_downloaded, stats.misses, stats.hits) == (0, 0, len(SIZES))
    again.close_cache()


def test_mapped_files_are_held_until_closed(memory: str, tmp_path: Path) -> None:
    limit = 450  # bytes: one file, not three
    source = TokenSource(memory, seq_len=SEQ, cache_dir=tmp_path, cache_limit=limit, prefetch=0)
    cursor = source.cursor(_context())
    assert len(list(cursor)) == sum(size // SEQ for size in SIZES)
    assert len(list(tmp_path.glob("*.data"))) == len(SIZES)
    FileCache(tmp_path, limit, 0).evict()
    assert len(list(tmp_path.glob("*.data"))) == len(SIZES), "a mapped file was evicted"
    cursor.close()
    FileCache(tmp_path, limit, 0).evict()
    assert sum(path.stat().st_size for path in tmp_path.glob("*.data")) <= limit
    source.close_cache()


# Requests.


def test_s3_a_shuffled_epoch_makes_requests_per_file_not_per_window(s3: S3, tmp_path: Path) -> None:
    pattern, options = _upload(s3), s3.options()
    windows = sum(size // SEQ for size in SIZES)
    counted = {}
    for name, cache in [("uncached", None), ("cached", tmp_path)]:
        source = TokenSource(
            pattern, seq_len=SEQ, shuffle=True, storage_options=options, cache_dir=cache
        )
        with _Counting() as counter:
            assert len(_epochs(source, epochs=1)) == windows
        counted[name] = len(counter.calls)
        source.close_cache()
    assert counted["uncached"] >= windows
    # A GET and an info() per file, and a second info() when the stream opens a file
    # that a prefetch thread is still downloading.
    assert counted["cached"] <= 3 * len(SIZES)


# Retries.


class _Flaky:
    """A filesystem that fails chosen calls of ``cat_file``, ``get_file`` and ``info``
    (numbered from 1 over the process) with a connection reset, then does them."""

    def __init__(self, fs: Any, fail: dict[str, set[int]]) -> None:
        self.fs, self.fail = fs, fail
        self.calls = dict.fromkeys(fail, 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)

    def _hit(self, name: str) -> None:
        self.calls[name] += 1
        if self.calls[name] in self.fail[name]:
            raise ConnectionResetError(104, "Connection reset by peer")

    def info(self, url: str) -> Any:
        self._hit("info")
        return self.fs.info(url)

    def get_file(self, url: str, local: str) -> None:
        self._hit("get_file")
        with open(local, "wb") as out:
            out.write(self.fs.cat_file(url)[:10])  # a partial download, then the reset
        self._hit("after")
        Path(local).write_bytes(self.fs.cat_file(url))

    def cat_file(self, url: str, start: int | None = None, end: int | None = None) -> bytes:
        self._hit("cat_file")
        return self.fs.cat_file(url, start=start, end=end)  # type: ignore[no-any-return]


@pytest.mark.parametrize("cached", [False, True])
def test_transient_faults_are_retried_and_give_the_same_stream(
    memory: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cached: bool
) -> None:
    waits: list[float] = []
    monkeypatch.setattr(retry, "sleep", waits.append)
    plain = _epochs(TokenSource(memory, seq_len=SEQ, shuffle=True))
    source = TokenSource(
        memory, seq_len=SEQ, shuffle=True, cache_dir=tmp_path if cached else None, prefetch=0
    )
    fs = source.filesystem(memory)
    fail = {"info": {2}, "get_file": {1}, "after": {3}, "cat_file": {1, 2, 5, 30}}
    flaky = _Flaky(fs, fail)
    monkeypatch.setattr(source, "filesystem", lambda url: flaky)
    assert _epochs(source) == plain
    assert len(waits) == (3 if cached else 4)
    source.close_cache()


def test_exhausted_retries_raise_a_storage_error(
    memory: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(retry, "sleep", lambda _: None)
    source = TokenSource(memory, seq_len=SEQ, retry=RetryPolicy(attempts=2))
    flaky = _Flaky(source.filesystem(memory), {"cat_file": set(range(1, 100))})
    monkeypatch.setattr(source, "filesystem", lambda url: flaky)
    with pytest.raises(StorageError, match="2 attempts failed"):
        _epochs(source, epochs=1)


# Arguments.


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cache_dir": 3}, "cache_dir"),
        ({"cache_limit": 10}, "needs a cache_dir"),
        ({"cache_dir": "x", "cache_limit": 0}, "positive"),
        ({"prefetch": -1}, "prefetch"),
        ({"retry": 3}, "RetryPolicy"),
        ({"storage_options": "anon"}, "storage_options"),
    ],
)
def test_bad_access_arguments_are_refused(memory: str, kwargs: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TokenSource(memory, seq_len=SEQ, **kwargs)


def test_storage_options_list_and_size_the_files(s3: S3) -> None:
    pattern = _upload(s3)
    source = TokenSource(pattern, seq_len=SEQ, storage_options=s3.options())
    assert source.config()["sizes"] == SIZES


# The storage figures of worker_stats().


def _lines(file: int, count: int) -> bytes:
    return "".join(json.dumps({"id": file * 100 + i}) + "\n" for i in range(count)).encode()


def _storage(loader: SavableDataLoader) -> list[Any]:
    it = iter(loader)
    for _ in range(3):
        next(it)
    return [stats["storage"] for stats in loader.worker_stats()]


def test_worker_stats_show_each_worker_s_cache(s3: S3, tmp_path: Path) -> None:
    sizes = [len(_lines(file, 40)) for file in range(4)]
    for file in range(4):
        s3.put(f"jsonl/part-{file}.jsonl", _lines(file, 40))
    pattern = s3.url("jsonl/*.jsonl")
    cached = JsonLinesSource(
        pattern, storage_options=s3.options(), cache_dir=tmp_path, split="files", prefetch=0
    )
    with SavableDataLoader(cached, batch_size=2, num_workers=2) as loader:
        storage = _storage(loader)
    assert all(entry is not None for entry in storage)
    assert [entry["misses"] for entry in storage] == [1, 1]  # each worker its first file
    assert [entry["bytes_downloaded"] for entry in storage] == sizes[:2]
    assert all(entry["wait_seconds"] > 0 for entry in storage)
    plain = JsonLinesSource(pattern, storage_options=s3.options(), split="files")
    with SavableDataLoader(plain, batch_size=2, num_workers=2) as loader:  # read directly
        assert [entry["misses"] for entry in _storage(loader)] == [1, 1]


def test_worker_stats_without_workers_sum_the_token_caches(memory: str, tmp_path: Path) -> None:
    source = TokenSource(memory, seq_len=SEQ, cache_dir=tmp_path, prefetch=0)
    with SavableDataLoader(source, batch_size=2) as loader:
        list(loader)
        (storage,) = [stats["storage"] for stats in loader.worker_stats()]
    assert (storage["misses"], storage["hits"]) == (len(SIZES), 0)
