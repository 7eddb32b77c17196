"""The ``savable-loader`` command: ``demo``, ``inspect`` and ``verify``.

``savable-loader demo`` trains a small model over a synthetic pipeline with worker
processes, kills the run with SIGKILL part way, resumes it in a new process from the last
saved state, and checks that the resumed stream of batches is the uninterrupted one
(NOTE [ Demo ] in ``_demo.py``). ``savable-loader inspect URL`` prints what a state file
holds. ``savable-loader verify MODULE:FACTORY`` runs the resume-equivalence check
(:func:`savable_loader.testing.verify`) on a user's pipeline. Reports go to stdout, errors
to stderr as one line; exit codes: 0 success, 1 the demo or the check found a difference
(or a demo process failed), 2 bad usage, an unreadable state or a factory that cannot be
loaded.

This module is past 400 lines because it holds the commands' reports, which are most of
it; the demo's pipeline and the code of its child processes live in ``_demo.py``, the
check itself in ``testing.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import msgpack
from tqdm import tqdm

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
from .errors import ConfigError, SavableLoaderError
from .state.files import state_from_payload
from .state.models import RankState, WorkerState
from .testing import ResumeMismatch, VerifyReport, verify

__all__ = ["main"]

logger = logging.getLogger(__name__)

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
    commands = parser.add_subparsers(dest="command", metavar="{demo,inspect,verify}", required=True)

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

    _verify_parser(commands)

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
        0 on success, 1 when the demo or the check fails, 2 on bad usage, an unreadable
        state or a factory that cannot be loaded.
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
    if args.command == "verify":
        return _verify(args)
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


# -- verify ---------------------------------------------------------------------------


def _verify_parser(commands: Any) -> None:
    verify_ = commands.add_parser(
        "verify",
        help="check that your pipeline resumes exactly from any save point",
        description=(
            "Import FACTORY from MODULE (a module name or a path to a .py file), build "
            "loaders over what it returns (a dataset, or a SavableDataLoader used as "
            "given), save at many points of an uninterrupted run, restore each state into "
            "a fresh loader and check that it yields exactly the rest of the stream. Exit 0 "
            "when every restore does, 1 with the first divergence, 2 on bad usage."
        ),
    )
    verify_.add_argument(
        "target",
        metavar="MODULE:FACTORY",
        help="e.g. my_project.data:build_dataset or path/to/pipeline.py:build",
    )
    verify_.add_argument(
        "--num-workers",
        type=int,
        default=None,
        metavar="N",
        help="worker processes (default 2); not with a factory that returns a loader",
    )
    verify_.add_argument(
        "--batch-size",
        type=int,
        default=None,
        metavar="B",
        help="items per batch (default: items one by one); not with a factory that returns "
        "a loader",
    )
    verify_.add_argument(
        "--points",
        type=int,
        default=6,
        metavar="K",
        help="random save points, besides the first and last item of every epoch and the "
        "epoch boundaries (default 6)",
    )
    verify_.add_argument(
        "--epochs", type=int, default=2, metavar="E", help="epochs of the reference run (default 2)"
    )
    verify_.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="seed of the choice of save points (default 0)",
    )
    verify_.add_argument("--no-progress", action="store_true", help="no progress bar")


class _UsageError(Exception):
    """MODULE:FACTORY cannot be loaded; the message says why, in one line."""


class _FactoryFailed(Exception):
    """The user's factory raised ``error``."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _load_factory(target: str) -> Callable[[], Any]:
    """Imports ``MODULE:FACTORY``; MODULE is a module name or a path to a .py file."""
    module_name, colon, attribute = target.rpartition(":")
    if not colon or not module_name or not attribute:
        raise _UsageError(
            f"{target!r} is not MODULE:FACTORY (for example my_project.data:build_dataset "
            "or path/to/pipeline.py:build)"
        )
    module = _import(module_name)
    factory: Any = module
    for part in attribute.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError:
            raise _UsageError(f"{module_name} has no attribute {attribute!r}") from None
    if not callable(factory):
        raise _UsageError(f"{target} is a {type(factory).__name__}, not a callable")
    return cast("Callable[[], Any]", factory)


def _import(name: str) -> Any:
    if name.endswith(".py") or "/" in name or os.sep in name:
        return _import_file(Path(name))
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as ``python -m`` does
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        logger.debug("importing %s failed", name, exc_info=True)
        raise _UsageError(f"cannot import {name!r}: {error}") from None
    except Exception as error:
        logger.debug("importing %s failed", name, exc_info=True)
        raise _UsageError(
            f"importing {name!r} raised {type(error).__name__}: {_brief(error)}"
        ) from None


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise _UsageError(f"{path}: no such file")
    path = path.resolve()
    # Its folder goes on sys.path so that worker processes started with spawn or
    # forkserver import the module (and the classes pickled from it) by its name.
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    if loaded is not None or not name.isidentifier():
        name = f"_savable_loader_verify_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise _UsageError(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        logger.debug("importing %s failed", path, exc_info=True)
        raise _UsageError(
            f"importing {path} raised {type(error).__name__}: {_brief(error)}"
        ) from None
    return module


def _brief(error: BaseException) -> str:
    """One line for an error; a worker's error keeps its first and last line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) > 2 and any(line.startswith("Original Traceback") for line in lines):
        return f"{lines[0]} {lines[-1]}"
    return "; ".join(lines)


class _Bar:
    """A tqdm progress bar on stderr, made on the first update."""

    def __init__(self) -> None:
        self._bar: Any = None

    def update(self, done: int, total: int) -> None:
        if self._bar is None:
            self._bar = tqdm(
                total=total,
                desc="verify",
                unit="run",
                file=sys.stderr,
                leave=False,
                ncols=min(shutil.get_terminal_size().columns, 100),  # 80 if it reports 0
            )
        self._bar.total = total
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _verify(args: argparse.Namespace) -> int:
    prefix = f"{_PROG} verify"
    try:
        factory = _load_factory(args.target)
    except _UsageError as error:
        _err(f"{prefix}: error: {error}")
        return 2

    def guarded() -> Any:
        try:
            return factory()
        except Exception as error:
            raise _FactoryFailed(error) from error

    _out(
        f"{prefix} {args.target}: {_epochs(args.epochs)}, "
        f"{_plural(args.points, 'random save point')} (seed {args.seed}) and the fixed ones"
    )
    bar = _Bar()
    show = not args.no_progress and sys.stderr.isatty()
    try:
        report = verify(
            guarded,
            num_workers=args.num_workers,
            batch_size=args.batch_size,
            points=args.points,
            epochs=args.epochs,
            seed=args.seed,
            progress=bar.update if show else None,
        )
    except _FactoryFailed as failed:
        logger.debug("the factory raised", exc_info=failed.error)
        cause = failed.error
        _err(f"{prefix}: error: {args.target} raised {type(cause).__name__}: {_brief(cause)}")
        return 2
    except ConfigError as error:
        _err(f"{prefix}: error: {_brief(error)}")
        return 2
    except ResumeMismatch as mismatch:
        _out(f"DIVERGED {mismatch}" if mismatch.point else f"FAILED: {mismatch}")
        return 1
    except Exception as error:
        logger.debug("the check raised", exc_info=True)
        _out(f"FAILED: the check raised {type(error).__name__}: {_brief(error)}")
        return 1
    finally:
        bar.close()
    for line in _verify_summary(report):
        _out(line)
    return 0 if sum(report.items_per_epoch) else 1


def _verify_summary(report: VerifyReport) -> Iterator[str]:
    items = sum(report.items_per_epoch)
    if not items:
        yield f"FAILED: nothing to check, the pipeline yielded no items in {report.epochs} epochs"
    else:
        yield "OK: every restored loader continued the uninterrupted stream exactly"
    where = _plural(report.num_workers, "worker") if report.num_workers else "no workers"
    batch = "items one by one" if report.batch_size is None else f"batch size {report.batch_size}"
    if report.checkpoint_share >= 1:
        checkpoints = "every item checkpointed"
    else:
        checkpoints = f"checkpoint_share={report.checkpoint_share:g}, replays may hide bugs"
    yield _field("pipeline", f"{report.pipeline}; {where}, {batch}, {checkpoints}")
    unit = "items" if report.batch_size is None and not report.from_loader else "batches"
    per_epoch = ", ".join(str(n) for n in report.items_per_epoch)
    yield _field(f"{unit} per epoch", f"{per_epoch} ({_epochs(report.epochs)})")
    after_items = len(report.save_points) - report.boundary_points
    yield _field(
        "save points",
        f"{len(report.save_points)} checked ({after_items} after items: random, first and "
        f"last of each epoch; {report.boundary_points} boundaries: before iter(), after "
        "iter(), after StopIteration)",
    )
    yield _field("chains", f"{report.chains} (restore, consume, save, restore again)")
    yield _field("restores", str(report.restores))
    yield _field("time", f"{report.seconds:.1f} s")


def _epochs(count: int) -> str:
    return "1 epoch" if count == 1 else f"{count} epochs"


def _field(name: str, value: str) -> str:
    return f"  {name + ':':<18} {value}"


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
