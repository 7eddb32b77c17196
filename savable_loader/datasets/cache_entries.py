"""A cache entry on disk: which URLs have one, its files' names, its signature and validity,
and its atomic commit (NOTE [ File cache ] in ``cache.py``: "An entry", "Writes are atomic").

A damaged sidecar (not JSON, not an object) makes its entry invalid, so the file is
downloaded again. An ``OSError`` of the folder itself, not of the remote file (a full or
read-only disk, a folder where a file should be), is a StorageError naming the folder
(:func:`folder_error`): no retry mends it and the store is not to blame.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import StorageError
from ..storage import describe_error
from .cache_stream import Changed

logger = logging.getLogger(__name__)

__all__ = [
    "cacheable",
    "commit",
    "entry_path",
    "final_error",
    "folder_error",
    "in_folder",
    "is_valid",
    "signature_of",
    "temp_path",
]

_LOCAL = ("file", "local")
#: Errors only a local disk reports: full, over its quota, read-only.
_LOCAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def cacheable(url: str) -> bool:
    """Whether ``url`` is a remote file the cache keeps (local paths and chained
    ``a::b`` URLs are read in place)."""
    if "::" in url or "://" not in url:
        return False
    return url.partition("://")[0] not in _LOCAL


def signature_of(info: dict[str, Any]) -> dict[str, Any]:
    """What an entry is checked against (NOTE [ File cache ]): the remote size and ETag or
    mtime, as the sidecar records them, from fsspec's ``info()`` or a listing's entry for
    the file (which agree on S3; where they do not, an entry is downloaded again)."""
    etag = info.get("ETag", info.get("etag"))
    mtime = next(
        (info[k] for k in ("mtime", "LastModified", "last_modified", "created") if k in info),
        None,
    )
    return {
        "size": int(info.get("size") or 0),
        "etag": None if etag is None else str(etag),
        "mtime": None if mtime is None else str(mtime),
    }


def entry_path(directory: Path, url: str, suffix: str) -> Path:
    """The file of ``url``'s entry with ``suffix`` (``.data``, ``.json``, ``.lock``...)."""
    key = hashlib.sha256(url.encode()).hexdigest()[:40]
    return directory / f"{key}{suffix}"


def in_folder(directory: Path, exc: BaseException) -> bool:
    """Whether ``exc`` is an ``OSError`` of the cache folder ``directory``, not of the
    remote file: about a file in it (the folder included), or a full or read-only disk
    (which a write reports without a file name)."""
    if not isinstance(exc, OSError):
        return False
    if exc.errno in _LOCAL_ERRNOS:
        return True
    named = [name for name in (exc.filename, exc.filename2) if isinstance(name, str | Path)]
    folder = os.path.abspath(directory)
    return any(os.path.commonpath([folder, os.path.abspath(name)]) == folder for name in named)


def folder_error(directory: Path, exc: OSError, url: str | None = None) -> StorageError:
    """The StorageError for ``exc``, an error of the cache folder (:func:`in_folder`): it
    names the folder and its file, not the store, and is never retried."""
    what = "" if url is None else f" for {url}"
    names = [str(name) for name in (exc.filename, exc.filename2) if name is not None]
    where = " -> ".join(names) or directory
    return StorageError(
        f"The cache folder {directory} cannot be used{what}: {where}: {describe_error(exc)}."
    )


def final_error(directory: Path, url: str, exc: BaseException) -> BaseException:
    """What the reader of a streamed download of ``url`` that failed with ``exc`` raises:
    never retried again (a StorageError's attempts are spent; an error of the cache
    folder, :func:`folder_error`, is no fault of the store), else ``exc`` itself. An
    error of the folder is logged at WARNING too: a reader that read every byte before
    the entry was to be written never sees it, and its file is not kept."""
    if isinstance(exc, StorageError):
        return StorageError(str(exc))
    if isinstance(exc, OSError) and in_folder(directory, exc):
        error = folder_error(directory, exc, url)
        logger.warning("%s The file is read from the store but not kept.", error)
        return error
    return exc


def temp_path(directory: Path, url: str) -> Path:
    """A new temp file's path for ``url``'s entry, in the cache's folder."""
    stem = entry_path(directory, url, "").name
    return directory / f".tmp-{stem}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def is_valid(directory: Path, url: str, signature: dict[str, Any]) -> bool:
    """Whether ``url``'s entry holds the file that ``signature`` describes. A damaged
    sidecar (not JSON, not an object, nested too deep to parse) makes the entry invalid,
    so the file is downloaded again."""
    try:
        recorded = json.loads(entry_path(directory, url, ".json").read_text())
        size = entry_path(directory, url, ".data").stat().st_size
    except (OSError, ValueError, RecursionError):
        return False
    return bool(
        isinstance(recorded, dict)
        and recorded.get("url") == url
        and {k: recorded.get(k) for k in signature} == signature
        and size == signature["size"]
    )


def commit(
    directory: Path,
    url: str,
    temp: Path,
    signature: dict[str, Any],
    before_valid: Callable[[int], None],
) -> int:
    """Makes ``temp``, ``url`` downloaded whole, its entry, and returns its size; calls
    ``before_valid(size)`` before the sidecar makes the entry valid. The caller holds the
    download lock and removes ``temp`` if this raises.

    Raises:
        Changed: ``temp``'s size is not the signature's.
    """
    data, sidecar = entry_path(directory, url, ".data"), entry_path(directory, url, ".json")
    with open(temp, "rb+") as out:
        os.fsync(out.fileno())
        got = os.fstat(out.fileno()).st_size
    if got != signature["size"]:
        raise Changed(f"downloaded {got} bytes of {url}, whose size is {signature['size']}")
    sidecar.unlink(missing_ok=True)
    os.replace(temp, data)
    with open(temp, "w") as out:
        json.dump({"url": url, **signature}, out)
        out.flush()
        os.fsync(out.fileno())
    before_valid(got)
    os.replace(temp, sidecar)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return got
