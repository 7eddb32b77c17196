"""A loopback S3 endpoint for tests: moto's server mode, one bucket, boto3 and s3fs access.

Nothing is mocked in process: the bytes go through fsspec, s3fs and botocore over HTTP,
as they would to AWS. ``tests/conftest.py`` wires it in as two fixtures: ``endpoint_url``
(one server per test module) and ``s3`` (a bucket of the test's own, as :class:`S3`).

Credentials and the endpoint reach s3fs either as storage options (:meth:`S3.options`)
or the usual way, through the ``AWS_*`` environment variables
(:meth:`S3.use_environment`; botocore reads ``AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from savable_loader.testing.proxy import FaultProxy

__all__ = [
    "BUCKET",
    "KEY_ID",
    "REGION",
    "S3",
    "S3FS_WARNINGS",
    "SECRET",
    "RecordingProxy",
    "moto_server",
    "s3_access",
]

BUCKET = "savable-loader-tests"
REGION = "us-east-1"
KEY_ID = "testing"
SECRET = "testing"

# fsspec warns once, when it first imports s3fs, if s3fs predates 2023 (the resolver
# once picked s3fs 0.4.2 beside boto3 1.44, because newer s3fs needs aiobotocore, which
# pins an older botocore). Apply with ``pytestmark = [S3FS_WARNINGS]``.
S3FS_WARNINGS = pytest.mark.filterwarnings(
    "ignore:Your installed version of s3fs is very old:UserWarning"
)

# Names of the threads ThreadedMotoServer starts: its server loop, and werkzeug's
# one-per-request handlers. None may outlive the server.
_SERVER_THREAD_MARKERS = ("_server_entry", "process_request_thread")

# A developer's own AWS setup must stay out: no profile, config file or other endpoint.
_AWS_VARIABLES = (
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
)


def _server_threads() -> list[threading.Thread]:
    return [
        thread
        for thread in threading.enumerate()
        if thread.is_alive() and any(marker in thread.name for marker in _SERVER_THREAD_MARKERS)
    ]


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """Runs moto's S3 server on 127.0.0.1 (a free port) with one bucket; yields its URL.

    The server and its threads are stopped on exit (checked).
    """
    assert _server_threads() == []
    werkzeug_logger = logging.getLogger("werkzeug")
    level = werkzeug_logger.level
    werkzeug_logger.setLevel(logging.ERROR)  # no access log line per request
    from moto.server import ThreadedMotoServer  # NOTE [ Heavy imports last ] in conftest.py

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        client(url).create_bucket(Bucket=BUCKET)
        yield url
    finally:
        # moto keeps its buckets in the process after its server stops: free them (NOTE
        # [ In-memory files ] in conftest.py says why the process's size matters).
        with contextlib.suppress(OSError):
            reset = urllib.request.Request(f"{url}/moto-api/reset", method="POST")
            urllib.request.urlopen(reset, timeout=10).close()
        server.stop()
        _clear_s3fs_instances()
        werkzeug_logger.setLevel(level)
    deadline = time.monotonic() + 5.0
    while _server_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _server_threads() == [], "moto server threads still running after stop()"


def _clear_s3fs_instances() -> None:
    """s3fs caches filesystems by their arguments; an instance made under another test's
    environment must not serve the next one."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def client(endpoint_url: str) -> Any:
    """A boto3 S3 client for the server."""
    import boto3

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

    def put(self, name: str, body: bytes) -> str:
        """Uploads ``body`` under ``name`` with boto3; returns its s3:// URL."""
        self.client.put_object(Bucket=BUCKET, Key=self.key(name), Body=body)
        return self.url(name)

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


@contextlib.contextmanager
def s3_access(endpoint_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3]:
    """A fresh prefix on the server, with the developer's own AWS setup kept out."""
    for name in _AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/savable-loader-tests/config")
    monkeypatch.setenv(
        "AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/savable-loader-tests/credentials"
    )
    _clear_s3fs_instances()
    try:
        yield S3(endpoint_url, f"test-{uuid.uuid4().hex}", client(endpoint_url), monkeypatch)
    finally:
        _clear_s3fs_instances()


class RecordingProxy(FaultProxy):
    """A FaultProxy that keeps the method of every request it receives."""

    def __init__(self, upstream: str, **kwargs: Any) -> None:
        super().__init__(upstream, **kwargs)
        self.methods_seen: list[str] = []

    def decide(self, method: str, path: str) -> str | None:
        with self.lock:
            self.methods_seen.append(method)
        return super().decide(method, path)

    def taken(self) -> list[str]:
        """The methods received since the last call."""
        with self.lock:
            seen, self.methods_seen = self.methods_seen, []
        return seen
