"""A hung worker's error carries what its threads were doing (NOTE [ Stacks of a hung
worker ] in ``savable_loader/_channel/commands.py``): hung in a sleep, stuck with the GIL held,
in ``worker_init_fn``, frozen, with its ``SIGUSR2`` taken by the user's code, and under
spawn. A worker hung before the loader's code ran is ``test_unstarted_workers.py``."""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from processes import SLACK, freeze

from savable_loader import SavableDataLoader, WorkerConfig, WorkerError
from savable_loader.datasets import IndexedDataset

HUNG_AT = 5
STACKS = "Worker 0's threads when the loader gave up on it (most recent call first):"


def _sleeps(index: int) -> int:
    if index == HUNG_AT:
        time.sleep(60)
    return index


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _deadlock(seconds: int) -> None:
    """Blocks with the GIL held for ``seconds``, as a deadlocked C extension does: one
    thread locks a mutex twice. Unlike ``sleep``, no signal ends the wait early."""
    libc = ctypes.PyDLL(None)  # PyDLL keeps the GIL through the call
    mutex = ctypes.create_string_buffer(64)  # zeroed: glibc's PTHREAD_MUTEX_INITIALIZER
    libc.pthread_mutex_lock(mutex)
    until = _Timespec(int(time.time()) + seconds, 0)
    libc.pthread_mutex_timedlock(mutex, ctypes.byref(until))


def _holds_the_gil(index: int) -> int:
    if index == HUNG_AT:
        _deadlock(60)
    return index


def _holds_the_gil_after_a_batch(index: int) -> int:
    if index == HUNG_AT - 1:
        time.sleep(0.3)  # with the GIL free, the worker's first batch goes out
    return _holds_the_gil(index)


def _takes_sigusr2(worker_id: int) -> None:
    marker = Path(os.environ["SAVABLE_LOADER_TEST_MARKER"])
    signal.signal(signal.SIGUSR2, lambda *_: marker.write_text("signalled"))


def _init_hangs(worker_id: int) -> None:
    if worker_id == 0:
        time.sleep(60)


def _loader(fn: Any, config: WorkerConfig, **kwargs: Any) -> SavableDataLoader:
    return SavableDataLoader(
        IndexedDataset(range(4 * HUNG_AT)).map(fn),
        batch_size=2,
        num_workers=2,
        worker_config=config,
        **kwargs,
    )


def _error(loader: SavableDataLoader) -> tuple[list[list[int]], str]:
    """The batches that arrived, and the error iterating raised."""
    batches: list[list[int]] = []
    with pytest.raises(WorkerError) as info:
        batches.extend(batch.tolist() for batch in loader)
    return batches, str(info.value)


def test_an_item_that_hangs_names_the_line_it_hangs_on() -> None:
    with _loader(_sleeps, WorkerConfig(item_timeout=1)) as loader:
        batches, message = _error(loader)
    assert "beyond WorkerConfig(item_timeout=1)" in message
    head, _, stacks = message.partition(STACKS)
    # The signal did not end the worker: it still told its position before it was killed.
    assert "stays after the last item handed on" in head
    assert f"line {_sleeps.__code__.co_firstlineno + 2} in _sleeps" in stacks
    assert "in _serve" in stacks  # every thread, the command thread included
    assert all(HUNG_AT not in batch for batch in batches)


def _collect_torchs_temporary_files() -> None:
    """When the main thread's wait for a hung worker's batch ends in an error (NOTE [ A
    fetch stuck on a worker ]), torch 2.4 (the lowest supported) opens 10 temporary files
    to tell a lack of file descriptors and leaves them to the garbage collector (torch
    2.13 closes them). They are collected here, where their ResourceWarning is expected,
    rather than in a later test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def test_a_worker_stuck_with_the_gil_held_still_shows_its_stack() -> None:
    with _loader(_holds_the_gil, WorkerConfig(command_timeout=2)) as loader:
        _, message = _error(loader)
    _collect_torchs_temporary_files()
    assert "worker 0 did not answer 'progress' within 2 s" in message
    assert "in _holds_the_gil" in message.partition(STACKS)[2]


def test_a_batch_taken_from_a_worker_stuck_with_the_gil_held_ends_in_the_same_error() -> None:
    """The main thread, taking in the worker's first batch, waits on a thread of the
    worker for its shared memory; the worker is hung with the GIL held by then (NOTE
    [ A fetch stuck on a worker ] in ``savable_loader/_main/fetch_guard.py``)."""
    config = WorkerConfig(command_timeout=2)
    with _loader(_holds_the_gil_after_a_batch, config) as loader:
        stream = iter(loader)
        time.sleep(1)  # the worker's first batch waits in the queue, and the worker hangs
        began = time.monotonic()
        with pytest.raises(WorkerError) as info:
            list(stream)
        elapsed = time.monotonic() - began
    message = str(info.value)
    del info
    _collect_torchs_temporary_files()
    assert "worker 0 did not answer 'progress' within 2 s" in message
    assert "in _deadlock" in message.partition(STACKS)[2]
    # Two poll intervals (0.5 s each), command_timeout, the stacks' wait, a loaded machine.
    assert elapsed < 1 + 2 + 1 + SLACK


def test_a_frozen_worker_is_reported_without_stacks_after_a_bounded_wait() -> None:
    with _loader(lambda i: i, WorkerConfig(command_timeout=1)) as loader:
        stream = iter(loader)
        next(stream)
        pid = loader.worker_stats()[0]["pid"]
        freeze(pid)  # every thread stopped, not only the signal sent
        began = time.monotonic()
        with pytest.raises(WorkerError) as info:
            loader.save_state_rank()
        elapsed = time.monotonic() - began
    assert f"{STACKS}\n(unavailable: none arrived within 1 s)" in str(info.value)
    assert elapsed < 1 + 1 + SLACK  # command_timeout, the stacks' wait, a loaded machine


def test_a_worker_whose_sigusr2_the_user_took_is_not_signalled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "marker"
    monkeypatch.setenv("SAVABLE_LOADER_TEST_MARKER", str(marker))
    config = WorkerConfig(item_timeout=1)
    with _loader(_sleeps, config, worker_init_fn=_takes_sigusr2) as loader:
        _, message = _error(loader)
    assert f"{STACKS}\n(unavailable: the worker's SIGUSR2 has another handler)" in message
    assert not marker.exists()


def test_a_hang_in_worker_init_fn_shows_its_stack() -> None:
    """The stacks are registered before the user's ``worker_init_fn`` runs; a worker
    hung in it has started (it is not started again: NOTE [ Workers that never started ]
    in ``_main/iterator.py``)."""
    config = WorkerConfig(command_timeout=2)
    with _loader(_sleeps, config, worker_init_fn=_init_hangs) as loader:
        _, message = _error(loader)
    assert "worker 0 did not answer 'progress' within 2 s" in message
    assert "in _init_hangs" in message.partition(STACKS)[2]


@pytest.mark.slow
def test_a_spawned_worker_shows_its_stack() -> None:
    config = WorkerConfig(item_timeout=1)
    with _loader(_sleeps, config, multiprocessing_context="spawn") as loader:
        _, message = _error(loader)
    assert "in _sleeps" in message.partition(STACKS)[2]
