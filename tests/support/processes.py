"""Freezing a worker process for the fault tests, and how late a bounded wait may end."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

#: How far past its bound a wait may end on a loaded machine before a test calls it a
#: hang. CI saw a 2 s command timeout end after 8.6 s while the suite ran beside other
#: jobs; every bound checked with it is far below the 60 s defaults it tells apart.
SLACK = 15.0


def freeze(pid: int, timeout: float = 10.0) -> None:
    """Sends SIGSTOP to ``pid`` and returns once every thread of it has stopped.

    A stop signal wakes one thread of a process, which then stops the others: until it
    is scheduled, the rest keep running. On a loaded machine that took milliseconds, in
    which a worker's command thread still answered a save.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout:g} s of SIGSTOP")
        time.sleep(0.001)


def thaw(pid: int) -> None:
    """Lets a frozen process run again (it may be gone already)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def _all_threads_stopped(pid: int) -> bool:
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            # The state follows the parenthesised command name, which may hold spaces.
            states.append(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(state in ("T", "t") for state in states)


def kill(pid: int, timeout: float = 10.0) -> None:
    """Kills ``pid`` (SIGKILL) and returns once it has died.

    The loader takes its workers off torch's SIGCHLD watch (NOTE [ Worker deaths are found
    where they are asked about ] in ``_main/stream.py``); a worker of torch's own ``DataLoader``
    is on it, and its death raises RuntimeError in the main thread wherever it is: here,
    where it is absorbed.
    """
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(RuntimeError):
            if not _running(pid):
                time.sleep(0.05)  # torch's SIGCHLD handler runs here, if it has not yet
                return
            time.sleep(0.005)
    raise TimeoutError(f"process {pid} did not die within {timeout:g} s of SIGKILL")


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
