"""save_state / load_state / ``inspect`` against a real S3 HTTP endpoint.

The endpoint is moto's server mode, started by this module on a free loopback port and
stopped at its end; the bucket is created with boto3. Nothing is mocked in process: the
bytes go through fsspec, s3fs and botocore over HTTP, as they would to AWS. Credentials
and the endpoint reach s3fs either as storage options or the usual way, through the
``AWS_*`` environment variables (botocore reads ``AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
import s3fs
from moto.server import ThreadedMotoServer

from savable_loader import (
    RankState,
    SavableDataLoader,
    WorkerConfig,
    load_state,
    save_state,
)
from savable_loader.cli import main
from savable_loader.errors import StateFormatError, StorageError

pytestmark = [
    # fsspec warns once, when it first imports s3fs, if s3fs predates 2023 (see the
    # report that came with this module: the resolver picks s3fs 0.4.2 beside boto3
    # 1.44, because newer s3fs needs aiobotocore, which pins an older botocore).
    pytest.mark.filterwarnings("ignore:Your installed version of s3fs is very old:UserWarning"),
]

BUCKET = "savable-loader-tests"
REGION = "us-east-1"
KEY_ID = "testing"
SECRET = "testing"

# Names of the threads ThreadedMotoServer starts: its server loop, and werkzeug's
# one-per-request handlers. None may outlive the module's fixture.
_SERVER_THREAD_MARKERS = ("_server_entry", "process_request_thread")


def _server_threads() -> list[threading.Thread]:
    return [
        thread
        for thread in threading.enumerate()
        if thread.is_alive() and any(marker in thread.name for marker in _SERVER_THREAD_MARKERS)
    ]


@pytest.fixture(scope="module")
def endpoint_url() -> Iterator[str]:
    """Runs moto's S3 server on 127.0.0.1 (a free port) with one bucket; stops it after."""
    assert _server_threads() == []
    werkzeug_logger = logging.getLogger("werkzeug")
    level = werkzeug_logger.level
    werkzeug_logger.setLevel(logging.ERROR)  # no access log line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        _client(url).create_bucket(Bucket=BUCKET)
        yield url
    finally:
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()
        werkzeug_logger.setLevel(level)
    deadline = time.monotonic() + 5.0
    while _server_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _server_threads() == [], "moto server threads still running after stop()"


def _client(endpoint_url: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
        region_name=REGION,
    )


@dataclass
class S3:
    """One test's view of the server: a fresh key prefix, boto3, and how to reach s3fs."""

    endpoint_url: str
    prefix: str
    client: Any
    monkeypatch: pytest.MonkeyPatch

    def url(self, name: str) -> str:
        return f"s3://{BUCKET}/{self.prefix}/{name}"

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def options(self) -> dict[str, Any]:
        """Storage options that carry the endpoint and credentials themselves."""
        return {
            "key": KEY_ID,
            "secret": SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION},
            "skip_instance_cache": True,
        }

    def use_environment(self) -> dict[str, Any]:
        """Sets the AWS_* variables; returns the (empty) storage options that then suffice."""
        self.monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
        self.monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        self.monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
        self.monkeypatch.setenv("AWS_ENDPOINT_URL", self.endpoint_url)
        return {}

    def access(self, how: str) -> dict[str, Any]:
        return self.options() if how == "options" else self.use_environment()

    def keys(self) -> list[str]:
        listing = self.client.list_objects_v2(Bucket=BUCKET, Prefix=f"{self.prefix}/")
        return sorted(item["Key"] for item in listing.get("Contents", []))


@pytest.fixture
def s3(endpoint_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3]:
    # Keep a developer's own AWS setup out: no profile, config file or other endpoint.
    for name in (
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_DEFAULT_REGION",
        "AWS_REGION",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/savable-loader-tests/config")
    monkeypatch.setenv(
        "AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/savable-loader-tests/credentials"
    )
    # s3fs caches filesystems by their arguments; an instance made under another
    # test's environment must not serve this one.
    s3fs.S3FileSystem.clear_instance_cache()
    yield S3(endpoint_url, f"test-{uuid.uuid4().hex}", _client(endpoint_url), monkeypatch)
    s3fs.S3FileSystem.clear_instance_cache()


def _batches(iterable: Any) -> list[list[int]]:
    return [batch.tolist() for batch in iterable]


def _take(loader: SavableDataLoader, count: int) -> list[list[int]]:
    iterator = iter(loader)
    return [next(iterator).tolist() for _ in range(count)]


def _state_after(batches: int, **kwargs: Any) -> RankState:
    with SavableDataLoader(list(range(30)), batch_size=4, **kwargs) as loader:
        _take(loader, batches)
        return loader.save_state_rank()


# save_state / load_state.


@pytest.mark.parametrize(
    ("num_workers", "how"), [(0, "options"), (2, "options"), (0, "environment")]
)
def test_resume_from_s3(s3: S3, num_workers: int, how: str) -> None:
    options = s3.access(how)
    url = s3.url("ckpt/loader.state")
    with SavableDataLoader(list(range(30)), batch_size=4, num_workers=num_workers) as original:
        head = _take(original, 3)
        save_state(original.save_state_rank(), url, **options)
        # The rest of this epoch, and the whole next one.
        expected = _batches(original) + _batches(original)

    assert s3.keys() == [s3.key("ckpt/loader.state")]
    state = load_state(url, **options)
    assert isinstance(state, RankState)
    with SavableDataLoader(list(range(30)), batch_size=4, num_workers=num_workers) as resumed:
        resumed.restore_state_rank(state)
        got = _batches(resumed) + _batches(resumed)

    assert got == expected
    assert len(head) + len(expected) == 8 + 8  # 30 items in batches of 4, two epochs
    assert got[0] != head[0]


def test_list_of_rank_states_round_trips(s3: S3) -> None:
    options = s3.use_environment()
    url = s3.url("global.state")
    states = [
        _state_after(2, worker_config=WorkerConfig(rank=rank, world_size=2)) for rank in (0, 1)
    ]
    save_state(states, url, **options)

    loaded = load_state(url, **options)

    assert isinstance(loaded, list)
    assert [state.to_plain() for state in loaded] == [state.to_plain() for state in states]
    assert [(state.rank, state.world_size) for state in loaded] == [(0, 2), (1, 2)]
    for rank, state in enumerate(loaded):
        config = WorkerConfig(rank=rank, world_size=2)
        with SavableDataLoader(list(range(30)), batch_size=4, worker_config=config) as loader:
            loader.restore_state_rank(state)
            # Rank r holds items r, r+2, ...; two batches of 4 were taken.
            assert next(iter(loader)).tolist() == [16 + rank, 18 + rank, 20 + rank, 22 + rank]


# Errors.


@pytest.mark.parametrize("where", ["key", "bucket"])
def test_missing_object_is_not_found(s3: S3, where: str) -> None:
    if where == "key":
        url = s3.url("never-written.state")
    else:
        url = f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}/loader.state"

    with pytest.raises(StorageError, match="not found") as caught:
        load_state(url, **s3.options())

    assert url in str(caught.value)


@pytest.mark.parametrize("damage", ["random", "truncated"])
def test_corrupt_object_is_a_format_error(s3: S3, damage: str) -> None:
    options = s3.options()
    url = s3.url("corrupt.state")
    if damage == "random":
        body = random.Random(0).randbytes(300)
    else:
        save_state(_state_after(1), url, **options)
        whole = s3.client.get_object(Bucket=BUCKET, Key=s3.key("corrupt.state"))["Body"].read()
        body = whole[: len(whole) // 2]
    s3.client.put_object(Bucket=BUCKET, Key=s3.key("corrupt.state"), Body=body)

    with pytest.raises(StateFormatError):
        load_state(url, **options)


def test_overwrite_keeps_the_newest(s3: S3) -> None:
    options = s3.options()
    url = s3.url("loader.state")
    older, newer = _state_after(1), _state_after(5)
    assert older.to_plain() != newer.to_plain()

    save_state(older, url, **options)
    save_state(newer, url, **options)

    loaded = load_state(url, **options)
    assert isinstance(loaded, RankState)
    assert loaded.to_plain() == newer.to_plain()
    assert s3.keys() == [s3.key("loader.state")]


# The inspect command, configured through the environment as a user would.


def test_inspect_prints_the_summary(s3: S3, capsys: pytest.CaptureFixture[str]) -> None:
    url = s3.url("ckpt/loader.state")
    state = _state_after(3)
    save_state(state, url, **s3.options())
    size = s3.client.head_object(Bucket=BUCKET, Key=s3.key("ckpt/loader.state"))["ContentLength"]
    s3.use_environment()
    s3fs.S3FileSystem.clear_instance_cache()

    assert main(["inspect", url]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert f"savable_loader state file: {url}" in out
    assert f"{size:,} bytes" in out
    assert "rank 0 of 1: no workers, batch size 4, seed 0" in out
    assert f"fingerprint {state.fingerprint}" in out

    assert main(["inspect", "--json", url]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["url"] == url
    assert summary["file_size"] == size
    assert summary["kind"] == "rank"
    assert summary["ranks"][0]["fingerprint"] == state.fingerprint


def test_inspect_missing_object_exits_2(s3: S3, capsys: pytest.CaptureFixture[str]) -> None:
    s3.use_environment()
    url = s3.url("never-written.state")

    assert main(["inspect", url]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == f"savable-loader inspect: {url}: Cannot read {url}: not found."
