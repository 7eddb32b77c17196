"""``savable-loader demo``, the parent side: checks the options, runs the three child
processes (NOTE [ Demo ] in ``demo_child.py``), kills the interrupted one with SIGKILL,
and compares the resumed stream of batches with the uninterrupted one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .demo_child import BATCH_SIZE, EPOCHS, DemoPaths, DemoSettings, read_digests, summarize_ms
from .output import _PROG, _out, _plural

_CHILD_TIMEOUT = 180.0


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
