"""Global-stream keys: what keying draws by the item's place in the global stream costs.

1. Keys. In a tight loop: a seeded map's per-item generator keyed by the item's key
   (``generator_for(Purpose.MAP_ITEM, seed, epoch, position)``) against the per-stream key
   it replaced (``generator_for(Purpose.MAP_STREAM_ITEM, seed, rank, worker, epoch,
   position)``), the key lookup (``Cursor.item_key()``) on a fresh cursor and on one
   restored onto another layout (the rest of the resumed epoch), and ``seed_item``.
   End to end: a loader over ``IndexedDataset(range(N), shuffle=True).map(fn, seed=1)``
   (``fn`` draws one number from its generator) against the same with an unseeded map
   (``fn`` draws from ``numpy.random``), an unseeded map whose ``fn`` builds the old
   per-stream generator itself (the old path, emulated), the seeded and unseeded maps
   after a restore from 4 ranks onto 1 (the rest of the resumed epoch), and torch's
   ``DataLoader``; 0 and 2 workers, batch 16.
2. ``seed_each_item``: a map-style dataset whose ``__getitem__`` draws ``torch.rand(())``,
   with ``seed_each_item`` False and True (also for the rest of an epoch restored from 4
   ranks onto 1), 0 and 2 workers, against torch's ``DataLoader``; and the bytes of the
   state saved after the run (``encode_state``: what ``save_state`` writes).
3. Restore at scale: ``IndexedDataset`` over a lazy map-style object of 10**6 and 10**9
   items (shuffled), 4 simulated ranks x 2 workers x batch 8 advanced 12, 11, 10 and 9
   batches and saved; rank 0 of 4 x 8 (the same layout), 2 x 16 and 8 x 4 (2 workers
   each) restored from every rank's state: the ``restore_state_rank`` call, the first
   batch (restore included), the main process's traced peak during the restore
   (``tracemalloc``, an untimed pass) and the workers' peak RSS (``VmHWM``). Both sizes
   and all layouts alternate in the same rounds, with torch's ``DataLoader`` at 10**6.

The process is pinned to one core when ``os.sched_setaffinity`` exists; the workers
inherit it, so with 2 workers the three processes share that core and a rate is the
whole CPU cost of an item, not a parallel speed. Loaders alternate within rounds
(NOTE [ Alternation ] in ``common.py``); figures are medians of rounds, ratios medians of
per-round ratios. Writes ``results/bench_global_stream.json`` and ``.md`` (not with
``--quick``).

    python benchmarks/bench_global_stream.py [--quick] [--rounds R]
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import common
import numpy as np
import torch
from torch.utils.data import DataLoader, get_worker_info

from savable_loader import RankState, SavableDataLoader, WorkerConfig, WorkerContext
from savable_loader.datasets import IndexedDataset
from savable_loader.rng import Purpose, generator_for, seed_item
from savable_loader.state.files import encode_state

SEED = 1
KEY_N = 10**6  # items of the part 1 and 2 datasets
BATCH = 16  # parts 1 and 2
SCALE_BATCH = 8  # part 3, per rank on 4 ranks
SCALE_STEPS = (12, 11, 10, 9)  # batches each of the 4 ranks reads before the save
LAYOUTS = ((4, 8), (2, 16), (8, 4))  # (ranks, per-rank batch) restored onto, 2 workers
#: Batches of 4 per rank before the save the "resumed" rows restore onto 1 rank x 16.
RESUMED_STEPS = (40, 37, 35, 33)
Rows = list[dict[str, Any]]


# -- datasets and functions (module level: the workers fork, the map configs name them) ----


Lazy = common.Range


class Draws:
    """``n`` items, each a fresh ``torch.rand(())``: a ``__getitem__`` that draws."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(())


class Mapped:
    """torch's reference: ``fn(data[i])`` with ``fn`` drawing from ``numpy.random``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return draw_global(index)


def draw_seeded(item: int, rng: np.random.Generator) -> int:
    """A seeded map's function: one number from the item's generator."""
    return item + int(rng.integers(1000))


def draw_global(item: int) -> int:
    """An unseeded map's function: one number from ``numpy.random``."""
    return item + int(np.random.randint(1000))


_OLD_POSITION = itertools.count()


def draw_old_key(item: int) -> int:
    """An unseeded map's function that builds the generator the seeded map built before
    items had keys: keyed by (rank, worker, epoch, this stream's position)."""
    info = get_worker_info()
    worker = 0 if info is None else info.id
    rng = generator_for(Purpose.MAP_STREAM_ITEM, SEED, 0, worker, 0, next(_OLD_POSITION))
    return item + int(rng.integers(1000))


MAPS: dict[str, tuple[Callable[..., int], int | None]] = {
    "seeded": (draw_seeded, SEED),
    "unseeded": (draw_global, None),
    "old key": (draw_old_key, None),
}


# -- helpers -------------------------------------------------------------------------------


def pin() -> str:
    """Pins this process (and the workers it will fork) to one core; says what it did."""
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned: os.sched_setaffinity is unavailable"
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[0]})
    return (
        f"pinned to core {cores[0]} of {cores} (os.sched_setaffinity); the workers inherit "
        "it, so with 2 workers the main process and its workers share that core"
    )


def children_peak_rss() -> list[int]:
    """Peak resident set (``VmHWM``, bytes) of each child process of this one."""
    peaks = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) != me:
                    continue
            with open(f"/proc/{entry}/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        peaks.append(int(line.split()[1]) * 1024)
        except (OSError, ValueError, IndexError):
            continue
    return peaks


def generator_bytes(state: RankState) -> int:
    """The bytes of the global generators' states the workers' checkpoints hold."""
    total = 0
    for worker in state.workers:
        rng = None if worker.checkpoint is None else worker.checkpoint.rng
        if rng is not None:
            total += len(rng.python) + len(rng.numpy_key) + len(rng.torch)
    return total


def per_call_us(call: Callable[[int], Any], calls: int) -> float:
    began = time.perf_counter()
    for position in range(calls):
        call(position)
    return (time.perf_counter() - began) / calls * 1e6


def steady_us_per_item(
    loader: Any, batches: int, restore: Callable[[Any], None] | None = None
) -> float:
    """Microseconds per item over ``batches`` batches read after the first (the first,
    with the workers' start-up, is not timed); leaves the loader open."""
    if restore is not None:
        restore(loader)
    stream = iter(loader)
    next(stream)
    began = time.perf_counter()
    for _ in range(batches):
        next(stream)
    elapsed = time.perf_counter() - began
    del stream
    return elapsed / (batches * BATCH) * 1e6


def rate(loader: Any, batches: int, restore: Callable[[Any], None] | None = None) -> float:
    try:
        return steady_us_per_item(loader, batches, restore)
    finally:
        common.close_loader(loader)


def keyed_loader(
    kind: str, *, workers: int, rank: int = 0, ranks: int = 1, batch: int = BATCH
) -> SavableDataLoader:
    fn, seed = MAPS[kind]
    dataset = IndexedDataset(range(KEY_N), shuffle=True, seed=SEED).map(fn, seed=seed)
    return SavableDataLoader(
        dataset,
        batch_size=batch,
        num_workers=workers,
        seed=SEED,
        worker_config=WorkerConfig(rank=rank, world_size=ranks),
    )


def save_on_ranks(build: Callable[[int], Any], steps: tuple[int, ...]) -> list[RankState]:
    """Every rank's state after ``steps[r]`` batches on rank ``r``."""
    states = []
    for rank, count in enumerate(steps):
        loader = build(rank)
        try:
            stream = iter(loader)
            for _ in range(count):
                next(stream)
            states.append(loader.save_state_rank())
            del stream
        finally:
            common.close_loader(loader)
    return states


# -- part 1: keys --------------------------------------------------------------------------


def key_cursors(states: list[RankState]) -> dict[str, Any]:
    """A seeded map's cursor of rank 0 of 1 (no workers), fresh and restored from
    ``states`` (saved on 4 ranks), each one item in."""
    loader = keyed_loader("seeded", workers=0)
    try:
        moved = loader.reshard(states, rank=0)
        stage = loader.source
    finally:
        loader.close()
    context = WorkerContext(
        rank=0, world_size=1, worker_id=0, num_workers=0, seed=SEED, batch_size=BATCH
    )
    checkpoint = moved.workers[0].checkpoint
    if checkpoint is None:
        raise RuntimeError("the resharded state has no checkpoint to restore a cursor from")
    cursors = {}
    for name, state in (("fresh", None), ("elastic", checkpoint.state["parent"])):
        cursor = stage.cursor(context)
        cursor.restore(state)
        next(cursor)
        cursors[name] = cursor
    return cursors


def part_keys(rounds: int, calls: int, cursors: dict[str, Any]) -> tuple[Rows, dict[str, Any]]:
    fresh, elastic = cursors["fresh"], cursors["elastic"]
    measures = {
        "new": lambda: per_call_us(lambda p: generator_for(Purpose.MAP_ITEM, SEED, 0, p), calls),
        "old": lambda: per_call_us(
            lambda p: generator_for(Purpose.MAP_STREAM_ITEM, SEED, 0, 1, 0, p), calls
        ),
        "key fresh": lambda: per_call_us(lambda p: fresh.item_key(), calls),
        "key elastic": lambda: per_call_us(lambda p: elastic.item_key(), calls),
        "seed_item": lambda: per_call_us(
            lambda p: seed_item(Purpose.ITEM_GLOBALS, SEED, 0, p), calls
        ),
    }
    results = common.alternate(measures, rounds, progress="keys")
    new_total = [g + k for g, k in zip(results["new"], results["key fresh"], strict=True)]
    new_elastic = [g + k for g, k in zip(results["new"], results["key elastic"], strict=True)]
    labelled = (
        ("old: generator_for(MAP_STREAM_ITEM, seed, rank, worker, epoch, position)", "old"),
        ("new: generator_for(MAP_ITEM, seed, epoch, position)", "new"),
        ("new: item_key(), fresh cursor", "key fresh"),
        ("new: item_key(), rest of an epoch restored from 4 ranks onto 1", "key elastic"),
        ("new path per item, fresh (item_key + generator)", new_total),
        ("new path per item, rest of that resumed epoch", new_elastic),
        ("seed_item(ITEM_GLOBALS, seed, epoch, position) (part 2)", "seed_item"),
    )
    rows: Rows = []
    for label, which in labelled:
        values = results[which] if isinstance(which, str) else which
        rows.append(
            {
                "call": label,
                "us per call": common.median(values),
                "/ old generator": common.paired_ratio(values, results["old"]),
            }
        )
    return rows, results


def part_keyed_loaders(
    rounds: int, batches: int, elastic_states: dict[str, list[RankState]]
) -> tuple[Rows, dict[str, Any]]:
    rows: Rows = []
    samples: dict[str, Any] = {}
    for workers in (0, 2):

        def restored(kind: str, workers: int = workers) -> float:
            return rate(
                keyed_loader(kind, workers=workers),
                batches,
                lambda loader: loader.restore_state_rank(elastic_states[kind]),
            )

        prefetch = 2 if workers else None
        measures: dict[str, Callable[[], float]] = {
            "torch": lambda w=workers, p=prefetch: rate(
                DataLoader(
                    Mapped(KEY_N),
                    batch_size=BATCH,
                    shuffle=True,
                    num_workers=w,
                    prefetch_factor=p,
                    persistent_workers=w > 0,
                ),
                batches,
            ),
            **{
                kind: lambda kind=kind, w=workers: rate(keyed_loader(kind, workers=w), batches)
                for kind in MAPS
            },
            "seeded, resumed": lambda: restored("seeded"),
            "unseeded, resumed": lambda: restored("unseeded"),
        }
        results = common.alternate(measures, rounds, progress=f"map loaders, {workers} workers")
        samples[f"{workers} workers"] = results
        labels = {
            "torch": "torch DataLoader, fn draws from numpy.random",
            "unseeded": "unseeded map, fn draws from numpy.random",
            "seeded": "map(fn, seed=1): generator keyed by item_key()",
            "old key": "unseeded map building the old per-stream generator (old path)",
            "unseeded, resumed": "unseeded map, rest of an epoch restored from 4 ranks",
            "seeded, resumed": "map(fn, seed=1), rest of an epoch restored from 4 ranks",
        }
        for name, label in labels.items():
            us = results[name]
            rows.append(
                {
                    "workers": workers,
                    "loader": label,
                    "us per item": common.median(us),
                    "items/s": 1e6 / common.median(us),
                    "- unseeded us": common.median(
                        [a - b for a, b in zip(us, results["unseeded"], strict=True)]
                    ),
                    "/ unseeded": common.paired_ratio(us, results["unseeded"]),
                    "/ torch": common.paired_ratio(us, results["torch"]),
                }
            )
    return rows, samples


# -- part 2: seed_each_item ----------------------------------------------------------------


def draws_loader(
    workers: int, seed_each_item: bool, *, rank: int = 0, ranks: int = 1, batch: int = BATCH
) -> SavableDataLoader:
    return SavableDataLoader(
        IndexedDataset(Draws(KEY_N), shuffle=True, seed=SEED),
        batch_size=batch,
        num_workers=workers,
        seed=SEED,
        seed_each_item=seed_each_item,
        worker_config=WorkerConfig(rank=rank, world_size=ranks),
    )


def run_and_save(
    loader: SavableDataLoader, batches: int, states: list[RankState] | None = None
) -> tuple[float, int, int]:
    """Microseconds per item (after restoring ``states`` if given), and the bytes of the
    state saved right after: all of them, and its generators'."""
    restore = None if states is None else (lambda loader: loader.restore_state_rank(states))
    try:
        us = steady_us_per_item(loader, batches, restore)
        state = loader.save_state_rank()
    finally:
        common.close_loader(loader)
    return us, len(encode_state(state)), generator_bytes(state)


def part_seed_each_item(
    rounds: int, batches: int, states: list[RankState]
) -> tuple[Rows, dict[str, Any]]:
    rows: Rows = []
    samples: dict[str, Any] = {}
    for workers in (0, 2):
        prefetch = 2 if workers else None
        measures: dict[str, Callable[[], Any]] = {
            "torch": lambda w=workers, p=prefetch: (
                rate(
                    DataLoader(
                        Draws(KEY_N),
                        batch_size=BATCH,
                        shuffle=True,
                        num_workers=w,
                        prefetch_factor=p,
                        persistent_workers=w > 0,
                    ),
                    batches,
                ),
                0,
                0,
            ),
            "off": lambda w=workers: run_and_save(draws_loader(w, False), batches),
            "on": lambda w=workers: run_and_save(draws_loader(w, True), batches),
            "on, resumed": lambda w=workers: run_and_save(draws_loader(w, True), batches, states),
        }
        results = common.alternate(measures, rounds, progress=f"seed_each_item, {workers} workers")
        samples[f"{workers} workers"] = results
        us = {name: [r[0] for r in values] for name, values in results.items()}
        for name, label in (
            ("torch", "torch DataLoader"),
            ("off", "seed_each_item=False"),
            ("on", "seed_each_item=True"),
            ("on, resumed", "seed_each_item=True, rest of an epoch restored from 4 ranks"),
        ):
            rows.append(
                {
                    "workers": workers,
                    "loader": label,
                    "us per item": common.median(us[name]),
                    "items/s": 1e6 / common.median(us[name]),
                    "- False us": common.median(
                        [a - b for a, b in zip(us[name], us["off"], strict=True)]
                    ),
                    "/ False": common.paired_ratio(us[name], us["off"]),
                    "/ torch": common.paired_ratio(us[name], us["torch"]),
                    "state B": "-"
                    if name == "torch"
                    else int(common.median([r[1] for r in results[name]])),
                    "of which generators B": "-"
                    if name == "torch"
                    else int(common.median([r[2] for r in results[name]])),
                }
            )
    return rows, samples


# -- part 3: restore at scale --------------------------------------------------------------


def scale_loader(n: int, rank: int, ranks: int, batch: int) -> SavableDataLoader:
    return SavableDataLoader(
        IndexedDataset(Lazy(n), shuffle=True, seed=SEED),
        batch_size=batch,
        num_workers=2,
        seed=SEED,
        worker_config=WorkerConfig(rank=rank, world_size=ranks),
    )


def restore_and_first(loader: Any, states: list[RankState] | None) -> tuple[float, float]:
    """(restore ms, first batch ms counted from the restore call); closes the loader."""
    try:
        began = time.perf_counter()
        if states is not None:
            loader.restore_state_rank(states)
        restored = time.perf_counter()
        next(iter(loader))
        done = time.perf_counter()
    finally:
        common.close_loader(loader)
    return (restored - began) * 1e3, (done - began) * 1e3


def memory_pass(n: int, layout: tuple[int, int], states: list[RankState]) -> dict[str, Any]:
    """An untimed restore: its traced peak, the workers' peak RSS, the resharded bytes."""
    ranks, batch = layout
    loader = scale_loader(n, 0, ranks, batch)
    try:
        moved = loader.reshard(states, rank=0) if layout != LAYOUTS[0] else states[0]
        tracemalloc.start()
        loader.restore_state_rank(states)
        _, traced_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        stream = iter(loader)
        next(stream)
        peaks = children_peak_rss()
        del stream
    finally:
        common.close_loader(loader)
    return {
        "traced": traced_peak,
        "workers": peaks,
        "bytes": len(encode_state(moved)),
        "generator_bytes": generator_bytes(moved),
    }


def part_scale(rounds: int, sizes: tuple[int, ...]) -> tuple[Rows, dict[str, Any]]:
    """Every size and layout alternates in the same rounds, so that a drift of the
    machine does not pass for a growth with the dataset's size."""
    saved: dict[int, list[RankState]] = {}
    save_s: dict[int, float] = {}
    for n in sizes:
        began = time.perf_counter()
        saved[n] = save_on_ranks(lambda r, n=n: scale_loader(n, r, 4, SCALE_BATCH), SCALE_STEPS)
        save_s[n] = time.perf_counter() - began
    measures: dict[str, Callable[[], tuple[float, float]]] = {}
    for n in sizes:
        for ranks, batch in LAYOUTS:
            measures[f"{n} {ranks}x{batch}"] = lambda n=n, r=ranks, b=batch: restore_and_first(
                scale_loader(n, 0, r, b), saved[n]
            )
        if n <= 10**7:  # torch's RandomSampler draws a permutation of n
            measures[f"{n} torch"] = lambda n=n: restore_and_first(
                DataLoader(Lazy(n), batch_size=SCALE_BATCH, shuffle=True, num_workers=2), None
            )
    results = common.alternate(measures, rounds, progress="restore at scale")
    rows: Rows = []
    samples: dict[str, Any] = {"save_s": save_s, **results}
    for n in sizes:
        same = [r[1] for r in results[f"{n} {LAYOUTS[0][0]}x{LAYOUTS[0][1]}"]]
        torch_first = results.get(f"{n} torch")
        for ranks, batch in LAYOUTS:
            name = f"{n} {ranks}x{batch}"
            memory = memory_pass(n, (ranks, batch), saved[n])
            first = [r[1] for r in results[name]]
            samples[f"{name} memory"] = memory
            rows.append(
                {
                    "items": f"10^{len(str(n)) - 1}",
                    "restored onto (rank 0 of)": (
                        f"{ranks} ranks x batch {batch}"
                        + (" (same layout)" if (ranks, batch) == LAYOUTS[0] else "")
                    ),
                    "restore ms": common.median([r[0] for r in results[name]]),
                    "first batch ms": common.median(first),
                    "/ same layout": common.paired_ratio(first, same),
                    "/ torch fresh": (
                        "-"
                        if torch_first is None
                        else common.paired_ratio(first, [r[1] for r in torch_first])
                    ),
                    "restore traced peak KB": memory["traced"] / 1024,
                    "worker peak RSS MB": max(memory["workers"], default=0) / 2**20,
                    "state B (rank 0)": memory["bytes"],
                    "of which generators B": memory["generator_bytes"],
                }
            )
        if torch_first is not None:
            rows.append(
                {
                    "items": f"10^{len(str(n)) - 1}",
                    "restored onto (rank 0 of)": "torch DataLoader, fresh (no state)",
                    "first batch ms": common.median([r[1] for r in torch_first]),
                }
            )
    return rows, samples


# -- main ----------------------------------------------------------------------------------


def section(title: str, rows: Rows, notes: list[str]) -> str:
    lines = [f"## {title}", "", common.format_table(list(rows[0]), rows), ""]
    return "\n".join(lines + [f"- {note}" for note in notes] + [""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds, fewer items; no files")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 5)")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    calls = 1000 if args.quick else 4000
    batches = 64 if args.quick else 256
    sizes = (10**6, 10**9)
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    pinned = pin()
    torch.set_num_threads(1)
    print(f"nproc {nproc}; {pinned}")
    started = time.perf_counter()

    elastic_states = {
        kind: save_on_ranks(
            lambda r, kind=kind: keyed_loader(kind, workers=0, rank=r, ranks=4, batch=BATCH // 4),
            RESUMED_STEPS,
        )
        for kind in ("seeded", "unseeded")
    }
    draws_states = save_on_ranks(
        lambda r: draws_loader(0, True, rank=r, ranks=4, batch=BATCH // 4), RESUMED_STEPS
    )
    keys, key_samples = part_keys(rounds, calls, key_cursors(elastic_states["seeded"]))
    loaders, loader_samples = part_keyed_loaders(rounds, batches, elastic_states)
    seeding, seeding_samples = part_seed_each_item(rounds, batches, draws_states)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale, scale_samples = part_scale(rounds, sizes)
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    elapsed = time.perf_counter() - started
    steps = ", ".join(map(str, RESUMED_STEPS))

    common_notes = [
        f"nproc {nproc}; {pinned}. torch.set_num_threads(1). {rounds} rounds, alternating; "
        f"medians, ratios are medians of per-round ratios. Whole run {elapsed:.0f} s.",
    ]
    key_notes = [
        f"{calls} calls per round each. '/ old generator' divides by the old per-stream "
        "generator's time in the same round. The old path read rank, worker, epoch and "
        "position from attributes (free); the new one also asks the parent cursor for the "
        "item's key, so 'new path per item' adds the two.",
        "The resumed epoch: a seeded map over IndexedDataset(range(10^6), shuffle=True) "
        f"saved on 4 ranks x batch 4 (no workers) after {steps} batches and "
        "resharded onto 1 rank x batch 16; its cursor's item_key() maps the shard position "
        "past the positions the old ranks consumed (a per-item NumPy call), for the rest "
        "of that epoch only.",
    ]
    loader_notes = [
        f"IndexedDataset(range(10^6), shuffle=True, seed=1), batch {BATCH}; per round each "
        f"loader reads one batch (start-up, not timed) then {batches} batches "
        f"({batches * BATCH} items), timed. With 2 workers all three processes share one "
        "core: the time per item is the whole CPU cost, not a parallel speed.",
        "'- unseeded us' and '/ unseeded' compare with the unseeded map in the same round; "
        "'/ torch' with torch's DataLoader over a map-style dataset applying the unseeded "
        "fn. 'Old path' is emulated: an unseeded map whose fn builds the generator the "
        "seeded map built before items had keys.",
        "Resumed: the same loader restored (restore_state_rank(every rank's state)) from "
        f"4 ranks x batch 4 x no workers saved after {steps} batches; the timed batches "
        "are all in the resumed epoch.",
    ]
    seeding_notes = [
        f"IndexedDataset over a dataset whose __getitem__ returns torch.rand(()), shuffled, "
        f"batch {BATCH}, {batches} timed batches as above. 'state B': len(encode_state("
        "save_state_rank())) right after the timed batches (what save_state writes); 'of "
        "which generators B': the random, numpy.random and torch generator states its "
        "workers' checkpoints hold (generator_bytes()). With "
        "seed_each_item=False the workers' checkpoints hold the three generators' bytes "
        "(the items drew); with True they name the epoch's seeding.",
        "Resumed: restored from 4 ranks x batch 4 x no workers saved with "
        f"seed_each_item=True after {steps} batches, as for the map; each item's seeding "
        "looks up its key in the global stream the same way as the seeded map's item_key().",
    ]
    scale_notes = [
        f"IndexedDataset(lazy object of N items, shuffle=True); 4 simulated ranks x 2 "
        f"workers x batch {SCALE_BATCH} read {', '.join(map(str, SCALE_STEPS))} batches and "
        "save_state_rank(); a new loader for rank 0 of the target layout (2 workers) calls "
        "restore_state_rank(every rank's state) and reads one batch. 'first batch ms' runs "
        "from the restore call to the first batch, the workers' start-up included.",
        "'restore traced peak KB': tracemalloc's peak over the restore call alone, in an "
        "untimed pass; 'worker peak RSS MB': the largest VmHWM of the loader's workers "
        "after the first batch of that pass; 'state B (rank 0)': encode_state of rank 0's "
        "state as restored (the resharded one for another layout, else the saved one), "
        "'of which generators B' as in the seed_each_item table. "
        f"Main process ru_maxrss over part 3: {rss_before / 1024:.0f} MB before, "
        f"{rss_after / 1024:.0f} MB after.",
        "torch's DataLoader(shuffle=True) is measured fresh at 10^6 only: its "
        "RandomSampler draws a permutation of N (10^9 would take GBs).",
    ]
    written = common.write_results(
        "bench_global_stream",
        title="Global-stream keys: seeded map, seed_each_item, restore onto another layout",
        parameters={
            "rounds": rounds,
            "calls": calls,
            "batch_size": BATCH,
            "timed_batches": batches,
            "key_dataset_items": KEY_N,
            "scale_sizes": sizes,
            "scale_batch": SCALE_BATCH,
            "scale_steps": SCALE_STEPS,
            "layouts": LAYOUTS,
            "nproc": nproc,
            "pinned": pinned,
        },
        columns=list(keys[0]),
        rows=keys,
        notes=common_notes + key_notes,
        samples={
            "keys": key_samples,
            "loaders": loader_samples,
            "seed_each_item": seeding_samples,
            "scale": scale_samples,
        },
        write=not args.quick,
    )
    extra = [
        section("A seeded map, end to end", loaders, loader_notes),
        section("seed_each_item", seeding, seeding_notes),
        section("Restore onto another layout at scale", scale, scale_notes),
    ]
    print("\n" + "\n".join(extra))
    if written is not None:
        _, md = written
        md.write_text(md.read_text() + "\n" + "\n".join(extra))


if __name__ == "__main__":
    main()
