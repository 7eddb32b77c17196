"""S3 clients share the process's parsed service models (NOTE [ Shared service models ]).

Against moto's loopback S3 server (``tests/s3_server.py``): a filesystem the library
builds gets a session of its own whose botocore data loader is the process's one; a
session the user gave is kept; a forked child (what a DataLoader worker is) builds its
client and answers its first request without parsing a model file again.
"""

from __future__ import annotations

import os
import pickle
import select
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
from s3_server import S3, S3FS_WARNINGS

from savable_loader import SavableDataLoader
from savable_loader._filesystems import url_to_fs
from savable_loader.datasets import JsonLinesSource

pytestmark = [S3FS_WARNINGS]

_CHILD_TIMEOUT_S = 60.0


def _fresh(s3: S3, **extra: Any) -> dict[str, Any]:
    """Storage options that fsspec's instance cache has not seen in this test."""
    return {**s3.options(), "skip_instance_cache": True, **extra}


def _in_fork(run: Callable[[], Any]) -> Any:
    """``run()`` in a forked child; its result, or the child's error raised here."""
    reading, writing = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(reading)
        try:
            answer = ("ok", run())
        except BaseException as exc:  # reported to the parent, which fails the test
            answer = ("error", repr(exc))
        with os.fdopen(writing, "wb") as out:
            pickle.dump(answer, out)
        os._exit(0)
    os.close(writing)
    try:
        ready, _, _ = select.select([reading], [], [], _CHILD_TIMEOUT_S)
        assert ready, f"the forked child sent nothing in {_CHILD_TIMEOUT_S} s"
        with os.fdopen(reading, "rb") as got:
            status, value = pickle.load(got)
    finally:
        os.waitpid(pid, 0)
    assert status == "ok", value
    return value


def _json_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The model files botocore parses from now on (paths, in order)."""
    from botocore.loaders import JSONFileLoader

    parsed: list[str] = []
    load = JSONFileLoader.load_file

    def counted(self: Any, file_path: str) -> Any:
        parsed.append(str(file_path))
        return load(self, file_path)

    monkeypatch.setattr(JSONFileLoader, "load_file", counted)
    return parsed


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


def test_a_forked_child_parses_no_model_again(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    s3.put("a", b"parent")
    parent, _ = url_to_fs(s3.url("a"), **_fresh(s3))
    assert parent.cat_file(s3.url("a")) == b"parent"  # the parent's client parsed them
    parsed = _json_reads(monkeypatch)

    def child() -> tuple[bytes, list[str]]:
        fs, _ = url_to_fs(s3.url("a"), **_fresh(s3))
        return fs.cat_file(s3.url("a")), parsed

    data, parsed_there = _in_fork(child)
    assert data == b"parent"
    assert parsed_there == []
    # Without the shared loader a client parses its models: the check can fail.
    fresh = fsspec.filesystem("s3", **_fresh(s3))
    assert fresh.cat_file(s3.url("a")) == b"parent"
    assert any("s3" in path for path in parsed)


def test_workers_read_s3_through_the_shared_models(s3: S3) -> None:
    lines = [f'{{"id": {i}}}' for i in range(40)]
    s3.put("part-0.jsonl", "\n".join(lines[:20]).encode() + b"\n")
    s3.put("part-1.jsonl", "\n".join(lines[20:]).encode() + b"\n")
    source = JsonLinesSource(s3.url("part-*.jsonl"), storage_options=s3.options())
    with SavableDataLoader(source, batch_size=5, num_workers=2, collate_fn=list) as loader:
        ids = sorted(item["id"] for batch in loader for item in batch)
    assert ids == list(range(40))
