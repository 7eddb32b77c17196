"""The ``savable-loader`` command: ``demo`` and ``inspect``.

``savable-loader demo`` trains a small model over a synthetic pipeline with worker
processes, kills the run with SIGKILL part way, resumes it in a new process from the last
saved state, and checks that the resumed stream of batches is the uninterrupted one
(NOTE [ Demo ] in ``_demo.py``). ``savable-loader inspect URL`` prints what a state file
holds. Reports go to stdout, errors to stderr as one line; exit codes: 0 success, 1 the
demo found a difference (or a demo process failed), 2 bad usage or an unreadable state.

This module is past 400 lines because it holds both commands' reports, which are most of
it; the demo's pipeline and the code of its child processes live in ``_demo.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack

from . import serialization, storage
from ._demo import (
    BATCH_SIZE,
    EPOCHS,
    DemoPaths,
    DemoSettings,
    read_digests,
    run_child,
    summarize_ms,
)
from ._version import __version__
from .errors import SavableLoaderError
from .state.files import state_from_payload
from .state.models import RankState, WorkerState

__all__ = ["main"]

_PROG = "savable-loader"
_CHILD_TIMEOUT = 180.0
_STATE_WIDTH = 60


def _out(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _err(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _one_line(error: BaseException) -> str:
    return "; ".join(part.strip() for part in str(error).splitlines() if part.strip())


# -- arguments ------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Save and restore a DataLoader's position exactly: demo and tools.",
    )
    parser.add_argument("--version", action="version", version=f"{_PROG} {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    commands = parser.add_subparsers(dest="command", metavar="{demo,inspect}", required=True)

    demo = commands.add_parser(
        "demo",
        help="kill a training run, resume it, and check the batches are the same",
        description=(
            "Train over a synthetic pipeline three times, each in its own process: "
            "uninterrupted; saving the loader's state every few steps and killed with "
            "SIGKILL; resumed from the last saved state. Exit 0 when the interrupted "
            "and resumed runs together yield exactly the uninterrupted run's batches."
        ),
    )
    _demo_options(demo)
    demo.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep the demo's files here (default: a temporary folder, removed at the end)",
    )

    inspect = commands.add_parser(
        "inspect",
        help="print what a saved loader state holds",
        description="Print a summary of a state file written by savable_loader.save_state.",
    )
    inspect.add_argument("url", help="a local path or an fsspec URL (s3://..., memory://...)")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")

    child = commands.add_parser("demo-child")  # internal: one process of the demo
    child.add_argument("mode", choices=("reference", "interrupted", "resumed"))
    _demo_options(child)
    child.add_argument("--workdir", type=Path, required=True)
    return parser


def _demo_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument(
        "--steps", type=int, default=40, help="batches per epoch; 2 epochs (default 40)"
    )
    parser.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="step at which the run is killed (default: two thirds of the way, off a save)",
    )
    parser.add_argument(
        "--save-every", type=int, default=10, help="save the state every N steps (default 10)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``savable-loader`` command; returns its exit code.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 1 when the demo fails, 2 on bad usage or an unreadable state.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version and usage errors
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.command == "inspect":
        try:
            return _inspect(args.url, as_json=args.json)
        except BrokenPipeError:
            # The reader left (``| head``): stop quietly, as Unix tools do.
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - replaces the closed stream
            return 0
    try:
        settings = _demo_settings(args)
    except ValueError as error:
        _err(f"{_PROG} {args.command}: error: {error}")
        return 2
    if args.command == "demo-child":
        return run_child(args.mode, settings, DemoPaths(args.workdir))
    return _demo(settings, args.workdir)


# -- inspect --------------------------------------------------------------------------


def _inspect(url: str, *, as_json: bool) -> int:
    try:
        data = storage.read_bytes(url)
        header = serialization.peek_header(data)
        # What load_state(url) does, on the bytes already read.
        payload = serialization.loads(data)
        loaded = state_from_payload(payload)
    except SavableLoaderError as error:
        _err(f"{_PROG} inspect: {url}: {_one_line(error)}")
        return 2
    states = loaded if isinstance(loaded, list) else [loaded]
    summary: dict[str, Any] = {
        "url": url,
        "file_size": len(data),
        "file_format_version": header.format_version,
        "body_length": header.body_length,
        "checksum_blake2b": header.digest,
        "kind": "global" if isinstance(loaded, list) else "rank",
        "ranks": [_rank_summary(state) for state in states],
    }
    if as_json:
        _out(json.dumps(summary, indent=2))
    else:
        for line in _render(summary):
            _out(line)
    return 0


def _rank_summary(state: RankState) -> dict[str, Any]:
    return {
        "state_format_version": state.format_version,
        "library_version": state.library_version,
        "rank": state.rank,
        "world_size": state.world_size,
        "num_workers": state.num_workers,
        "batch_size": state.batch_size,
        "seed": state.seed,
        "epoch": state.epoch,
        "between_epochs": state.between_epochs,
        "fingerprint": state.fingerprint,
        "next_worker": state.next_worker,
        "workers": [_worker_summary(worker) for worker in state.workers],
    }


def _worker_summary(worker: WorkerState) -> dict[str, Any]:
    checkpoint = worker.checkpoint
    summary: dict[str, Any] = {
        "worker_id": worker.worker_id,
        "delivered": worker.delivered,
        "ended": worker.ended,
        "checkpoint_seq": None,
        "replay": worker.replay,
        "exhausted": None,
        "dataset_state": None,
        "dataset_state_bytes": None,
    }
    if checkpoint is not None:
        summary.update(
            checkpoint_seq=checkpoint.seq,
            exhausted=checkpoint.exhausted,
            dataset_state=_decode_dataset_state(checkpoint.dataset_state),
            dataset_state_bytes=len(checkpoint.dataset_state),
        )
    return summary


def _decode_dataset_state(data: bytes) -> Any:
    try:
        state = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as error:
        return f"<{len(data)} bytes, not msgpack: {error}>"
    return _displayable(state)


def _displayable(value: Any) -> Any:
    """Makes decoded msgpack printable as JSON: bytes become ``"<N bytes>"``."""
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        return {
            key if isinstance(key, str) else json.dumps(_displayable(key)): _displayable(item)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_displayable(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def _render(summary: dict[str, Any]) -> Iterator[str]:
    ranks = summary["ranks"]
    yield f"savable_loader state file: {summary['url']}"
    yield (
        f"  size:                 {summary['file_size']:,} bytes "
        f"(header {serialization.HEADER_SIZE}, body {summary['body_length']:,})"
    )
    yield (
        f"  file format version:  {summary['file_format_version']} "
        f"(checksum blake2b-256 {summary['checksum_blake2b'][:16]}..., verified)"
    )
    if summary["kind"] == "rank":
        yield "  holds:                one rank's state (save_state_rank)"
    else:
        yield f"  holds:                {len(ranks)} rank states (save_state_global)"
    if ranks:
        formats = sorted({str(rank["state_format_version"]) for rank in ranks})
        versions = sorted({rank["library_version"] for rank in ranks})
        yield f"  state format version: {', '.join(formats)}"
        yield f"  library version:      {', '.join(versions)}"
    for rank in ranks:
        yield ""
        yield from _render_rank(rank)


def _render_rank(rank: dict[str, Any]) -> Iterator[str]:
    workers = rank["num_workers"]
    batch = rank["batch_size"]
    yield (
        f"rank {rank['rank']} of {rank['world_size']}: "
        f"{workers if workers else 'no'} worker{'' if workers == 1 else 's'}, "
        f"batch size {batch if batch is not None else 'None (no batching)'}, seed {rank['seed']}"
    )
    if rank["between_epochs"]:
        position = f"epoch {rank['epoch']} ended (the next iter() starts epoch {rank['epoch'] + 1})"
    else:
        position = f"epoch {rank['epoch']} in progress, next worker {rank['next_worker']}"
    yield f"  {position}"
    yield f"  fingerprint {rank['fingerprint']}"
    header = ["worker", "delivered", "ended", "checkpoint seq", "replay", "exhausted"]
    rows = [
        [
            str(w["worker_id"]),
            str(w["delivered"]),
            _yes_no(w["ended"]),
            "-" if w["checkpoint_seq"] is None else str(w["checkpoint_seq"]),
            str(w["replay"]),
            "-" if w["exhausted"] is None else _yes_no(w["exhausted"]),
        ]
        for w in rank["workers"]
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    yield (
        "  "
        + "  ".join(f"{h:>{n}}" for h, n in zip(header, widths, strict=True))
        + "  dataset state"
    )
    for row, worker in zip(rows, rank["workers"], strict=True):
        cells = "  ".join(f"{cell:>{n}}" for cell, n in zip(row, widths, strict=True))
        yield f"  {cells}  {_compact(worker)}"


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _compact(worker: dict[str, Any]) -> str:
    if worker["dataset_state_bytes"] is None:
        return "(none: starts from the dataset's initial state)"
    text = json.dumps(worker["dataset_state"], separators=(",", ":"))
    if len(text) > _STATE_WIDTH:
        text = text[: _STATE_WIDTH - 3] + "..."
    return f"{text} ({worker['dataset_state_bytes']} B)"


# -- demo -----------------------------------------------------------------------------


def _demo_settings(args: argparse.Namespace) -> DemoSettings:
    if args.workers < 0:
        raise ValueError(f"--workers must be 0 or more, got {args.workers}")
    if args.steps < 2:
        raise ValueError(f"--steps must be at least 2, got {args.steps}")
    total = args.steps * EPOCHS
    if args.save_every < 1 or args.save_every >= total:
        raise ValueError(f"--save-every must be between 1 and {total - 1}, got {args.save_every}")
    kill_at = args.kill_at
    if kill_at is None:
        kill_at = total * 2 // 3
        if kill_at % args.save_every == 0:
            kill_at += 1  # off a save, so that some batches are redone
        kill_at = min(max(kill_at, args.save_every), total - 1)
    if not args.save_every <= kill_at < total:
        raise ValueError(
            f"--kill-at must be between --save-every ({args.save_every}, so that a state "
            f"was saved before the kill) and {total - 1} (the run has {total} steps), "
            f"got {kill_at}"
        )
    return DemoSettings(
        workers=args.workers, steps=args.steps, kill_at=kill_at, save_every=args.save_every
    )


@contextlib.contextmanager
def _workdir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="savable-loader-demo-") as tmp:
        yield Path(tmp)


class _DemoFailure(Exception):
    """A demo process failed; the message says which and why."""


def _demo(settings: DemoSettings, workdir: Path | None) -> int:
    began = time.perf_counter()
    where = "in every worker" if settings.workers else "in the main process"
    _out(
        f"savable-loader demo: {_plural(settings.workers, 'worker')}, batch size {BATCH_SIZE}, "
        f"{EPOCHS} epochs x {settings.steps} steps = {settings.total_steps} steps; "
        f"random augmentations from random, numpy.random and torch {where}"
    )
    with _workdir(workdir) as root:
        kept = "kept" if workdir is not None else "temporary, removed at the end"
        _out(f"work folder: {root} ({kept})")
        paths = DemoPaths(root)
        paths.clear()
        try:
            status = _run_demo(settings, paths)
        except _DemoFailure as failure:
            _out(f"FAIL: {failure}")
            status = 1
        if workdir is not None and paths.saved():
            _out(f"files kept in {root}; try: {_PROG} inspect {paths.saved()[-1][1]}")
    _out(f"demo finished in {time.perf_counter() - began:.1f} s")
    return status


def _run_demo(settings: DemoSettings, paths: DemoPaths) -> int:
    _out("")
    _out("[a] uninterrupted run (new process) ...")
    seconds = _run_child("reference", settings, paths)
    reference = read_digests(paths.digests("reference"))
    _out(f"    {len(reference)} batches in {seconds:.1f} s, a blake2b digest of each recorded")
    if len(reference) != settings.total_steps:
        raise _DemoFailure(
            f"the uninterrupted run yielded {len(reference)} batches, expected "
            f"{settings.total_steps}"
        )

    _out(
        f"[b] interrupted run (new process): saves the loader state every "
        f"{_plural(settings.save_every, 'step')}, killed at step {settings.kill_at} ..."
    )
    killed = _run_and_kill(settings, paths)
    saves = killed["saves"]
    if not saves:
        raise _DemoFailure("the interrupted run saved no state before it was killed")
    last = saves[-1]
    interrupted = read_digests(paths.digests("interrupted"))
    if settings.workers:
        victims = f"the trainer and its {_plural(settings.workers, 'worker')}, prefetching"
    else:
        victims = "the trainer, which runs the pipeline itself with num_workers=0"
    _out(
        f"    killed with SIGKILL at step {killed['step']} "
        f"(process group of pid {killed['pid']}: {victims})"
    )
    _out(
        f"    {len(saves)} saves, at steps {', '.join(str(s['step']) for s in saves)}; "
        f"the last save was at step {last['step']}"
    )
    _out(
        "    save_state_rank(): "
        + summarize_ms([s["save_state_rank_ms"] for s in saves])
        + "; save_state() to file (atomic, fsync): "
        + summarize_ms([s["save_state_ms"] for s in saves])
    )
    _out(f"    state file: {last['bytes']:,} bytes")
    lost = settings.kill_at - last["step"]
    if lost:
        _out(f"    {_plural(lost, 'step')} after the last save lost with the kill, to redo")

    _out("[c] resumed run (new process): load_state() the last save, restore, train on ...")
    _run_child("resumed", settings, paths)
    resumed_report = json.loads(paths.report("resumed").read_text())
    resumed = read_digests(paths.digests("resumed"))
    _out(
        f"    load_state() {resumed_report['load_state_ms']:.2f} ms, "
        f"restore_state_rank() {resumed_report['restore_state_rank_ms']:.2f} ms, "
        f"first batch {resumed_report.get('first_batch_ms', float('nan')):.0f} ms later "
        f"({'worker start-up and ' if settings.workers else ''}a replay of "
        f"{_plural(resumed_report['replayed'], 'batch')})"
    )
    _out(
        f"    resumed at step {resumed_report['start_step'] + 1}, "
        f"ran to step {resumed_report['end_step']}"
    )

    _out("")
    combined = interrupted[: last["step"]] + resumed
    _out(
        f"compare: [b] steps 1-{last['step']} + [c] steps {last['step'] + 1}-"
        f"{last['step'] + len(resumed)} against [a] steps 1-{len(reference)}"
    )
    line, ok = compare(reference, combined, resumed_from=last["step"])
    _out(line)
    return 0 if ok else 1


def _plural(count: int, noun: str) -> str:
    if count == 1:
        return f"1 {noun}"
    return f"{count} {noun}{'es' if noun.endswith('ch') else 's'}"


def compare(reference: list[str], combined: list[str], *, resumed_from: int) -> tuple[str, bool]:
    """Compares the interrupted-then-resumed digests with the uninterrupted ones.

    Returns:
        The verdict line and whether the streams are identical.
    """
    for index, (want, got) in enumerate(zip(reference, combined, strict=False)):
        if want != got:
            origin = "resumed run" if index >= resumed_from else "interrupted run"
            return (
                f"FAIL: first divergence at step {index + 1} ({origin}): digest {got[:16]} "
                f"where the uninterrupted run has {want[:16]}",
                False,
            )
    if len(combined) != len(reference):
        return (
            f"FAIL: the interrupted and resumed runs yielded {len(combined)} batches together, "
            f"the uninterrupted run {len(reference)} (identical up to step "
            f"{min(len(combined), len(reference))})",
            False,
        )
    return (
        f"OK: resumed stream identical to uninterrupted run ({len(reference)} batches compared)",
        True,
    )


def _child_command(mode: str, settings: DemoSettings, paths: DemoPaths) -> list[str]:
    return [
        sys.executable,
        "-m",
        "savable_loader.cli",
        "demo-child",
        mode,
        "--workers",
        str(settings.workers),
        "--steps",
        str(settings.steps),
        "--kill-at",
        str(settings.kill_at),
        "--save-every",
        str(settings.save_every),
        "--workdir",
        str(paths.root),
    ]


def _run_child(mode: str, settings: DemoSettings, paths: DemoPaths) -> float:
    began = time.perf_counter()
    try:
        done = subprocess.run(
            _child_command(mode, settings, paths),
            capture_output=True,
            text=True,
            timeout=_CHILD_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise _DemoFailure(f"the {mode} run did not finish within {_CHILD_TIMEOUT:.0f} s") from None
    if done.returncode != 0:
        raise _DemoFailure(
            f"the {mode} run exited with code {done.returncode}:\n{done.stderr.strip()}"
        )
    return time.perf_counter() - began


def _run_and_kill(settings: DemoSettings, paths: DemoPaths) -> dict[str, Any]:
    """Starts the interrupted run, waits until it reports the kill step, kills it."""
    report = paths.report("interrupted")
    with tempfile.TemporaryFile("w+") as stderr:
        child = subprocess.Popen(
            _child_command("interrupted", settings, paths),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,  # its own process group: the kill takes its workers too
        )
        try:
            deadline = time.monotonic() + _CHILD_TIMEOUT
            while not report.exists():
                if child.poll() is not None:
                    stderr.seek(0)
                    raise _DemoFailure(
                        f"the interrupted run exited with code {child.returncode} before "
                        f"step {settings.kill_at}:\n{stderr.read().strip()}"
                    )
                if time.monotonic() > deadline:
                    raise _DemoFailure(
                        f"the interrupted run did not reach step {settings.kill_at} within "
                        f"{_CHILD_TIMEOUT:.0f} s"
                    )
                time.sleep(0.02)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    if child.returncode != -signal.SIGKILL:
        raise _DemoFailure(f"the interrupted run ended with code {child.returncode}, not SIGKILL")
    result: dict[str, Any] = json.loads(report.read_text())
    return result


if __name__ == "__main__":
    sys.exit(main())
