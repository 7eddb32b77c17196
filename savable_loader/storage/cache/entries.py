"""A cache entry on disk: which URLs have one, its files' names, its signature and validity,
its checksum, and its atomic commit (NOTE [ File cache ] in ``storage/cache/node.py``: "An entry",
"Writes are atomic").

A damaged sidecar (not JSON, not an object) makes its entry invalid, so the file is
downloaded again. An ``OSError`` of the folder itself, not of the remote file (a full or
read-only disk, a folder where a file should be), is a StorageError naming the folder
(:func:`folder_error`): no retry mends it and the store is not to blame.

NOTE [ Checked entries ]
A sidecar records the CRC-32 of its entry's bytes (``zlib.crc32``), computed as they land
from the store (by :func:`~.cache_probe.write_rest` and ``fetch_into``), so a download
costs no extra pass; only a file that fsspec writes itself (``get_file``: stores other
than unversioned S3) is read back once for it. An entry whose bytes no longer match (a
flipped bit, a file written over in place) is damaged: it is never served, a WARNING
names it, and it is downloaded again as an invalid entry is. A sidecar without a
checksum (written by an older release) makes its entry invalid: downloaded once more.

When: once per file per cache object (``FileCache``, one per source and process), at the
first open of that file, before any byte of it is handed on, and again whenever the entry
is another file (a new inode: replaced by a download). Not at every open: a data file is
never written in place by the cache (a download replaces it by a rename), so a file that
matched keeps matching unless something outside the cache writes into it while the
process runs, and a check at every open would cost every epoch a full extra read of
every file: about 1 ms per MB (0.15 ms of it the read, from the page cache), where
reading a cached entry for its samples costs the read alone. The checks of prefetched
entries run in the prefetch threads, off the reader's path.

NOTE [ A shared folder ]
Whoever can write the cache folder can plant names in it. So the cache follows no link
there: every file it opens in the folder is opened with ``O_NOFOLLOW`` (:func:`open_fd`),
every file it replaces or removes is refused if it is a link (:func:`refuse_link`), and
a link where a cache file should be is a StorageError naming it, as a folder in its place
is; the file a link names is never read, written, created or touched. Eviction counts,
keeps and removes regular files only. New files are created exclusively
(``O_EXCL``) under random names, then renamed into place; nothing is written in place,
so lock files are opened read-only (``flock`` needs no more). The files and the folder
the cache creates are ``0o644`` and ``0o755`` (less by the umask): no other user can
write into them or plant names in a folder the cache made. A folder shared by several
users is made by them, sticky (``chmod 1777``) or group-owned, and its entries are
usable by all only as far as its permissions let them replace and remove each other's.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import stat
import threading
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import StorageError
from ..urls import describe_error
from .download import Changed

logger = logging.getLogger(__name__)

__all__ = [
    "FILE_MODE",
    "Verified",
    "cacheable",
    "checksum",
    "commit",
    "entry_path",
    "final_error",
    "folder_error",
    "in_folder",
    "intact",
    "is_valid",
    "linked",
    "open_fd",
    "refuse_link",
    "replace_file",
    "signature_of",
    "temp_path",
]

#: The mode of the files the cache creates (NOTE [ A shared folder ]).
FILE_MODE = 0o644
_CHUNK_BYTES = 2**20
#: The files a :class:`Verified` remembers: 10 MB at most.
_VERIFIED_MAX = 2**16

_LOCAL = ("file", "local")
#: Errors only a local disk reports: full, over its quota, read-only.
_LOCAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


class Verified:
    """The data files one cache object checked (NOTE [ Checked entries ]): whether each
    matched its checksum, by (device, inode, size, checksum); the oldest forgotten past
    :data:`_VERIFIED_MAX` (checked again if opened again)."""

    def __init__(self) -> None:
        self._results: dict[tuple[int, int, int, int], bool] = {}
        self._mutex = threading.Lock()

    def get(self, key: tuple[int, int, int, int]) -> bool | None:
        with self._mutex:
            return self._results.get(key)

    def put(self, key: tuple[int, int, int, int], matched: bool) -> None:
        with self._mutex:
            self._results.pop(key, None)
            self._results[key] = matched
            while len(self._results) > _VERIFIED_MAX:
                del self._results[next(iter(self._results))]


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


def linked(path: Path) -> OSError:
    """The error of a link where the cache expects its own file (NOTE [ A shared folder ])."""
    return OSError(errno.ELOOP, "it is a symbolic link, which the cache never follows", str(path))


def open_fd(path: Path, flags: int) -> int:
    """``path`` opened with ``flags`` (created :data:`FILE_MODE`), never through a link.

    Raises:
        OSError: :func:`linked` for a link; what ``os.open`` raised.
    """
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise linked(path) from None
        raise


def refuse_link(path: Path) -> None:
    """Raises :func:`linked` if ``path`` is a link (a missing file is none)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISLNK(os.lstat(path).st_mode):
            raise linked(path)


def _write_new(path: Path, data: bytes, *, sync: bool) -> None:
    """Creates ``path``, which must not exist, holding ``data``."""
    with os.fdopen(open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as out:
        out.write(data)
        out.flush()
        if sync:
            os.fsync(out.fileno())


def replace_file(directory: Path, name: str, data: bytes) -> None:
    """Makes ``directory / name`` hold ``data`` by a rename, never writing into a file."""
    target = directory / name
    refuse_link(target)
    temp = directory / f".tmp-{name.lstrip('.')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _write_new(temp, data, sync=False)
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def checksum(fd: int) -> int:
    """The CRC-32 of the bytes of ``fd`` from its position on (NOTE [ Checked entries ])."""
    crc, buffer = 0, bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    while count := os.readv(fd, [buffer]):
        crc = zlib.crc32(view[:count], crc)
    return crc


def temp_path(directory: Path, url: str) -> Path:
    """A new temp file's path for ``url``'s entry, in the cache's folder."""
    stem = entry_path(directory, url, "").name
    return directory / f".tmp-{stem}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _recorded(directory: Path, url: str, signature: dict[str, Any]) -> int | None:
    """The checksum the sidecar of ``url``'s entry records when the entry holds the file
    that ``signature`` describes, else None.

    Raises:
        OSError: :func:`linked`, for a link in place of the data file or the sidecar.
    """
    try:
        mode = os.lstat(entry_path(directory, url, ".data"))
        fd = open_fd(entry_path(directory, url, ".json"), os.O_RDONLY)
        with os.fdopen(fd, "rb") as file:
            recorded = json.loads(file.read())
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise
        return None
    except (ValueError, RecursionError):
        return None
    if stat.S_ISLNK(mode.st_mode):
        raise linked(entry_path(directory, url, ".data"))
    valid = (
        isinstance(recorded, dict)
        and recorded.get("url") == url
        and {k: recorded.get(k) for k in signature} == signature
        and mode.st_size == signature["size"]
        and type(recorded.get("crc32")) is int
    )
    return recorded["crc32"] if valid else None


def is_valid(directory: Path, url: str, signature: dict[str, Any]) -> bool:
    """Whether ``url``'s entry holds the file that ``signature`` describes, by its
    sidecar (:func:`intact` checks its bytes). A damaged sidecar (not JSON, not an object,
    nested too deep to parse, no checksum) makes the entry invalid, so the file is
    downloaded again.

    Raises:
        OSError: :func:`linked`, for a link in place of the data file or the sidecar.
    """
    return _recorded(directory, url, signature) is not None


def intact(directory: Path, url: str, signature: dict[str, Any], verified: Verified) -> bool:
    """Whether ``url``'s entry is valid (:func:`is_valid`) and its bytes have the checksum
    its sidecar records, computed unless ``verified`` holds the result for this file
    (NOTE [ Checked entries ]); marks the entry used (its mtime) for eviction.

    Raises:
        OSError: :func:`linked`, for a link in place of the data file or the sidecar.
    """
    crc = _recorded(directory, url, signature)
    if crc is None:
        return False
    data = entry_path(directory, url, ".data")
    try:
        fd = open_fd(data, os.O_RDONLY)
    except FileNotFoundError:
        return False  # evicted since
    try:
        with contextlib.suppress(PermissionError):  # another user's entry
            os.utime(fd)
        found = os.fstat(fd)
        key = (found.st_dev, found.st_ino, found.st_size, crc)
        matched = verified.get(key)
        if matched is None:
            matched = checksum(fd) == crc
            verified.put(key, matched)
            if not matched:
                logger.warning(
                    "The cache entry %s of %s is damaged (its checksum is not the one recorded "
                    "at its download): it is downloaded again.",
                    data,
                    url,
                )
        return matched
    finally:
        os.close(fd)


def commit(
    directory: Path,
    url: str,
    temp: Path,
    signature: dict[str, Any],
    crc: int | None,
    before_valid: Callable[[int], None],
    verified: Verified,
) -> int:
    """Makes ``temp``, ``url`` downloaded whole, its entry, and returns its size; calls
    ``before_valid(size)`` before the sidecar makes the entry valid. ``crc``: the bytes'
    checksum, computed as they landed (None: read ``temp`` for it), recorded in the
    sidecar and in ``verified`` (NOTE [ Checked entries ]). The caller holds the download
    lock and removes ``temp`` if this raises.

    Raises:
        Changed: ``temp``'s size is not the signature's.
        OSError: :func:`linked`, for a link in place of a file of the entry.
    """
    data, sidecar = entry_path(directory, url, ".data"), entry_path(directory, url, ".json")
    fd = open_fd(temp, os.O_RDONLY)
    try:
        os.fsync(fd)
        written = os.fstat(fd)
        crc = checksum(fd) if crc is None else crc
    finally:
        os.close(fd)
    got = written.st_size
    if got != signature["size"]:
        raise Changed(f"downloaded {got} bytes of {url}, whose size is {signature['size']}")
    refuse_link(data)
    refuse_link(sidecar)
    sidecar.unlink(missing_ok=True)
    os.replace(temp, data)
    verified.put((written.st_dev, written.st_ino, got, crc), True)
    _write_new(temp, json.dumps({"url": url, **signature, "crc32": crc}).encode(), sync=True)
    before_valid(got)
    os.replace(temp, sidecar)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return got
