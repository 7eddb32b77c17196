"""Listing and opening the files of a file source, over fsspec.

NOTE [ Listing files ]
A file source takes paths, globs or fsspec URLs. Globs are expanded with fsspec when the
stage is built, in the process that builds it, and the whole list is sorted, so every
worker of every rank sees the same list. A glob matching nothing is a ``ConfigError``; a
literal path is kept without a look-up, so a missing file shows when it is read.

NOTE [ Listed signatures ]
On S3 a listing gives each file's size, ETag and modification time: the signature that
the cache checks an entry against (NOTE [ File cache ] in ``storage/cache/node.py``), for which it
otherwise asks ``info()``, a HEAD request, at every open. The file sources that list
globs (the sharded ones, ``TokenSource``) keep what their listing said of each file
(``listed``, with ``cache_dir`` or a counts file, whose signatures they are too) and,
with ``cache_dir``, spend it so:

* An open of a file whose cached entry holds the listed version reads it without a
  request, in every worker and epoch. Any other open asks the store as before: its
  download's first request brings the signature (NOTE [ Probing a download ] in
  ``storage/cache/probe.py``), so a file replaced since the listing is downloaded as it is now.
* A prefetch thread downloads a listed file with one GET checked against the listed
  ETag, without ``info()`` first. A file replaced since the listing fails that check:
  the thread drops it, and the reader's own open downloads it as above.
* The listing is taken when the source is built, as are its file list and counts; an
  entry cached before a file was replaced is read until the source is built again (a
  restart lists anew). Without a listed signature, a change shows at the next open.
* Only s3fs listings are used so, whose signatures equal what ``info()`` and a GET's
  headers give (checked by ``tests/storage/test_listed_signatures.py``); other stores ask
  ``info()`` as before. A literal path, not listed, asks too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from ...errors import ConfigError, SavableLoaderError, StorageError
from ...storage.filesystems import url_to_fs
from ...storage.urls import describe_error

__all__ = ["Urls", "expand_urls", "storage_errors"]

_GLOB_CHARACTERS = frozenset("*?[")

Urls = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


@contextlib.contextmanager
def storage_errors(url: str, action: str = "read") -> Iterator[None]:
    """Turns what fsspec, a backend or a decompressor raises into a StorageError."""
    try:
        yield
    except SavableLoaderError:
        raise
    except Exception as exc:
        raise StorageError(f"Cannot {action} {url}: {describe_error(exc)}.") from exc


def expand_urls(
    urls: Urls,
    storage_options: dict[str, Any],
    stage: str,
    listed: dict[str, dict[str, Any]] | None = None,
    beside: Sequence[str] = (),
) -> tuple[str, ...]:
    """Returns the sorted files that ``urls`` name (NOTE [ Listing files ]); with
    ``listed``, puts there what the listing of a glob said of each file it matched, and
    of each URL of ``beside`` that lies in a listed folder (a counts file beside the
    shards) where the filesystem kept that folder's listing: no request more.

    Raises:
        ConfigError: ``urls`` is empty or a glob in it matches nothing.
        StorageError: Listing failed.
    """
    given = [urls] if isinstance(urls, (str, os.PathLike)) else list(urls)
    if not given:
        raise ConfigError(f"{stage} needs at least one path, glob or URL")
    found: set[str] = set()
    for item in given:
        url = os.fspath(item) if isinstance(item, (str, os.PathLike)) else item
        if not isinstance(url, str):
            raise ConfigError(f"{stage} takes paths or URLs as str, got {type(url).__name__}")
        with storage_errors(url, "list"):
            fs, path = url_to_fs(url, **storage_options)
            if "::" in url or not _GLOB_CHARACTERS.intersection(path):
                found.add(url if "::" in url else _unstrip(fs, path))
                continue
            listing = fs.glob(path, detail=True)
            files = {
                _unstrip(fs, match): info
                for match, info in listing.items()
                if info.get("type") != "directory"
            }
            matches = list(files)
            if listed is not None:
                listed.update(files)
                for other in beside:
                    info = _kept_info(fs, other)
                    if info is not None:
                        listed[other] = info
        if not matches:
            raise ConfigError(f"{stage}: {url!r} matches no file")
        found.update(matches)
    return tuple(sorted(found))


def _kept_info(fs: Any, url: str) -> dict[str, Any] | None:
    """What ``fs``'s kept listing of ``url``'s folder says of it (fsspec's listings cache,
    which s3fs fills as it lists), never asking the store; None where it keeps none."""
    kept = getattr(fs, "_ls_from_cache", None)
    if kept is None:
        return None
    path = fs._strip_protocol(url)
    try:
        entries = kept(path)
    except FileNotFoundError:
        return None  # the folder was listed without it
    found = [entry for entry in entries or () if entry.get("name") == path]
    return found[0] if found and found[0].get("type") != "directory" else None


def _unstrip(fs: Any, path: str) -> str:
    return path if isinstance(fs, LocalFileSystem) else str(fs.unstrip_protocol(path))
