"""A download into the cache takes the file's signature from its first ranged GET, not a
HEAD before it (NOTE [ Probing a download ] in ``savable_loader/storage/cache/probe.py``).

Against moto's S3 server on loopback, through a ``FaultProxy`` that records every
request's method, so each test states the requests an open costs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from s3_server import REGION, S3, S3FS_WARNINGS, RecordingProxy

from savable_loader.datasets import RetryPolicy
from savable_loader.storage.cache import node as cache_module
from savable_loader.storage.cache.download import STREAM_MIN_BYTES, Changed
from savable_loader.storage.cache.entries import is_valid
from savable_loader.storage.cache.node import FileCache, signature_of
from savable_loader.storage.cache.probe import PROBE_BYTES, probe
from savable_loader.testing.proxy import FaultProxy

pytestmark = [S3FS_WARNINGS, pytest.mark.timeout(120)]

LIMIT = 64 * 2**20


@pytest.fixture
def proxy(endpoint_url: str) -> Iterator[RecordingProxy]:
    with RecordingProxy(endpoint_url) as running:
        yield running


def _fs(s3: S3, proxy: FaultProxy) -> Any:
    options = {**s3.options(), "client_kwargs": {"endpoint_url": proxy.url, "region_name": REGION}}
    return fsspec.filesystem("s3", **options)


def _body(size: int, salt: int = 0) -> bytes:
    pattern = bytes((i * 7 + salt) % 251 for i in range(251))
    return (pattern * (size // 251 + 1))[:size]


def _read(cache: FileCache, url: str, fs: Any, **kwargs: Any) -> bytes:
    with cache.open(url, lambda: fs, **kwargs) as file:
        return file.read()  # type: ignore[no-any-return]


def test_a_small_file_missing_from_the_cache_costs_one_get_and_its_reuse_one_head(
    s3: S3, proxy: RecordingProxy, tmp_path: Path
) -> None:
    body = _body(10_000)
    url = s3.put("small.bin", body)
    fs = _fs(s3, proxy)
    cache = FileCache(tmp_path, LIMIT, prefetch=0)
    proxy.taken()
    assert _read(cache, url, fs) == body
    assert proxy.taken() == ["GET"]
    assert (cache.stats.misses, cache.stats.bytes_downloaded) == (1, len(body))
    # The signature the probe recorded is the one info() gives: a later open (another
    # process, or a restart) finds the entry valid with one HEAD and no bytes.
    assert is_valid(tmp_path, url, signature_of(fs.info(url)))
    proxy.taken()
    again = FileCache(tmp_path, LIMIT, prefetch=0)
    assert _read(again, url, fs) == body
    assert proxy.taken() == ["HEAD"]
    assert (again.stats.hits, again.stats.misses, again.stats.bytes_downloaded) == (1, 0, 0)
    cache.close()
    again.close()


@pytest.mark.parametrize(
    ("size", "stream"),
    [
        (1, False),
        (PROBE_BYTES, False),
        (PROBE_BYTES + 1, False),
        (3 * PROBE_BYTES + 17, False),
        (STREAM_MIN_BYTES + 5, True),
    ],
    ids=["1B", "probe", "probe+1", "3probe+17", "streamed"],
)
def test_a_download_goes_on_after_its_probe_without_a_head_or_a_byte_twice(
    s3: S3, proxy: RecordingProxy, tmp_path: Path, size: int, stream: bool
) -> None:
    body = _body(size)
    url = s3.put(f"sized-{size}.bin", body)
    fs = _fs(s3, proxy)
    cache = FileCache(tmp_path, LIMIT, prefetch=0)
    proxy.taken()
    assert _read(cache, url, fs, stream=stream) == body
    methods = proxy.taken()
    # The probe, then (for a longer file) the rest: one GET, or ranges when streamed.
    if stream:
        assert set(methods) == {"GET"}
    else:
        assert methods == ["GET"] * (1 if size <= PROBE_BYTES else 2)
    assert cache.stats.bytes_downloaded == size  # the probe's bytes are not fetched again
    signature = signature_of(fs.info(url))
    deadline = time.monotonic() + 30  # a streamed download commits after its last read
    while not is_valid(tmp_path, url, signature):
        assert time.monotonic() < deadline, "the entry never became valid"
        time.sleep(0.01)
    assert [p.read_bytes() for p in tmp_path.glob("*.data")] == [body]
    cache.close()


def test_an_empty_file_is_asked_its_size_as_before(
    s3: S3, proxy: RecordingProxy, tmp_path: Path
) -> None:
    url = s3.put("empty.bin", b"")
    fs = _fs(s3, proxy)
    cache = FileCache(tmp_path, LIMIT, prefetch=0)
    assert probe(fs, url) is None  # no byte to give: the store refuses the range
    proxy.taken()
    assert _read(cache, url, fs) == b""
    assert proxy.taken()[:2] == ["GET", "HEAD"]  # the refused probe, then info()
    assert is_valid(tmp_path, url, signature_of(fs.info(url)))
    cache.close()


def test_a_missing_file_raises_from_the_probe_as_from_info(s3: S3, proxy: RecordingProxy) -> None:
    fs = _fs(s3, proxy)
    with pytest.raises(FileNotFoundError):
        probe(fs, s3.url("missing.bin"))


def test_a_filesystem_that_cannot_probe_asks_info() -> None:
    memory = fsspec.filesystem("memory")
    memory.pipe_file("/probe-test/file.bin", b"abc")
    try:
        assert probe(memory, "memory:///probe-test/file.bin") is None
    finally:
        memory.rm("/probe-test", recursive=True)


def test_a_replaced_file_of_the_same_size_is_downloaded_again(
    s3: S3, proxy: RecordingProxy, tmp_path: Path
) -> None:
    url = s3.put("replaced.bin", _body(5_000))
    fs = _fs(s3, proxy)
    cache = FileCache(tmp_path, LIMIT, prefetch=0)
    assert _read(cache, url, fs) == _body(5_000)
    s3.put("replaced.bin", _body(5_000, salt=1))
    fs.invalidate_cache()
    proxy.taken()
    assert _read(cache, url, fs) == _body(5_000, salt=1)
    assert proxy.taken()[0] == "HEAD"  # an entry exists: checked, then downloaded again
    assert cache.stats.misses == 2
    cache.close()


def test_a_file_replaced_between_its_probe_and_its_rest_is_not_cached_mixed(
    s3: S3, proxy: RecordingProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = 2 * PROBE_BYTES
    url = s3.put("swapped.bin", _body(size))
    fs = _fs(s3, proxy)
    cache = FileCache(tmp_path, LIMIT, prefetch=0)

    def swapped_then(*args: Any) -> None:
        s3.put("swapped.bin", _body(size, salt=1))  # same size, another ETag
        original(*args)

    original = cache_module.write_rest
    monkeypatch.setattr(cache_module, "write_rest", swapped_then)
    with pytest.raises(Changed):
        _read(cache, url, fs)
    monkeypatch.setattr(cache_module, "write_rest", original)
    assert not list(tmp_path.glob(".tmp-*"))
    assert not list(tmp_path.glob("*.json"))
    assert _read(cache, url, fs) == _body(size, salt=1)  # the next open (a retry's) is whole
    cache.close()


def test_a_streamed_file_replaced_between_its_ranges_fails_its_download_at_once(
    s3: S3, proxy: RecordingProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = STREAM_MIN_BYTES + 5
    url = s3.put("streamed-swap.bin", _body(size))
    fs = _fs(s3, proxy)
    original = cache_module.range_reader
    swapped: list[int] = []

    def swapping(fs_: Any, url_: str, etag: str | None) -> Any:
        read = original(fs_, url_, etag)

        def swap_first(start: int, end: int) -> bytes | None:
            if not swapped:  # before the first range after the probe
                swapped.append(start)
                s3.put("streamed-swap.bin", _body(size, salt=1))
            return read(start, end)

        return swap_first

    monkeypatch.setattr(cache_module, "range_reader", swapping)
    cache = FileCache(tmp_path, LIMIT, prefetch=0)
    # The source's retry policy would retry every range; the replaced file's is not.
    retry = RetryPolicy(attempts=5, base_delay=0.001, max_delay=0.002)
    proxy.taken()
    with pytest.raises(Changed, match="replaced"):
        _read(cache, url, fs, stream=True, retry=retry)
    assert swapped == [PROBE_BYTES]
    assert proxy.taken() == ["GET", "GET"]  # the probe and one range, not retried
    assert not list(tmp_path.glob("*.json"))  # no entry of mixed bytes
    monkeypatch.setattr(cache_module, "range_reader", original)
    assert _read(cache, url, fs, stream=True) == _body(size, salt=1)  # the reader's retry
    cache.close()


def test_two_caches_probing_one_file_at_once_read_it_whole(
    s3: S3, proxy: RecordingProxy, tmp_path: Path
) -> None:
    body = _body(2 * PROBE_BYTES + 3)
    url = s3.put("shared.bin", body)
    caches = [FileCache(tmp_path, LIMIT, prefetch=0) for _ in range(4)]
    results: list[bytes | BaseException] = []

    def read(cache: FileCache) -> None:
        try:
            results.append(_read(cache, url, _fs(s3, proxy)))
        except BaseException as exc:  # reported below
            results.append(exc)

    threads = [threading.Thread(target=read, args=(cache,)) for cache in caches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == [body] * 4
    assert sum(c.stats.misses for c in caches) >= 1
    assert len(list(tmp_path.glob("*.data"))) == 1
    assert not list(tmp_path.glob(".tmp-*"))
    for cache in caches:
        cache.close()


def test_a_faulted_probe_is_retried_by_the_source_and_the_stream_is_exact(
    s3: S3, endpoint_url: str, tmp_path: Path
) -> None:
    from savable_loader.datasets import TableSource

    bodies = [_body(3_000 + row, salt=row) for row in range(16)]
    for row, body in enumerate(bodies):
        s3.put(f"faulted/{row}.bin", body)
    rows = "".join(f'{{"file": "{row}.bin"}}\n' for row in range(len(bodies)))
    table = s3.put("faulted/rows.jsonl", rows.encode())
    # Mostly cut answers: s3fs retries a 503 itself, after sleeps of its own.
    with RecordingProxy(endpoint_url, slow_down=0.05, cut=0.3, seed=3) as faulty:
        options = {
            **s3.options(),
            "client_kwargs": {"endpoint_url": faulty.url, "region_name": REGION},
        }
        source = TableSource(
            table,
            files="file",
            threads=0,
            storage_options=options,
            cache_dir=tmp_path,
            retry=RetryPolicy(attempts=8, base_delay=0.001, max_delay=0.01),
        )
        cursor = source.cursor(_one())
        try:
            got = [item["file"] for item in cursor]
        finally:
            cursor.close()
            source.close_cache()
        assert faulty.stats.slow_downs + faulty.stats.cuts > 0
    assert got == bodies


def _one() -> Any:
    from savable_loader import WorkerContext

    return WorkerContext(0, 1, 0, 0, 0, None)
