"""A synchronous botocore client beside an s3fs filesystem, for the GETs the library sends
itself (NOTE [ Synchronous GETs ]).

NOTE [ Synchronous GETs ]
s3fs sends every request through aiobotocore on fsspec's event-loop thread, and the
thread that asked waits for the loop. A GET of a 16 KB object cost 4.5 ms of CPU that
way, against 2.3 ms with botocore's own synchronous client (boto3's); streaming tar
shards through the cache added 0.28 ms of CPU per 100 KB sample over local through s3fs
and 0.19 ms through botocore's client (``benchmarks/bench_client_cost.py``, the same
rounds). So the GETs the library sends itself, not
through a file object (the cache's probe, the rest of a download and the ranges of one
read as it arrives: ``storage/cache/probe.py``; a table's file read whole without a cache:
``storage/counted_reads.py``), go through a botocore client of the process, made for the s3fs
filesystem as s3fs makes its own: from the filesystem's ``client_kwargs``, endpoint,
``use_ssl`` and config options, in a botocore session of the same profile, whose service
models are the process's (NOTE [ Shared service models ] in ``storage/filesystems.py``), and the
same credentials.

* The credentials are the keys the filesystem was given, or none with ``anon``; without
  either, the session finds them as s3fs's session does (the environment, the profile,
  a role), and refreshes them itself. Only what it can copy exactly: a session the
  library made for the filesystem (not one the user gave, whose settings it cannot
  see), no region cache (``cache_regions``), no requester-pays, no extra request
  arguments (``s3_additional_kwargs``), no versions, session arguments that name at most
  a profile, ``client_kwargs`` that botocore's ``create_client`` takes and config options
  that its ``Config`` takes. Any other filesystem is asked through s3fs, as before.
* Errors read as s3fs's: a ``ClientError`` is turned into the ``OSError`` that s3fs's
  ``translate_boto_error`` gives (a missing object ``FileNotFoundError``, a range past
  the end ``OSError(EINVAL)``, denied ``PermissionError``), chained from the original;
  connection, timeout and streaming errors stay botocore's and urllib3's, which NOTE
  [ Retries ] in ``storage/retry.py`` classifies as it does aiobotocore's.
* Where ``obstore`` is installed, these GETs go through it instead (NOTE [ A client
  outside the GIL ] in ``storage/object_store.py``).
* One client per filesystem and process, built at its first GET; botocore's clients are
  thread-safe, so the fetch and prefetch threads share it. A forked child (a DataLoader
  worker) builds its own and closes its copies of the parent's connections.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from . import object_store
from .filesystems import made_session

__all__ = ["get_object"]

#: Per filesystem: (the process id it was built in, the client or None: asked through
#: s3fs). A forked child finds its parent's pid and builds its own.
_CLIENTS: weakref.WeakKeyDictionary[Any, tuple[int, Any]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
#: ``client_kwargs`` that botocore's ``create_client`` takes as s3fs passes them.
_CLIENT_KWARGS = frozenset({"region_name", "endpoint_url", "verify", "use_ssl", "api_version"})


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()
    for _, client in list(_CLIENTS.values()):
        if client is not None:
            client._endpoint.http_session.close()  # this process's copies of the sockets


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextmanager
def get_object(fs: Any, bucket: str, key: str, span: str) -> Iterator[dict[str, Any] | None]:
    """A GET of the byte range ``span`` (an HTTP ``Range``) of ``key`` with ``fs``'s
    synchronous client: its answer (headers and the streaming ``Body``, closed on exit);
    None when ``fs`` is to be asked through s3fs (NOTE [ Synchronous GETs ]).

    Raises:
        OSError: What s3fs would raise for the same answer (``translate_boto_error``).
        Exception: botocore's and urllib3's connection, timeout and streaming errors.
    """
    if object_store.enabled() and _copyable(fs):  # NOTE [ A client outside the GIL ]
        store = object_store.store_for(fs, bucket)
        if store is not None:
            with object_store.get_object(store, f"s3://{bucket}/{key}", key, span) as answer:
                yield answer
            return
    client = _client(fs)
    if client is None:
        yield None
        return
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    try:
        answer = client.get_object(Bucket=bucket, Key=key, Range=span)
    except ClientError as exc:
        raise translate_boto_error(exc) from exc
    try:
        yield answer
    finally:
        answer["Body"].close()


def _client(fs: Any) -> Any:
    built = _CLIENTS.get(fs)  # every GET asks: no lock once this process has built it
    if built is not None and built[0] == os.getpid():
        return built[1]
    with _LOCK:
        built = _CLIENTS.get(fs)
        if built is not None and built[0] == os.getpid():
            return built[1]
        client = _build(fs)
        _CLIENTS[fs] = (os.getpid(), client)
        return client


def _build(fs: Any) -> Any:
    """A synchronous client for ``fs``, made as s3fs makes its own; None where this copy
    could differ from s3fs's client (NOTE [ Synchronous GETs ])."""
    if not _copyable(fs):
        return None
    import botocore
    import botocore.config
    import botocore.session

    config_kwargs = dict(fs._prepare_config_kwargs())
    if not set(config_kwargs) <= set(botocore.config.Config.OPTION_DEFAULTS):
        return None
    init: dict[str, Any] = {"endpoint_url": fs.endpoint_url}
    if "use_ssl" not in fs.client_kwargs:
        init["use_ssl"] = fs.use_ssl
    if fs.anon:
        config_kwargs["signature_version"] = botocore.UNSIGNED
    else:  # none given: the session finds them as s3fs's does, and refreshes them
        init.update(
            aws_access_key_id=fs.key, aws_secret_access_key=fs.secret, aws_session_token=fs.token
        )
    init = {k: v for k, v in init.items() if v is not None and k not in fs.client_kwargs}
    session = botocore.session.Session(profile=fs.kwargs.get("profile"))
    session.register_component("data_loader", fs.session.get_component("data_loader"))
    return session.create_client(
        "s3", config=botocore.config.Config(**config_kwargs), **init, **fs.client_kwargs
    )


def _copyable(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem whose settings the copy can honour."""
    s3fs = sys.modules.get("s3fs")
    return bool(
        s3fs is not None
        and isinstance(fs, s3fs.S3FileSystem)
        and isinstance(getattr(fs, "kwargs", None), dict)
        and set(fs.kwargs) <= {"profile"}
        and isinstance(fs.client_kwargs, dict)
        and set(fs.client_kwargs) <= _CLIENT_KWARGS
        and isinstance(fs.config_kwargs, dict)
        and callable(getattr(fs, "_prepare_config_kwargs", None))
        and not fs.req_kw
        and not fs.s3_additional_kwargs
        and not fs.version_aware
        and not fs.cache_regions
        and made_session(fs.session)
    )
