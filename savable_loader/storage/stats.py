"""What a source's reads of remote files cost: :class:`CacheStats`, filled by the node's
cache (NOTE [ File cache ] in ``storage/cache/node.py``) or, without one, by the direct reads (NOTE
[ Direct reads ] in ``storage/counted_reads.py``), and their sums over stages and processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

__all__ = ["CacheStats", "summed"]


@dataclasses.dataclass
class CacheStats:
    """What this process's reads of remote files cost: with a cache, what the cache did
    (NOTE [ File cache ] in ``storage/cache/node.py``); without one, the direct reads
    (NOTE [ Direct reads ] in ``storage/counted_reads.py``).

    Attributes:
        bytes_downloaded: Bytes downloaded into the cache, prefetched ones too; without
            a cache, bytes read from the store (as stored: compressed).
        hits: Opens served by a valid entry, downloaded by another open or a prefetch;
            0 without a cache.
        misses: Opens that had to download (or stream a file larger than the limit);
            without a cache, every open of a remote file.
        prefetched: Files downloaded ahead by the prefetch threads; 0 without a cache.
        wait_seconds: Seconds the readers waited on storage: with a cache, in its opens
            (or on a download in progress); without, in the opens, reads and seeks of
            the remote files. Neither counts the threads that read ahead (the cache's
            prefetch, ``TableSource``'s fetch threads); a ``TableSource``'s reader's
            wait for its fetch threads counts instead.
    """

    bytes_downloaded: int = 0
    hits: int = 0
    misses: int = 0
    prefetched: int = 0
    wait_seconds: float = 0.0


def summed(parts: Iterable[CacheStats]) -> CacheStats | None:
    """The field-by-field sum of ``parts``, a new object; None when there are none."""
    total: CacheStats | None = None
    for stats in parts:
        total = total or CacheStats()
        for field in dataclasses.fields(CacheStats):
            setattr(total, field.name, getattr(total, field.name) + getattr(stats, field.name))
    return total
