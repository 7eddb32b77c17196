"""The library's own GETs through ``obstore`` where it is installed (NOTE [ A client
outside the GIL ]).

NOTE [ A client outside the GIL ]
``obstore`` is the Python binding of Rust's ``object_store``: a request is signed, sent
and parsed on its own threads, without the GIL. One GET of a 16 KB object cost 0.44 ms
of the process's CPU with it, against 2.70 ms with botocore's synchronous client and
0.76 ms for a bare urllib3 GET of a URL signed beforehand (``benchmarks/
bench_client_cost.py``, 2026-11-29): for a table of small files, where every row is a
request, the client's CPU is what bounds the throughput. A ``TableSource`` of 2,000
rows of 16 KB files read from S3 without a cache by 2 workers pinned to one core (moto
on the other) took 1.29 to 1.46 ms of the loader's CPU per row this way, against 3.84
to 4.12 ms with botocore's client and 0.29 to 0.37 ms from local files (3 alternated
rounds; moto's own CPU then bounds the throughput, about 250 rows a second). So where ``obstore``
can be imported (the ``obstore`` extra), the GETs that NOTE [ Synchronous GETs ] in
``storage/s3_client.py`` lists go through an ``S3Store`` of the bucket instead of
botocore's client, under the same conditions (a filesystem whose settings the library
made and can copy), and only when the filesystem's credentials are its own keys, none
(``anon``) or the environment's ``AWS_ACCESS_KEY_ID``: ``object_store`` reads neither
profiles nor botocore's configuration files, so any other filesystem keeps botocore's
client. ``SAVABLE_LOADER_OBSTORE=0`` in the environment turns it off.

Only in a loader's worker processes (:func:`allow_in_worker`, from the loader's
``worker_init_fn``), and only in one that did not inherit ``obstore`` from its parent:
``obstore`` runs its requests on a Tokio runtime, whose threads a ``fork()`` does not
copy, so a process forked after its parent sent a request through ``obstore`` hangs in
its own first request (seen here with 0.12.1). The main process forks the workers, so it
never imports ``obstore``; a worker whose parent had imported it (the user's code did)
keeps botocore's client.

* The store retries nothing itself (``max_retries=0``): NOTE [ Retries ] in
  ``storage/retry.py`` decides, as for every other client. Its errors are turned into
  the ones s3fs's ``translate_boto_error`` gives and the retry module reads: a missing
  object ``FileNotFoundError``, denied ``PermissionError``, a range past the end
  ``OSError(EINVAL)``, a 429 or 5xx answer and a request or body that broke
  ``ConnectionError`` (transient), any other answer ``OSError(EIO)`` (permanent).
* The answer reads as botocore's: ``Body`` (``read(n)``, ``read()``, ``close()``),
  ``ETag`` and ``LastModified`` as botocore gives them, ``ContentRange`` and
  ``ContentLength`` of the bytes sent.
* One store per filesystem, bucket and process; a forked worker builds its own.
"""

from __future__ import annotations

import errno
import functools
import importlib.util
import os
import re
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["allow_in_worker", "enabled", "get_object"]

#: Per filesystem: (the process id they were built in, the stores by bucket).
_STORES: weakref.WeakKeyDictionary[Any, tuple[int, dict[str, Any]]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_SPAN = re.compile(r"bytes=(\d+)-(\d*)$")
_STATUS = re.compile(r"status code: (\d{3})")
#: The worker process that may use obstore (NOTE [ A client outside the GIL ]).
_WORKER: int | None = None


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()
    _STORES.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


@functools.cache
def installed() -> bool:
    """Whether ``obstore`` can be imported. Asked once per process; the loader asks in the
    main process before its workers start, which inherit the answer (a search of
    ``sys.path`` cost each worker about a millisecond before its first batch)."""
    return importlib.util.find_spec("obstore") is not None


def allow_in_worker() -> None:
    """Lets this process, a loader's worker, send its GETs through ``obstore`` unless it
    inherited ``obstore`` from its parent (NOTE [ A client outside the GIL ])."""
    global _WORKER
    if "obstore" not in sys.modules and installed():
        _WORKER = os.getpid()


def enabled() -> bool:
    """Whether this process sends its GETs through ``obstore`` (NOTE [ A client outside
    the GIL ])."""
    return os.getpid() == _WORKER and os.environ.get("SAVABLE_LOADER_OBSTORE", "1") != "0"


def store_for(fs: Any, bucket: str) -> Any:
    """This process's ``S3Store`` of ``bucket`` for ``fs`` (an s3fs filesystem that
    ``storage/s3_client.py`` can copy), or None where its credentials are not known here
    (NOTE [ A client outside the GIL ])."""
    built = _STORES.get(fs)
    if built is None or built[0] != os.getpid():
        with _LOCK:
            built = _STORES.get(fs)
            if built is None or built[0] != os.getpid():
                built = _STORES[fs] = (os.getpid(), {})
    stores = built[1]
    if bucket not in stores:
        stores[bucket] = _build(fs, bucket)
    return stores[bucket]


def _build(fs: Any, bucket: str) -> Any:
    from datetime import timedelta

    from obstore.store import S3Store

    if fs.config_kwargs or fs.kwargs.get("profile"):
        return None
    options: dict[str, Any] = {}
    if fs.anon:
        options["skip_signature"] = True
    elif fs.key and fs.secret:
        options.update(access_key_id=fs.key, secret_access_key=fs.secret)
        if fs.token:
            options["token"] = fs.token
    elif not os.environ.get("AWS_ACCESS_KEY_ID"):
        return None  # a profile, a role or a file: botocore finds them, object_store not
    endpoint = fs.client_kwargs.get("endpoint_url") or fs.endpoint_url
    endpoint = (
        endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        options["endpoint"] = endpoint
    region = fs.client_kwargs.get("region_name") or os.environ.get("AWS_REGION")
    region = region or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    client: Any = {"timeout": timedelta(seconds=60)}
    client["connect_timeout"] = timedelta(seconds=60)
    if endpoint and endpoint.startswith("http://"):
        client["allow_http"] = True
    if fs.client_kwargs.get("verify") is False:
        client["allow_invalid_certificates"] = True
    return S3Store(
        bucket,
        region=region,
        client_options=client,
        retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=1)},
        **options,
    )


@contextmanager
def get_object(store: Any, url: str, key: str, span: str) -> Iterator[dict[str, Any]]:
    """A GET of the byte range ``span`` (an HTTP ``Range``) of ``key`` through ``store``:
    an answer that reads as botocore's (NOTE [ A client outside the GIL ]).

    Raises:
        OSError: What s3fs would raise for the same answer; ``ConnectionError`` for a
            transient one.
    """
    import obstore

    with _translated(url):
        result = obstore.get(store, key, options={"range": _range(span)})
        meta = result.meta
        start, stop = result.range
    body = _Body(result, url)
    answer = {
        "Body": body,
        "ETag": meta.get("e_tag") or "",
        "LastModified": meta.get("last_modified"),
        "ContentLength": stop - start,
        "ContentRange": f"bytes {start}-{stop - 1}/{meta['size']}",
    }
    try:
        yield answer
    finally:
        body.close()


def _range(span: str) -> Any:
    match = _SPAN.match(span)
    if match is None or not match.group(1):  # a suffix: the library sends none
        raise ValueError(f"a Range the library does not send: {span!r}")
    first, last = match.groups()
    if not last:
        return {"offset": int(first)}
    return (int(first), int(last) + 1)


class _Body:
    """The bytes of a GET, read as botocore's streaming body is read."""

    def __init__(self, result: Any, url: str) -> None:
        self._result = result
        self._url = url
        self._chunks: Iterator[Any] | None = None
        self._pending = memoryview(b"")
        self._done = False

    def read(self, size: int | None = None) -> bytes:
        if self._done:
            return b""
        with _translated(self._url):
            if size is None or size < 0:
                if self._chunks is None:
                    self._done = True
                    return bytes(self._result.bytes())
                rest = [bytes(self._pending), *(bytes(chunk) for chunk in self._chunks)]
                self._done = True
                return b"".join(rest)
            if self._chunks is None:
                self._chunks = iter(self._result.stream(min_chunk_size=size))
            if not self._pending:
                chunk = next(self._chunks, None)
                if chunk is None:
                    self._done = True
                    return b""
                self._pending = memoryview(bytes(chunk))
            out, self._pending = self._pending[:size], self._pending[size:]
            return bytes(out)

    def close(self) -> None:
        self._done = True
        self._chunks = None


@contextmanager
def _translated(url: str) -> Iterator[None]:
    """``obstore``'s errors as s3fs's (NOTE [ A client outside the GIL ])."""
    from obstore.exceptions import (
        BaseError,
        GenericError,
        PermissionDeniedError,
        UnauthenticatedError,
    )

    try:
        yield
    except (FileNotFoundError, PermissionError):
        raise
    except (PermissionDeniedError, UnauthenticatedError) as exc:
        raise PermissionError(str(exc).partition(":")[0]) from exc
    except GenericError as exc:
        raise _generic(exc, url) from exc
    except BaseError as exc:
        raise OSError(errno.EIO, str(exc).partition("\n")[0], url) from exc


def _status(exc: BaseException) -> int | None:
    """The HTTP status of the answer ``exc`` reports; None when there was none."""
    found = _STATUS.search(str(exc))
    return None if found is None else int(found.group(1))


def _generic(exc: BaseException, url: str) -> OSError:
    text = str(exc)
    code = _status(exc)
    if code is None:  # no answer: the request or its body broke
        return ConnectionError(errno.ECONNRESET, text.partition("\n")[0], url)
    if code == 416:
        return OSError(errno.EINVAL, "Invalid Range", url)
    if code == 429 or code >= 500:
        return ConnectionError(errno.EAGAIN, f"{code}: {text.partition(chr(10))[0]}", url)
    if code == 404:
        return FileNotFoundError(errno.ENOENT, "Not Found", url)
    if code in (401, 403):
        return PermissionError("Forbidden")
    return OSError(errno.EIO, text.partition("\n")[0], url)
