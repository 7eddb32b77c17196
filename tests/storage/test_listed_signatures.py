"""File sources spend their listing's signatures on the cache (NOTE [ Listed signatures ]
in ``savable_loader/datasets/files/file_list.py``): a cached file costs no request to open, and a
file replaced since the listing is still read as it is now, never lost or mixed.

Against moto's S3 server on loopback, through a proxy that records every request's method,
so each test states what an open costs.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from s3_server import REGION, S3, S3FS_WARNINGS, RecordingProxy
from sample_files import write_tar

from savable_loader import SavableDataLoader, WorkerContext
from savable_loader.datasets import JsonLinesSource, TarSource, TokenSource
from savable_loader.datasets.files import access
from savable_loader.storage.cache.entries import is_valid
from savable_loader.storage.cache.node import FileCache, signature_of
from savable_loader.storage.cache.probe import probe
from savable_loader.storage.filesystems import url_to_fs

pytestmark = [S3FS_WARNINGS, pytest.mark.timeout(120)]

ONE = WorkerContext(0, 1, 0, 0, 0, None)
FILES = 4


@pytest.fixture
def proxy(endpoint_url: str) -> Iterator[RecordingProxy]:
    with RecordingProxy(endpoint_url) as running:
        yield running


def _options(s3: S3, proxy: RecordingProxy) -> dict[str, Any]:
    return {**s3.options(), "client_kwargs": {"endpoint_url": proxy.url, "region_name": REGION}}


def _lines(file: int, version: int = 0) -> bytes:
    rows = [json.dumps({"id": file * 100 + i, "v": version}) for i in range(5)]
    return ("\n".join(rows) + "\n").encode()


def _put_jsonl(s3: S3) -> str:
    for file in range(FILES):
        s3.put(f"jsonl/part-{file}.jsonl", _lines(file))
    return s3.url("jsonl/*.jsonl")


def _items(source: Any) -> list[Any]:
    cursor = source.cursor(ONE)
    try:
        return list(cursor)
    finally:
        cursor.close()


def test_the_listing_s_signature_is_the_one_a_head_and_a_get_give(
    s3: S3, proxy: RecordingProxy, tmp_path: Path
) -> None:
    pattern = _put_jsonl(s3)
    source = JsonLinesSource(pattern, storage_options=_options(s3, proxy), cache_dir=tmp_path)
    fs, _ = url_to_fs(pattern, **_options(s3, proxy))
    assert sorted(source.listed) == list(source.urls)
    # Without a cache or a counts file nothing spends them: none is kept.
    assert JsonLinesSource(pattern, storage_options=_options(s3, proxy)).listed == {}
    for url in source.urls:
        probed = probe(fs, url)
        assert probed is not None
        # A listing's entry, info() and a probe's headers agree to the character: an
        # entry written from one is valid against the others (is_valid compares them).
        assert source.listed[url] == signature_of(fs.info(url)) == signature_of(probed[0])
        assert source.listed[url]["etag"]


def test_a_cached_file_source_is_read_again_without_a_request(
    s3: S3, proxy: RecordingProxy, tmp_path: Path
) -> None:
    pattern = _put_jsonl(s3)
    options = _options(s3, proxy)
    expected = [file * 100 + i for file in range(FILES) for i in range(5)]
    first = JsonLinesSource(pattern, split="files", storage_options=options, cache_dir=tmp_path)
    assert [item["id"] for item in _items(first)] == expected
    first.close_cache()
    proxy.taken()
    again = JsonLinesSource(pattern, split="files", storage_options=options, cache_dir=tmp_path)
    assert proxy.taken() == ["GET"]  # its listing
    assert [item["id"] for item in _items(again)] == expected
    assert proxy.taken() == []  # every file read from the cache, no HEAD before it
    stats = again.cache_stats()
    again.close_cache()
    assert stats is not None
    assert (stats.hits, stats.misses, stats.bytes_downloaded) == (FILES, 0, 0)
    # Literal URLs are not listed: each open asks the store for the signature (a HEAD).
    literal = JsonLinesSource(
        list(again.urls), split="files", storage_options=options, cache_dir=tmp_path
    )
    assert literal.listed == {}
    assert [item["id"] for item in _items(literal)] == expected
    literal.close_cache()
    asked = proxy.taken()
    assert set(asked) == {"HEAD"}
    assert len(asked) >= FILES


def test_a_file_replaced_after_the_listing_is_read_as_it_is_now(
    s3: S3, proxy: RecordingProxy, tmp_path: Path
) -> None:
    pattern = _put_jsonl(s3)
    source = JsonLinesSource(
        pattern, split="files", storage_options=_options(s3, proxy), cache_dir=tmp_path
    )
    s3.put("jsonl/part-2.jsonl", _lines(2, version=1))  # after the listing, not cached yet
    items = _items(source)
    source.close_cache()
    assert [item["id"] for item in items] == [f * 100 + i for f in range(FILES) for i in range(5)]
    assert [item["v"] for item in items] == [1 if item["id"] // 100 == 2 else 0 for item in items]


def test_an_entry_cached_before_a_replacement_is_read_until_the_source_is_built_again(
    s3: S3, proxy: RecordingProxy, tmp_path: Path
) -> None:
    pattern = _put_jsonl(s3)
    options = _options(s3, proxy)
    source = JsonLinesSource(pattern, split="files", storage_options=options, cache_dir=tmp_path)
    _items(source)
    source.close_cache()
    s3.put("jsonl/part-1.jsonl", _lines(1, version=1))
    # The source's listing is its snapshot of the dataset: the version it listed is read.
    assert {item["v"] for item in _items(source)} == {0}
    source.close_cache()
    # A source built again (a restart) lists anew and downloads the replaced file.
    rebuilt = JsonLinesSource(pattern, split="files", storage_options=options, cache_dir=tmp_path)
    items = _items(rebuilt)
    stats = rebuilt.cache_stats()
    rebuilt.close_cache()
    assert [item["v"] for item in items] == [1 if item["id"] // 100 == 1 else 0 for item in items]
    assert stats is not None
    assert stats.bytes_downloaded == len(_lines(1, version=1))  # that file alone


def test_a_prefetch_of_a_file_replaced_after_the_listing_is_dropped_and_read_anew(
    s3: S3, proxy: RecordingProxy, tmp_path: Path
) -> None:
    pattern = _put_jsonl(s3)
    source = JsonLinesSource(
        pattern,
        split="files",
        prefetch=FILES,
        storage_options=_options(s3, proxy),
        cache_dir=tmp_path,
    )
    for file in range(1, FILES):  # every file the prefetch threads will fetch
        s3.put(f"jsonl/part-{file}.jsonl", _lines(file, version=1))
    proxy.taken()
    items = _items(source)
    source.close_cache()
    assert [item["id"] for item in items] == [f * 100 + i for f in range(FILES) for i in range(5)]
    assert [item["v"] for item in items] == [0 if item["id"] < 100 else 1 for item in items]


def test_a_prefetch_with_a_stale_listed_signature_leaves_no_entry_of_it(
    s3: S3, proxy: RecordingProxy, tmp_path: Path
) -> None:
    url = s3.put("one.jsonl", _lines(0))
    fs, _ = url_to_fs(url, **_options(s3, proxy))
    listed = signature_of(fs.info(url))
    s3.put("one.jsonl", _lines(0, version=1) + b"\n")  # another ETag and size
    cache = FileCache(tmp_path, 2**30, prefetch=1)
    proxy.taken()
    cache.want([url], lambda _: fs, {url: listed})
    deadline = time.monotonic() + 30
    while "GET" not in proxy.methods_seen:
        assert time.monotonic() < deadline, "the prefetch never asked"
        time.sleep(0.01)
    cache.close()  # waits for the prefetch to end
    assert proxy.taken() == ["GET"]  # the listed signature taken: no HEAD before it
    assert not is_valid(tmp_path, url, listed)  # its answer was another version: dropped
    reader = FileCache(tmp_path, 2**30, prefetch=0)
    with reader.open(url, lambda: fs) as file:
        assert file.read() == _lines(0, version=1) + b"\n"
    reader.close()
    assert is_valid(tmp_path, url, signature_of(fs.info(url)))


def test_workers_open_cached_shards_and_token_files_without_a_request(
    s3: S3, proxy: RecordingProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart on a warm node: the workers read every file from the cache without a
    request, and without building a filesystem (an S3 client, tens of ms of CPU before a
    worker's first batch): which listed signatures the cache may take was decided in the
    main process, with the filesystem that listed them."""
    write_tar(tmp_path)
    for path in sorted(tmp_path.glob("*.tar")):
        s3.put(f"tar/{path.name}", path.read_bytes())
    for file in range(FILES):
        tokens = np.arange(file * 1000, file * 1000 + 512, dtype=np.uint16)
        s3.put(f"tokens/part-{file}.bin", tokens.tobytes())
    options = _options(s3, proxy)

    def tar() -> TarSource:
        return TarSource(s3.url("tar/*.tar"), storage_options=options, cache_dir=tmp_path / "t")

    def token() -> TokenSource:
        return TokenSource(
            s3.url("tokens/*.bin"),
            seq_len=16,
            shuffle=True,
            storage_options=options,
            cache_dir=tmp_path / "k",
        )

    def read(source: Any) -> list[Any]:
        loader = SavableDataLoader(source, batch_size=4, num_workers=2, collate_fn=list)
        with loader:
            return [
                [bytes(item["id"]) if isinstance(item, dict) else item.tolist() for item in b]
                for b in loader
            ]

    built = tmp_path / "built"  # the processes that built a filesystem, one line each
    real_url_to_fs = access.url_to_fs

    def recording(url: str, **options: Any) -> Any:
        with open(built, "a") as out:
            out.write(f"{os.getpid()}\n")
        return real_url_to_fs(url, **options)

    monkeypatch.setattr(access, "url_to_fs", recording)  # forked into the workers
    for build in (tar, token):
        expected = read(build())  # downloads into the cache (and counts the tar samples)
        source = build()
        proxy.taken()
        built.write_text("")
        assert read(source) == expected
        assert proxy.taken() == [], build.__name__  # every open a hit, asked nothing
        assert set(built.read_text().split()) <= {str(os.getpid())}, build.__name__
