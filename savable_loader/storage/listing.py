"""Signatures of remote files taken from listings of their folders (``TableSource``).

NOTE [ Listing folders ]
With ``cache_dir``, an entry is checked against the remote file's signature (size and ETag
or modification time: NOTE [ File cache ] in ``storage/cache/node.py``), which the cache asks of the
store with ``info()`` (on S3 a HEAD request) before each reuse of a cached file; a file
not cached yet takes it from its download's first GET (NOTE [ Probing a download ] in
``storage/cache/probe.py``). A table of many small files cached already then makes a request per
file in every epoch, and the store's and the client's cost per request, not the bytes,
bounds the throughput. With ``list_folders=True`` a ``TableSource`` takes the signatures
from listings instead:

* Each process lists a folder in a background thread (``table-list``) once it has fetched
  :data:`LIST_AFTER` files in it (so the first batch does not wait behind a listing, and a
  folder a process reads little of is not listed), and again once the listing is older
  than :data:`MAX_AGE_SECONDS` (the older one serves meanwhile). Before a folder's listing
  arrives, and for a file it does not hold, the cache asks ``info()`` as without it.
* A listing costs one request per 1,000 keys on S3, for every key of the folder, whatever
  the table names: the option is for folders that hold mostly the table's files, not a
  few files of a folder of millions.
* A listed signature is as fresh as its listing. A file replaced after its folder was
  listed is noticed when its download's size differs from the listed one (the cache then
  asks ``info()`` and downloads again), or at the next listing: until then an entry cached
  before the change may be read. Without the option a change is noticed at the next open.
* The listings use a filesystem of their own that keeps no listings cache
  (``use_listings_cache=False``), so that the source's ``info()`` calls keep asking the
  store (an fsspec listings cache answers ``info()`` for a file missing from a cached
  listing with a directory of size 0, and looks a file up by scanning its folder's list).
* A listing that fails is logged at DEBUG and tried again after :data:`MAX_AGE_SECONDS`;
  reads go on with ``info()``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from fsspec.core import strip_protocol

from .cache.node import signature_of

__all__ = ["LIST_AFTER", "MAX_AGE_SECONDS", "FolderListings"]

logger = logging.getLogger(__name__)

#: Files a process fetches in a folder before it lists it (NOTE [ Listing folders ]).
LIST_AFTER = 32
#: Seconds a folder's listing serves before it is taken again (NOTE [ Listing folders ]).
MAX_AGE_SECONDS = 300.0


class FolderListings:
    """One process's listings of the folders of a source's files (NOTE [ Listing folders ]).

    Args:
        filesystem: Builds the filesystem that lists a URL's folder (called in a listing
            thread, once per protocol); it must keep no listings cache.
    """

    def __init__(self, filesystem: Callable[[str], Any]) -> None:
        self._filesystem = filesystem
        self._lock = threading.Lock()
        self._listed: dict[str, tuple[float, dict[str, dict[str, Any]]]] = {}
        self._listing: set[str] = set()
        self._asked: collections.Counter[str] = collections.Counter()
        self._filesystems: dict[str, Any] = {}
        self._closed = False

    def known(self, url: str) -> dict[str, Any] | None:
        """``url``'s signature (``signature_of`` in ``storage/cache/node.py``) from its folder's
        listing; None before the folder is listed or when its listing does not hold the file.
        Starts a listing of the folder when it is due."""
        folder = url.rpartition("/")[0]
        with self._lock:
            listed = self._listed.get(folder)
            if listed is None:
                self._asked[folder] += 1
                due = self._asked[folder] >= LIST_AFTER
            else:
                due = time.monotonic() - listed[0] > MAX_AGE_SECONDS
            if due and folder not in self._listing and not self._closed:
                self._listing.add(folder)
                thread = threading.Thread(
                    target=self._list, args=(folder,), name="table-list", daemon=True
                )
                thread.start()
        return None if listed is None else listed[1].get(strip_protocol(url))

    def _list(self, folder: str) -> None:
        started = time.monotonic()
        signatures: dict[str, dict[str, Any]] = {}
        try:
            protocol = folder.partition("://")[0]
            fs = self._filesystems.get(protocol)
            if fs is None:
                fs = self._filesystems.setdefault(protocol, self._filesystem(folder))
            for info in fs.ls(folder, detail=True):
                if info.get("type") == "file":
                    signatures[strip_protocol(fs.unstrip_protocol(info["name"]))] = signature_of(
                        info
                    )
            logger.debug("listed %s: %d files", folder, len(signatures))
        except Exception as exc:  # reads go on with info()
            logger.debug("listing %s failed: %r", folder, exc)
        with self._lock:
            self._listing.discard(folder)
            if not self._closed:
                self._listed[folder] = (started, signatures)

    def close(self) -> None:
        """Drops the listings; a listing in progress ends on its own and is dropped.
        Idempotent."""
        with self._lock:
            self._closed = True
            self._listed.clear()
            self._asked.clear()
