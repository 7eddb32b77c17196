"""Saves answered by the workers' command threads; dead and hung workers (issue 2)."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from pipelines import RandomCounter, Stuck
from processes import SLACK, freeze, kill, thaw

from savable_loader import SavableDataLoader, WorkerConfig, WorkerError
from savable_loader.testing import digest

pytestmark = pytest.mark.slow


def _drain(iterator, count):
    for _ in range(count):
        next(iterator)


def test_save_does_not_wait_for_the_item_in_progress():
    loader = SavableDataLoader(Stuck(40, stuck_at=6, seconds=20), batch_size=1, num_workers=2)
    try:
        iterator = iter(loader)
        for _ in range(4):
            next(iterator)
        time.sleep(0.5)  # worker 0 is now inside its 20 s item
        began = time.monotonic()
        state = loader.save_state_rank()
        elapsed = time.monotonic() - began
        assert elapsed < SLACK, f"save took {elapsed:.1f} s while a worker was busy"
        assert [worker.delivered for worker in state.workers] == [2, 2]
    finally:
        loader.close()


class BusyInPython(RandomCounter):
    """Worker 0 spends 30 s in pure Python code (holding the GIL) on item 3."""

    def __iter__(self):
        for item in super().__iter__():
            if item["index"] == 3:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    sum(range(10_000))
            yield item


def test_save_answers_while_a_worker_runs_python_code():
    loader = SavableDataLoader(BusyInPython(40), batch_size=1, num_workers=2)
    try:
        iterator = iter(loader)
        next(iterator)
        time.sleep(0.5)
        began = time.monotonic()
        state = loader.save_state_rank()
        assert time.monotonic() - began < SLACK
        assert state.workers[0].delivered == 1
    finally:
        loader.close()


def test_stopped_worker_raises_worker_error_within_the_command_timeout():
    loader = SavableDataLoader(
        RandomCounter(200, cost=0.01),
        batch_size=1,
        num_workers=2,
        worker_config=WorkerConfig(command_timeout=2.0),
    )
    try:
        iterator = iter(loader)
        next(iterator)
        pid = loader.worker_stats()[1]["pid"]
        freeze(pid)
        began = time.monotonic()
        with pytest.raises(WorkerError, match=r"worker 1 did not answer 'checkpoint' within 2 s"):
            loader.save_state_rank()
        assert 2 <= time.monotonic() - began < 2 + SLACK
    finally:
        thaw(pid)
        loader.close()


def test_dead_worker_during_save_raises_worker_error_naming_it():
    loader = SavableDataLoader(RandomCounter(200, cost=0.01), batch_size=1, num_workers=2)
    try:
        iterator = iter(loader)
        next(iterator)
        pids = [stats["pid"] for stats in loader.worker_stats()]
        kill(pids[1])
        began = time.monotonic()
        with pytest.raises(WorkerError, match=r"worker\(s\) \[1\] died during a save"):
            loader.save_state_rank()
        assert time.monotonic() - began < SLACK
    finally:
        loader.close()


def test_a_worker_dying_between_batches_raises_nothing_there_and_the_next_batch_names_it():
    # Torch's SIGCHLD handler, installed by the first iterator with workers, raised
    # RuntimeError in the main thread wherever it was when a worker died: in the training
    # step, or on the way into next() (NOTE [ Worker deaths are found where they are asked
    # about ] in _stream.py). SIGCHLD is not blocked here.
    assert signal.SIGCHLD not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    loader = SavableDataLoader(RandomCounter(200, cost=0.01), batch_size=1, num_workers=2)
    try:
        iterator = iter(loader)
        next(iterator)
        assert callable(signal.getsignal(signal.SIGCHLD))  # torch's handler is in place
        pids = [stats["pid"] for stats in loader.worker_stats()]
        os.kill(pids[1], signal.SIGKILL)  # not kill(), which absorbs torch's error
        deadline = time.monotonic() + 1.0  # the training step: signals run between lines
        while time.monotonic() < deadline:
            sum(range(1_000))
        # How it ended, in torch's words (its SIGCHLD handler's for its own workers).
        killed = rf"\(DataLoader worker \(pid {pids[1]}\) is killed by signal: Killed\.\)"
        with pytest.raises(
            WorkerError, match=r"worker\(s\) \[1\] died while producing items " + killed
        ):
            _drain(iterator, 10)
    finally:
        loader.close()


class ExitsAt(RandomCounter):
    """Worker 1 exits with code 3 at item 5, as a C extension calling exit() would."""

    def __iter__(self):
        for item in super().__iter__():
            if item["index"] == 5:
                os._exit(3)
            yield item


def test_a_worker_that_exits_is_reported_with_its_exit_code():
    loader = SavableDataLoader(ExitsAt(40), batch_size=1, num_workers=2)
    with loader, pytest.raises(WorkerError) as raised:
        list(loader)
    message = str(raised.value)
    assert re.match(r"worker\(s\) \[\d\] died while producing items \(DataLoader worker", message)
    assert re.search(r"exited unexpectedly with exit code 3\.\)", message), message


def test_dead_worker_while_iterating_raises_worker_error_and_last_state_resumes():
    reference = SavableDataLoader(RandomCounter(60, cost=0.002), batch_size=2, num_workers=2)
    expected = [digest(item) for item in reference]
    reference.close()
    loader = SavableDataLoader(RandomCounter(60, cost=0.002), batch_size=2, num_workers=2)
    try:
        iterator = iter(loader)
        got = [digest(next(iterator)) for _ in range(5)]
        state = loader.save_state_rank()
        kill(loader.worker_stats()[0]["pid"])
        with pytest.raises(WorkerError):
            _drain(iterator, 100)
    finally:
        loader.close()
    assert got == expected[:5]
    resumed = SavableDataLoader(RandomCounter(60, cost=0.002), batch_size=2, num_workers=2)
    resumed.restore_state_rank(state)
    assert expected[:5] + [digest(item) for item in resumed] == expected
    resumed.close()


def test_worker_stats_report_checkpoints():
    loader = SavableDataLoader(RandomCounter(100), batch_size=4, num_workers=2)
    try:
        iterator = iter(loader)
        for _ in range(5):
            next(iterator)
        stats = loader.worker_stats()
    finally:
        loader.close()
    assert len(stats) == 2
    for worker in stats:
        assert worker["checkpoints_taken"] >= 1
        assert 0 < worker["checkpoint_bytes"] < 32 * 1024
        assert worker["ring_entries"] >= 1
