"""Training jobs run as subprocesses for the trainer integration tests (Lightning,
Accelerate, the Hugging Face Trainer): the runner that can SIGKILL a job's process group,
the records each rank writes, and the shared check of a killed-and-resumed run.

Run as a script, ``python trainer_jobs.py SCRIPT OUT RANKS KILL`` starts ``SCRIPT job OUT
KILL`` once per rank (:func:`launch_ranks`): a launcher that imports nothing but the
standard library, so the ranks start at once instead of after a second import of the
trainer's library.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Records = list[dict[str, Any]]


def run_job(command: list[str], kill: str, timeout: float) -> int:
    """Runs ``command`` in a session of its own (a kill takes the job's whole group, never
    pytest); returns its exit code. A job not meant to be killed (``kill == "none"``), or
    one that ended otherwise than by SIGKILL, must exit 0; one past ``timeout`` is killed
    and raises ``TimeoutExpired``."""
    process = subprocess.Popen(
        command,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    if kill == "none" or process.returncode != -signal.SIGKILL:
        assert process.returncode == 0, err[-3000:]
    return process.returncode


def records(out: Path, rank: int) -> Records:
    """The training steps rank ``rank`` wrote (one JSON object per step)."""
    lines = (out / f"rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def produced(out: Path) -> int:
    """How many items the workers produced (one line each in ``produced.txt``)."""
    return len((out / "produced.txt").read_text().splitlines())


def check_resume(
    run: Callable[[Path, int, str], int],
    reference: list[Records],
    tmp: Path,
    ranks: int,
    kill: str,
    *,
    items: int,
    batch: int,
    epochs: int,
    every: int,
) -> None:
    """Runs a job killed as ``kill`` says (``step:<n>``: before step n; ``after:<n>``: right
    after step n's checkpoint), resumes it from the trainer's last checkpoint, and checks
    the steps against ``reference``, an uninterrupted run's: batch for batch (ids,
    augmented values, losses), mid-epoch, and without producing the skipped items again.

    Args:
        run: ``run(out, ranks, kill)`` runs the job writing into ``out``.
        reference: Each rank's records of an uninterrupted run.
        every: The job checkpoints every ``every`` steps.
    """
    per_epoch = items // batch // ranks
    out = tmp / "run"
    out.mkdir()
    assert run(out, ranks, kill) == -signal.SIGKILL
    killed = [records(out, rank) for rank in range(ranks)]
    for rank in range(ranks):
        (out / f"rank{rank}.jsonl").rename(out / f"killed{rank}.jsonl")
    (out / "produced.txt").unlink()
    run(out, ranks, "none")
    for rank in range(ranks):
        assert [r["step"] for r in reference[rank]] == list(range(epochs * per_epoch))
        resumed = records(out, rank)
        start = resumed[0]["step"]
        assert 0 < start < len(reference[rank]), start
        assert start % every == 0, start
        if kill.startswith("step:"):
            assert start == int(kill.partition(":")[2]) // every * every, start
        assert start % per_epoch != 0, start  # mid-epoch: a fresh epoch would differ
        before = [record for record in killed[rank] if record["step"] < start]
        assert len(before) == start  # the killed run reached the checkpoint
        # Batch for batch (ids, augmented values, losses): nothing replayed or skipped.
        assert before + resumed == reference[rank], rank
    # The resumed run produced the items it trained on, not the epoch's skipped ones: a
    # skip-based resume would have produced its checkpoint's share of the epoch again.
    trained = sum(len(r["ids"]) for rank in range(ranks) for r in records(out, rank))
    skipped = (start % per_epoch) * batch * ranks
    assert trained <= produced(out) < trained + skipped, (produced(out), trained, skipped)
    for epoch in range(epochs):
        seen = sorted(
            i
            for rank in range(ranks)
            for r in reference[rank]
            for i in r["ids"]
            if r["epoch"] == epoch
        )
        assert seen == list(range(items)), (epoch, seen)  # each epoch reads every item once
    orders = [[r["ids"] for r in reference[0] if r["epoch"] == epoch] for epoch in range(epochs)]
    assert orders[0] != orders[1] != orders[2]  # a new order every epoch


def launch_ranks(script: str, out: str, ranks: int, kill: str) -> int:
    """Starts ``script job OUT KILL`` once per rank with torchrun's environment variables
    (a free loopback port); returns the first failing exit code, or 0."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    children = []
    for rank in range(ranks):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        children.append(subprocess.Popen([sys.executable, script, "job", out, kill], env=env))
    codes = [child.wait() for child in children]
    return next((code for code in codes if code != 0), 0)


_REFERENCES: dict[tuple[str, int], list[Records]] = {}


def check_script_resumes(
    script: str, tmp: Path, ranks: int, kill: str, *, timeout: float, **sizes: int
) -> None:
    """:func:`check_resume` for a test module run as ``script job OUT KILL`` on each rank
    (one rank: directly; more: through this module's launcher); the uninterrupted
    reference runs once per script and number of ranks."""

    def run(out: Path, ranks: int, kill: str) -> int:
        if ranks == 1:
            command = [sys.executable, script, "job", str(out), kill]
        else:
            command = [sys.executable, __file__, script, str(out), str(ranks), kill]
        return run_job(command, kill, timeout)

    if (script, ranks) not in _REFERENCES:
        out = tmp / "reference"
        out.mkdir()
        run(out, ranks, "none")
        _REFERENCES[script, ranks] = [records(out, rank) for rank in range(ranks)]
    check_resume(run, _REFERENCES[script, ranks], tmp, ranks, kill, **sizes)


if __name__ == "__main__":
    sys.exit(launch_ranks(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
