"""GETs through obstore read as botocore's (NOTE [ A client outside the GIL ] in
``storage/object_store.py``): the same bytes, headers and errors, the same verdicts on
what is worth a retry; and only in a worker that did not inherit obstore."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("obstore")

from savable_loader.storage import object_store, s3_client
from savable_loader.storage.filesystems import url_to_fs
from savable_loader.storage.retry import is_transient
from savable_loader.testing import FaultProxy


def _options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }


def _answer(url: str, span: str, options: dict[str, Any], client: str) -> dict[str, Any]:
    """What a GET of ``span`` of ``url`` answers through ``client``: its headers and its
    bytes read whole and read 7 bytes at a time, or the error it raised."""
    fs = url_to_fs(url, **options)[0]
    bucket, key, _ = fs.split_path(url)

    def read(answer: dict[str, Any]) -> dict[str, Any]:
        names = ("ETag", "LastModified", "ContentRange", "ContentLength")
        return {name: answer.get(name) for name in names}

    try:
        if client == "obstore":
            store = object_store.store_for(fs, bucket)
            assert store is not None
            with object_store.get_object(store, url, key, span) as answer:
                whole = answer["Body"].read()
                seen = read(answer)
            with object_store.get_object(store, url, key, span) as answer:
                pieces = list(iter(lambda: answer["Body"].read(7), b""))
        else:
            with s3_client.get_object(fs, bucket, key, span) as answer:
                assert answer is not None
                whole = answer["Body"].read()
                seen = read(answer)
            with s3_client.get_object(fs, bucket, key, span) as answer:
                assert answer is not None
                pieces = list(iter(lambda: answer["Body"].read(7), b""))
    except Exception as error:  # botocore's streaming errors are not OSErrors
        found = {"error": type(error), "transient": is_transient(error)}
        return {**found, "errno": getattr(error, "errno", None)}
    assert all(len(piece) <= 7 for piece in pieces)
    return {**seen, "whole": whole, "pieces": b"".join(pieces)}


@pytest.mark.parametrize("size", [0, 1, 1000, 70_000])
def test_an_answer_reads_as_botocores(s3: Any, size: int) -> None:
    url = s3.put(f"blob-{size}.bin", bytes(range(251)) * (size // 251) + bytes(size % 251))
    for span in ("bytes=0-", "bytes=0-99", "bytes=10-", "bytes=0-999999"):  # what it sends
        botocore = _answer(url, span, s3.options(), "botocore")
        ours = _answer(url, span, s3.options(), "obstore")
        assert ours == botocore, span
        if "whole" in ours:
            assert ours["pieces"] == ours["whole"]


@pytest.fixture
def proxy(endpoint_url: str) -> Iterator[FaultProxy]:
    with FaultProxy(endpoint_url, seed=0) as started:
        yield started


@pytest.mark.parametrize("fault", ["missing", "denied", "slow down", "cut"])
def test_an_error_reads_as_botocores(
    s3: Any, proxy: FaultProxy, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # botocore's own retries (4, backing off for seconds) only delay the error compared.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    url = s3.put("blob.bin", b"x" * 5000)
    if fault == "missing":
        url += ".gone"
    proxy.deny = ("blob.bin",) if fault == "denied" else ()
    proxy.slow_down = 1.0 if fault == "slow down" else 0.0
    proxy.cut = 1.0 if fault == "cut" else 0.0
    options = _options(proxy.url)
    botocore = _answer(url, "bytes=0-", options, "botocore")
    ours = _answer(url, "bytes=0-", options, "obstore")
    assert ours["transient"] is botocore["transient"] is (fault in ("slow down", "cut"))
    if fault in ("missing", "denied"):
        assert ours == botocore
        assert ours["error"] is (FileNotFoundError if fault == "missing" else PermissionError)


def test_only_a_worker_that_did_not_inherit_obstore_uses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(object_store, "_WORKER", None)
    assert not object_store.enabled()  # the main process: it forks the workers
    object_store.allow_in_worker()  # this test process imported obstore: as inherited
    assert not object_store.enabled()
    for name in [name for name in sys.modules if name.split(".")[0] == "obstore"]:
        monkeypatch.delitem(sys.modules, name)
    object_store.allow_in_worker()
    assert object_store.enabled()
    monkeypatch.setenv("SAVABLE_LOADER_OBSTORE", "0")
    assert not object_store.enabled()


def test_a_store_is_built_only_for_credentials_it_can_read(
    s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = s3.options()
    fs = url_to_fs(s3.url("x"), **options)[0]
    assert object_store.store_for(fs, "b") is not None  # its own keys
    anon = url_to_fs(s3.url("x"), anon=True, client_kwargs=options["client_kwargs"])[0]
    assert object_store.store_for(anon, "b") is not None
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    found = url_to_fs(s3.url("x"), client_kwargs=options["client_kwargs"])[0]
    assert object_store.store_for(found, "b") is None  # a profile or a role: botocore's
    configured = url_to_fs(s3.url("x"), config_kwargs={"connect_timeout": 5}, **options)[0]
    assert object_store.store_for(configured, "b") is None
