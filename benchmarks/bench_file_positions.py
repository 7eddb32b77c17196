"""What reading a file source by position costs: ``split="global"`` against ``"samples"``.

``split="global"`` (NOTE [ File sources by position ] in
``savable_loader/datasets/files/positions.py``) gives the same global batches on every
layout; its workers keep one forward reader per lane (``batch_size`` lanes a rank) and
pass the samples of the other workers' steps, and the loader counts every file when it
is built. This measures, for the same files read by one rank with 2 workers and batch 8
(the loader's processes pinned to one core, ``os.sched_setaffinity``, so that the figures
are CPU per item rather than a race for cores), each configuration once per round in an
alternated order (NOTE [ Alternation ] in ``common.py``):

* items per second over one epoch, after the first batch;
* the time to build the loader and get the first batch (the count happens there);
* CPU seconds per item of the main process and its workers (``cpu_seconds``).

Data: ``tar``: 16 shards of 250 samples (a 50 KB ``.bin`` and a ``.cls``); ``jsonl`` and
``jsonl.gz``: 8 files of 5,000 lines of about 1 KB. Usage::

    python benchmarks/bench_file_positions.py [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import alternate, cpu_seconds, median, paired_ratio, write_results

from savable_loader import SavableDataLoader
from savable_loader.datasets import JsonLinesSource, TarSource

BATCH, WORKERS = 8, 2


def write_data(root: Path, quick: bool) -> dict[str, str]:
    shards, samples, lines, files = (4, 100, 1000, 4) if quick else (16, 250, 5000, 8)
    payload = os.urandom(50_000)
    for f in range(shards):
        with tarfile.open(root / f"shard-{f:02d}.tar", "w") as tar:
            for i in range(samples):
                for ext, data in (("bin", payload), ("cls", b"%d" % (i % 10))):
                    info = tarfile.TarInfo(f"{f:02d}_{i:05d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    text = "x" * 1000
    for f in range(files):
        rows = "".join(json.dumps({"id": f * lines + i, "text": text}) + "\n" for i in range(lines))
        (root / f"part-{f:02d}.jsonl").write_text(rows)
        with gzip.open(root / f"gz-{f:02d}.jsonl.gz", "wt") as file:
            file.write(rows)
    return {
        "tar": str(root / "shard-*.tar"),
        "jsonl": str(root / "part-*.jsonl"),
        "jsonl.gz": str(root / "gz-*.jsonl.gz"),
    }


def measure(kind: str, urls: str, split: str) -> Callable[[], dict[str, float]]:
    def run() -> dict[str, float]:
        cpu, start = cpu_seconds(), time.perf_counter()
        source = (
            TarSource(urls, split=split) if kind == "tar" else JsonLinesSource(urls, split=split)
        )
        loader = SavableDataLoader(source, batch_size=BATCH, num_workers=WORKERS, collate_fn=list)
        stream = iter(loader)
        items = len(next(stream))
        first = time.perf_counter()
        for batch in stream:
            items += len(batch)
        end = time.perf_counter()
        loader.close()
        return {
            "items": items,
            "first_s": first - start,
            "items_per_s": items / (end - first),
            "cpu_us_per_item": (cpu_seconds() - cpu) / items * 1e6,
        }

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small data, results not written")
    args = parser.parse_args()
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})  # workers inherit it
    rows: list[dict[str, Any]] = []
    samples: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        data = write_data(Path(folder), args.quick)
        for kind, urls in data.items():
            results = alternate(
                {split: measure(kind, urls, split) for split in ("samples", "global")},
                args.rounds,
                progress=kind,
            )
            samples[kind] = results
            for split in ("samples", "global"):
                runs = results[split]
                rows.append(
                    {
                        "source": kind,
                        "split": split,
                        "items": runs[0]["items"],
                        "items/s": round(median([r["items_per_s"] for r in runs])),
                        "/ samples": round(
                            paired_ratio(
                                [r["items_per_s"] for r in runs],
                                [r["items_per_s"] for r in results["samples"]],
                            ),
                            2,
                        ),
                        "first batch s": round(median([r["first_s"] for r in runs]), 3),
                        "CPU us/item": round(median([r["cpu_us_per_item"] for r in runs])),
                    }
                )
    write_results(
        "bench_file_positions",
        title="File sources read by position (split=global) against split=samples",
        parameters={"batch_size": BATCH, "num_workers": WORKERS, "rounds": args.rounds},
        columns=[
            "source",
            "split",
            "items",
            "items/s",
            "/ samples",
            "first batch s",
            "CPU us/item",
        ],
        rows=rows,
        notes=[
            "one rank, 2 workers, the loader's processes pinned to one core; medians over "
            "rounds, '/ samples' the median of the per-round ratios",
        ],
        samples=samples,
        write=not args.quick,
    )


if __name__ == "__main__":
    main()
