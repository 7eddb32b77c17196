"""Storage: bytes in and out of URLs, the filesystems and clients that carry them, the
node's cache of remote files. Runs wherever a read or a write happens: the main
process (state files, checkpoint folders, listings) and every worker (a source's reads).

- ``urls``: :func:`read_bytes` and :func:`write_bytes`, atomic for local paths (public).
- ``filesystems`` and ``s3_client``: the fsspec filesystems and the botocore client.
- ``retry``: retries of transient storage errors; ``listing``: signatures from listings.
- ``stats`` and ``counted_reads``: what reads cost; ``cache/``: the node-local cache.
"""

from .urls import describe_error, read_bytes, write_bytes

__all__ = ["describe_error", "read_bytes", "write_bytes"]
