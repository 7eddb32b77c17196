"""Bytes in and out of URLs: local paths written atomically, anything else through fsspec.

NOTE [ Atomic local writes ]
    A local write goes to a temporary file beside the target (``.{name}.tmp-<random>``),
    which is flushed and fsynced, renamed onto the target with :func:`os.replace` (atomic
    on POSIX and Windows), and then the folder is fsynced so that the rename itself
    survives a power cut. A reader therefore sees the old file or the new one, never a
    mix, even if the writer is killed. A symlink is followed: the file it points to is
    replaced and the link stays. After a failure the temporary file is removed; only
    a writer killed outright (SIGKILL, power cut) can leave one behind, and its name says
    what it is. The temporary file is created with mode 0o666 minus the umask, as
    :func:`open` would create the target, not with :func:`tempfile.mkstemp`'s 0o600.

    Other URLs (``memory://``, ``s3://``...) go through ``fsspec.url_to_fs`` and one
    ``pipe_file`` or ``cat_file`` call; object stores make a single put atomic by
    themselves. Every failure becomes a :class:`~savable_loader.errors.StorageError` that
    names the URL and chains the cause.

NOTE [ A missing state file ]
    A read of a URL where nothing exists (a local ``FileNotFoundError``, or fsspec's for
    ``memory://``, ``s3://``: a missing key or bucket) raises
    :class:`~savable_loader.errors.StateFileNotFoundError`, a ``StorageError`` that is
    also a ``FileNotFoundError``, so ``except FileNotFoundError:`` starts a first run
    afresh whatever the URL. Every other failure stays a plain ``StorageError``; so does a
    failed write (missing local folders are created).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Iterator
from typing import Any

import fsspec

from savable_loader.errors import ConfigError, StateFileNotFoundError, StorageError
from savable_loader.storage.filesystems import url_to_fs

__all__ = ["describe_error", "read_bytes", "write_bytes"]

logger = logging.getLogger(__name__)

# Protocols whose fsspec backend ships as a savable-loader extra.
_EXTRAS = {"s3": "s3", "s3a": "s3"}


def write_bytes(url: str | os.PathLike[str], data: bytes, **storage_options: Any) -> None:
    """Writes ``data`` to ``url``, replacing what was there; atomically for a local path.

    Args:
        url: A local path (``str`` or path-like, or a ``file://`` URL), or any fsspec URL.
        data: The bytes to write.
        **storage_options: Passed to the fsspec filesystem (credentials, endpoint...).

    Raises:
        StorageError: The write failed; the message names the URL and the cause. Missing
            parent folders of a local path are created, not an error.
        ConfigError: ``storage_options`` were given for a local path.
    """
    url, local = _resolve(url, storage_options)
    if local is None:
        with _remote_errors(url, "write"):
            fs, path = url_to_fs(url, **storage_options)
            fs.pipe_file(path, data)
        return
    # Through a symlink, replace the file it points to and keep the link.
    directory, name = os.path.split(os.path.realpath(local))
    try:
        os.makedirs(directory, exist_ok=True)
        tmp, fd = _create_temporary(directory, name)
    except OSError as exc:
        raise StorageError(f"Cannot write {url}: {describe_error(exc)}.") from exc
    try:
        with open(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, os.path.join(directory, name))
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, Exception):
            raise StorageError(f"Cannot write {url}: {describe_error(exc)}.") from exc
        raise
    _fsync_directory(directory)


def read_bytes(url: str | os.PathLike[str], **storage_options: Any) -> bytes:
    """Reads all the bytes at ``url``.

    Args:
        url: A local path (``str`` or path-like, or a ``file://`` URL), or any fsspec URL.
        **storage_options: Passed to the fsspec filesystem (credentials, endpoint...).

    Returns:
        The file's content.

    Raises:
        StateFileNotFoundError: Nothing exists at ``url``; also a ``FileNotFoundError``
            (NOTE [ A missing state file ]).
        StorageError: Reading failed otherwise.
        ConfigError: ``storage_options`` were given for a local path.
    """
    url, local = _resolve(url, storage_options)
    if local is None:
        with _remote_errors(url, "read"):
            fs, path = url_to_fs(url, **storage_options)
            content: bytes = fs.cat_file(path)
        return content
    try:
        with open(local, "rb") as file:
            return file.read()
    except FileNotFoundError as exc:
        raise _not_found(url) from exc
    except OSError as exc:
        raise StorageError(f"Cannot read {url}: {describe_error(exc)}.") from exc


def _not_found(url: str) -> StateFileNotFoundError:
    """NOTE [ A missing state file ]."""
    return StateFileNotFoundError(f"Cannot read {url}: not found.", url)


def _resolve(
    url: str | os.PathLike[str], storage_options: dict[str, Any]
) -> tuple[str, str | None]:
    """Returns ``(url as str, local path or None for an fsspec URL)``."""
    url = os.fspath(url)
    if "://" in url and not url.startswith("file://"):
        return url, None
    local = url.removeprefix("file://")
    if storage_options:
        raise ConfigError(
            f"Storage options {sorted(storage_options)} were given for the local path {url}; "
            "they apply only to fsspec URLs such as s3://bucket/key."
        )
    return url, local


def _create_temporary(directory: str, name: str) -> tuple[str, int]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = os.path.join(directory, f".{name}.tmp-{secrets.token_hex(4)}")
        try:
            return tmp, os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary file name beside {name} in {directory}")


def _fsync_directory(directory: str) -> None:
    """Makes the rename durable; some systems (Windows, some network filesystems) cannot."""
    try:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        logger.debug("Could not fsync the folder %s: %s", directory, exc)


@contextlib.contextmanager
def _remote_errors(url: str, action: str) -> Iterator[None]:
    """Turns whatever fsspec or its backend raises into a StorageError naming the URL."""
    try:
        yield
    except FileNotFoundError as exc:
        if action == "read":
            raise _not_found(url) from exc
        raise StorageError(f"Cannot {action} {url}: {describe_error(exc)}.") from exc
    except Exception as exc:
        # "simplecache::s3://bucket/key" chains protocols; the last one holds the data.
        protocols = [part.partition("://")[0] for part in url.split("::")]
        unknown = [p for p in protocols if p not in fsspec.available_protocols()]
        if isinstance(exc, ImportError):
            extra = _EXTRAS.get(protocols[-1])
            fix = f"pip install savable-loader[{extra}]" if extra else "install that backend"
            reason = f"a storage backend is not installed ({exc}); {fix}"
        elif isinstance(exc, ValueError) and unknown:
            reason = f"fsspec knows no storage protocol {unknown[0]!r} (a typo in the URL?)"
        else:
            reason = describe_error(exc)
        raise StorageError(f"Cannot {action} {url}: {reason}.") from exc


def describe_error(exc: BaseException) -> str:
    """A short reason for a failed read or write, for a StorageError's message."""
    if isinstance(exc, FileNotFoundError):
        return "not found"
    if isinstance(exc, PermissionError):
        return "permission denied"
    if isinstance(exc, IsADirectoryError):
        return "it is a folder"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[0].lower() + exc.strerror[1:]
    return f"{type(exc).__name__}: {exc}"
