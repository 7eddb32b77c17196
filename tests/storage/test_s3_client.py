"""The library's own GETs go through botocore's synchronous client where it can copy s3fs's
client exactly, and read as s3fs's would (NOTE [ Synchronous GETs ] in ``storage/s3_client.py``):
the same bytes, the same signature as ``info()``, the same errors; any setting it cannot
copy leaves the request to s3fs."""

from __future__ import annotations

import errno
import importlib.util
import io
import multiprocessing
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from savable_loader import SavableDataLoader
from savable_loader.datasets import TableSource, TarSource
from savable_loader.storage import object_store, s3_client
from savable_loader.storage.cache.entries import signature_of
from savable_loader.storage.cache.probe import probe, read_whole
from savable_loader.storage.filesystems import url_to_fs
from savable_loader.testing import assert_resumes_exactly, digest


def _fs(s3: Any, **extra: Any) -> Any:
    return url_to_fs(s3.url("x"), **{**s3.options(), **extra})[0]


@pytest.mark.parametrize("how", ["options", "environment"])
def test_a_get_reads_the_bytes_and_the_signature_info_gives(s3: Any, how: str) -> None:
    body = bytes(range(256)) * 40
    url = s3.put("blob.bin", body)
    fs = url_to_fs(url, **s3.access(how))[0]
    with s3_client.get_object(fs, *fs.split_path(url)[:2], "bytes=10-99") as answer:
        assert answer is not None  # botocore's client, not s3fs
        assert answer["Body"].read() == body[10:100]
    info, first = probe(fs, url) or ({}, b"")
    assert first == body
    assert signature_of(info) == signature_of(fs.info(url))  # a later open finds it valid
    assert read_whole(fs, url) == body


def test_errors_are_the_ones_s3fs_raises(s3: Any) -> None:
    empty = s3.put("empty.bin", b"")
    fs = _fs(s3)
    with pytest.raises(FileNotFoundError):
        read_whole(fs, s3.url("missing.bin"))
    with pytest.raises(FileNotFoundError):
        fs.cat_file(s3.url("missing.bin"))
    with pytest.raises(OSError) as caught:
        read_whole(fs, empty)  # no byte to give: as s3fs, EINVAL
    assert caught.value.errno == errno.EINVAL
    assert s3_client._client(fs) is not None


@pytest.mark.parametrize(
    "extra",
    [
        {"requester_pays": True},
        {"s3_additional_kwargs": {"ServerSideEncryption": "AES256"}},
        {"cache_regions": True},
        {"config_kwargs": {"connector_args": {"keepalive_timeout": 12}}},
        {"version_aware": True},
    ],
    ids=["requester-pays", "additional-kwargs", "cache-regions", "aiohttp-config", "versions"],
)
def test_settings_it_cannot_copy_leave_the_request_to_s3fs(s3: Any, extra: Any) -> None:
    url = s3.put("blob.bin", b"abc" * 100)
    fs = _fs(s3, **extra)
    assert s3_client._client(fs) is None
    with s3_client.get_object(fs, *fs.split_path(url)[:2], "bytes=0-") as answer:
        assert answer is None
    if not fs.version_aware:  # a versioned filesystem is read through s3fs's own calls
        assert read_whole(fs, url) == b"abc" * 100


def test_a_session_the_user_gave_is_left_to_s3fs(s3: Any) -> None:
    from aiobotocore.session import AioSession

    url = s3.put("blob.bin", b"abc")
    fs = _fs(s3, session=AioSession())
    assert s3_client._client(fs) is None
    assert read_whole(fs, url) == b"abc"


def _tar(members: int, size: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for i in range(members):
            data = bytes([i % 251]) * size
            info = tarfile.TarInfo(f"{i:04d}.bin")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _stream(loader: SavableDataLoader) -> list[str]:
    with loader:
        return [digest(batch) for _ in range(2) for batch in loader]


def _streams(tars: str, rows: str, options: dict[str, Any], cache: Path | None) -> Any:
    """The streams of two-worker loaders over tar shards and a table of small files."""
    kept = {"cache_dir": cache} if cache is not None else {}
    return [
        _stream(
            SavableDataLoader(source, batch_size=4, num_workers=2, multiprocessing_context="fork")
        )
        for source in (
            TarSource(tars, storage_options=options, **kept),
            TableSource(rows, files="file", storage_options=options, **kept),
        )
    ]


def _recording(module: Any, record: Path) -> None:
    """Makes ``module._build`` note in ``record`` which process built a client."""
    real_build = module._build

    def recording_build(*args: Any) -> Any:
        built = real_build(*args)
        with open(record, "a") as out:
            out.write(f"{os.getpid()} {built is not None}\n")
        return built

    module._build = recording_build


def _fresh_streams(queue: Any, record: Path, *args: Any) -> None:
    """:func:`_streams` in a process that never imported obstore, as a training script's
    (its forked workers then use it: NOTE [ A client outside the GIL ])."""
    _recording(object_store, record)
    queue.put(_streams(*args))


@pytest.mark.parametrize("client", ["botocore", "obstore"])
@pytest.mark.parametrize("cached", [False, True], ids=["direct", "cache"])
def test_sources_read_the_same_stream_through_either_client(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cached: bool, client: str
) -> None:
    """A table of small files and tar shards large enough to be read as they download,
    with two workers (each forked after the main process built its client), read the same
    stream through botocore's client, or obstore's (NOTE [ A client outside the GIL ]),
    as through s3fs's."""
    if client == "obstore" and importlib.util.find_spec("obstore") is None:
        pytest.skip("obstore is not installed")
    for shard in range(2):  # ~5 MB each: over STREAM_MIN_BYTES, read as they arrive
        s3.put(f"tar/{shard}.tar", _tar(40, 128_000))
    rows = [s3.put(f"files/{i}.bin", bytes([i]) * (1000 + i)) for i in range(24)]
    table = "".join(f'{{"id": {i}, "file": "{url}"}}\n' for i, url in enumerate(rows))
    s3.put("rows.jsonl", table.encode())
    urls = (s3.url("tar/*.tar"), s3.url("rows.jsonl"), s3.options())
    record = tmp_path / "built"  # the forked workers build theirs: a file sees them
    if client == "obstore":  # this process may have imported obstore: a fresh one reads
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        reader = context.Process(
            target=_fresh_streams,
            args=(queue, record, *urls, tmp_path / "ours" if cached else None),
        )
        reader.start()
        ours = queue.get(timeout=240)
        reader.join(timeout=60)
    else:
        monkeypatch.setenv("SAVABLE_LOADER_OBSTORE", "0")
        monkeypatch.setattr(s3_client, "_build", s3_client._build)  # undone after the test
        _recording(s3_client, record)
        ours = _streams(*urls, tmp_path / "ours" if cached else None)
    built = [line.split() for line in record.read_text().splitlines()]
    assert len({pid for pid, _ in built}) >= 2  # the workers' own clients
    assert all(made == "True" for _, made in built)
    monkeypatch.setenv("SAVABLE_LOADER_OBSTORE", "0")
    monkeypatch.setattr(s3_client, "_build", lambda fs: None)
    assert _streams(*urls, tmp_path / "s3fs" if cached else None) == ours


@pytest.mark.parametrize("cached", [False, True], ids=["direct", "cache"])
def test_a_stream_read_through_botocore_resumes_exactly(
    s3: Any, tmp_path: Path, cached: bool
) -> None:
    """The resume-equivalence harness over tar shards read as they download (cached) or
    a table's files read whole (direct), both through botocore's client in two workers."""
    for shard in range(2):
        s3.put(f"tar/{shard}.tar", _tar(40, 128_000))
    rows = [s3.put(f"files/{i}.bin", bytes([i]) * 700) for i in range(16)]
    s3.put("rows.jsonl", "".join(f'{{"file": "{url}"}}\n' for url in rows).encode())

    def build() -> SavableDataLoader:
        if cached:
            source: Any = TarSource(
                s3.url("tar/*.tar"), storage_options=s3.options(), cache_dir=tmp_path / "c"
            )
        else:
            source = TableSource(
                s3.url("rows.jsonl"), files="file", storage_options=s3.options(), shuffle=True
            )
        return SavableDataLoader(source, batch_size=4, num_workers=2)

    # Chains saved inline (from the resumed loader, which goes on): the same saves and
    # restores with one fresh loader fewer a chain.
    report = assert_resumes_exactly(
        build, num_points=3, chain_items=(2,), boundaries=False, inline_chains=True
    )
    assert report.restores >= 3
