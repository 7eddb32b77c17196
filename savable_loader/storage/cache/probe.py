"""A remote file's signature and first bytes in one request (NOTE [ Probing a download ]).

NOTE [ Probing a download ]
The cache checks an entry against the remote file's signature (size, ETag or mtime: NOTE
[ File cache ] in ``storage/cache/node.py``), which ``info()`` asks of the store: on S3 a HEAD
request. When no entry of the file exists, the open is a download, and the HEAD only delays it by
a round trip: a table of small files paid two requests per file, and every file's first
bytes came a round trip late. So when the cache holds no sidecar for a URL, an open asks
for the file's first :data:`PROBE_BYTES` with one ranged GET instead, whose answer
carries the signature too (ETag, Last-Modified, and the total size in Content-Range):

* A file no longer than that is then complete: one request in all. A longer one's
  download goes on from where the probe ended, so the probe costs no byte twice: with
  one more GET, of the rest, for a file downloaded whole (:func:`write_rest`), or in the
  ranges of NOTE [ Reading a download ] in ``storage/cache/download.py`` for one read as it
  arrives. An answer of another ETag than the probe's (the file replaced in between)
  fails the download (``Changed``), which the reader's retry opens anew; so does a range
  of such a download (:func:`range_reader`), probed or not, where fsspec's ``cat_file``
  would have joined the bytes of two versions of a file replaced by one of equal size.
* The signature is the one ``info()`` gives (s3fs builds both from the same headers), so
  a later open's HEAD finds the entry valid.
* Opens are probed, where a reader (or a ``TableSource`` fetch thread, whose requests
  bound its throughput) waits. The cache's prefetch threads are not: no one waits for
  their round trip, and they download a file with one GET after its ``info()``, where
  the rest of a large file after a probe would be a second GET of it (which moto, the
  benchmark's server, answers by copying the whole object again). Nor is an open of a
  file this process's prefetch threads were asked for: it waits for their download, as
  before, instead of fetching the first bytes a second time.
* That one GET is this module's too (:func:`write_rest` from byte 0), checked against
  the ETag ``info()`` gave: s3fs's ``get_file`` reads its answer 64 KiB at a time, and
  cost 1.2 ms of CPU per MB against 0.85 ms here (a 50 MB object from moto on
  loopback, the bytes written to a file).
* Only s3fs filesystems are probed, and only a URL without a version; any other
  filesystem, or a probe the store refuses as a range (an empty file: 416), asks
  ``info()`` as before. An entry that exists is checked with ``info()`` as before: a hit
  costs one HEAD and no bytes.
* Two processes that probe the same file at once both fetch its first bytes; one
  downloads the rest, the other finds its entry valid and drops its probe. So does an
  open of a file larger than ``cache_limit``, which is streamed from the store uncached.
  The bytes of every probe count as downloaded.
"""

from __future__ import annotations

import errno
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsspec.asyn import sync

from ..s3_client import get_object
from .download import Changed
from .entries import open_fd

__all__ = ["PROBE_BYTES", "asks", "probe", "range_reader", "read_whole", "write_rest"]

#: Bytes an open asks for with the request that takes a file's signature (NOTE
#: [ Probing a download ]): the first range of a download read as it arrives.
PROBE_BYTES = 2**20
#: Bytes :func:`write_rest` reads from the answer at a time.
_READ_BYTES = 2**20


def probe(fs: Any, url: str) -> tuple[dict[str, Any], bytes] | None:
    """``url``'s info, as s3fs's ``info()`` gives the fields of a signature (``size``,
    ``ETag``, ``LastModified``), and its first :data:`PROBE_BYTES` bytes (all of them for
    a smaller file), with one request; None where ``fs`` cannot (NOTE [ Probing a
    download ]).

    Raises:
        Exception: What ``fs`` raised (a missing file, a fault), as ``info()`` would.
    """
    if not asks(fs, url):
        return None
    try:
        answer, data = _get(fs, url, f"bytes=0-{PROBE_BYTES - 1}")
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # no byte to give (an empty file): ask info()
            return None
        raise
    span = answer.get("ContentRange")
    size = int(span.rpartition("/")[2]) if span else len(data)
    if len(data) != min(size, PROBE_BYTES):
        raise ConnectionError(f"{url}: the probe answered {len(data)} bytes of {size}")
    # The defaults of s3fs's info(), so that the signatures agree.
    etag, modified = answer.get("ETag", ""), answer.get("LastModified", "")
    return {"size": size, "ETag": etag, "LastModified": modified}, data


def write_rest(
    fs: Any,
    url: str,
    signature: dict[str, Any],
    first: bytes,
    temp: Path,
    counted: Callable[[int], None],
) -> int:
    """Writes ``url``'s bytes to ``temp``, a new file: ``first``, a probe's (empty for a
    whole download), then the rest of the file with one GET from where they end (none
    when they are the whole file), telling ``counted`` of the rest's bytes as they land
    (NOTE [ Probing a download ]); returns their CRC-32 (NOTE [ Checked entries ] in
    ``storage/cache/entries.py``).

    Raises:
        Changed: The answer is of another ETag than ``signature``'s.
        Exception: What ``fs`` or ``counted`` raised.
    """
    crc = zlib.crc32(first)
    with os.fdopen(open_fd(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as out:
        out.write(first)
        if len(first) >= signature["size"]:
            return crc

        def landed(chunk: bytes) -> None:
            nonlocal crc
            out.write(chunk)
            crc = zlib.crc32(chunk, crc)
            counted(len(chunk))

        _get(fs, url, f"bytes={len(first)}-", landed, etag=signature["etag"])
    return crc


def range_reader(fs: Any, url: str, etag: str | None) -> Callable[[int, int], bytes | None]:
    """Reads bytes ``start`` to ``end`` (excluded) of ``url``, as ``fs.cat_file`` does;
    on s3fs, each answer is checked against ``etag`` (NOTE [ Probing a download ]).

    The reader returns None for an answer of another ETag (so that its caller fails the
    download at once, where a retry of the range would meet the same answer), and raises
    what ``fs`` raised.
    """
    if etag is None or not asks(fs, url):
        return lambda start, end: fs.cat_file(url, start=start, end=end)

    def read(start: int, end: int) -> bytes | None:
        try:
            return _get(fs, url, f"bytes={start}-{end - 1}", etag=etag)[1]
        except Changed:
            return None

    return read


def read_whole(fs: Any, url: str) -> bytes | None:
    """``url`` read whole with one GET from byte 0, as ``fs.cat_file(url, start=0)`` reads
    it, where this module asks the store itself (:func:`asks`); None elsewhere.

    Raises:
        Exception: What ``fs`` raised (``OSError(EINVAL)`` for an empty file's range).
    """
    return _get(fs, url, "bytes=0-")[1] if asks(fs, url) else None


def asks(fs: Any, url: str) -> bool:
    """Whether this module asks the store for ``url`` itself: ``fs`` is s3fs and the URL
    names an object without a version."""
    if not callable(getattr(fs, "_call_s3", None)) or not callable(getattr(fs, "split_path", None)):
        return False
    _, key, version = fs.split_path(url)
    return bool(key) and not version


def _get(
    fs: Any,
    url: str,
    span: str,
    landed: Callable[[bytes], None] | None = None,
    *,
    etag: str | None = None,
) -> tuple[dict[str, Any], bytes]:
    """One GET of the byte range ``span`` (an HTTP ``Range``) of ``url``, an object of
    ``fs`` (:func:`asks`): its answer's headers and its bytes (with ``landed``, each
    chunk is handed to it as it arrives instead, and the bytes returned are empty).
    Sent with the process's synchronous client where it can be (NOTE [ Synchronous GETs ]
    in ``storage/s3_client.py``), else through s3fs.

    Raises:
        Changed: ``etag`` is given and the answer is of another ETag (its body unread).
        Exception: What ``fs`` raised.
    """
    bucket, key, _ = fs.split_path(url)
    with get_object(fs, bucket, key, span) as answer:  # NOTE [ Synchronous GETs ]
        if answer is not None:
            body = answer["Body"]
            if etag is not None and str(answer.get("ETag", "")) != etag:
                raise Changed(f"{url} was replaced while it was being downloaded")
            if landed is None:
                return answer, body.read()
            while chunk := body.read(_READ_BYTES):
                landed(chunk)
            return answer, b""

    async def call() -> tuple[dict[str, Any], bytes]:
        answer = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=span)
        body = answer["Body"]
        try:
            if etag is not None and str(answer.get("ETag", "")) != etag:
                raise Changed(f"{url} was replaced while it was being downloaded")
            if landed is None:
                return answer, await body.read()
            while chunk := await body.read(_READ_BYTES):
                landed(chunk)
            return answer, b""
        finally:
            body.close()

    return sync(fs.loop, call)  # type: ignore[no-any-return]
