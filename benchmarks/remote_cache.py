"""The local file cache: reading JSON lines from S3 with and without it, and from disk.

A loopback S3 server (moto's threaded server, in this process, behind the loopback proxy
``savable_loader.testing.FaultProxy``) answers every request after an injected first-byte
latency (30 ms by default), as an object store far from the node would. The same gzip JSON-lines files are written to local disk and uploaded. One
stream (``num_workers=0``, as one worker reads) reads every line and spends a fixed CPU
cost on each (NOTE [ Item cost ] in ``common.py``). Configurations, measured once per
round in an order rotated every round (NOTE [ Alternation ] in ``common.py``):

* ``local``: the files on local disk (no cache: local paths are read in place).
* ``s3``: from S3 without a cache.
* ``cold``: from S3 into an empty cache, ``prefetch=0``.
* ``cold+prefetchN``: from S3 into an empty cache, ``prefetch=N`` (1, 2, 4).
* ``warm``: from S3 with every file already cached (``prefetch=2``: the threads ask
  ``info()`` ahead of the reader).

Reported: lines per second (median over rounds), the median per-round ratio to ``s3``,
and the seconds the reader waited on storage (``CacheStats.wait_seconds``).

    python benchmarks/remote_cache.py [--files N] [--lines N] [--latency S] [--rounds R]
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

from common import burn, calibrate, units_for

from savable_loader import WorkerContext
from savable_loader.datasets import JsonLinesSource
from savable_loader.testing import FaultProxy

BUCKET = "bench-cache"


@dataclass
class Latency:
    """The first-byte latency of :func:`latent_s3`, changeable while it serves."""

    seconds: float


@contextmanager
def slow_s3(latency: float) -> Iterator[str]:
    """A loopback S3 endpoint whose every answer starts ``latency`` seconds late."""
    with latent_s3(Latency(latency)) as url:
        yield url


class _LatentProxy(FaultProxy):
    """A :class:`FaultProxy` whose first-byte latency is ``latency.seconds``, read at every
    request."""

    def __init__(self, upstream: str, latency: Latency) -> None:
        self._latency = latency
        super().__init__(upstream, latency=latency.seconds)

    @property
    def latency(self) -> float:
        return self._latency.seconds

    @latency.setter
    def latency(self, seconds: float) -> None:
        self._latency.seconds = seconds


@contextmanager
def latent_s3(latency: Latency) -> Iterator[str]:
    """A loopback S3 endpoint whose every answer starts ``latency.seconds`` late: moto's
    threaded server behind a :class:`FaultProxy` (no faults, only the latency)."""
    from moto.server import ThreadedMotoServer

    werkzeug = logging.getLogger("werkzeug")
    level = werkzeug.level
    werkzeug.setLevel(logging.ERROR)  # no access log line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        with _LatentProxy(f"http://{host}:{port}", latency) as proxy:
            yield proxy.url
    finally:
        server.stop()
        werkzeug.setLevel(level)


def upload(root: Path, endpoint: str, bucket: str, *, threads: int = 1) -> None:
    """Creates ``bucket`` on ``endpoint`` and uploads every file under ``root``, keyed by
    its path relative to ``root``, ``threads`` at a time."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="k",
        aws_secret_access_key="s",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=bucket)

    def put(path: Path) -> None:
        client.put_object(Bucket=bucket, Key=str(path.relative_to(root)), Body=path.read_bytes())

    paths = sorted(p for p in root.rglob("*") if p.is_file())
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, paths))


def _file(index: int, lines: int) -> bytes:
    rows = [json.dumps({"id": index * lines + i, "text": "x" * 200}) for i in range(lines)]
    return gzip.compress(("\n".join(rows) + "\n").encode())


def _read(source: JsonLinesSource, units: int) -> tuple[int, float, float]:
    """Lines read, seconds, and seconds waited on storage."""
    cursor = source.cursor(WorkerContext(0, 1, 0, 0, 0, None))
    started = time.perf_counter()
    count = 0
    for _ in cursor:
        burn(units)
        count += 1
    elapsed = time.perf_counter() - started
    cursor.close()
    stats = source.cache_stats()
    source.close_cache()
    return count, elapsed, (stats.wait_seconds if stats is not None else float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--lines", type=int, default=500)
    parser.add_argument("--latency", type=float, default=0.03)
    parser.add_argument("--item-us", type=float, default=50.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    calibrate()
    units = units_for(args.item_us)
    with tempfile.TemporaryDirectory() as tmp, slow_s3(args.latency) as endpoint:
        root = Path(tmp)
        (root / "data").mkdir()
        for index in range(args.files):
            body = _file(index, args.lines)
            (root / "data" / f"part-{index:03d}.jsonl.gz").write_bytes(body)
        upload(root, endpoint, BUCKET)
        options = {
            "key": "k",
            "secret": "s",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            "skip_instance_cache": True,
        }
        remote = f"s3://{BUCKET}/data/*.jsonl.gz"
        warm_dir = root / "warm"
        _read(JsonLinesSource(remote, storage_options=options, cache_dir=warm_dir), 0)

        def build(name: str, round_: int) -> JsonLinesSource:
            if name == "local":
                return JsonLinesSource(str(root / "data" / "*.jsonl.gz"))
            if name == "s3":
                return JsonLinesSource(remote, storage_options=options)
            if name == "warm":
                return JsonLinesSource(remote, storage_options=options, cache_dir=warm_dir)
            cold = root / f"cold-{name}-{round_}"
            prefetch = int(name.partition("+prefetch")[2] or 0)
            return JsonLinesSource(
                remote, storage_options=options, cache_dir=cold, prefetch=prefetch
            )

        names = ["local", "s3", "cold", "cold+prefetch1", "cold+prefetch2", "cold+prefetch4"]
        names.append("warm")
        rates: dict[str, list[float]] = {name: [] for name in names}
        waits: dict[str, list[float]] = {name: [] for name in names}
        ratios: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            measured: dict[str, float] = {}
            for name in order:
                source = build(name, round_)
                count, elapsed, waited = _read(source, units)
                measured[name] = count / elapsed
                rates[name].append(count / elapsed)
                waits[name].append(waited)
            for name in names:
                ratios[name].append(measured[name] / measured["s3"])
        print(
            f"{args.files} files x {args.lines} lines, {args.latency * 1000:.0f} ms first-byte "
            f"latency, {args.item_us:.0f} us per line, {args.rounds} rounds, one stream"
        )
        print(f"{'config':<15}{'lines/s':>12}{'x s3':>8}{'waited s':>10}")
        for name in names:
            print(
                f"{name:<15}{statistics.median(rates[name]):>12.0f}"
                f"{statistics.median(ratios[name]):>8.2f}{statistics.median(waits[name]):>10.3f}"
            )


if __name__ == "__main__":
    main()
