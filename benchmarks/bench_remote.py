"""Remote against local: every file-reading source from S3 behind 30 ms, and from disk.

A loopback S3 server (moto's threaded server behind the loopback proxy
``savable_loader.testing.FaultProxy``, which adds a fixed first-byte latency to every
answer, as an object store far from the node would) serves the same data that is
written to local disk (uploaded before the latency is switched on). By default the
server and the proxy run in a child process (``--server process``), so that their CPU
time is measured apart from the loader's and they do not take the loader's main
process's GIL; ``--server inline`` runs them in the benchmark's own process
(``latent_s3`` in ``remote_cache.py``) and writes no results. Either way they share the
machine's cores with the loader (NOTE [ Server CPU ]).

Each source is read by a ``SavableDataLoader`` with 2 workers, batch 8, and a fixed CPU
cost per item (200 us, NOTE [ Item cost ] in ``common.py``), for one epoch or
``--max-seconds`` after the first batch, whichever ends first, in each configuration
once per round, in an order rotated every round (NOTE [ Alternation ] in ``common.py``).
The data (:class:`Sizes`) gives each local epoch seconds of work:

* ``tar``: 40 tar shards of 500 samples of ~100 KB (2 GB).
* ``jsonl``: 16 gzip JSON-lines files of 2,500 records.
* ``tokens``: 4 raw uint16 token files of 2**21 tokens, windows of 256, shuffled.
* ``table``: a JSON-lines table of 24,000 rows, each naming a 16 KB file it needs.

Configurations (:data:`BASELINES`), every source with its defaults otherwise:

* ``local``: the files on local disk, read in place.
* ``s3-cache``: from S3 through an empty ``cache_dir`` (removed after each
  measurement). A file missing from it costs one ranged GET that brings its signature
  (NOTE [ Probing a download ] in ``savable_loader/storage/cache/probe.py``).
* ``s3-direct``: from S3 without a cache, the floor.
* ``s3-cache:listed`` (table): the cache with ``list_folders=True``, the signatures
  from listings of the folder (NOTE [ Listing folders ] in
  ``savable_loader/storage/listing.py``). moto answers a page of 1,000 keys in about
  0.2 s, so each worker's listing of the folder of 24,000 keys costs about 5 s of the
  server's CPU, which a measurement of seconds does not earn back.
* ``local:files`` and ``s3-cache:files`` (tar, jsonl): ``split="files"``. With the
  default ``split="samples"`` the loader counts every file's samples when it is built
  (NOTE [ Counting samples ] in ``datasets/files/sharded.py``), which through the cache downloads every
  file before the first batch, so the workers of ``s3-cache`` read local copies; with
  ``split="files"`` nothing is counted and the workers stream their shards through the
  cache, downloading ahead (NOTE [ Prefetching files ] in ``storage/cache/node.py``).
* ``local:counts`` and ``s3-cache:counts`` (tar, jsonl): ``split="samples"`` with a
  counts file written beside the files before the run (``counts=``: NOTE [ Counts files ]
  in ``datasets/files/counts_file.py``), so that the loader counts nothing when it is built and the
  workers stream their shards through the cache as with ``split="files"``.

Each configuration is compared with the local one of the same split (:data:`BASELINES`).
Reported per source and configuration: items per second after the first batch (median
over rounds), the median of the per-round ratios to local, the time to the first batch
(and to the built loader) and its ratio to local, the requests the server answered, and
the CPU seconds of the server, of the loader's main process and of its workers.

NOTE [ Server CPU ]
moto is a Python server: each request costs it milliseconds of CPU, and the proxy
copies every byte once more. A real object store spends none of the node's CPU, but
here the server runs on the same 2 cores as the 2 workers, so every remote figure pays
for the server too. The benchmark measures that share instead of guessing it: the child
process reports its own CPU time (``time.process_time()``) and the proxy's request count
before and after each measurement; the loader's main process is measured the same way,
its workers through ``RUSAGE_CHILDREN`` once they are joined. "cores busy" is all of it
over the measurement's wall time: near 2, the run was bound by CPU, not by latency.

NOTE [ The cache's disk ]
A cache entry creates four files (the data, its sidecar and two lock files:
NOTE [ File cache ] in ``savable_loader/storage/cache/node.py``), so a table of small files
pays for file creation once per row. On this project's VM, creating a file in a new folder under
``/tmp`` took 116 to 537 us, against 18 us under ``/work``, the same ext4 disk
(measured 2026-11-27; the cause was not traced). ``--dir`` chooses where
the run keeps its data and caches, as a user chooses a node-local disk for
``cache_dir``; every run measures and reports the cost of creating a file there.

Usage::

    python benchmarks/bench_remote.py [--quick] [--rounds R] [--latency S]
        [--only NAME,...] [--max-seconds S] [--server process|inline] [--dir D]
        [--plot] [--plot-only]

``--plot`` draws ``docs/img/remote.png`` after the run and ``--plot-only`` redraws it from
``results/bench_remote.json`` (both need matplotlib, imported only then).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gzip
import io
import json
import logging
import multiprocessing
import os
import resource
import shutil
import statistics
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import common
import fsspec
import numpy as np
from remote_cache import Latency, latent_s3, upload

from savable_loader import SavableDataLoader
from savable_loader.datasets import JsonLinesSource, TableSource, TarSource, TokenSource

BUCKET = "bench-remote"
BATCH, WORKERS, ITEM_US, SEQ_LEN = 8, 2, 200.0, 256
SOURCES = ("tar", "jsonl", "tokens", "table")
#: The file sources' configurations (tar, jsonl), each with its local one.
_FILE_BASELINES = {
    "local": "local",
    "s3-cache": "local",
    "s3-direct": "local",
    "local:files": "local:files",
    "s3-cache:files": "local:files",
    "local:counts": "local:counts",
    "s3-cache:counts": "local:counts",
}
#: Per source, its configurations, each with the local one it is compared with.
BASELINES: dict[str, dict[str, str]] = {
    "tar": _FILE_BASELINES,
    "jsonl": _FILE_BASELINES,
    "tokens": {"local": "local", "s3-cache": "local", "s3-direct": "local"},
    "table": {
        "local": "local",
        "s3-cache": "local",
        "s3-cache:listed": "local",
        "s3-direct": "local",
    },
}
#: ``--quick``: this share of :class:`Sizes`' samples per file.
QUICK_SHARE = 0.1
#: Seconds the server process may take to start (moto's import), and to answer a command.
STARTUP_TIMEOUT_S, ANSWER_TIMEOUT_S = 120.0, 30.0
PLOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "remote.png"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How much data each source has: enough for seconds of work per epoch at
    :data:`ITEM_US` with :data:`WORKERS` workers (``--quick`` scales it down)."""

    tar_shards: int = 40
    tar_samples: int = 500  # per shard, each ~100 KB: 2 GB in all
    jsonl_files: int = 16
    jsonl_lines: int = 2500  # per file
    token_files: int = 4
    token_count: int = 2**21  # per file: 2**13 windows of 256
    table_rows: int = 24_000  # each with a file of 16 KB: 384 MB

    def scaled(self, share: float) -> Sizes:
        """The same layout with ``share`` of the samples per file (at least one)."""
        return dataclasses.replace(
            self,
            tar_samples=max(1, int(self.tar_samples * share)),
            jsonl_lines=max(1, int(self.jsonl_lines * share)),
            token_count=max(SEQ_LEN, int(self.token_count * share)),
            table_rows=max(1, int(self.table_rows * share)),
        )

    def describe(self) -> list[str]:
        """One line per source, as the results' notes say it."""
        windows = self.token_files * (self.token_count // SEQ_LEN)
        return [
            f"tar: {self.tar_shards} shards of {self.tar_samples} samples of ~100 KB "
            f"({self.tar_shards * self.tar_samples:,} samples).",
            f"jsonl: {self.jsonl_files} gzip files of {self.jsonl_lines:,} lines "
            f"({self.jsonl_files * self.jsonl_lines:,} lines).",
            f"tokens: {self.token_files} raw uint16 files of {self.token_count:,} tokens, "
            f"shuffled windows of {SEQ_LEN} ({windows:,} windows).",
            f"table: a JSON-lines table of {self.table_rows:,} rows, each naming a file of 16 KB.",
        ]


def write_data(root: Path, sizes: Sizes) -> None:
    """The four sources' files under ``root`` (the same bytes go to the bucket)."""
    rng = np.random.default_rng(0)
    (root / "tar").mkdir()
    for shard in range(sizes.tar_shards):
        with tarfile.open(root / "tar" / f"shard-{shard:03d}.tar", mode="w") as tar:
            for sample in range(sizes.tar_samples):
                for ext, data in (
                    ("bin", rng.bytes(100_000)),
                    ("cls", str(sample % 10).encode()),
                ):
                    info = tarfile.TarInfo(f"{shard:03d}{sample:05d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    (root / "jsonl").mkdir()
    lines = sizes.jsonl_lines
    for part in range(sizes.jsonl_files):
        rows = [json.dumps({"id": part * lines + i, "text": "x" * 200}) for i in range(lines)]
        body = gzip.compress(("\n".join(rows) + "\n").encode())
        (root / "jsonl" / f"part-{part:02d}.jsonl.gz").write_bytes(body)
    (root / "tokens").mkdir()
    for part in range(sizes.token_files):
        tokens = rng.integers(0, 50_000, sizes.token_count, dtype=np.uint16)
        (root / "tokens" / f"tokens-{part}.bin").write_bytes(tokens.tobytes())
    (root / "table" / "files").mkdir(parents=True)
    table = []
    for row in range(sizes.table_rows):
        (root / "table" / "files" / f"{row:06d}.bin").write_bytes(rng.bytes(16_000))
        table.append(json.dumps({"id": row, "file": f"files/{row:06d}.bin"}))
    (root / "table" / "rows.jsonl").write_text("\n".join(table) + "\n")


# -- the server --------------------------------------------------------------------------


def serve(conn: Connection) -> None:
    """The server process: moto's threaded server behind a :class:`FaultProxy`, sending
    the proxy's URL, then answering ``("latency", seconds)`` and ``("figures", None)``
    (its CPU seconds and the requests so far) until ``("stop", None)``."""
    from moto.server import ThreadedMotoServer

    from savable_loader.testing import FaultProxy

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        with FaultProxy(f"http://{host}:{port}") as proxy:
            conn.send(proxy.url)
            while True:
                command, value = conn.recv()
                if command == "stop":
                    break
                if command == "latency":
                    proxy.latency = value
                conn.send((time.process_time(), proxy.stats.requests))
    finally:
        server.stop()


class Server:
    """The S3 endpoint: in a child process (``inline=False``) or in this one."""

    def __init__(self, *, inline: bool) -> None:
        self.inline = inline
        self.url = ""
        self._latency = Latency(0.0)
        self._conn: Connection | None = None
        self._process: multiprocessing.process.BaseProcess | None = None

    @contextlib.contextmanager
    def running(self) -> Iterator[Server]:
        if self.inline:
            with latent_s3(self._latency) as url:
                self.url = url
                yield self
            return
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(target=serve, args=(theirs,), name="bench-s3", daemon=True)
        process.start()
        theirs.close()  # the child's end lives in the child only: its death is an EOF here
        self._conn, self._process = ours, process
        try:
            self.url = self._receive("its URL", STARTUP_TIMEOUT_S)
            yield self
        finally:
            with contextlib.suppress(OSError):
                ours.send(("stop", None))
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()
            ours.close()
            self._conn = self._process = None

    def _receive(self, what: str, timeout: float) -> Any:
        """The server's next message, polled so that a dead or hung server is an error,
        never a wait without end.

        Raises:
            RuntimeError: The server process exited, or sent nothing for ``timeout`` s.
        """
        if self._conn is None or self._process is None:
            raise RuntimeError("the S3 server process is not running")
        deadline = time.monotonic() + timeout
        try:
            while not self._conn.poll(0.5):
                if not self._process.is_alive():
                    raise EOFError
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the S3 server process (pid {self._process.pid}) sent no {what} "
                        f"in {timeout:.0f} s"
                    )
            return self._conn.recv()
        except (EOFError, OSError):
            self._process.join(5)
            raise RuntimeError(
                f"the S3 server process (pid {self._process.pid}) exited (exit code "
                f"{self._process.exitcode}) before it sent {what}; its error, if any, is "
                "above"
            ) from None

    def _ask(self, command: str, value: Any = None) -> tuple[float, int]:
        if self._conn is None:
            raise RuntimeError("the S3 server process is not running")
        with contextlib.suppress(OSError):  # it died: _receive says how
            self._conn.send((command, value))
        answer: tuple[float, int] = self._receive(f"an answer to {command!r}", ANSWER_TIMEOUT_S)
        return answer

    def set_latency(self, seconds: float) -> None:
        if self.inline:
            self._latency.seconds = seconds
        else:
            self._ask("latency", seconds)

    def figures(self) -> tuple[float, int] | None:
        """(CPU seconds, requests) so far; None in this process (not separable)."""
        return None if self.inline else self._ask("figures")


# -- one measurement -------------------------------------------------------------------------


def file_creation_us(folder: Path, count: int = 500) -> float:
    """Microseconds to create (and close) one empty file in a new subfolder of ``folder``,
    the median of ``count`` (NOTE [ The cache's disk ])."""
    probe = folder / "creation-probe"
    probe.mkdir()
    times = []
    for index in range(count):
        started = time.perf_counter()
        os.close(os.open(probe / f"f{index}", os.O_WRONLY | os.O_CREAT, 0o644))
        times.append(time.perf_counter() - started)
    shutil.rmtree(probe)
    return statistics.median(times) * 1e6


def write_counts(root: Path, names: list[str], options: dict[str, Any]) -> None:
    """The counts files of the ``:counts`` configurations: one beside the local files, one
    beside the uploaded ones (written from the bucket's listing, so that it records the
    ETags), each counted as a loader would (NOTE [ Counts files ] in
    ``savable_loader/datasets/files/counts_file.py``)."""
    kinds = {"tar": (TarSource, "*.tar"), "jsonl": (JsonLinesSource, "*.jsonl.gz")}
    for name in names:
        if name in kinds:
            build, pattern = kinds[name]
            build(str(root / name / pattern)).write_counts(root / name / "counts.json")
            remote = build(f"s3://{BUCKET}/{name}/{pattern}", storage_options=options)
            remote.write_counts(f"s3://{BUCKET}/{name}/counts.json")


def stage(tmp: Path, url: str, sizes: Sizes, names: list[str]) -> tuple[Path, dict[str, Any], Any]:
    """Writes the sources' files under ``tmp / "data"``, uploads them to the server at
    ``url`` and writes the counts files of ``names``; returns the data folder, the storage
    options that reach the server, and this process's S3 filesystem. That filesystem, the
    one the sources find in fsspec's instance cache, is built once per run: it takes a
    second of CPU, and an S3 client that a forked worker inherits and drops logs "Task
    exception was never retrieved" there."""
    root = tmp / "data"
    root.mkdir()
    write_data(root, sizes)
    upload(root, url, BUCKET, threads=8)
    options = {
        "key": "k",
        "secret": "s",
        "client_kwargs": {"endpoint_url": url, "region_name": "us-east-1"},
    }
    main_fs = fsspec.filesystem("s3", **options)
    write_counts(root, names, options)
    return root, options, main_fs


def cost(units: int, item: Any) -> int:
    """The per-item CPU cost; the item itself is dropped (only its reading is measured)."""
    common.burn(units)
    return 1


def build(name: str, config: str, root: Path, options: dict[str, Any], cache: Path) -> Any:
    """Source ``name`` read as ``config`` says (:data:`BASELINES`)."""
    where, _, variant = config.partition(":")
    kwargs: dict[str, Any] = {}
    base = str(root)
    if where != "local":
        base, kwargs = f"s3://{BUCKET}", {"storage_options": options}
        if where == "s3-cache":
            kwargs["cache_dir"] = cache
    if variant == "files":
        kwargs["split"] = "files"
    if variant == "counts":
        kwargs["counts"] = f"{base}/{name}/counts.json"
    if name == "tar":
        return TarSource(f"{base}/tar/*.tar", **kwargs)
    if name == "jsonl":
        return JsonLinesSource(f"{base}/jsonl/*.jsonl.gz", **kwargs)
    if name == "tokens":
        return TokenSource(f"{base}/tokens/*.bin", seq_len=SEQ_LEN, shuffle=True, **kwargs)
    listed = variant == "listed"
    return TableSource(f"{base}/table/rows.jsonl", files="file", list_folders=listed, **kwargs)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(
    make: Callable[[], Any], units: int, server: Server, max_seconds: float
) -> dict[str, Any]:
    """One measurement: builds the source, reads one epoch (or ``max_seconds`` after the
    first batch) and returns its figures (NOTE [ Server CPU ])."""
    server_before = server.figures()
    main_before, workers_before = time.process_time(), _children_cpu()
    started = time.perf_counter()
    source = make()  # a remote source lists its files here, in the main process
    loader = SavableDataLoader(
        source.map(functools.partial(cost, units)),
        batch_size=BATCH,
        num_workers=WORKERS,
        collate_fn=len,
    )  # split="samples" counts the samples of every file here (tar, jsonl)
    built = time.perf_counter()
    capped = False
    with loader:
        iterator = iter(loader)
        first = next(iterator)
        first_at = time.perf_counter()
        items = 0
        for batch in iterator:
            items += batch
            if time.perf_counter() - first_at > max_seconds:
                capped = True
                break
        ended = time.perf_counter()
        storage = [w.get("storage") or {} for w in loader.worker_stats()]
    closed = time.perf_counter()
    server_after = server.figures()
    figures: dict[str, Any] = {
        "items": first + items,
        "items_per_s": items / (ended - first_at),
        "first_batch_s": first_at - started,
        "build_s": built - started,
        "capped": capped,
        "wall_s": closed - started,
        "main_cpu_s": time.process_time() - main_before,
        "workers_cpu_s": _children_cpu() - workers_before,
        "server_cpu_s": None,
        "requests": None,
        "storage_wait_s": sum(s.get("wait_seconds", 0.0) for s in storage),
    }
    if server_before is not None and server_after is not None:
        figures["server_cpu_s"] = server_after[0] - server_before[0]
        figures["requests"] = server_after[1] - server_before[1]
    return figures


# -- the run -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1 round of 3 s per measurement on a tenth of the data; writes no results "
        "(and draws --plot in the temp folder)",
    )
    parser.add_argument("--latency", type=float, default=0.03)
    parser.add_argument("--only", default=",".join(SOURCES))
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=20.0,
        help="stop a measurement this long after its first batch (default 20)",
    )
    parser.add_argument("--server", choices=("process", "inline"), default="process")
    parser.add_argument(
        "--dir",
        default=None,
        help="the folder of the run's data and caches (the node-local disk; default: the "
        "system's temp folder; NOTE [ The cache's disk ])",
    )
    parser.add_argument("--plot", action="store_true", help=f"draw {PLOT} (matplotlib)")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from the JSON")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads((common.RESULTS_DIR / "bench_remote.json").read_text())["samples"], PLOT)
        return
    rounds, max_seconds = (1, 3.0) if args.quick else (args.rounds, args.max_seconds)
    sizes = Sizes().scaled(QUICK_SHARE) if args.quick else Sizes()
    names = [name for name in args.only.split(",") if name]
    common.calibrate()
    units = common.units_for(ITEM_US)
    server = Server(inline=args.server == "inline")
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, server.running():
        creation_us = file_creation_us(Path(tmp))
        root, options, main_fs = stage(Path(tmp), server.url, sizes, names)
        server.set_latency(args.latency)
        for name in names:
            configs = list(BASELINES[name])
            samples[name] = {config: [] for config in configs}
            for round_ in range(rounds):
                turn = round_ % len(configs)
                for config in configs[turn:] + configs[:turn]:
                    cache = Path(tmp) / f"cache-{name}-{round_}"
                    make = functools.partial(build, name, config, root, options, cache)
                    samples[name][config].append(measure(make, units, server, max_seconds))
                    shutil.rmtree(cache, ignore_errors=True)
                    main_fs.invalidate_cache()  # every measurement lists its files anew
                print(f"  {name}: round {round_ + 1}/{rounds}", flush=True)
    write = not args.quick and not server.inline and set(names) == set(SOURCES)
    report(samples, args, sizes, rounds, max_seconds, creation_us, write=write)
    if args.plot:
        plot(samples, PLOT if write else Path(tempfile.gettempdir()) / PLOT.name)


def _median(runs: list[dict[str, Any]], field: str) -> float | None:
    values = [run[field] for run in runs if run[field] is not None]
    return statistics.median(values) if values else None


def rows_of(samples: dict[str, dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """The table: per source and configuration, medians over rounds."""
    rows = []
    for name, configs in samples.items():
        for config, runs in configs.items():
            pairs = list(zip(runs, configs[BASELINES[name][config]], strict=True))
            server_cpu = _median(runs, "server_cpu_s")
            requests = _median(runs, "requests")
            busy, shares, per_request = [], [], []
            for run in runs:
                server = run["server_cpu_s"] or 0.0
                total = run["main_cpu_s"] + run["workers_cpu_s"] + server
                busy.append(total / run["wall_s"])
                shares.append(server / total if total else 0.0)
                if run["requests"]:
                    per_request.append(1000 * server / run["requests"])
            rows.append(
                {
                    "source": name,
                    "config": config,
                    "items/s": _median(runs, "items_per_s"),
                    "x local": statistics.median(
                        r["items_per_s"] / b["items_per_s"] for r, b in pairs
                    ),
                    "first batch s": _median(runs, "first_batch_s"),
                    "first batch x local": statistics.median(
                        r["first_batch_s"] / b["first_batch_s"] for r, b in pairs
                    ),
                    "built s": _median(runs, "build_s"),
                    "requests": "" if requests is None else int(requests),
                    "server CPU s": "" if server_cpu is None else server_cpu,
                    "server ms/request": statistics.median(per_request) if per_request else "",
                    "server share of CPU": statistics.median(shares),
                    "cores busy": statistics.median(busy),
                    "storage wait s": _median(runs, "storage_wait_s"),
                }
            )
    return rows


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Per source, whether the cached remote read meets the issue's targets."""
    notes = []
    for row in rows:
        if row["config"] not in ("s3-cache", "s3-cache:counts"):
            continue
        rate = row["x local"] >= 0.9
        first = row["first batch x local"] <= 2.0
        notes.append(
            f"{row['source']}: {row['config']} {row['x local']:.2f}x local items/s (target >= 0.9: "
            f"{'met' if rate else 'not met'}), first batch {row['first batch x local']:.1f}x "
            f"local (target <= 2: {'met' if first else 'not met'})."
        )
    return notes


def report(
    samples: dict[str, dict[str, list[dict[str, Any]]]],
    args: Any,
    sizes: Sizes,
    rounds: int,
    max_seconds: float,
    creation_us: float,
    *,
    write: bool,
) -> None:
    rows = rows_of(samples)
    capped = sorted(
        {f"{n} {c}" for n, cs in samples.items() for c, runs in cs.items() if runs[0]["capped"]}
    )
    notes = [
        f"{WORKERS} workers, batch {BATCH}, {ITEM_US:.0f} us of CPU per item, "
        f"{args.latency * 1000:.0f} ms first-byte latency on every request; one epoch per "
        f"measurement or {max_seconds:.0f} s after the first batch; {rounds} rounds, order "
        "rotated every round; medians over rounds; 'x local' = median of per-round ratios "
        "to the local configuration of the same split (local:files for the :files ones, "
        "local:counts for the :counts ones).",
        *sizes.describe(),
        "Configurations: s3-cache = an empty cache_dir; s3-cache:listed = the table's "
        "cache with list_folders=True; s3-direct = no cache; "
        ':files = split="files" (tar, jsonl); :counts = a counts file written before the '
        "run (counts=, tar, jsonl); otherwise every source with its defaults "
        '(split="samples", prefetch=2; the table threads=8, prefetch=16).',
        "items/s counts the items after the first batch; first batch s includes building "
        "the source and the loader (built s: a remote source builds its S3 client and "
        'lists its files; with split="samples" tar and jsonl count the samples of every '
        "file, which through a cache downloads them all), starting the workers and their "
        "first reads.",
        f"Server: moto's threaded server behind FaultProxy, in {args.server} mode "
        "(NOTE [ Server CPU ] in bench_remote.py), on the same 2 cores as the loader. "
        "requests: what it answered during the measurement; server ms/request: its CPU "
        "per request; server share of CPU: its CPU over the server's, the loader's main "
        "process's and its workers' together; cores busy: that total over the wall time "
        "(2 = both cores busy).",
        f"Disk: the data and the caches in {args.dir or 'the system temp folder'}, where "
        f"creating a file took {creation_us:.0f} us (NOTE [ The cache's disk ]).",
    ]
    if capped:
        notes.append("Stopped at the time limit (not a whole epoch): " + ", ".join(capped) + ".")
    notes += verdicts(rows)
    common.write_results(
        "bench_remote",
        title="Remote (S3 behind a first-byte latency) against local disk, per file source",
        parameters={
            "batch_size": BATCH,
            "num_workers": WORKERS,
            "item_us": ITEM_US,
            "latency_s": args.latency,
            "rounds": rounds,
            "max_seconds": max_seconds,
            "server": args.server,
            "sources": list(samples),
            "sizes": dataclasses.asdict(sizes),
            "dir": args.dir,
            "file_creation_us": round(creation_us, 1),
        },
        columns=list(rows[0]),
        rows=rows,
        notes=notes,
        samples=samples,
        command=(
            f"python benchmarks/bench_remote.py --rounds {rounds} --max-seconds {max_seconds:g}"
            + (f" --dir {args.dir}" if args.dir else "")
            + " --plot"
        ),
        write=write,
    )


def plot(samples: dict[str, dict[str, list[dict[str, Any]]]], path: Path) -> None:
    """Draws the figure (``remote_plot.py``; matplotlib is imported only here)."""
    import remote_plot

    print(f"wrote {remote_plot.draw(samples, BASELINES, path)}")


if __name__ == "__main__":
    main()
