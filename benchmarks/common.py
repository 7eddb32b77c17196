"""What the benchmarks share: a calibrated CPU workload, one synthetic dataset, an
alternating timer and a result writer.

NOTE [ Item cost ]
An item's cost is emulated with real CPU work: BLAKE2b over a fixed 512-byte buffer,
repeated ``units`` times. ``calibrate()`` measures, in the main process, what one
repetition costs (the fastest of 15 bursts of ~20 ms: the speed when nothing else
competed) and ``units_for(us)`` converts a cost in microseconds to repetitions. The
buffer is below hashlib's 2 KiB threshold, so every call keeps the GIL, like a
pure-Python transform: the worst case for a worker's command thread, which must win the
GIL to answer a save. Items do not sleep or spin on ``time.perf_counter``: on the
Firecracker VM these benchmarks were developed on, both were found to make everything
that ran after them pathologically slow (only the save latency benchmark also sleeps,
last). The calibrated cost is nominal, since the VM's speed drifts; both loaders of a
comparison run the same repetitions, so the ratios do not depend on it.

NOTE [ Alternation ]
A comparison measures each loader once per round, alternating the order every round
(A B, B A, A B, ...) so that a slow drift of the machine hits both alike, and reports
medians over rounds: per loader, and of the per-round ratios (a paired figure, the one
the tables call "ratio").
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import multiprocessing
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, get_worker_info

import savable_loader
from savable_loader import SavableDataLoader, SavableDataset

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BUFFER = bytes(range(256)) * 2
NOISE_NOTE = (
    "Measured on a shared virtual machine (Firecracker VM, 2 vCPUs) whose speed drifts "
    "by tens of percent within minutes. Each figure is a median over alternating rounds; "
    "ratios against torch's DataLoader measured in the same run are the meaningful "
    "figures, absolute rates and latencies are indicative only. Differences of a few "
    "percent are within the noise."
)

# torch warns when there are more workers than cores (bench_memory runs 4 on 2 cores).
warnings.filterwarnings("ignore", message="This DataLoader will create")

_unit_us: float | None = None
# Load average when this module was imported (the run's start): other jobs on the machine
# are the main source of noise, so the results record it.
LOAD_AT_START = os.getloadavg()


# -- item cost ---------------------------------------------------------------------------


def burn(units: int) -> None:
    """Spends CPU time: ``units`` BLAKE2b digests of :data:`BUFFER` (NOTE [ Item cost ])."""
    for _ in range(units):
        hashlib.blake2b(BUFFER).digest()


def calibrate(trials: int = 15, burst_s: float = 0.02) -> float:
    """Measures one repetition of :func:`burn` in microseconds: the fastest of ``trials``
    bursts of about ``burst_s`` seconds, i.e. the machine's speed when nothing else
    competed (other jobs only ever slow a burst down)."""
    global _unit_us
    probe = 1000
    began = time.perf_counter()
    burn(probe)
    first = max(time.perf_counter() - began, 1e-6)
    probe = max(1000, int(probe * burst_s / first))
    samples = []
    for _ in range(trials):
        began = time.perf_counter()
        burn(probe)
        samples.append((time.perf_counter() - began) / probe * 1e6)
    _unit_us = min(samples)
    return _unit_us


def unit_us() -> float:
    """The calibrated cost of one repetition, calibrating on first use."""
    return _unit_us if _unit_us is not None else calibrate()


def units_for(cost_us: float) -> int:
    """Repetitions of :func:`burn` that cost ``cost_us`` microseconds (0 for 0)."""
    if cost_us <= 0:
        return 0
    return max(1, round(cost_us / unit_us()))


# -- the dataset ---------------------------------------------------------------------------


class Range:
    """``n`` items, item ``i`` being ``i``; nothing is stored (a map-style dataset of any
    length, up to 10**9 and beyond)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class SyntheticDataset(SavableDataset[dict[str, Any]]):
    """Items ``{"x": torch.rand(tensor_size), "index": i, "aug": int}`` for i in 0..n-1.

    Sharded with ``get_worker_info()`` (worker w yields the i with ``i % workers == w``),
    so torch's ``DataLoader`` and :class:`SavableDataLoader` iterate the same class. Every
    item draws from ``random``, ``numpy.random`` and torch's generator and costs
    ``units`` repetitions of :func:`burn` (``mode="cpu"``) or a ``sleep_s`` sleep
    (``mode="sleep"``, only for the save latency benchmark). At the end of an epoch the
    state moves to the next one.
    """

    def __init__(
        self,
        n: int = 10**9,
        *,
        units: int = 0,
        mode: str = "cpu",
        sleep_s: float = 0.0,
        tensor_size: int = 16,
    ) -> None:
        self.n = n
        self.units = units
        self.mode = mode
        self.sleep_s = sleep_s
        self.tensor_size = tensor_size
        self.pos = 0
        self.epoch = 0

    def config(self) -> dict[str, Any]:
        return {
            "type": "SyntheticDataset",
            "n": self.n,
            "units": self.units,
            "mode": self.mode,
            "sleep_s": self.sleep_s,
            "tensor_size": self.tensor_size,
        }

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        while self.pos < self.n:
            index = self.pos
            self.pos += 1
            if index % workers != worker:
                continue
            if self.mode == "sleep":
                time.sleep(self.sleep_s)
            else:
                burn(self.units)
            yield {
                "x": torch.rand(self.tensor_size),
                "index": index,
                "aug": random.randrange(1000) + int(np.random.randint(1000)),
            }
        self.pos = 0
        self.epoch += 1

    def save_state(self) -> dict[str, int]:
        return {"pos": self.pos, "epoch": self.epoch}

    def restore_state(self, state: Any) -> None:
        state = state or {"pos": 0, "epoch": 0}
        self.pos, self.epoch = state["pos"], state["epoch"]


def make_loader(
    kind: str,
    dataset: SyntheticDataset,
    *,
    batch_size: int,
    num_workers: int,
    prefetch_factor: int = 2,
) -> Any:
    """Builds ``"ours"`` (SavableDataLoader) or ``"torch"`` (DataLoader) over ``dataset``."""
    prefetch = prefetch_factor if num_workers > 0 else None
    if kind == "ours":
        return SavableDataLoader(
            dataset, batch_size=batch_size, num_workers=num_workers, prefetch_factor=prefetch
        )
    if kind == "torch":
        return DataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            prefetch_factor=prefetch,
            persistent_workers=num_workers > 0,
        )
    raise ValueError(f"unknown loader kind {kind!r}")


def close_loader(loader: Any) -> None:
    """Stops a loader's workers now, not whenever the garbage collector gets to them."""
    if isinstance(loader, SavableDataLoader):
        loader.close()
    else:
        # torch keeps a persistent iterator in the private ``_iterator`` and stops its
        # workers only when it is collected; stop them explicitly between measurements.
        iterator = getattr(loader, "_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
    gc.collect()


# -- timing --------------------------------------------------------------------------------


def alternate(
    measures: dict[str, Callable[[], Any]],
    rounds: int,
    *,
    progress: str = "",
) -> dict[str, list[Any]]:
    """Runs every measure once per round, reversing the order every other round.

    Returns each measure's results in round order (NOTE [ Alternation ]).
    """
    names = list(measures)
    results: dict[str, list[Any]] = {name: [] for name in names}
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            results[name].append(measures[name]())
        if progress:
            print(f"  {progress}: round {round_index + 1}/{rounds}", file=sys.stderr)
    return results


def cpu_seconds() -> float:
    """CPU time of this process plus its terminated, reaped children (closed workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """Median over rounds of ``numerator / denominator`` measured in the same round."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def bootstrap_ci(
    values: Sequence[float], *, level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A percentile bootstrap confidence interval for the median of ``values``.

    Seeded, so a given set of samples always gives the same interval; it uses its own
    generator and leaves the global ones alone.
    """
    generator = random.Random(seed)
    medians = sorted(
        statistics.median(generator.choices(values, k=len(values))) for _ in range(resamples)
    )
    low = medians[int((1 - level) / 2 * resamples)]
    high = medians[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return low, high


# -- results -------------------------------------------------------------------------------


def _git_revision() -> str:
    """The checkout's commit, with ``+dirty`` when the package has uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "savable_loader"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine_info() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "savable_loader": savable_loader.__version__,
        "git": _git_revision(),
        "start_method": multiprocessing.get_context().get_start_method(),
        "burn_unit_us": round(unit_us(), 4),
        "loadavg_1_5_15_at_start": [round(x, 2) for x in LOAD_AT_START],
        "loadavg_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
    }


def format_table(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    """A GitHub markdown table of ``rows`` (dicts) over ``columns``."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            if abs(value) < 10:
                return f"{value:.3f}"
            return f"{value:.1f}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value)

    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_results(
    bench: str,
    *,
    title: str,
    parameters: dict[str, Any],
    columns: Sequence[str],
    rows: Sequence[dict[str, Any]],
    notes: Sequence[str] = (),
    samples: dict[str, Any] | None = None,
    command: str | None = None,
    write: bool = True,
) -> tuple[Path, Path] | None:
    """Prints the table; writes ``results/<bench>.json`` and ``results/<bench>.md``.

    ``write=False`` (``--quick`` runs) only prints, so a smoke run never replaces the
    committed results.
    """
    machine = machine_info()
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    payload = {
        "bench": bench,
        "command": command or f"python benchmarks/{bench}.py",
        "title": title,
        "date": when,
        "machine": machine,
        "parameters": parameters,
        "columns": list(columns),
        "rows": list(rows),
        "notes": list(notes),
        "noise": NOISE_NOTE,
        "samples": samples or {},
    }
    table = format_table(columns, rows)
    print()
    print(table)
    for note in notes:
        print(f"- {note}")
    if not write:
        print("\nquick run: results not written")
        return None
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    json_path = RESULTS_DIR / f"{bench}.json"
    md_path = RESULTS_DIR / f"{bench}.md"
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    machine_line = ", ".join(f"{key}={value}" for key, value in machine.items())
    parts = [
        f"# {title}",
        "",
        f"Generated by `{command or f'python benchmarks/{bench}.py'}` on {when}.",
        "",
        table,
        "",
        *[f"- {note}" for note in notes],
        "",
        f"Parameters: `{json.dumps(parameters, default=str)}`",
        "",
        f"Machine: {machine_line}.",
        "",
        f"Noise: {NOISE_NOTE}",
        "",
    ]
    md_path.write_text("\n".join(parts))
    print(f"\nwrote {json_path} and {md_path}")
    return json_path, md_path
