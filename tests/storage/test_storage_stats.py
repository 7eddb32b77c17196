"""The storage figures without a cache (NOTE [ Direct reads ] in ``storage/counted_reads.py``):
what a source reading ``s3://`` directly reports, per process and per worker, and the
waits of ``TableSource``'s reader counted once (NOTE [ Fetching files ahead ]).

Against moto's S3 server on loopback (``tests/support/s3_server.py``); where a wait must be
measurable, through ``FaultProxy`` adding a first-byte latency to every answer.
"""

from __future__ import annotations

import gzip
import json
import logging
import pickle
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from s3_server import REGION, S3, S3FS_WARNINGS
from sample_files import tar_shard
from stage_harness import check_stage

from savable_loader import SavableDataLoader, WorkerContext
from savable_loader.datasets import CacheStats, TableSource, TokenSource
from savable_loader.datasets.files.access import storage_stats
from savable_loader.datasets.files.jsonl import JsonLinesSource
from savable_loader.datasets.files.tar import TarSource
from savable_loader.storage.listing import LIST_AFTER
from savable_loader.testing.proxy import FaultProxy

pytestmark = [S3FS_WARNINGS, pytest.mark.timeout(120)]

ONE = WorkerContext(0, 1, 0, 0, 0, None)
LATENCY = 0.05
ROWS = 16
SEQ = 4


def _lines(part: int, count: int) -> bytes:
    return "".join(
        json.dumps({"id": part * 100 + i, "pad": "x" * i}) + "\n" for i in range(count)
    ).encode()


def _upload_jsonl(s3: S3, folder: Path, parts: int = 4) -> dict[str, int]:
    """``parts`` gzip JSON-lines files in the bucket and in ``folder``; their stored sizes."""
    sizes = {}
    for part in range(parts):
        body = gzip.compress(_lines(part, 20 + part), mtime=0)
        sizes[s3.put(f"jsonl/part-{part}.jsonl.gz", body)] = len(body)
        (folder / f"part-{part}.jsonl.gz").write_bytes(body)
    return sizes


def _upload_tar(s3: S3, folder: Path) -> dict[str, int]:
    """Tar shards, every other one gzipped, in the bucket and in ``folder``."""
    sizes = {}
    for shard in range(4):
        gz = shard % 2 == 1
        name = f"data-{shard:03d}.tar" + ".gz" * gz
        body = tar_shard(shard, 3 + shard, "w:gz" if gz else "w")
        sizes[s3.put(f"tar/{name}", body)] = len(body)
        (folder / name).write_bytes(body)
    return sizes


def _stream(source: Any) -> list[Any]:
    cursor = source.cursor(ONE)
    try:
        return [_plain(item) for item in cursor]
    finally:
        cursor.close()


def _plain(item: Any) -> Any:
    """A tar sample without its URL (the bucket's or the folder's)."""
    if isinstance(item, dict) and "__key__" in item:
        return {k: v for k, v in item.items() if k != "__url__"}
    return item


# What a source reading s3:// directly reports.


@pytest.mark.parametrize("kind", ["jsonl", "tar"])
def test_direct_reads_count_the_stored_bytes_and_every_open(
    s3: S3, tmp_path: Path, kind: str
) -> None:
    upload = _upload_jsonl if kind == "jsonl" else _upload_tar
    sizes = upload(s3, tmp_path)
    build = JsonLinesSource if kind == "jsonl" else TarSource
    pattern = f"{kind}/*"
    remote = build(s3.url(pattern), storage_options=s3.options(), split="files")
    assert remote.cache_stats() is None  # nothing read yet
    local = build(str(tmp_path / "*"), split="files")
    assert _stream(remote) == _stream(local)  # the counted files read the same bytes
    stats = remote.cache_stats()
    assert stats is not None
    assert stats.bytes_downloaded == sum(sizes.values())  # as stored: compressed
    assert (stats.misses, stats.hits, stats.prefetched) == (len(sizes), 0, 0)
    assert stats.wait_seconds > 0
    assert local.cache_stats() is None  # local files are not counted
    assert storage_stats(remote) == {**vars(stats)}


def test_direct_token_windows_count_each_range_request(s3: S3) -> None:
    tokens = np.arange(10 * SEQ, dtype=np.uint16)
    url = s3.put("tokens/part-0.bin", tokens.tobytes())
    source = TokenSource(url, seq_len=SEQ, shuffle=True, seed=1, storage_options=s3.options())
    windows = _stream(source)
    assert sorted(int(window[0]) for window in windows) == list(range(0, 10 * SEQ, SEQ))
    stats = source.cache_stats()
    assert stats is not None
    # One range request per window, of its bytes: a shuffled stream reads no file whole.
    assert (stats.misses, stats.bytes_downloaded) == (10, 10 * SEQ * tokens.itemsize)
    assert stats.wait_seconds > 0


@pytest.fixture
def memory() -> Iterator[str]:
    """A ``memory://`` folder (remote to ``cacheable``) with gzip JSON lines and tars."""
    fs = fsspec.filesystem("memory")
    root = f"/storage-stats-{uuid.uuid4().hex[:8]}"
    for part in range(3):
        fs.pipe_file(f"{root}/part-{part}.jsonl.gz", gzip.compress(_lines(part, 5 + part)))
        gz = part % 2 == 1
        body = tar_shard(part, 2 + part, "w:gz" if gz else "w")
        fs.pipe_file(f"{root}/data-{part:03d}.tar" + ".gz" * gz, body)
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


@pytest.mark.parametrize("kind", ["jsonl", "tar"])
def test_resuming_through_the_counted_files_is_exact(memory: str, kind: str) -> None:
    def build() -> Any:
        if kind == "jsonl":
            return JsonLinesSource(f"{memory}/part-*", shuffle_shards=True)
        return TarSource(f"{memory}/data-*", shuffle_shards=True).map(_plain)

    source = build()
    _stream(source)
    assert storage_stats(source) is not None  # read through the counted files
    check_stage(build, num_workers=0, batch_size=None)


def test_local_files_are_not_counted(tmp_path: Path) -> None:
    for row in range(4):
        (tmp_path / f"{row}.bin").write_bytes(bytes([row]) * 10)
    (tmp_path / "rows.jsonl").write_text(
        "".join(json.dumps({"id": row, "file": f"{row}.bin"}) + "\n" for row in range(4))
    )
    for threads in (2, 0):
        source = TableSource(str(tmp_path / "rows.jsonl"), files="file", threads=threads)
        assert len(_stream(source)) == 4
        assert source.cache_stats() is None
        source.close_cache()


def test_the_counters_are_this_process_s_and_close_cache_logs_them(
    s3: S3, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sizes = _upload_jsonl(s3, tmp_path, parts=2)
    source = JsonLinesSource(s3.url("jsonl/*"), storage_options=s3.options(), split="files")
    _stream(source)
    copy = pickle.loads(pickle.dumps(source))  # as spawn sends it to a worker
    assert copy.cache_stats() is None
    with caplog.at_level(logging.DEBUG, logger="savable_loader.datasets.files.access"):
        source.close_cache()
    (message,) = [r.getMessage() for r in caplog.records if "storage" in r.getMessage()]
    assert f"bytes_downloaded={sum(sizes.values())}, hits=0, misses=2" in message
    assert source.cache_stats() is None  # counted afresh if it reads again
    source.close_cache()  # idempotent


# Per worker, as worker_stats() reports them.


def test_each_worker_reports_its_own_direct_reads(s3: S3, tmp_path: Path) -> None:
    sizes = list(_upload_jsonl(s3, tmp_path).values())
    source = JsonLinesSource(s3.url("jsonl/*"), storage_options=s3.options(), split="files")
    items = sum(20 + part for part in range(4))
    with SavableDataLoader(source, batch_size=4, num_workers=2) as loader:
        batches = iter(loader)
        while items:  # every item, and no StopIteration yet: the workers still run
            items -= len(next(batches)["id"])
        storage = [stats["storage"] for stats in loader.worker_stats()]
    assert source.cache_stats() is None  # the main process read nothing
    # split="files": worker w reads files w and w + 2, whole.
    assert [entry["bytes_downloaded"] for entry in storage] == [
        sizes[0] + sizes[2],
        sizes[1] + sizes[3],
    ]
    assert [(entry["misses"], entry["hits"]) for entry in storage] == [(2, 0), (2, 0)]
    assert all(entry["wait_seconds"] > 0 for entry in storage)


# TableSource: the reader's waits, once.


@pytest.fixture
def proxy(endpoint_url: str) -> Iterator[FaultProxy]:
    with FaultProxy(endpoint_url, latency=LATENCY) as running:
        yield running


def _upload_table(s3: S3) -> tuple[str, int]:
    """A JSON-lines table of ROWS rows naming a file each; its URL and the bytes stored."""
    total = 0
    rows = []
    for row in range(ROWS):
        body = bytes([row]) * (1000 + row)
        s3.put(f"table/files/{row}.bin", body)
        total += len(body)
        rows.append({"id": row, "file": f"files/{row}.bin"})
    table = "".join(json.dumps(row) + "\n" for row in rows).encode()
    return s3.put("table/rows.jsonl", table), total + len(table)


@pytest.mark.parametrize(
    ("threads", "cached"), [(4, False), (0, False), (4, True)], ids=["threads", "reader", "cache"]
)
def test_table_source_counts_the_reader_s_wait_once(
    s3: S3, proxy: FaultProxy, tmp_path: Path, threads: int, cached: bool
) -> None:
    url, stored = _upload_table(s3)
    options = {**s3.options(), "client_kwargs": {"endpoint_url": proxy.url, "region_name": REGION}}
    source = TableSource(
        url,
        files="file",
        threads=threads,
        storage_options=options,
        cache_dir=tmp_path / "cache" if cached else None,
    )
    built = source.cache_stats()  # the table, read by the constructor
    assert built is not None
    assert built.misses == 1
    started = time.perf_counter()
    items = _stream(source)
    elapsed = time.perf_counter() - started
    assert [item["file"] for item in items] == [bytes([r]) * (1000 + r) for r in range(ROWS)]
    stats = source.cache_stats()
    source.close_cache()
    assert isinstance(stats, CacheStats)
    assert (stats.misses, stats.hits, stats.bytes_downloaded) == (ROWS + 1, 0, stored)
    waited = stats.wait_seconds - built.wait_seconds
    # Every request waits LATENCY: the reader waited for its rows' files, a request each
    # without the cache, two through it (its size, then its bytes), fetched 4 at a time
    # with threads (so for 4 rounds at least).
    assert waited >= 2 * LATENCY
    # Counted once: the fetch threads' time (ROWS files, 4 at a time) is not added to the
    # reader's wait, which lasts no longer than the reading.
    assert waited <= elapsed


# TableSource: the requests a file costs, as the store answers them.


def _through(s3: S3, proxy: FaultProxy) -> dict[str, Any]:
    return {**s3.options(), "client_kwargs": {"endpoint_url": proxy.url, "region_name": REGION}}


def test_table_source_reads_a_remote_file_whole_with_one_request(s3: S3, proxy: FaultProxy) -> None:
    bodies = [bytes([r]) * (1000 + r) for r in range(ROWS)] + [b""]
    for row, body in enumerate(bodies):
        s3.put(f"whole/{row}.bin", body)
    rows = "".join(json.dumps({"file": f"{row}.bin"}) + "\n" for row in range(len(bodies)))
    url = s3.put("whole/rows.jsonl", rows.encode())
    source = TableSource(url, files="file", threads=0, storage_options=_through(s3, proxy))
    before = proxy.stats.requests
    assert [item["file"] for item in _stream(source)] == bodies
    # A GET each, no size asked before it; the empty file, whose range the store cannot
    # satisfy, then its size.
    assert proxy.stats.requests - before == ROWS + 2
    stats = source.cache_stats()
    source.close_cache()
    assert stats is not None
    assert (stats.misses, stats.bytes_downloaded) == (ROWS + 3, sum(map(len, bodies)) + len(rows))


def _body(i: int, version: int = 0) -> bytes:
    return f"file {i} version {version}".encode() * (1 + version)


def test_listed_folders_take_one_request_per_file_and_notice_a_replaced_one(
    s3: S3, proxy: FaultProxy, tmp_path: Path
) -> None:
    n = LIST_AFTER + 6
    for i in range(n):
        s3.put(f"listed/files/{i}.bin", _body(i))
    rows = "".join(json.dumps({"id": i, "file": f"files/{i}.bin"}) + "\n" for i in range(n))
    url = s3.put("listed/rows.jsonl", rows.encode())
    source = TableSource(
        url,
        files="file",
        threads=0,
        list_folders=True,
        storage_options=_through(s3, proxy),
        cache_dir=tmp_path,
    )
    cursor = source.cursor(ONE)
    before = proxy.stats.requests
    files = [next(cursor)["file"] for _ in range(LIST_AFTER)]
    listings = source.folder_listings()
    deadline = time.monotonic() + 30
    while listings.known(s3.url("listed/files/0.bin")) is None:
        assert time.monotonic() < deadline, "the folder was never listed"
        time.sleep(0.01)
    # Until its folder's turn to be listed, a file costs one ranged GET, which brings its
    # signature with its bytes (NOTE [ Probing a download ]); the listing is one request.
    assert proxy.stats.requests - before == LIST_AFTER + 1
    replaced = LIST_AFTER + 2
    s3.put(f"listed/files/{replaced}.bin", _body(replaced, version=1))  # not through the proxy
    before = proxy.stats.requests
    files += [item["file"] for item in cursor]
    cursor.close()
    expected = [_body(i) for i in range(n)]
    expected[replaced] = _body(replaced, version=1)
    assert files == expected
    # Listed: a GET each. The replaced file's GET disagrees with its listed size: a HEAD
    # and a GET again.
    assert proxy.stats.requests - before == n - LIST_AFTER + 2
    stats = source.cache_stats()
    source.close_cache()
    assert stats is not None
    assert (stats.misses, stats.hits) == (n + 1, 0)
