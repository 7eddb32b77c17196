"""Training jobs run as subprocesses for the trainer integration tests (Lightning,
Accelerate, the Hugging Face Trainer): the runner that can SIGKILL a job's process group,
the records each rank writes, and the shared check of a killed-and-resumed run.

The tests fork their jobs from a zygote that imported the trainer's library once (NOTE
[ Jobs from a zygote ] in zygote.py). Without one, a job is a new interpreter, and run
as a script, ``python trainer_jobs.py SCRIPT OUT RANKS KILL`` starts ``SCRIPT job OUT
KILL`` once per rank (:func:`launch_ranks`): a launcher that imports nothing but the
standard library, so the ranks start at once instead of after a second import of the
trainer's library.

NOTE [ The reference beside the killed run ]
A job spends most of its time importing the trainer's library, on one core per rank. The
uninterrupted reference run does not depend on the killed run, so it runs at the same
time as the killed run and its resumption (:class:`Job`), each job in a session of its
own and out folder of its own; the comparison waits for it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paths import pythonpath
from zygote import Zygote, ZygoteJob

Records = list[dict[str, Any]]


class Job:
    """``command`` started in a session of its own (a kill takes the job's whole group, never
    pytest). :meth:`wait` returns its exit code: a job not meant to be killed (``kill ==
    "none"``), or one that ended otherwise than by SIGKILL, must exit 0; one past
    ``timeout`` seconds from its start is killed and raises ``TimeoutExpired``. Leaving the
    ``with`` block kills a job still running (a failed check does not leave it behind)."""

    def __init__(
        self,
        command: list[str],
        kill: str,
        timeout: float,
        *,
        zygote: Zygote | None = None,
        ranks: int = 1,
    ) -> None:
        """With a ``zygote``, ``command`` (``[sys.executable, script, ...]``) is forked from
        it, on ``ranks`` processes (NOTE [ Jobs from a zygote ] in zygote.py)."""
        self.kill = kill
        self.deadline = time.monotonic() + timeout
        # The job imports this module and the helpers beside it (NOTE [ Test folders ]).
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": pythonpath()}
        self.process: subprocess.Popen[str] | ZygoteJob
        if zygote is not None:
            self.process = zygote.start(command[1:], ranks=ranks, env=env)
            return
        assert ranks == 1, "several ranks: trainer_jobs.py's launcher, or a zygote"
        self.process = subprocess.Popen(
            command,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def wait(self) -> int:
        process = self.process
        try:
            _, err = process.communicate(timeout=max(self.deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        if self.kill == "none" or process.returncode != -signal.SIGKILL:
            assert process.returncode == 0, err[-3000:]
        return process.returncode

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.communicate()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_job(
    command: list[str], kill: str, timeout: float, *, zygote: Zygote | None = None, ranks: int = 1
) -> int:
    """Runs ``command`` as a :class:`Job` and waits for it; returns its exit code."""
    with Job(command, kill, timeout, zygote=zygote, ranks=ranks) as job:
        return job.wait()


def records(out: Path, rank: int) -> Records:
    """The training steps rank ``rank`` wrote (one JSON object per step)."""
    lines = (out / f"rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def produced(out: Path) -> int:
    """How many items the workers produced (one line each in ``produced.txt``)."""
    return len((out / "produced.txt").read_text().splitlines())


def check_resume(
    run: Callable[[Path, int, str], int],
    uninterrupted: Callable[[], list[Records]],
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
    the steps against an uninterrupted run's: batch for batch (ids, augmented values,
    losses), mid-epoch, and without producing the skipped items again.

    Args:
        run: ``run(out, ranks, kill)`` runs the job writing into ``out``.
        uninterrupted: Returns each rank's records of an uninterrupted run, once the
            killed and resumed runs are done (NOTE [ The reference beside the killed run ]).
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
    reference = uninterrupted()
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
    script: str,
    tmp: Path,
    ranks: int,
    kill: str,
    *,
    timeout: float,
    zygote: Zygote | None = None,
    **sizes: int,
) -> None:
    """:func:`check_resume` for a test module run as ``script job OUT KILL`` on each rank
    (forked from ``zygote``; without one, one rank directly, more through this module's
    launcher); the uninterrupted reference runs once per script and number of ranks."""

    def command(out: Path, kill: str) -> list[str]:
        if ranks == 1 or zygote is not None:
            return [sys.executable, script, "job", str(out), kill]
        return [sys.executable, __file__, script, str(out), str(ranks), kill]

    def job(out: Path, kill: str) -> Job:
        shown = ranks if zygote is not None else 1
        return Job(command(out, kill), kill, timeout, zygote=zygote, ranks=shown)

    def run(out: Path, ranks: int, kill: str) -> int:
        with job(out, kill) as started:
            return started.wait()

    key = (script, ranks)
    if key in _REFERENCES:
        check_resume(run, lambda: _REFERENCES[key], tmp, ranks, kill, **sizes)
        return
    out = tmp / "reference"
    out.mkdir()
    # NOTE [ The reference beside the killed run ]
    with job(out, "none") as reference:

        def uninterrupted() -> list[Records]:
            reference.wait()
            _REFERENCES[key] = [records(out, rank) for rank in range(ranks)]
            return _REFERENCES[key]

        check_resume(run, uninterrupted, tmp, ranks, kill, **sizes)


if __name__ == "__main__":
    sys.exit(launch_ranks(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
