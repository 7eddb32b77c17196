"""S3 clients share the process's parsed service models (NOTE [ Shared service models ]).

Against moto's loopback S3 server (``tests/support/s3_server.py``): a filesystem the library
builds gets a session of its own whose botocore data loader is the process's one; a
session the user gave is kept; a forked DataLoader worker builds its
client and answers its first request without parsing a model file again.
"""

from __future__ import annotations

import functools
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
import pytest
from s3_server import S3, S3FS_WARNINGS

from savable_loader import SavableDataLoader
from savable_loader.datasets import IndexedDataset, JsonLinesSource
from savable_loader.storage.filesystems import start_client, url_to_fs

pytestmark = [S3FS_WARNINGS]

#: The model files botocore parsed, in this process or a worker forked from it
#: (:func:`_count_parsing`).
_PARSED: list[str] = []


def _fresh(s3: S3, **extra: Any) -> dict[str, Any]:
    """Storage options that fsspec's instance cache has not seen in this test."""
    return {**s3.options(), "skip_instance_cache": True, **extra}


def _read_in_worker(url: str, options: dict[str, Any], index: int) -> tuple[bytes, list[str]]:
    """In a DataLoader worker: ``url`` read through a new filesystem, and the model files
    parsed in that worker."""
    fs, _ = url_to_fs(url, **options)
    return fs.cat_file(url), list(_PARSED)


def _count_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, every model file botocore parses goes to :data:`_PARSED`."""
    from botocore.loaders import JSONFileLoader

    load = JSONFileLoader.load_file

    def counted(self: Any, file_path: str) -> Any:
        _PARSED.append(str(file_path))
        return load(self, file_path)

    monkeypatch.setattr(JSONFileLoader, "load_file", counted)
    monkeypatch.setattr(sys.modules[__name__], "_PARSED", [])


def test_filesystems_share_one_data_loader_and_keep_their_own_sessions(s3: S3) -> None:
    first, _ = url_to_fs(s3.url("a"), **_fresh(s3))
    second, path = url_to_fs(s3.url("b"), **_fresh(s3, default_block_size=2**20))
    assert path == second._strip_protocol(s3.url("b"))
    assert first is not second
    assert first.session is not second.session
    assert first.session.get_component("data_loader") is second.session.get_component("data_loader")
    s3.put("a", b"first")
    assert first.cat_file(s3.url("a")) == b"first"


def test_a_session_the_user_gave_is_kept(s3: S3) -> None:
    from aiobotocore.session import AioSession

    given = AioSession()
    fs, _ = url_to_fs(s3.url("a"), **_fresh(s3, session=given))
    assert fs.session is given
    s3.put("a", b"mine")
    assert fs.cat_file(s3.url("a")) == b"mine"


def test_the_session_takes_the_options_s3fs_gives_its_own(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "aws-config"
    config.write_text("[profile elsewhere]\nregion = eu-west-3\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    fs, _ = url_to_fs(s3.url("a"), **_fresh(s3, profile="elsewhere"))
    assert fs.session.profile == "elsewhere"
    assert fs.session.get_config_variable("region") == "eu-west-3"
    s3.put("a", b"profiled")
    assert fs.cat_file(s3.url("a")) == b"profiled"


def test_other_filesystems_are_left_alone() -> None:
    fs, path = url_to_fs("memory://shared-models/a")
    assert fs is fsspec.filesystem("memory")
    assert path == "/shared-models/a"


def test_a_forked_worker_parses_no_model_again(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    s3.put("a", b"parent")
    parent, _ = url_to_fs(s3.url("a"), **_fresh(s3))
    assert parent.cat_file(s3.url("a")) == b"parent"  # the parent's client parsed them
    _count_parsing(monkeypatch)
    read = functools.partial(_read_in_worker, s3.url("a"), _fresh(s3))
    with SavableDataLoader(
        IndexedDataset(range(1)).map(read),
        batch_size=None,
        num_workers=1,
        multiprocessing_context="fork",
    ) as loader:
        [(data, parsed_there)] = list(loader)
    assert data == b"parent"
    assert parsed_there == []
    # Without the shared loader a client parses its models: the check can fail.
    fresh = fsspec.filesystem("s3", **_fresh(s3))
    assert fresh.cat_file(s3.url("a")) == b"parent"
    assert any("s3" in path for path in _PARSED)


def test_workers_read_s3_through_the_shared_models(s3: S3) -> None:
    lines = [f'{{"id": {i}}}' for i in range(40)]
    s3.put("part-0.jsonl", "\n".join(lines[:20]).encode() + b"\n")
    s3.put("part-1.jsonl", "\n".join(lines[20:]).encode() + b"\n")
    source = JsonLinesSource(s3.url("part-*.jsonl"), storage_options=s3.options())
    with SavableDataLoader(source, batch_size=5, num_workers=2, collate_fn=list) as loader:
        ids = sorted(item["id"] for batch in loader for item in batch)
    assert ids == list(range(40))


def test_start_client_builds_one_client_before_concurrent_first_requests(s3: S3) -> None:
    fs, _ = url_to_fs(s3.url("a"), **_fresh(s3))
    assert fs._s3 is None
    start_client(fs)
    client = fs._s3
    assert client is not None
    start_client(fs)  # once built, kept
    s3.put("a", b"x")
    with ThreadPoolExecutor(4) as pool:  # first requests from several threads at once
        assert list(pool.map(fs.cat_file, [s3.url("a")] * 4)) == [b"x"] * 4
    assert fs._s3 is client


def test_start_client_leaves_other_filesystems_and_errors_alone(s3: S3, tmp_path: Path) -> None:
    local = fsspec.filesystem("file")
    start_client(local)  # nothing to build
    assert local.ls(str(tmp_path)) == []
    options = {**_fresh(s3), "client_kwargs": {"endpoint_url": "not a url"}}
    broken, _ = url_to_fs(s3.url("a"), **options)
    start_client(broken)  # the client cannot be built: the first request says why
    with pytest.raises(ValueError, match="not a url"):
        broken.cat_file(s3.url("a"))
