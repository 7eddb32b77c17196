"""A process that has imported a trainer's library once and forks each training job from
there (NOTE [ Jobs from a zygote ]).

NOTE [ Jobs from a zygote ]
A training job of the trainer tests spends most of its CPU importing the trainer's
library: 7 to 8 s for the Hugging Face ``Trainer`` or Lightning, on one core per rank, in
every rank of every run (the uninterrupted reference, the killed run and its resumption).
A :class:`Zygote` is started once per test module (or test) with the library imported and
nothing else run; each job is a fork of it, in a session of its own, that runs the job's
script as ``python SCRIPT ARGS...`` would (``__main__``, ``sys.argv``, the script's folder
first on ``sys.path``, the environment and working directory the test gives), and exits
as the script does. A job of several ranks is a leader that forks one process per rank,
with torchrun's environment variables (a free loopback port), as ``trainer_jobs.py``'s
launcher starts them. So each job is still a fresh process that never ran a training
step, as the resumption of a killed job must be, the way ``gloo.py``'s ranks come from a
forkserver (NOTE [ Ranks from a forkserver ] in gloo.py). A rank a trainer starts itself
(Lightning's launcher starts rank 1 with ``sys.executable``) is a new interpreter, as in
a real run. A kill takes the job's process group (its session), never the zygote, whose
children the test process does not see: the zygote kills what is left of its jobs when
it is closed.

Run as a script, ``python zygote.py MODULE...`` imports the modules, then reads one job
a line (JSON) on stdin and answers on stdout when each starts (its pid) and ends (its
exit code, negative for a signal, as ``subprocess`` reports it).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paths import pythonpath

#: How long :meth:`Zygote.start` waits for the zygote to fork a job (it imports first).
START_TIMEOUT = 120.0


class Zygote:
    """The zygote process; :meth:`start` forks a job, :meth:`close` ends the zygote and
    every job still running."""

    def __init__(self, *preload: str) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="zygote-"))
        with (self.folder / "zygote.err").open("w") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, __file__, *preload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                start_new_session=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": pythonpath()},
            )
        self._changed = threading.Condition()
        self._pids: dict[int, int] = {}
        self._codes: dict[int, int] = {}
        self._ended = False
        self._next = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            with self._changed:
                if "pid" in message:
                    self._pids[message["id"]] = message["pid"]
                else:
                    self._codes[message["id"]] = message["code"]
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def start(
        self,
        argv: Sequence[str],
        *,
        ranks: int = 1,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ZygoteJob:
        """Forks ``python argv...`` (``ranks`` processes, each with torchrun's variables
        when more than one); returns it as a ``Popen`` the test can wait for or kill."""
        job, self._next = self._next, self._next + 1
        stderr = self.folder / f"job{job}.err"
        request = {
            "id": job,
            "argv": [str(arg) for arg in argv],
            "ranks": ranks,
            "env": dict(os.environ if env is None else env),
            "cwd": cwd or os.getcwd(),
            "stderr": str(stderr),
        }
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        with self._changed:
            ready = self._changed.wait_for(
                lambda: job in self._pids or self._ended, timeout=START_TIMEOUT
            )
            if not ready or job not in self._pids:
                raise RuntimeError(f"the zygote did not start the job: {self._error()}")
            return ZygoteJob(self, job, self._pids[job], stderr)

    def _error(self) -> str:
        return (self.folder / "zygote.err").read_text()[-3000:]

    def close(self) -> None:
        assert self.process.stdin is not None
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self._reader.join(timeout=10)
        assert self.process.stdout is not None
        self.process.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ZygoteJob:
    """A job forked by a :class:`Zygote`, read as the ``Popen`` of ``trainer_jobs.Job``:
    ``pid`` (its process group), ``returncode``, ``poll()`` and ``communicate()``, which
    gives its stderr."""

    def __init__(self, zygote: Zygote, job: int, pid: int, stderr: Path) -> None:
        self.zygote, self.job, self.pid, self.stderr = zygote, job, pid, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        with self.zygote._changed:
            if self.job in self.zygote._codes:
                self.returncode = self.zygote._codes[self.job]
            elif self.zygote._ended:
                self.returncode = 255  # the zygote died: never a success
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[None, str]:
        with self.zygote._changed:
            done = self.zygote._changed.wait_for(
                lambda: self.job in self.zygote._codes or self.zygote._ended, timeout=timeout
            )
        if not done:
            raise subprocess.TimeoutExpired(f"zygote job {self.job}", timeout or 0)
        self.poll()
        error = self.stderr.read_text() if self.stderr.exists() else ""
        if self.returncode == 255 and self.job not in self.zygote._codes:
            error += "\nthe zygote ended: " + self.zygote._error()
        return None, error


# -- the zygote process --------------------------------------------------------------------


def _send(message: dict[str, Any]) -> None:
    os.write(1, json.dumps(message).encode() + b"\n")


def _run(argv: list[str]) -> None:
    """Runs the script as ``python argv...`` would; ends the process as the script does."""
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


def _ranks(argv: list[str], ranks: int) -> int:
    """Forks one process per rank with torchrun's environment variables; returns the first
    failing exit code, or 0 (as ``trainer_jobs.launch_ranks``)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    children = []
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(ranks),
                LOCAL_WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            _run(argv)
        children.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    return next((code for code in codes if code != 0), 0)


def _job(request: dict[str, Any]) -> None:
    """In the forked job: its session, stdio, environment and folder, then the script (or
    a leader of its ranks). Never returns: ``SystemExit`` ends the process normally."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request["ranks"] == 1:
        _run(request["argv"])
    code = _ranks(request["argv"], request["ranks"])
    sys.stderr.flush()
    os._exit(code)


def _reap(jobs: dict[int, int]) -> None:
    while jobs:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in jobs:
            _send({"id": jobs.pop(pid), "code": os.waitstatus_to_exitcode(status)})


def _serve(preload: list[str]) -> None:
    for name in preload:
        importlib.import_module(name)
    jobs: dict[int, int] = {}
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _job(request)
                jobs[pid] = request["id"]
                _send({"id": request["id"], "pid": pid})
        _reap(jobs)
    # Closed: no job outlives the zygote.
    for pid in jobs:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while jobs and time.monotonic() < deadline:
        _reap(jobs)
        time.sleep(0.05)


if __name__ == "__main__":
    _serve(sys.argv[1:])
