"""What a first batch from S3 waits for: local disk, S3 with the node's cache already
holding every file, and S3 with an empty cache, behind 30 ms of first-byte latency.

``bench_remote.py`` times the first batch from an empty cache only. This benchmark adds
the same source read again with the files already in the cache (a job restarted on the
same node): no byte has to be downloaded before the first batch, so what it waits for
beyond local's is the listing of the files, the S3 clients and the cache's checks
(NOTE [ A warm cache's first batch ]).

NOTE [ A warm cache's first batch ]
Each source is first read whole into a cache folder, then, round after round and in an
order rotated every round, timed from building the source to the first batch of a new
two-worker loader: from local disk, from S3 through that folder (warm), and from S3
through a new, empty folder (cold). fsspec's listings cache is dropped before every S3
measurement, so each one lists the files anew, as a new job does. Medians over rounds.

Run: ``python benchmarks/bench_first_batch.py`` (``--quick``: 1 round, prints only).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_remote
import common

from savable_loader import SavableDataLoader

#: Per source, its S3 configuration and the local one it is compared with.
CONFIGS = {
    "tar": ("s3-cache:counts", "local:counts"),
    "jsonl": ("s3-cache:counts", "local:counts"),
    "tokens": ("s3-cache", "local"),
    "table": ("s3-cache", "local"),
}
MODES = ("local", "warm", "cold")


def first_batch_s(make: Any, *, whole_epoch: bool = False) -> float:
    """Seconds from building the source (``make()``) to a two-worker loader's first
    batch; ``whole_epoch`` reads the rest of the epoch too (to fill a cache)."""
    started = time.perf_counter()
    source = make()
    loader = SavableDataLoader(
        source.map(functools.partial(bench_remote.cost, 1)),
        batch_size=bench_remote.BATCH,
        num_workers=bench_remote.WORKERS,
        collate_fn=len,
    )
    with loader:
        iterator = iter(loader)
        next(iterator)
        elapsed = time.perf_counter() - started
        if whole_epoch:
            for _ in iterator:
                pass
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="1 round; writes no results")
    parser.add_argument("--latency", type=float, default=0.03)
    parser.add_argument("--dir", default=None, help="the folder of the data and caches")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    sizes = bench_remote.Sizes().scaled(bench_remote.QUICK_SHARE)
    server = bench_remote.Server(inline=False)
    runs: dict[str, dict[str, list[float]]] = {}
    requests: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, server.running():
        root, options, main_fs = bench_remote.stage(Path(tmp), server.url, sizes, list(CONFIGS))
        server.set_latency(args.latency)
        for name, (remote, local) in CONFIGS.items():
            warm = Path(tmp) / f"warm-{name}"

            def make(config: str, cache: Path, name: str = name) -> Any:
                return bench_remote.build(name, config, root, options, cache)

            main_fs.invalidate_cache()
            first_batch_s(functools.partial(make, remote, warm), whole_epoch=True)
            runs[name] = {mode: [] for mode in MODES}
            for round_ in range(rounds):
                turn = round_ % len(MODES)
                for mode in MODES[turn:] + MODES[:turn]:
                    main_fs.invalidate_cache()  # every measurement lists its files anew
                    cache = {"warm": warm, "cold": Path(tmp) / f"cold-{name}-{round_}"}
                    config = local if mode == "local" else remote
                    built = functools.partial(make, config, cache.get(mode, warm))
                    runs[name][mode].append(first_batch_s(built))
            print(f"  {name}: {rounds} rounds", flush=True)
        requests.update(listing=[], get=[])
        for _ in range(rounds):  # the two requests a counts file's first batch waits on
            main_fs.invalidate_cache()
            started = time.perf_counter()
            main_fs.glob(f"{bench_remote.BUCKET}/tar/*.tar")
            requests["listing"].append(time.perf_counter() - started)
            started = time.perf_counter()
            main_fs.cat_file(f"{bench_remote.BUCKET}/tar/counts.json")
            requests["get"].append(time.perf_counter() - started)
    report(runs, requests, sizes, rounds, args.latency, write=not args.quick)


def report(
    runs: dict[str, dict[str, list[float]]],
    requests: dict[str, list[float]],
    sizes: bench_remote.Sizes,
    rounds: int,
    latency: float,
    *,
    write: bool,
) -> None:
    rows = []
    for name, modes in runs.items():
        local = statistics.median(modes["local"])
        row: dict[str, Any] = {"source": name, "config": CONFIGS[name][0], "local s": local}
        for mode in ("warm", "cold"):
            row[f"{mode} s"] = statistics.median(modes[mode])
            row[f"{mode} x local"] = statistics.median(
                s3 / disk for s3, disk in zip(modes[mode], modes["local"], strict=True)
            )
        rows.append(row)
    notes = [
        f"{rounds} rounds, the three modes in an order rotated every round; medians (x "
        "local: medians of the per-round ratios). 2 workers, batch 8; moto behind "
        f"FaultProxy adding {latency * 1e3:.0f} ms before every answer, in a child process "
        "on the same cores (NOTE [ A warm cache's first batch ]).",
        "warm: the cache folder already holds every file (read whole once before the "
        "rounds); cold: an empty folder. Both list the files anew.",
        *sizes.describe(),
        f"Alone, from this process: listing the {sizes.tar_shards} tar shards took "
        f"{statistics.median(requests['listing']) * 1e3:.0f} ms and reading the counts file "
        f"{statistics.median(requests['get']) * 1e3:.0f} ms (medians of {rounds}).",
    ]
    common.write_results(
        "bench_first_batch",
        title="The first batch from S3: local, a warm cache and an empty one",
        parameters={"rounds": rounds, "latency_s": latency},
        columns=[
            "source",
            "config",
            "local s",
            "warm s",
            "warm x local",
            "cold s",
            "cold x local",
        ],
        rows=rows,
        notes=notes,
        samples={"first_batch_s": runs, "requests_s": requests},
        write=write,
    )


if __name__ == "__main__":
    main()
