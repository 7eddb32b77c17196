"""The fsspec filesystems the library reads and writes through (NOTE [ Shared service models ]).

NOTE [ Shared service models ]
An S3 client (botocore's, under s3fs) starts by parsing its service's models, JSON files
that botocore ships: on this project's 2-core machine about 130 ms of a worker's CPU, of the
160 ms it takes to build a client and send its first request. botocore keeps what it parsed in
its session's ``data_loader`` and every session has its own, so every process parses again:
each DataLoader worker, at every epoch with ``persistent_workers=False``, and each worker
restarted after a fault.

:func:`url_to_fs` builds filesystems as ``fsspec.url_to_fs`` does, and gives an s3fs
filesystem that has no session yet a session of its own, made as s3fs would make it
(``AioSession(**fs.kwargs)``), whose ``data_loader`` is this process's one loader for that
session's data path. A worker forked after the main process built an S3 client inherits the
loader with the models already parsed: its first client costs it about 35 ms of CPU instead of
160 ms. Only the loader, a cache of files read from disk, is shared; the session (credentials,
their refresh, the event hooks) and the client are built in each process, as before.

A filesystem whose session the user gave (``session=`` in the storage options), or that
already made one (the user's own use of the same cached filesystem), keeps it; the first
session the process sees for a data path, whoever made it, gives the process its loader.
Other filesystems are left alone, and so are s3fs filesystems should s3fs stop keeping
its extra arguments as ``kwargs``: they work as before, only slower to start.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from typing import Any

import fsspec

__all__ = ["made_session", "start_client", "url_to_fs"]

#: This process's botocore loaders by data path (NOTE [ Shared service models ]); a forked
#: child inherits them.
_LOADERS: dict[str | None, Any] = {}
#: The sessions already looked at, so that a filesystem from fsspec's cache costs no lock.
_SEEN: weakref.WeakSet[Any] = weakref.WeakSet()
#: The sessions :func:`url_to_fs` made, as s3fs would, for filesystems without one.
_MADE: weakref.WeakSet[Any] = weakref.WeakSet()
_LOCK = threading.Lock()


def url_to_fs(url: str, **storage_options: Any) -> tuple[Any, str]:
    """``fsspec.url_to_fs(url, **storage_options)``, with the S3 client's service models
    shared by the process (NOTE [ Shared service models ])."""
    fs, path = fsspec.url_to_fs(url, **storage_options)
    _share_models(fs)
    return fs, path


def _share_models(fs: Any) -> None:
    """Gives ``fs``, an s3fs filesystem without a session, one whose data loader is the
    process's; the first session seen, ours or not, gives the process its loader (NOTE
    [ Shared service models ])."""
    s3fs = sys.modules.get("s3fs")  # fsspec imported it if fs is one of its filesystems
    if s3fs is None or not isinstance(fs, s3fs.S3FileSystem):
        return
    if fs.session in _SEEN:
        return
    kwargs = getattr(fs, "kwargs", None)
    if fs.session is None and not isinstance(kwargs, dict):
        return
    from aiobotocore.session import AioSession

    with _LOCK:
        session = fs.session or AioSession(**(kwargs or {}))
        data_path = session.get_config_variable("data_path")
        loader = _LOADERS.get(data_path)
        if loader is None:  # the first: its loader becomes the process's
            _LOADERS[data_path] = session.get_component("data_loader")
        elif fs.session is None:
            session.register_component("data_loader", loader)
        if fs.session is None:
            fs.session = session
            _MADE.add(session)
        _SEEN.add(fs.session)


def made_session(session: Any) -> bool:
    """Whether :func:`url_to_fs` made ``session`` from the filesystem's own arguments, as
    s3fs would (not a session the user gave, whose settings are not known here)."""
    return session is not None and session in _MADE


def start_client(fs: Any) -> None:
    """Builds an s3fs filesystem's client now, before two threads send its first requests
    at once: s3fs releases up to 2024.6 (the lowest this project supports) build it without
    a lock, so both would build one and one would never be closed. Other filesystems are
    left alone. An error is left to the request that follows, which raises it."""
    connect = getattr(fs, "connect", None)
    if callable(connect) and callable(getattr(fs, "_call_s3", None)):
        with contextlib.suppress(Exception):
            connect()
