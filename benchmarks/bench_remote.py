"""Remote against local: every file-reading source from S3 behind 30 ms, and from disk.

A loopback S3 server (moto's threaded server, in this process, behind the loopback proxy
``savable_loader.testing.FaultProxy``: ``latent_s3`` in ``remote_cache.py``) answers every
request after a fixed first-byte latency, as an object store far from the node would.
The same data is written to local disk and uploaded (before the latency is switched
on). Each source is read by a ``SavableDataLoader`` with 2 workers, batch 8,
and a fixed CPU cost per item (200 us, NOTE [ Item cost ] in ``common.py``), for one
epoch, alternately from disk and from S3 in an order rotated every round (NOTE
[ Alternation ] in ``common.py``):

* ``tar``: 8 tar shards of 24 samples of ~100 KB.
* ``jsonl``: 8 gzip JSON-lines files of 1,500 records.
* ``tokens``: 2 raw uint16 token files of 2**21 tokens, windows of 256, shuffled.
* ``table``: a JSON-lines table of 2,000 rows, each naming a 16 KB file it needs.

Remote reads go through an empty node cache every round (``cache_dir``, default
``prefetch``; the table fetches its rows' files with ``threads`` per worker), and, as
the floor, without a cache (``s3-direct``; the table with ``threads=0``). Reported per
source: items per second after the first batch (median over rounds), the median of the
per-round ratios to local, and the time to the first batch.

    python benchmarks/bench_remote.py [--rounds R] [--latency S] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import functools
import gzip
import io
import json
import statistics
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import numpy as np
from remote_cache import Latency, latent_s3, upload

from savable_loader import SavableDataLoader
from savable_loader.datasets import JsonLinesSource, TableSource, TarSource, TokenSource

BUCKET = "bench-remote"
BATCH, WORKERS, ITEM_US = 8, 2, 200.0
SOURCES = ("tar", "jsonl", "tokens", "table")
#: Fetch threads per worker of the remote table: 30 ms per file needs many in flight.
TABLE_THREADS = 32


def write_data(root: Path) -> None:
    """The four sources' files under ``root`` (the same bytes go to the bucket)."""
    rng = np.random.default_rng(0)
    for shard in range(8):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for sample in range(24):
                for ext, data in (
                    ("bin", rng.bytes(100_000)),
                    ("cls", str(sample % 10).encode()),
                ):
                    info = tarfile.TarInfo(f"{shard:02d}{sample:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        (root / "tar").mkdir(exist_ok=True)
        (root / "tar" / f"shard-{shard:02d}.tar").write_bytes(buffer.getvalue())
    (root / "jsonl").mkdir()
    for part in range(8):
        rows = [json.dumps({"id": part * 1500 + i, "text": "x" * 200}) for i in range(1500)]
        body = gzip.compress(("\n".join(rows) + "\n").encode())
        (root / "jsonl" / f"part-{part:02d}.jsonl.gz").write_bytes(body)
    (root / "tokens").mkdir()
    for part in range(2):
        tokens = rng.integers(0, 50_000, 2**21, dtype=np.uint16)
        (root / "tokens" / f"tokens-{part}.bin").write_bytes(tokens.tobytes())
    (root / "table" / "files").mkdir(parents=True)
    lines = []
    for row in range(2000):
        (root / "table" / "files" / f"{row:05d}.bin").write_bytes(rng.bytes(16_000))
        lines.append(json.dumps({"id": row, "file": f"files/{row:05d}.bin"}))
    (root / "table" / "rows.jsonl").write_text("\n".join(lines) + "\n")


def cost(units: int, item: Any) -> int:
    """The per-item CPU cost; the item itself is dropped (only its reading is measured)."""
    common.burn(units)
    return 1


def build(name: str, config: str, root: Path, options: dict[str, Any], cache: Path) -> Any:
    """Source ``name`` read as ``config`` says: from ``root``, or from the bucket."""
    kwargs: dict[str, Any] = {}
    base = str(root)
    if config != "local":
        base, kwargs = f"s3://{BUCKET}", {"storage_options": options}
        if config == "s3-cache":
            kwargs["cache_dir"] = cache
    if name == "tar":
        return TarSource(f"{base}/tar/*.tar", **kwargs)
    if name == "jsonl":
        return JsonLinesSource(f"{base}/jsonl/*.jsonl.gz", **kwargs)
    if name == "tokens":
        return TokenSource(f"{base}/tokens/*.bin", seq_len=256, shuffle=True, **kwargs)
    threads = {"local": 8, "s3-cache": TABLE_THREADS, "s3-direct": 0}[config]
    return TableSource(f"{base}/table/rows.jsonl", files="file", threads=threads, **kwargs)


def measure(make: Callable[[], Any], units: int) -> tuple[float, float]:
    """(items per second after the first batch, seconds to the first batch)."""
    source = make()
    loader = SavableDataLoader(
        source.map(functools.partial(cost, units)),
        batch_size=BATCH,
        num_workers=WORKERS,
        collate_fn=len,
    )
    with loader:
        started = time.perf_counter()
        iterator = iter(loader)
        first = next(iterator)
        first_at = time.perf_counter()
        items = sum(iterator)
        ended = time.perf_counter()
    assert first > 0
    return items / (ended - first_at), first_at - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.03)
    parser.add_argument("--only", default=",".join(SOURCES))
    args = parser.parse_args()
    names = [name for name in args.only.split(",") if name]
    common.calibrate()
    units = common.units_for(ITEM_US)
    configs = ("local", "s3-cache", "s3-direct")
    latency = Latency(0.0)  # no latency while the data is uploaded
    with tempfile.TemporaryDirectory() as tmp, latent_s3(latency) as endpoint:
        root = Path(tmp) / "data"
        root.mkdir()
        write_data(root)
        upload(root, endpoint, BUCKET)
        latency.seconds = args.latency
        options = {
            "key": "k",
            "secret": "s",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
        results: dict[str, dict[str, list[tuple[float, float]]]] = {}
        for name in names:
            results[name] = {config: [] for config in configs}
            for round_ in range(args.rounds):
                order = configs[round_ % 3 :] + configs[: round_ % 3]
                for config in order:
                    cache = Path(tmp) / f"cache-{name}-{round_}"
                    make = functools.partial(build, name, config, root, options, cache)
                    results[name][config].append(measure(make, units))
    report(results, args)


def report(results: dict[str, dict[str, list[tuple[float, float]]]], args: Any) -> None:
    print(
        f"{WORKERS} workers, batch {BATCH}, {ITEM_US:.0f} us per item, "
        f"{args.latency * 1000:.0f} ms first-byte latency, {args.rounds} rounds; "
        f"load at start {common.LOAD_AT_START[0]:.2f}"
    )
    header = f"{'source':<8}{'config':<11}{'items/s':>10}{'x local':>9}{'first batch s':>15}"
    print(header)
    for name, configs in results.items():
        local = configs["local"]
        for config, runs in configs.items():
            ratios = [run[0] / base[0] for run, base in zip(runs, local, strict=True)]
            print(
                f"{name:<8}{config:<11}{statistics.median(r[0] for r in runs):>10.0f}"
                f"{statistics.median(ratios):>9.2f}"
                f"{statistics.median(r[1] for r in runs):>15.3f}"
            )


if __name__ == "__main__":
    main()
