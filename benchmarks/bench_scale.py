"""Scale: memory per worker and time to the first batch as the dataset grows, state bytes,
and global save / restore time as the job grows (issue 16).

1. A shuffled map-style dataset of ``N`` items (an index is its item), 2 workers, batch
   32: the peak RSS of each worker (``VmHWM``) and the time from building the loader to
   its first batch, for N = 10**6 .. 10**10. The shuffled order is computed (NOTE
   [ Computed epoch orders ]); torch's ``DataLoader`` with ``shuffle=True`` is measured
   up to 10**8 in the same run (its ``RandomSampler`` draws a permutation of N).
2. The bytes of a saved state per worker and per job, for that dataset.
3. Global save and restore on 2, 4, 8 and 16 gloo ranks of one process each, 2 workers a
   rank, in both forms: ``save_state_global`` (gathered on rank 0, one file) and
   ``save_checkpoint`` (a file per rank, metadata last); a line fitted to the times and
   its value at 1,024 ranks, **an extrapolation, not a measurement**.
4. A torch sampler's epoch (``RandomSampler``, ``DistributedSampler``) at N = 10**6 and
   10**7: the main process's peak RSS above its baseline up to the first batch, ours and
   torch's ``DataLoader`` over the same sampler, each in a fresh process.

Writes ``benchmarks/results/bench_scale.json`` and ``.md`` (not with ``--quick``,
``--no-ranks`` or ``--samplers`` (part 4 alone), which print only).

    python benchmarks/bench_scale.py [--quick] [--no-ranks] [--samplers]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import numpy as np
import torch
from torch.utils.data import DataLoader

from savable_loader import (
    SavableDataLoader,
    WorkerConfig,
    load_checkpoint,
    load_state,
    save_checkpoint,
    save_state,
)
from savable_loader.state.files import encode_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

BATCH = 32


Range = common.Range


def _children_peak_rss() -> list[int]:
    """Peak resident set (bytes) of this process's child processes."""
    peaks = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            if parent != me:
                continue
            with open(f"/proc/{entry}/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        peaks.append(int(line.split()[1]) * 1024)
        except (OSError, ValueError, IndexError):
            continue
    return peaks


def _first_batch(build: Any) -> tuple[float, list[int]]:
    began = time.perf_counter()
    loader = build()
    iterator = iter(loader)
    batch = next(iterator)
    elapsed = time.perf_counter() - began
    assert len(batch) == BATCH
    peaks = _children_peak_rss()
    # Stop the workers now, so that the next loader's forked workers inherit no iterator.
    if hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    del iterator, loader
    gc.collect()
    return elapsed, peaks


Rows = list[dict[str, Any]]


def part_sizes(sizes: list[int], torch_up_to: int) -> Rows:
    """Part 1: first batch and worker peak RSS, ours and torch's, per ``N``."""
    rows: Rows = []
    for n in sizes:
        ours = _first_batch(
            lambda n=n: SavableDataLoader(Range(n), batch_size=BATCH, shuffle=True, num_workers=2)
        )
        theirs: tuple[float, list[int]] | None = None
        if n <= torch_up_to:
            theirs = _first_batch(
                lambda n=n: DataLoader(Range(n), batch_size=BATCH, shuffle=True, num_workers=2)
            )
        mb = lambda peaks: f"{max(peaks) / 2**20:.0f} MB" if peaks else "-"  # noqa: E731
        rows.append(
            {
                "N": f"10^{len(str(n)) - 1}",
                "ours: first batch s": ours[0],
                "ours: worker peak RSS": mb(ours[1]),
                "torch: first batch s": theirs[0] if theirs else "not run (permutation of N)",
                "torch: worker peak RSS": mb(theirs[1]) if theirs else "-",
            }
        )
    return rows


def part_state_bytes() -> Rows:
    """Part 2: the bytes of a saved state per worker and per job (10^9 items)."""
    import msgpack

    rows: Rows = []
    for workers in (0, 2, 8):
        loader = SavableDataLoader(
            Range(10**9), batch_size=BATCH, shuffle=True, num_workers=workers
        )
        iterator = iter(loader)
        for _ in range(3):
            next(iterator)
        state = loader.save_state_rank()
        loader.close()
        per_worker = [
            len(msgpack.packb(w.model_dump(mode="python"), use_bin_type=True))
            for w in state.workers
        ]
        rows.append(
            {
                "workers": workers,
                "per worker B (msgpack of the worker's state)": max(per_worker),
                "whole file B": len(encode_state(state)),
            }
        )
    return rows


def _job(rank: int, world_size: int, tmp: Path) -> dict[str, float]:
    """One rank: a loader of 2 workers, 3 batches, then both save forms and both restores."""
    import torch.distributed as dist

    def build() -> SavableDataLoader:
        return SavableDataLoader(
            Range(10**6),
            batch_size=BATCH,
            shuffle=True,
            num_workers=2,
            worker_config=WorkerConfig(rank=rank, world_size=world_size),
        )

    loader = build()
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    times: dict[str, float] = {}
    dist.barrier()
    began = time.perf_counter()
    states = loader.save_state_global()
    if rank == 0:
        save_state(states, tmp / f"global-{world_size}.msgpack")
    dist.barrier()
    times["gather save"] = time.perf_counter() - began
    began = time.perf_counter()
    save_checkpoint(loader, tmp / f"dir-{world_size}")
    dist.barrier()
    times["directory save"] = time.perf_counter() - began
    loader.close()
    restored = build()
    dist.barrier()
    began = time.perf_counter()
    restored.restore_state_global(load_state(tmp / f"global-{world_size}.msgpack"))
    dist.barrier()
    times["gather restore"] = time.perf_counter() - began
    began = time.perf_counter()
    load_checkpoint(restored, tmp / f"dir-{world_size}")
    dist.barrier()
    times["directory restore"] = time.perf_counter() - began
    restored.close()
    if rank == 0:  # what rank 0 reads and holds of a save, in bytes
        times["gather bytes on rank 0"] = float(
            os.path.getsize(tmp / f"global-{world_size}.msgpack")
        )
        folder = tmp / f"dir-{world_size}"
        own = next(folder.glob("*/rank-0.msgpack"))
        times["directory bytes on rank 0"] = float(
            os.path.getsize(own) + os.path.getsize(folder / "metadata.msgpack")
        )
    return times


def extra_worker_bytes(state_bytes: Rows) -> float:
    """What one more worker adds to a rank's state file, from part 2 (2 and 8 workers)."""
    size = {row["workers"]: row["whole file B"] for row in state_bytes}
    return (size[8] - size[2]) / 6


def part_ranks(ranks: list[int], per_worker: float) -> Rows:
    """Part 3: global save and restore on gloo ranks, times on rank 0, a fitted line and
    its value at 1,024 ranks (an extrapolation).

    The bytes are measured with 2 workers a rank; at 8 workers a rank's own state file
    holds 6 more workers (``per_worker`` bytes each, from part 2). Gathered, rank 0 reads
    every rank's state, so the fitted line at 1,024 ranks gains 1,024 x 6 workers;
    in the directory form it reads its own file (6 more workers) and the metadata,
    whose line per rank does not depend on the workers."""
    from gloo import in_rank_order, run_ranks

    measured: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for world in ranks:
            reports = in_rank_order(
                run_ranks(_job, world, Path(folder), timeout=600), world, "scale"
            )
            for name, seconds in reports[0].items():
                measured.setdefault(name, []).append(seconds)
    rows: Rows = []
    for name, values in measured.items():
        slope, intercept = np.polyfit(ranks, values, 1)
        at = intercept + slope * 1024
        row: dict[str, Any] = {"form": name}
        if "bytes" in name:
            row.update({f"{r} ranks": f"{v:,.0f} B" for r, v in zip(ranks, values, strict=True)})
            row["fitted per rank"] = f"{slope:,.0f} B"
            ranks_with_more = 1024 if name.startswith("gather") else 1
            at += ranks_with_more * 6 * per_worker
            row["at 1,024 ranks x 8 workers (extrapolation)"] = f"~{at / 2**20:.2f} MB"
        else:
            row.update(
                {f"{r} ranks": f"{v * 1000:.0f} ms" for r, v in zip(ranks, values, strict=True)}
            )
            row["fitted per rank"] = f"{slope * 1000:.1f} ms"
            row["at 1,024 ranks x 8 workers (extrapolation)"] = f"~{max(at, 0):.1f} s"
        rows.append(row)
    return rows


def _peak_rss_status() -> dict[str, int]:
    """This process's resident set now and at its peak (bytes)."""
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                found[line.split(":")[0]] = int(line.split()[1]) * 1024
    return found


def _sampler_child(kind: str, n: int, which: str) -> None:
    """In a fresh process: the main process's peak RSS above its baseline and the time to
    the first batch of one loader reading one sampler (printed as JSON)."""
    import json

    from torch.utils.data import DistributedSampler, RandomSampler

    torch.set_num_threads(1)
    data = Range(n)
    if kind == "DistributedSampler":
        sampler: Any = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
    else:
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(0))
    batch = None if kind == "RandomSampler, batch_size=None" else BATCH
    kind_of = SavableDataLoader if which == "ours" else DataLoader
    gc.collect()
    baseline = _peak_rss_status()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as refs:  # VmHWM := VmRSS
        refs.write("5")
    began = time.perf_counter()
    loader = kind_of(data, sampler=sampler, batch_size=batch, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    elapsed = time.perf_counter() - began
    peak = _peak_rss_status()["VmHWM"] - baseline
    if hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    print(json.dumps({"peak": peak, "seconds": elapsed}))


def part_samplers(sizes: list[int]) -> Rows:
    """Part 4: the main process's peak memory drawing a torch sampler's epoch, ours and
    torch's ``DataLoader`` over the same sampler, each loader in a fresh process."""
    import json
    import subprocess

    rows: Rows = []
    kinds = ["RandomSampler", "RandomSampler, batch_size=None", "DistributedSampler"]
    for kind in kinds:
        for n in sizes:
            measured = {}
            for which in ("ours", "torch"):
                command = [sys.executable, __file__, "--sampler-child", kind, str(n), which]
                done = subprocess.run(
                    command, capture_output=True, text=True, check=True, timeout=600
                )
                measured[which] = json.loads(done.stdout.strip().splitlines()[-1])
            ours, theirs = measured["ours"]["peak"], measured["torch"]["peak"]
            rows.append(
                {
                    "sampler": kind,
                    "N": f"10^{len(str(n)) - 1}",
                    "ours: main peak above baseline": f"{ours / 2**20:.0f} MB",
                    "torch: main peak above baseline": f"{theirs / 2**20:.0f} MB",
                    "ours / torch": f"{ours / theirs:.2f}",
                    "ours: B per index": f"{ours / n:.1f}",
                    "torch: B per index": f"{theirs / n:.1f}",
                    "ours: first batch s": f"{measured['ours']['seconds']:.2f}",
                    "torch: first batch s": f"{measured['torch']['seconds']:.2f}",
                }
            )
    return rows


SAMPLER_TITLE = "A torch sampler's epoch in the main process"
SAMPLER_NOTES = [
    "Each loader runs in a fresh process: its main process's peak RSS (VmHWM, reset to "
    "the resident set just before the loader is built) less that resident set, up to "
    "its first batch, 2 workers (fork), batch 32 unless said. RandomSampler has its own "
    "generator; DistributedSampler has 2 replicas (rank 0 reads half of N).",
    "torch's RandomSampler holds randperm(N).tolist() while the epoch is read (a Python "
    "int and a list slot per index, about 36 B) and DistributedSampler a list of its "
    "share besides; both loaders pay it. 'B per index' divides by N.",
]


def _section(title: str, rows: Rows, notes: list[str]) -> str:
    """A markdown section: a heading, the table, its notes."""
    lines = [f"## {title}", "", common.format_table(list(rows[0]), rows), ""]
    return "\n".join(lines + [f"- {note}" for note in notes] + [""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer sizes and ranks; writes nothing"
    )
    parser.add_argument(
        "--no-ranks", action="store_true", help="skip part 3 (gloo ranks); writes nothing"
    )
    parser.add_argument(
        "--samplers",
        action="store_true",
        help="only part 4 (a torch sampler's epoch in the main process); writes nothing",
    )
    parser.add_argument("--sampler-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sampler_child:
        kind, n, which = args.sampler_child
        _sampler_child(kind, int(n), which)
        return
    torch.set_num_threads(1)
    sampler_sizes = [10**6, 10**7]
    if args.samplers:
        print("\n" + _section(SAMPLER_TITLE, part_samplers(sampler_sizes), SAMPLER_NOTES))
        return
    sizes = [10**6, 10**8, 10**10] if args.quick else [10**6, 10**7, 10**8, 10**9, 10**10]
    ranks = [2, 4] if args.quick else [2, 4, 8, 16]
    sized = part_sizes(sizes, torch_up_to=10**7 if args.quick else 10**8)
    state_bytes = part_state_bytes()
    print(
        "\n" + _section("State bytes (shuffled map-style dataset of 10^9 items)", state_bytes, [])
    )
    ranked = [] if args.no_ranks else part_ranks(ranks, extra_worker_bytes(state_bytes))
    rank_notes = [
        "Each rank has 2 workers; all ranks share this machine's 2 cores (3 processes a "
        "rank), so the times grow with the oversubscription as much as with the algorithm; "
        "the bytes do not.",
        "The last column extends the fitted line to 1,024 ranks: an extrapolation, not a "
        "measurement. Bytes at 8 workers a rank add 6 workers' bytes (from the state-bytes "
        "table: the 8-worker file less the 2-worker one, over 6) to each rank's state "
        "gathered on rank 0, and to rank 0's own file in the directory form (its metadata "
        "grows with the ranks only); times are the fitted line as measured, with 2 "
        "workers a rank.",
    ]
    if ranked:
        print("\n" + _section("Global save and restore on gloo ranks", ranked, rank_notes))
    samplers = part_samplers(sampler_sizes)
    print("\n" + _section(SAMPLER_TITLE, samplers, SAMPLER_NOTES))
    written = common.write_results(
        "bench_scale",
        title="Scale: memory and first batch by dataset size, state bytes, global saves by ranks",
        parameters={
            "batch_size": BATCH,
            "workers": 2,
            "sizes": sizes,
            "ranks": ranks,
            "sampler_sizes": sampler_sizes,
        },
        columns=list(sized[0]),
        rows=sized,
        notes=[
            "Shuffled map-style dataset (an index is its item), 2 workers, batch 32; the "
            "time runs from building the loader to its first batch; peak RSS is each "
            "worker's VmHWM. torch's DataLoader(shuffle=True) is measured up to 10^8.",
            "The other three parts are below, and in the JSON file under samples.",
        ],
        samples={"state_bytes": state_bytes, "ranks": ranked, "samplers": samplers},
        write=not (args.quick or args.no_ranks),
    )
    if written is not None:
        _, md = written
        extra = [
            _section("State bytes (shuffled map-style dataset of 10^9 items)", state_bytes, []),
            _section("Global save and restore on gloo ranks", ranked, rank_notes),
            _section(SAMPLER_TITLE, samplers, SAMPLER_NOTES),
        ]
        md.write_text(md.read_text() + "\n" + "\n".join(extra))


if __name__ == "__main__":
    main()
