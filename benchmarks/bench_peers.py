"""Peers: savable_loader against torch's DataLoader, torchdata and Megatron-Energon.

One harness, one workload definition (``peers/workloads.py``), one small adapter per
loader (``peers/adapters.py``), every loader measured in the same run with alternating
order (NOTE [ Alternation ] in ``common.py``). Loaders: torch's ``DataLoader``
(throughput baseline; it cannot save), torchdata's ``StatefulDataLoader`` with
``snapshot_every_n_steps`` 1 (its default) and 64, Megatron-Energon's
``SavableDataLoader`` when it is installed, and ours. 2 workers, prefetch 2.

Workloads: synthetic items drawing from the global ``random``, ``numpy.random`` and
``torch`` generators and costing 0, 200 us or 2 ms of CPU work; and JPEG images the
benchmark writes itself (200 of 128x96), decoded, randomly cropped to 80x80, flipped and
brightness-jittered.

Phases (NOTE [ Peer phases ]):

* throughput: fresh loader per measurement, batch 32; items/s as a ratio to torch's
  DataLoader measured in the same round; worker memory (PSS, USS) after the timed batches;
* save: 2 ms items, batch 8; save every 2 batches while the workers are busy; latency
  median and max, state size;
* resume: batch 8; save after k batches, restore into a fresh loader, time from restore
  to the first batch, items recomputed, and whether the next batches equal an
  uninterrupted run's (first divergence if not).

    python benchmarks/bench_peers.py [--quick] [--rounds R] [--seconds S] [--plots-only]

NOTE [ Peer phases ]
Throughput, per workload and round, measures every loader once, the order reversing
every round: build, ``iter()``, time to the first batch, discard ``WARMUP`` batches (the
prefetched ones included), time batches for ``--seconds``, read the memory of the worker
processes (children of this process that appeared since the loader started:
``/proc/<pid>/smaps_rollup``), close. The save phase runs each savable loader once per
round on 2 ms items and times ``save()`` after every second batch: the consumer takes
batches as soon as they come, so the workers are always inside an item. The resume phase
runs, per workload and savable loader, one uninterrupted reference of
``max(POINTS) + CONTINUE`` batches, then per round and save point k: a loader takes k
batches and saves (timed; state size), a fresh loader restores that state, and the time
from ``restore()`` to its first batch is taken; its first ``CONTINUE`` batches are
compared with the reference's batches k, k+1, ... by digest
(``savable_loader.testing.digest``), and the positions its workers produced that the
saving loader had already delivered are counted (NOTE [ Counting recomputed items ] in
``peers/workloads.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import common
from peers import adapters as peer_adapters
from peers import workloads as peer_workloads
from peers.adapters import Adapter
from peers.workloads import Workload

from savable_loader.testing import digest

warnings.filterwarnings("ignore", message="This DataLoader will create")
# torchdata 0.11 calls a torch function that torch 2.13 deprecates.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

WORKERS = 2
PREFETCH = 2
COSTS_US = (0.0, 200.0, 2000.0)
THROUGHPUT_BATCH = 32
WARMUP = 2 * PREFETCH * WORKERS + 4
SAVE_BATCH = 8
SAVE_COST_US = 2000.0
SAVE_EVERY = 2
RESUME_BATCH = 8
POINTS = (5, 37, 100)
CONTINUE = 16
DOCS_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"


# -- processes -------------------------------------------------------------------------------


def child_pids() -> set[int]:
    """This process's children (from every thread's ``/proc/.../children``)."""
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids.update(int(pid) for pid in (task / "children").read_text().split())
        except OSError:
            continue
    return pids


def memory_kib(pids: Sequence[int]) -> dict[str, float]:
    """Summed RSS, PSS and USS (private clean + dirty) of ``pids``, in KiB."""
    totals = {"rss": 0.0, "pss": 0.0, "uss": 0.0, "processes": 0.0}
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        fields = {}
        for line in lines[1:]:
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                fields[parts[0].rstrip(":")] = float(parts[1])
        totals["rss"] += fields.get("Rss", 0.0)
        totals["pss"] += fields.get("Pss", 0.0)
        totals["uss"] += fields.get("Private_Clean", 0.0) + fields.get("Private_Dirty", 0.0)
        totals["processes"] += 1
    return totals


def batch_digest(batch: Any) -> str:
    """The digest of a batch's data (keys starting with ``__``, loaders' bookkeeping such
    as Energon's restore keys, are left out)."""
    if isinstance(batch, dict):
        batch = {key: value for key, value in batch.items() if not str(key).startswith("__")}
    return digest(batch)


def batch_positions(batch: Any) -> list[int]:
    return [int(i) for i in batch["index"]]


# -- throughput and memory ---------------------------------------------------------------------


def _time_batches(iterator: Iterator[Any], seconds: float) -> tuple[int, float]:
    batches = 0
    began = time.perf_counter()
    while True:
        next(iterator)
        batches += 1
        elapsed = time.perf_counter() - began
        if elapsed >= seconds:
            return batches, elapsed


def measure_throughput(
    cls: type[Adapter], workload: Workload, *, seconds: float, warmup: int
) -> dict[str, float]:
    adapter = cls.build(
        workload, batch_size=THROUGHPUT_BATCH, num_workers=WORKERS, prefetch_factor=PREFETCH
    )
    before = child_pids()
    try:
        began = time.perf_counter()
        iterator = adapter.iterator()
        next(iterator)
        first = time.perf_counter() - began
        for _ in range(warmup):
            next(iterator)
        batches, elapsed = _time_batches(iterator, seconds)
        memory = memory_kib(sorted(child_pids() - before))
        del iterator
    finally:
        adapter.close()
    return {
        "items_per_s": batches * THROUGHPUT_BATCH / elapsed,
        "batches": batches,
        "first_batch_ms": first * 1e3,
        "workers_rss_kib": memory["rss"],
        "workers_pss_kib": memory["pss"],
        "workers_uss_kib": memory["uss"],
        "worker_processes": memory["processes"],
    }


def run_throughput(
    workloads: Sequence[Workload],
    loaders: dict[str, type[Adapter]],
    *,
    rounds: int,
    seconds: float,
    warmup: int,
) -> dict[str, dict[str, list[dict[str, float]]]]:
    results = {}
    for workload in workloads:
        results[workload.name] = common.alternate(
            {
                key: functools.partial(
                    measure_throughput, cls, workload, seconds=seconds, warmup=warmup
                )
                for key, cls in loaders.items()
            },
            rounds,
            progress=f"throughput, {workload.name}",
        )
    return results


# -- save latency ---------------------------------------------------------------------------------


def measure_saves(cls: type[Adapter], workload: Workload, *, saves: int) -> dict[str, list[float]]:
    adapter = cls.build(
        workload, batch_size=SAVE_BATCH, num_workers=WORKERS, prefetch_factor=PREFETCH
    )
    latencies, sizes = [], []
    try:
        iterator = adapter.iterator()
        for _ in range(WARMUP):
            next(iterator)
        for _ in range(saves):
            for _ in range(SAVE_EVERY):
                next(iterator)
            began = time.perf_counter()
            state = adapter.save()
            latencies.append((time.perf_counter() - began) * 1e3)
            sizes.append(adapter.state_size(state))
        del iterator
    finally:
        adapter.close()
    return {"latency_ms": latencies, "state_bytes": sizes}


def run_saves(
    workload: Workload, loaders: dict[str, type[Adapter]], *, rounds: int, saves: int
) -> dict[str, list[dict[str, list[float]]]]:
    return common.alternate(
        {
            key: functools.partial(measure_saves, cls, workload, saves=saves)
            for key, cls in loaders.items()
        },
        rounds,
        progress="save latency",
    )


# -- resume: exactness, restore time, recomputed items ----------------------------------------


def reference(cls: type[Adapter], workload: Workload, batches: int) -> list[dict[str, Any]]:
    adapter = cls.build(
        workload, batch_size=RESUME_BATCH, num_workers=WORKERS, prefetch_factor=PREFETCH
    )
    try:
        iterator = adapter.iterator()
        taken = [next(iterator) for _ in range(batches)]
        del iterator
    finally:
        adapter.close()
    return [{"digest": batch_digest(b), "positions": batch_positions(b)} for b in taken]


def measure_resume(
    cls: type[Adapter],
    workload: Workload,
    *,
    point: int,
    follow: int,
    ref: list[dict[str, Any]],
) -> dict[str, Any]:
    """Saves after ``point`` batches, restores into a fresh loader, compares ``follow``
    batches with the reference (NOTE [ Peer phases ])."""
    saver = cls.build(
        workload, batch_size=RESUME_BATCH, num_workers=WORKERS, prefetch_factor=PREFETCH
    )
    try:
        began = time.perf_counter()
        iterator = saver.iterator()
        delivered = batch_positions(next(iterator))
        fresh_first = time.perf_counter() - began
        for _ in range(point - 1):
            delivered += batch_positions(next(iterator))
        began = time.perf_counter()
        state = saver.save()
        save_ms = (time.perf_counter() - began) * 1e3
        size = saver.state_size(state)
        del iterator
    finally:
        saver.close()

    with tempfile.TemporaryDirectory(prefix="peers-log-") as log_dir:
        restored = cls.build(
            workload.logging_to(log_dir),
            batch_size=RESUME_BATCH,
            num_workers=WORKERS,
            prefetch_factor=PREFETCH,
        )
        try:
            began = time.perf_counter()
            restored.restore(state)
            iterator = restored.iterator()
            got = [next(iterator)]
            restore_first = time.perf_counter() - began
            got += [next(iterator) for _ in range(follow - 1)]
            stats = (
                restored.loader.worker_stats()
                if isinstance(restored, peer_adapters.OursAdapter)
                else None
            )
            del iterator
        finally:
            restored.close()
        produced = peer_workloads.logged_positions(log_dir)
    already = set(delivered)
    recomputed = sum(1 for position in produced if position in already)
    divergence = None
    same_positions = None
    for offset, batch in enumerate(got):
        expected = ref[point + offset]
        if batch_digest(batch) != expected["digest"]:
            divergence = offset
            same_positions = batch_positions(batch) == expected["positions"]
            break
    result: dict[str, Any] = {
        "point": point,
        "exact": divergence is None,
        "first_divergence": divergence,
        "divergent_batch_has_same_positions": same_positions,
        "fresh_first_batch_ms": fresh_first * 1e3,
        "restore_to_first_batch_ms": restore_first * 1e3,
        "save_ms": save_ms,
        "state_bytes": size,
        "items_recomputed": recomputed,
    }
    if stats is not None:
        result["ours_replayed_items"] = sum(s["replayed"] for s in stats) * RESUME_BATCH
    return result


def run_resume(
    workloads: Sequence[Workload],
    loaders: dict[str, type[Adapter]],
    *,
    rounds: int,
    points: Sequence[int],
    follow: int,
) -> dict[str, dict[str, list[list[dict[str, Any]]]]]:
    results = {}
    for workload in workloads:
        refs = {key: reference(cls, workload, max(points) + follow) for key, cls in loaders.items()}

        def one_round(
            key: str,
            workload: Workload = workload,
            refs: dict[str, list[dict[str, Any]]] = refs,
        ) -> list[dict[str, Any]]:
            return [
                measure_resume(loaders[key], workload, point=point, follow=follow, ref=refs[key])
                for point in points
            ]

        results[workload.name] = common.alternate(
            {key: functools.partial(one_round, key) for key in loaders},
            rounds,
            progress=f"resume, {workload.name}",
        )
    return results


# -- tables ------------------------------------------------------------------------------------


def _range(values: Sequence[float]) -> str:
    return f"{min(values):.2f}..{max(values):.2f}"


def throughput_rows(
    results: dict[str, dict[str, list[dict[str, float]]]], names: dict[str, str]
) -> tuple[list[str], list[dict[str, Any]]]:
    columns = ["workload", "torch items/s"] + [
        f"{names[key]} / torch" for key in next(iter(results.values())) if key != "torch"
    ]
    rows = []
    for workload, by_loader in results.items():
        torch_rates = [r["items_per_s"] for r in by_loader["torch"]]
        row: dict[str, Any] = {"workload": workload, "torch items/s": common.median(torch_rates)}
        for key, runs in by_loader.items():
            if key == "torch":
                continue
            ratios = [
                r["items_per_s"] / t["items_per_s"]
                for r, t in zip(runs, by_loader["torch"], strict=True)
            ]
            row[f"{names[key]} / torch"] = f"{statistics.median(ratios):.3f} ({_range(ratios)})"
        rows.append(row)
    return columns, rows


def memory_rows(
    results: dict[str, dict[str, list[dict[str, float]]]], names: dict[str, str]
) -> tuple[list[str], list[dict[str, Any]]]:
    keys = list(next(iter(results.values())))
    columns = ["workload"] + [names[key] for key in keys]
    rows = []
    for workload, by_loader in results.items():
        row: dict[str, Any] = {"workload": workload}
        for key in keys:
            pss = common.median([r["workers_pss_kib"] for r in by_loader[key]]) / 1024
            uss = common.median([r["workers_uss_kib"] for r in by_loader[key]]) / 1024
            row[names[key]] = f"{pss:.1f} / {uss:.1f}"
        rows.append(row)
    return columns, rows


def save_rows(
    results: dict[str, list[dict[str, list[float]]]], names: dict[str, str]
) -> tuple[list[str], list[dict[str, Any]]]:
    columns = ["loader", "saves", "median ms", "p90 ms", "max ms", "state bytes (median)"]
    rows = []
    for key, runs in results.items():
        latencies = [x for run in runs for x in run["latency_ms"]]
        sizes = [x for run in runs for x in run["state_bytes"]]
        rows.append(
            {
                "loader": names[key],
                "saves": len(latencies),
                "median ms": common.median(latencies),
                "p90 ms": sorted(latencies)[int(0.9 * (len(latencies) - 1))],
                "max ms": max(latencies),
                "state bytes (median)": int(common.median(sizes)),
            }
        )
    return columns, rows


def resume_rows(
    results: dict[str, dict[str, list[list[dict[str, Any]]]]],
    names: dict[str, str],
    points: Sequence[int],
) -> tuple[list[str], list[dict[str, Any]]]:
    at = " / ".join(str(p) for p in points)
    columns = [
        "workload",
        "loader",
        "continuation exact",
        "first divergence",
        f"items recomputed, saved after {at} batches",
        "fresh start -> first batch ms",
        f"restore -> first batch ms, after {at} batches",
        "state bytes",
    ]
    rows = []
    for workload, by_loader in results.items():
        for key, rounds in by_loader.items():
            runs = [run for round_runs in rounds for run in round_runs]
            exact = sum(1 for run in runs if run["exact"])
            diverged = [run for run in runs if not run["exact"]]
            if diverged:
                first = min(diverged, key=lambda run: (run["first_divergence"], run["point"]))
                kind = (
                    "same items, other random draws"
                    if first["divergent_batch_has_same_positions"]
                    else "other items"
                )
                points_diverged = sorted({run["point"] for run in diverged})
                divergence = (
                    f"batch {first['first_divergence']} after restore ({kind}); "
                    f"saved after {', '.join(map(str, points_diverged))}"
                )
            else:
                divergence = "-"

            def per_point(field: str, runs: list[dict[str, Any]] = runs) -> list[float]:
                return [
                    common.median([run[field] for run in runs if run["point"] == point])
                    for point in points
                ]

            recomputed = per_point("items_recomputed")
            restore_ms = per_point("restore_to_first_batch_ms")
            rows.append(
                {
                    "workload": workload,
                    "loader": names[key],
                    "continuation exact": f"{exact}/{len(runs)}",
                    "first divergence": divergence,
                    f"items recomputed, saved after {at} batches": " / ".join(
                        f"{x:g}" for x in recomputed
                    ),
                    "fresh start -> first batch ms": common.median(
                        [run["fresh_first_batch_ms"] for run in runs]
                    ),
                    f"restore -> first batch ms, after {at} batches": " / ".join(
                        f"{x:.0f}" for x in restore_ms
                    ),
                    "state bytes": int(common.median([run["state_bytes"] for run in runs])),
                }
            )
    return columns, rows


# -- output ---------------------------------------------------------------------------------------


def write(
    tables: dict[str, tuple[str, list[str], list[dict[str, Any]]]],
    *,
    parameters: dict[str, Any],
    notes: list[str],
    samples: dict[str, Any],
    runtime_s: float,
) -> None:
    machine = common.machine_info()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = "python benchmarks/bench_peers.py"
    payload = {
        "bench": "bench_peers",
        "command": command,
        "title": "Peers: savable_loader, torch, torchdata and Megatron-Energon",
        "date": when,
        "runtime_s": round(runtime_s, 1),
        "machine": machine,
        "parameters": parameters,
        "tables": {
            key: {"title": title, "columns": columns, "rows": rows}
            for key, (title, columns, rows) in tables.items()
        },
        "notes": notes,
        "noise": common.NOISE_NOTE,
        "samples": samples,
    }
    common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    json_path = common.RESULTS_DIR / "bench_peers.json"
    md_path = common.RESULTS_DIR / "bench_peers.md"
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    parts = [
        f"# {payload['title']}",
        "",
        f"Generated by `{command}` on {when} in {runtime_s / 60:.1f} minutes.",
        "",
    ]
    for title, columns, rows in tables.values():
        parts += [f"## {title}", "", common.format_table(columns, rows), ""]
    parts += ["## Notes", "", *[f"- {note}" for note in notes], ""]
    machine_line = ", ".join(f"{key}={value}" for key, value in machine.items())
    parts += [
        f"Parameters: `{json.dumps(parameters)}`",
        "",
        f"Machine: {machine_line}.",
        "",
        f"Noise: {common.NOISE_NOTE}",
        "",
    ]
    md_path.write_text("\n".join(parts))
    print(f"\nwrote {json_path} and {md_path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny rounds (smoke run); writes nothing"
    )
    parser.add_argument("--rounds", type=int, default=None, help="throughput rounds (default 6)")
    parser.add_argument(
        "--seconds", type=float, default=None, help="timed seconds per throughput run (default 1.5)"
    )
    parser.add_argument(
        "--plots-only",
        action="store_true",
        help="redraw docs/img/peers_*.png from results/bench_peers.json; measure nothing",
    )
    args = parser.parse_args()
    if args.plots_only:
        redraw()
        return
    quick = args.quick
    rounds = args.rounds or (1 if quick else 6)
    seconds = args.seconds or (0.3 if quick else 1.5)
    warmup = 4 if quick else WARMUP
    save_rounds, saves = (1, 4) if quick else (3, 20)
    resume_rounds, points, follow = (1, (3, 10), 4) if quick else (2, POINTS, CONTINUE)
    started = time.perf_counter()

    print(f"burn unit: {common.calibrate():.3f} us per BLAKE2b call (main process)")
    loaders = peer_adapters.available()
    names = {key: cls.name for key, cls in loaders.items()}
    savable = {key: cls for key, cls in loaders.items() if cls.savable}
    energon_note = (
        f"Megatron-Energon {_version('megatron-energon')} ran on CPU, over an Energon "
        "SavableDataset subclass around the same items (no WebDataset preparation needed "
        "for a custom dataset), with its defaults (checkpoint_every_sec=60)."
        if "energon" in loaders
        else f"Megatron-Energon was not measured: {peer_adapters.ENERGON_ERROR}."
    )
    print(energon_note, file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="peers-images-") as image_dir:
        began = time.perf_counter()
        paths = peer_workloads.make_images(Path(image_dir) / "jpeg")
        print(f"wrote {len(paths)} images in {time.perf_counter() - began:.2f} s", file=sys.stderr)
        workloads = peer_workloads.workloads(COSTS_US, paths)
        save_workload = next(w for w in workloads if w.cost_us == SAVE_COST_US)
        throughput = run_throughput(
            workloads, loaders, rounds=rounds, seconds=seconds, warmup=warmup
        )
        save_results = run_saves(save_workload, savable, rounds=save_rounds, saves=saves)
        resume = run_resume(workloads, savable, rounds=resume_rounds, points=points, follow=follow)
    runtime = time.perf_counter() - started

    tables = {
        "throughput": (
            "Throughput, ratio to torch's DataLoader (median over rounds, min..max)",
            *throughput_rows(throughput, names),
        ),
        "save": (
            "Save latency while the workers are busy (2 ms items)",
            *save_rows(save_results, names),
        ),
        "resume": (
            "Restore: exactness, time to first batch, items recomputed, state size",
            *resume_rows(resume, names, points),
        ),
        "memory": (
            "Worker memory, MiB: PSS / USS summed over the 2 workers (median over rounds)",
            *memory_rows(throughput, names),
        ),
    }
    for title, columns, rows in tables.values():
        print(f"\n{title}\n{common.format_table(columns, rows)}")
    load = os.getloadavg()
    notes = [
        f"{WORKERS} workers, prefetch_factor {PREFETCH}, persistent workers, fixed seeds; "
        "each loader's own defaults otherwise (NOTE [ Loader settings ] in "
        "benchmarks/peers/adapters.py).",
        f"Throughput: batch {THROUGHPUT_BATCH}; {rounds} alternating rounds; each measurement "
        f"builds the loader, discards {warmup} batches after the first, times {seconds:g} s of "
        "batches and closes it. Cells: median over rounds of (loader / torch) items per second "
        "in the same round, then min..max over rounds.",
        f"Save latency: batch {SAVE_BATCH}, items of 2 ms of CPU work; {save_rounds} rounds "
        f"per loader, {saves} saves each, one after every {SAVE_EVERY} batches, timing the "
        "loader's own save call (ours: save_state_rank(); torchdata: state_dict(); Energon: "
        "save_state_rank()). torch's DataLoader cannot save.",
        f"Restore: batch {RESUME_BATCH}; per round and save point, a loader takes k batches "
        f"and saves, a fresh loader restores and yields {follow} batches, compared by digest "
        f"with an uninterrupted run; {resume_rounds} rounds. 'exact' counts runs whose "
        f"{follow} batches all matched. 'restore -> first batch': restore() + iter() + the "
        "first batch (worker start-up included); 'fresh start': iter() + the first batch "
        "of the saving loader. Items recomputed: positions the restored loader's workers "
        "produced that the saving loader had already delivered (median over rounds).",
        "State bytes: ours as a state file (msgpack); torchdata and Energon as "
        "len(pickle.dumps(state)) in memory (NOTE [ State size ]).",
        "Worker memory: /proc/<pid>/smaps_rollup of the loader's worker processes after the "
        "timed throughput batches; PSS shares pages with the main process, USS counts only "
        "the workers' private pages.",
        energon_note,
        f"Load average (1, 5, 15 min) at the start {list(common.LOAD_AT_START)} and at the end "
        f"{[round(x, 2) for x in load]}: "
        + (
            "the machine was shared with other jobs during this run, so absolute figures are "
            "lower and noisier than on a quiet machine."
            if max(max(common.LOAD_AT_START), max(load)) > 1.0
            else "the machine was quiet."
        ),
        f"Run time {runtime / 60:.1f} minutes.",
    ]
    for note in notes:
        print(f"- {note}")
    from peers import plots

    if quick:
        # A smoke run draws the plots outside the repository, to look at, and leaves the
        # committed results alone.
        plot_dir = Path(tempfile.mkdtemp(prefix="peers-plots-"))
        drawn = plots.draw(throughput, save_results, resume, names, points, plot_dir)
        print(f"\nquick run: results not written; {len(drawn)} plots drawn into {plot_dir}")
        return
    write(
        tables,
        parameters={
            "workers": WORKERS,
            "prefetch_factor": PREFETCH,
            "costs_us": COSTS_US,
            "throughput_batch": THROUGHPUT_BATCH,
            "throughput_rounds": rounds,
            "throughput_seconds": seconds,
            "warmup_batches": warmup,
            "save_batch": SAVE_BATCH,
            "save_rounds": save_rounds,
            "saves_per_round": saves,
            "save_every_batches": SAVE_EVERY,
            "resume_batch": RESUME_BATCH,
            "resume_rounds": resume_rounds,
            "save_points": points,
            "continue_batches": follow,
            "loaders": names,
        },
        notes=notes,
        samples={"throughput": throughput, "save": save_results, "resume": resume},
        runtime_s=runtime,
    )
    for path in plots.draw(throughput, save_results, resume, names, points, DOCS_IMG):
        print(f"wrote {path}")


def redraw() -> None:
    """Draws the plots from the committed samples (``results/bench_peers.json``)."""
    from peers import plots

    payload = json.loads((common.RESULTS_DIR / "bench_peers.json").read_text())
    samples, parameters = payload["samples"], payload["parameters"]
    for path in plots.draw(
        samples["throughput"],
        samples["save"],
        samples["resume"],
        parameters["loaders"],
        parameters["save_points"],
        DOCS_IMG,
    ):
        print(f"wrote {path}")


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "(unknown version)"


if __name__ == "__main__":
    main()
