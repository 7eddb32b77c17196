"""What reading from S3 costs the loader's own CPU, against reading the same data locally.

``bench_remote.py`` measures throughput with the S3 server on the same two cores as the
loader, so its figures mix three costs: the loader's, the S3 client's and the server's.
This benchmark takes the server out: it runs in a child process whose CPU is not
counted, on loopback with no added latency, and the loader reads with ``num_workers=0``,
so that everything the loader does for an item (the S3 client, the cache, the fetch and
prefetch threads, fsspec's event loop thread, and the item's 200 us of work) is CPU
time of this one process (NOTE [ The client's ceiling ]).

NOTE [ The client's ceiling ]
On a machine whose cores are all busy reading, as the loader keeps them, throughput is
cores over CPU per item. So ``local CPU per item / S3 CPU per item`` is the most the S3
configuration's throughput can be, as a share of local's, on the same cores, however
well latency is hidden and however little the server costs: the ceiling of issue 15's
"remote throughput >= 0.9x local" target for that source and configuration. The
benchmark measures it per configuration (medians over rounds, alternating the order),
and measures the floor under it too: the CPU of one GET of a 16 KB object with botocore
(boto3's client), with s3fs (the loader's filesystem) and with a bare urllib3 GET of a URL
signed beforehand (presigned), which neither signs nor parses (no S3 client in Python
costs less), and the CPU per MB of a download written to a file. The configurations named
``.../s3fs`` send every request through s3fs, as the loader did before its own GETs went
through botocore's synchronous client (NOTE [ Synchronous GETs ] in
``savable_loader/storage/s3_client.py``), so each round measures that change too.

NOTE [ A client outside the GIL ]
Where ``obstore`` is installed (the ``bench`` extra), the same GETs and downloads are
measured with it too: the Python binding of Rust's ``object_store``, whose requests run
on its own threads without the GIL. ``time.process_time()`` counts those threads, so its
figures are the whole process's CPU, as for the Python clients. It is measured, not yet
used by the loader.

Run: ``python benchmarks/bench_client_cost.py`` (``--quick``: 1 round, prints only).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bench_remote
import common
import fsspec

from savable_loader import SavableDataLoader
from savable_loader.storage import s3_client

#: The configurations measured, each against its local one (``bench_remote.build``).
CONFIGS = {
    "tar": {
        "local:counts": "local:counts",
        "s3-cache:counts": "local:counts",
        "s3-cache:counts/s3fs": "local:counts",
    },
    "table": {
        "local": "local",
        "s3-direct": "local",
        "s3-direct/s3fs": "local",
        "s3-cache": "local",
        "s3-cache/s3fs": "local",
    },
}
#: A configuration ending so sends every request through s3fs, as before the library's
#: own GETs went through botocore's synchronous client (NOTE [ Synchronous GETs ] in
#: ``savable_loader/storage/s3_client.py``): the change's effect, measured in the same rounds.
VIA_S3FS = "/s3fs"
#: The data: tar shards of ~100 KB samples and a table of 16 KB files, as bench_remote's.
SIZES = bench_remote.Sizes(
    tar_shards=12,
    tar_samples=150,
    jsonl_files=1,
    jsonl_lines=1,
    token_files=1,
    token_count=bench_remote.SEQ_LEN,
    table_rows=3000,
)
GETS = 300


def loader_cpu(make: Callable[[], Any], units: int) -> dict[str, float]:
    """CPU seconds per item of one epoch read with ``num_workers=0`` (all of it in this
    process: the loader, its threads, the S3 client), and the epoch's wall time."""
    source = make()
    items = 0
    cpu, wall = time.process_time(), time.perf_counter()
    with SavableDataLoader(
        source.map(functools.partial(bench_remote.cost, units)),
        batch_size=bench_remote.BATCH,
        num_workers=0,
        collate_fn=len,
    ) as loader:
        for batch in loader:
            items += batch
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"items": items, "cpu_ms_per_item": 1e3 * cpu / items, "wall_s": wall}


def get_costs(options: dict[str, Any], keys: list[str]) -> dict[str, float]:
    """CPU milliseconds of one GET of a 16 KB object, per client (NOTE [ The client's
    ceiling ]), each after a first request that builds its client."""
    import boto3
    import urllib3

    endpoint = options["client_kwargs"]["endpoint_url"]
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=options["key"],
        aws_secret_access_key=options["secret"],
        region_name="us-east-1",
    )
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    pool = urllib3.PoolManager()
    bucket = bench_remote.BUCKET
    presigned = {  # signed before the measurement: the GET alone is measured
        key: client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key})
        for key in keys
    }
    clients: dict[str, Callable[[str], bytes]] = {
        "urllib3 GET of a presigned URL": lambda key: pool.request("GET", presigned[key]).data,
        "boto3 get_object": lambda key: client.get_object(Bucket=bucket, Key=key)["Body"].read(),
        "s3fs cat_file": lambda key: fs.cat_file(f"{bucket}/{key}"),
    }
    store = _obstore(options)
    if store is not None:  # NOTE [ A client outside the GIL ]
        import obstore

        clients["obstore get"] = lambda key: bytes(obstore.get(store, key).bytes())
        clients["obstore get, a range"] = lambda key: bytes(
            obstore.get_range(store, key, start=0, end=16_000)
        )
    costs = {}
    for name, get in clients.items():
        get(keys[0])
        cpu = time.process_time()
        for key in keys:
            if len(get(key)) != 16_000:
                raise RuntimeError(f"{name}: a short answer for {key}")
        costs[name] = 1e3 * (time.process_time() - cpu) / len(keys)
    return costs


def download_costs(options: dict[str, Any], keys: list[str], folder: Path) -> dict[str, float]:
    """CPU milliseconds per MB of downloads of ``keys`` into a file: boto3's answer read 1
    MiB at a time (as the cache's own GET reads it: NOTE [ Probing a download ]), and a
    presigned URL's answer read by urllib3 into one reused buffer, written to the file or
    not (a reader without a cache); ``cheapest``: the lowest."""
    import boto3
    import urllib3

    client = boto3.client(
        "s3",
        endpoint_url=options["client_kwargs"]["endpoint_url"],
        aws_access_key_id=options["key"],
        aws_secret_access_key=options["secret"],
        region_name="us-east-1",
    )
    bucket = bench_remote.BUCKET
    urls = {
        key: client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key})
        for key in keys
    }
    pool = urllib3.PoolManager()
    buffer = bytearray(2**20)

    def with_boto3(out: Any, key: str) -> int:
        size, body = 0, client.get_object(Bucket=bucket, Key=key)["Body"]
        while chunk := body.read(2**20):
            size += out.write(chunk)
        return size

    def with_urllib3(out: Any, key: str) -> int:
        size, answer = 0, pool.request("GET", urls[key], preload_content=False)
        view = memoryview(buffer)
        while got := answer.readinto(view):
            size += out.write(view[:got])
        answer.release_conn()
        return size

    def into_memory(out: Any, key: str) -> int:
        size, answer = 0, pool.request("GET", urls[key], preload_content=False)
        view = memoryview(buffer)
        while got := answer.readinto(view):
            size += got
        answer.release_conn()
        return size

    downloads: list[tuple[str, Callable[[Any, str], int]]] = [
        ("boto3, 1 MiB reads", with_boto3),
        ("urllib3 readinto, presigned", with_urllib3),
        ("urllib3 readinto, presigned, not written", into_memory),
    ]
    store = _obstore(options)
    if store is not None:  # NOTE [ A client outside the GIL ]
        import obstore

        def with_obstore(out: Any, key: str) -> int:
            size = 0
            for chunk in obstore.get(store, key).stream(min_chunk_size=2**20):
                size += out.write(chunk)
            return size

        downloads.append(("obstore stream, 1 MiB chunks", with_obstore))
    costs = {}
    for name, download in downloads:
        with open(folder / "download", "wb") as out:
            download(out, keys[0])  # the client and its connection are set up
        cpu, size = time.process_time(), 0
        for key in keys:
            with open(folder / "download", "wb") as out:
                size += download(out, key)
        costs[name] = 1e3 * (time.process_time() - cpu) / (size / 1e6)
    costs["cheapest"] = min(costs.values())
    return costs


def _obstore(options: dict[str, Any]) -> Any:
    """An ``obstore`` store of the benchmark's bucket, or None where obstore is not
    installed (NOTE [ A client outside the GIL ])."""
    try:
        from obstore.store import S3Store
    except ImportError:
        return None
    endpoint = options["client_kwargs"]["endpoint_url"]
    return S3Store(
        bench_remote.BUCKET,
        endpoint=endpoint,
        access_key_id=options["key"],
        secret_access_key=options["secret"],
        region="us-east-1",
        client_options={"allow_http": endpoint.startswith("http://")},
    )


@contextlib.contextmanager
def through_s3fs(on: bool) -> Iterator[None]:
    """With ``on``, this process and the workers it forks send every request through s3fs
    (:data:`VIA_S3FS`)."""
    if not on:
        yield
        return
    build, clients = s3_client._build, dict(s3_client._CLIENTS)
    s3_client._build = lambda fs: None
    s3_client._CLIENTS.clear()
    try:
        yield
    finally:
        s3_client._build = build
        s3_client._CLIENTS.clear()
        s3_client._CLIENTS.update(clients)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 round; writes no results")
    parser.add_argument("--dir", default=None, help="the folder of the data and caches")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    common.calibrate()
    units = common.units_for(bench_remote.ITEM_US)
    server = bench_remote.Server(inline=False)
    runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, server.running():
        root, options, main_fs = bench_remote.stage(Path(tmp), server.url, SIZES, ["tar"])
        # The process's clients (s3fs's, and botocore's of NOTE [ Synchronous GETs ]) are
        # built before the measurements, as bench_remote.py builds s3fs's once per run.
        main_fs.connect()
        with s3_client.get_object(main_fs, bench_remote.BUCKET, "tar/counts.json", "bytes=0-0"):
            pass
        keys = [f"table/files/{row:06d}.bin" for row in range(GETS)]
        shards = [f"tar/shard-{shard:03d}.tar" for shard in range(SIZES.tar_shards)]
        # Every round measures every configuration and the floors, in a rotated order,
        # so that the machine's drift hits them alike (NOTE [ Alternation ] in common.py).
        steps = ["gets", "downloads"] + [
            f"{name} {config}" for name, configs in CONFIGS.items() for config in configs
        ]
        for round_ in range(rounds):
            figures: dict[str, float] = {}
            turn = round_ % len(steps)
            for step in steps[turn:] + steps[:turn]:
                if step == "gets":
                    figures.update(get_costs(options, keys))
                elif step == "downloads":
                    figures.update(download_costs(options, shards, Path(tmp)))
                else:
                    name, config = step.split()
                    cache = Path(tmp) / f"cache-{name}-{config.replace('/', '-')}-{round_}"
                    plain = config.removesuffix(VIA_S3FS)
                    make = functools.partial(bench_remote.build, name, plain, root, options, cache)
                    with through_s3fs(config.endswith(VIA_S3FS)):
                        figures[step] = loader_cpu(make, units)["cpu_ms_per_item"]
                    main_fs.invalidate_cache()  # every measurement lists its files anew
            runs.append(figures)
            print(f"  round {round_ + 1}/{rounds}", flush=True)
    report(runs, write=not args.quick)


#: Per source, its local configuration, the CPU per item of its data, and the floor
#: under reading that data from S3 (NOTE [ The client's ceiling ]).
FLOORS = {
    "table": ("table local", "urllib3 GET of a presigned URL", 1.0),
    "tar": ("tar local:counts", "cheapest", 0.1),  # 100 KB a sample
}


FLOOR_NAMES = {
    "table": "a presigned GET (urllib3) per row",
    "tar": "the cheapest download per 100 KB sample",
}


def report(runs: list[dict[str, float]], *, write: bool) -> None:
    def median(key: str) -> float:
        return statistics.median(run[key] for run in runs)

    def paired(ratio: Callable[[dict[str, float]], float]) -> float:
        return statistics.median(ratio(run) for run in runs)

    rows = []
    for name, configs in CONFIGS.items():
        for config, baseline in configs.items():
            key, local = f"{name} {config}", f"{name} {baseline}"
            rows.append(
                {
                    "what": f"{name}, {config}",
                    "CPU ms per item": median(key),
                    "over local, ms": median(key) - median(local),
                    "ceiling, x local": paired(lambda run, k=key, b=local: run[b] / run[k]),
                }
            )
    for name, (local, floor, share) in FLOORS.items():
        rows.append(
            {
                "what": f"{name}, the floor: local + {FLOOR_NAMES[name]}",
                "CPU ms per item": median(local) + share * median(floor),
                "over local, ms": share * median(floor),
                "ceiling, x local": paired(
                    lambda run, b=local, f=floor, s=share: run[b] / (run[b] + s * run[f])
                ),
            }
        )
    gets = ["urllib3 GET of a presigned URL", "boto3 get_object", "s3fs cat_file"]
    gets += [key for key in ("obstore get", "obstore get, a range") if key in runs[0]]
    for key in gets:
        rows.append({"what": f"one GET of 16 KB: {key}", "CPU ms per item": median(key)})
    downloads = [
        "boto3, 1 MiB reads",
        "urllib3 readinto, presigned",
        "urllib3 readinto, presigned, not written",
    ]
    downloads += [key for key in ("obstore stream, 1 MiB chunks",) if key in runs[0]]
    for key in downloads:
        rows.append({"what": f"a download, per MB: {key}", "CPU ms per item": median(key)})
    notes = [
        f"{len(runs)} rounds, every step of a round in an order rotated every round; "
        "medians (ceilings: medians of the per-round ratios). The loader reads with "
        "num_workers=0, batch 8, 200 us of CPU per item; the S3 server (moto behind "
        "FaultProxy, no added latency) runs in a child process whose CPU is not counted.",
        "ceiling = local CPU per item / this configuration's: the most its throughput can "
        "be, as a share of local's, on the same cores (NOTE [ The client's ceiling ]). "
        "The floor rows add to local's CPU per item only the cheapest Python fetch of the "
        "item's bytes: one presigned GET per table row, a presigned download of 100 KB "
        "per tar sample.",
        f"tar: {SIZES.tar_shards} shards of {SIZES.tar_samples} samples of ~100 KB, read "
        f"with a counts file; table: {SIZES.table_rows:,} rows, each naming a file of 16 KB.",
        f"One GET of 16 KB: CPU ms per request, {GETS} requests per client. A download, "
        "per MB: CPU ms per MB of every tar shard (~10 MB each) written to a file; the "
        "floor of tar takes the cheapest download per round.",
    ]
    common.write_results(
        "bench_client_cost",
        title="The loader's CPU per item, S3 against local (the server excluded)",
        parameters={"rounds": len(runs), "item_us": bench_remote.ITEM_US},
        columns=["what", "CPU ms per item", "over local, ms", "ceiling, x local"],
        rows=rows,
        notes=notes,
        samples={"runs": runs},
        write=write,
    )


if __name__ == "__main__":
    main()
