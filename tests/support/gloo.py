"""Runs a job on several ``torch.distributed`` ranks over gloo: processes on loopback,
each reporting one result; every wait is bounded.

NOTE [ Ranks from a forkserver ]
Each rank is a fresh process, as torchrun starts them, but forked from multiprocessing's
forkserver, which has imported torch once (the list ``test_resume.py``'s forkserver case
gives it too), instead of a spawned interpreter that imports torch itself: seconds per
job of two or three ranks. The forkserver is a process of its own that never ran the
tests (nothing of pytest's threads or state reaches the ranks) and lives as long as
pytest, which the leak check knows. A rank takes ``sys.path`` and the working directory
from the test, as a spawned one does, but the environment variables the forkserver
started with: the jobs here set none of theirs through the environment.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import queue as queue_module
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: A job: ``job(rank, world_size, tmp)`` returns the rank's report (picklable).
Job = Callable[[int, int, Path], Any]
#: Seconds gloo's threads get before a group is destroyed (see destroy_process_group).
_GLOO_SETTLE_SECONDS = 0.1
#: How long a collective waits for the other ranks (init_process_group's timeout).
_COLLECTIVE_TIMEOUT_SECONDS = 100
#: The command_timeout of the jobs' loaders: a worker forked while a gloo thread held
#: CPython's thread-state lock (python/cpython#112275) hangs before the loader's code
#: runs; the loader starts its workers again after this long (NOTE [ Workers that never
#: started ] in savable_loader/_iterator.py), well within the collective timeout.
COMMAND_TIMEOUT = 20.0


def _stacks_file(tmp: str, port: int, rank: int) -> Path:
    return Path(tmp) / f".stacks-{port}-{rank}.txt"


def _run_rank(
    rank: int,
    world_size: int,
    port: int,
    job: Job,
    tmp: str,
    out: Any,
    timeout: float,
) -> None:
    import torch.distributed as dist

    # A rank still running shortly before the parent gives up writes where it waits, so a
    # hang reports its stacks instead of only its silence.
    stacks = _stacks_file(tmp, port, rank).open("w")
    faulthandler.dump_traceback_later(max(timeout - 3.0, 1.0), file=stacks)

    # Workers start as in a job launched by torchrun: forked (spawn would start each one
    # as a fresh interpreter importing torch, seconds per loader).
    multiprocessing.set_start_method("fork", force=True)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            # Beyond the 20 s command_timeout of the jobs' loaders: a worker that hangs
            # in its start-up is found and started again while the other ranks wait
            # (NOTE [ Workers that never started ] in savable_loader/_iterator.py).
            timeout=datetime.timedelta(seconds=_COLLECTIVE_TIMEOUT_SECONDS),
        )
        try:
            out.put((rank, "ok", job(rank, world_size, Path(tmp))))
        finally:
            destroy_process_group()
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        stacks.close()


def destroy_process_group() -> None:
    """``dist.destroy_process_group()`` once gloo's threads are done with the last
    collective, if a group is initialized.

    NOTE [ Gloo's teardown on older torch ]
    On older torch (2.4 here), ``ProcessGroupGloo``'s destructor joins gloo's threads
    while holding the GIL, and a thread that drops a finished collective's work may free a
    tensor whose Python object needs the GIL: both wait forever (seen in ``tests_lowest``:
    a docs page destroyed its group right after a collective; torch later releases the
    GIL there, pytorch/pytorch#154976, merged June 2025). A short sleep before the destroy
    lets the threads finish.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        time.sleep(_GLOO_SETTLE_SECONDS)
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(
    job: Job, world_size: int, tmp: Path, *, timeout: float
) -> dict[int, tuple[str, Any]]:
    """Runs ``job`` on ``world_size`` ranks (NOTE [ Ranks from a forkserver ]); returns
    ``{rank: (status, report)}`` for the ranks that reported within ``timeout`` (status
    "ok", or "error" with the traceback). Ranks still running then are killed."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch"])
    out = context.Queue()
    port = _free_port()
    processes = [
        context.Process(
            target=_run_rank,
            args=(rank, world_size, port, job, str(tmp), out, timeout),
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    reports: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(reports) < world_size and time.monotonic() < deadline:
            try:
                rank, status, payload = out.get(timeout=1.0)
            except queue_module.Empty:
                if not any(process.is_alive() for process in processes):
                    break
                continue
            reports[rank] = (status, payload)
    finally:
        for process in processes:
            process.join(timeout=max(deadline - time.monotonic(), 5.0))
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
        out.close()
    for rank in sorted(set(range(world_size)) - set(reports)):
        path = _stacks_file(str(tmp), port, rank)
        text = path.read_text() if path.exists() else "(no stacks written)"
        print(
            f"rank {rank} did not report within {timeout} s; its threads then:\n{text}",
            file=sys.stderr,
        )
    return reports


def in_rank_order(reports: dict[int, tuple[str, Any]], world_size: int, label: str) -> list[Any]:
    """The ranks' reports in rank order; fails naming the ranks that failed or were silent."""
    errors = {rank: payload for rank, (status, payload) in reports.items() if status != "ok"}
    assert not errors, f"{label} on {world_size} ranks failed: {errors}"
    missing = sorted(set(range(world_size)) - set(reports))
    assert not missing, f"{label} on {world_size} ranks: ranks {missing} did not report in time"
    return [reports[rank][1] for rank in range(world_size)]


def outcome(call: Callable[[], Any]) -> tuple[str, str, float]:
    """Runs ``call`` in a rank; returns (exception type name or "ok", message, seconds),
    plain data a rank can report back."""
    began = time.monotonic()
    try:
        call()
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - began
    return "ok", "", time.monotonic() - began
