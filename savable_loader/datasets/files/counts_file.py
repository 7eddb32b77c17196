"""Sample counts kept in a file beside the shards, so that a loader need not count them.

NOTE [ Counts files ]
``split="samples"`` needs the number of samples of every file (NOTE [ Counting samples ]
in ``datasets/files/sharded.py``). Counting reads every file: through a cache, the whole dataset is
downloaded before the first batch; without one, it is read through once more. A counts
file records the counts once, written by ``ShardedSource.write_counts(url)`` (which counts
as the loader would), and a source built with ``counts=url`` takes them from it:

* The file is JSON (a small, readable, stable format; a pydantic model checks it): a
  ``format`` tag and ``version``, the source's type, and per file its ``name`` (relative to
  the counts file's folder when the file lies under it, else its whole URL), its
  ``samples``, and the signature it had when counted: ``size`` and ETag or modification
  time (``signature_of`` in ``storage/cache/node.py``).
* A count is taken only for a file whose signature now equals the recorded one: the same
  size, and the same ETag when the store reports one both times (an S3 ETag is the
  content's hash for a single-part upload), else the same modification time. Any other
  file of the source is counted as without a counts file, and the loader logs how many at
  INFO. A stale counts file therefore costs time, never a wrong split; a file that changes
  after it was counted is an error when read, as always.
* The signatures come from the listing of the source's globs when it holds them (one
  request per folder on S3), else from ``info()`` per file, in the counting threads.
* A remote counts file is requested while the source lists its globs, in a thread of its
  own, so that the two round trips to the store overlap when the source is built. Its
  bytes are kept for the first read of the counts; if it failed, that read requests the
  file again, retried like any other read, so an error of the early request costs one
  request, nothing more.
* With ``cache_dir``, a remote counts file is read through the node's cache as the shards
  are, so a job restarted on the same node asks the store nothing for it: when the cache
  holds a copy, no early request is sent, and once the globs are listed the copy is read
  if the listing (of the counts file's folder: s3fs keeps it, so a counts file beside the
  shards costs no request) gives it the signature the copy was downloaded with; a counts
  file changed since is downloaded again, in place of the copy. Without a copy, the early
  request downloads it into the cache.
* A counts file that is missing, unreadable or malformed, or was written by another type of
  source, is an error naming it, never a silent count.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...errors import ConfigError, StorageError
from ...storage.urls import read_bytes, write_bytes

__all__ = [
    "FORMAT",
    "CountsFile",
    "FileCount",
    "fetch_counts",
    "local_url",
    "read_counts",
    "recorded_signature",
    "same_file",
    "write_counts",
]

#: The ``format`` tag of a counts file.
FORMAT: Literal["savable-loader/sample-counts"] = "savable-loader/sample-counts"

Count = Annotated[int, Field(ge=0)]


class FileCount(BaseModel):
    """One file's entry of a counts file (NOTE [ Counts files ])."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    name: str = Field(min_length=1, description="Relative to the counts file's folder, or a URL.")
    samples: Count
    size: Count
    etag: str | None = None
    mtime: str | None = None


class CountsFile(BaseModel):
    """A counts file's content (NOTE [ Counts files ])."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    format: Literal["savable-loader/sample-counts"]
    version: Literal[1]
    source: str
    files: list[FileCount]


def same_file(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> bool:
    """Whether two signatures (``signature_of``) describe the same bytes: the same size, and
    the same ETag when both have one, else the same modification time."""
    if recorded.get("size") != now.get("size"):
        return False
    if recorded.get("etag") is not None and now.get("etag") is not None:
        return bool(recorded["etag"] == now["etag"])
    return recorded.get("mtime") is not None and recorded.get("mtime") == now.get("mtime")


def _folder(url: str) -> str:
    return url.rpartition("/")[0] + "/" if "/" in url else ""


def local_url(url: str) -> bool:
    """Whether ``url`` is a local path (which takes no storage options)."""
    return "://" not in url or url.startswith("file://")


def write_counts(
    url: str,
    source: str,
    urls: Sequence[str],
    counts: Sequence[int],
    signatures: Sequence[Mapping[str, Any]],
    storage_options: dict[str, Any],
) -> None:
    """Writes a counts file for ``urls`` (atomically for a local path).

    Raises:
        StorageError: The write failed.
    """
    folder = _folder(url)
    files = [
        FileCount(
            name=file.removeprefix(folder) if folder and file.startswith(folder) else file,
            samples=count,
            size=int(signature["size"]),
            etag=signature.get("etag"),
            mtime=signature.get("mtime"),
        )
        for file, count, signature in zip(urls, counts, signatures, strict=True)
    ]
    content = CountsFile(format=FORMAT, version=1, source=source, files=files)
    options = {} if local_url(url) else storage_options  # the source's options are remote
    write_bytes(url, (content.model_dump_json(indent=1) + "\n").encode(), **options)


def fetch_counts(
    url: str,
    source: str,
    filesystem: Callable[[str], Any],
    read: Callable[[], bytes] | None = None,
) -> bytes:
    """The bytes of the counts file at ``url``: one request on an object store (a byte
    range from 0; a plain ``cat_file`` asks the size first on S3), ``filesystem(url)``
    being the source's filesystem for it; ``read``, where given, reads a remote file
    instead (through the node's cache: NOTE [ Counts files ]).

    Raises:
        StorageError: The file does not exist (the message says how to write it).
        Exception: What the filesystem raised otherwise (the caller retries it).
    """
    try:
        if local_url(url):
            return read_bytes(url)
        try:
            data: bytes = read() if read is not None else filesystem(url).cat_file(url, start=0)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return b""  # an empty object, whose range S3 refuses: not a counts file
        return data
    except FileNotFoundError as exc:  # StateFileNotFoundError too
        raise StorageError(
            f"{source}: the counts file {url} does not exist; write it once with "
            f"{source}(...).write_counts({url!r})"
        ) from exc


def read_counts(raw: bytes, url: str, source: str) -> dict[str, FileCount]:
    """The entries of the counts file ``raw``, read from ``url``, by the URL of their file.

    Raises:
        ConfigError: It is not a counts file, or one written for another type of source.
    """
    try:
        content = CountsFile.model_validate(json.loads(raw))
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "the top level"
        raise ConfigError(
            f"{source}: {url} is not a counts file ({where}: {error['msg']}); write it with "
            f"{source}(...).write_counts(url)"
        ) from exc
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"{source}: {url} is not a counts file ({first}); write it with "
            f"{source}(...).write_counts(url)"
        ) from exc
    if content.source != source:
        raise ConfigError(
            f"{source}: the counts file {url} was written by a {content.source}, whose "
            f"samples are not {source}'s; write one with {source}(...).write_counts(url)"
        )
    folder = _folder(url)
    whole = [
        entry.name if "://" in entry.name or os.path.isabs(entry.name) else folder + entry.name
        for entry in content.files
    ]
    return dict(zip(whole, content.files, strict=True))


def recorded_signature(entry: FileCount) -> dict[str, Any]:
    """The signature an entry records, as ``signature_of`` gives one."""
    return {"size": entry.size, "etag": entry.etag, "mtime": entry.mtime}
