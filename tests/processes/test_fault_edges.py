"""Faults at the edges of the worker protocol (issue 14, "Faults"), beside the matrix of
``tests/processes/test_faults.py``:

- the dataset's ``save_state()`` blocks inside a worker, at a checkpoint after an item or
  at the end of an epoch: a hung worker, reported within ``command_timeout`` (NOTE
  [ Watchdog ] in ``_main/stream.py``);
- the dataset's ``save_state()`` raises inside a worker: a :class:`DatasetError` naming
  the worker and the item (NOTE [ Pipeline errors ] in ``_channel/events.py``);
- a worker frozen (SIGSTOP) during a save: it is killed, and ``close()`` returns at once
  (NOTE [ Workers given up on ] in ``_main/stream.py``);
- ``torch.multiprocessing``'s ``file_system`` sharing strategy: stopping the workers
  removes no shared memory file a live tensor still owns (NOTE [ Shared memory of a
  killed worker ] in ``_channel/torch_compat.py``).

Each case asserts the error type, its message and its bound, and that the last good
state resumes into a clean loader that yields exactly the uninterrupted stream's
continuation. ``TALLY`` counts faults, hangs, crashes and leaked processes; the last test
asserts none of the last three (``pytest -s -o log_cli=true`` logs the counts).
"""

from __future__ import annotations

import collections
import gc
import logging
import mmap
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from paths import pythonpath
from pipelines import RandomCounter
from processes import freeze, thaw
from torch.utils.data import get_worker_info

from savable_loader import DatasetError, SavableDataLoader, WorkerConfig, WorkerError
from savable_loader.testing import digest

logger = logging.getLogger(__name__)

N = 40
EPOCHS = 2
BATCH = 2
WORKERS = 2
#: Per item: enough that the worker checkpoints every batch or nearly (NOTE [ Checkpoint
#: policy ] in ``_worker/ring.py``), so the faulty save_state() runs after an item.
COST = 0.01
COMMAND_TIMEOUT = 2.0
ITEM_TIMEOUT = 2.0
#: Beyond the bound: the watchdog's poll, stopping the other workers, a loaded machine.
MARGIN = 4.0
#: How long a blocking save_state() blocks: longer than any bound plus margin, so the
#: loader must report it; short enough that a loader that does not ends the test anyway.
BLOCK_SECONDS = 15.0

TALLY: collections.Counter[str] = collections.Counter()


# -- pipelines -------------------------------------------------------------------------------


def _due(dataset: RandomCounter, at: str) -> bool:
    """In worker 0: a checkpoint after an item past the first few (``at="item"``), or the
    one after the end of the first epoch (``at="end"``)."""
    info = get_worker_info()
    if info is None or info.id != 0:
        return False
    if at == "item":
        return dataset.epoch == 0 and dataset.pos >= 9
    return dataset.epoch == 1 and dataset.pos == 0


class BlockingSave(RandomCounter):
    """Worker 0's ``save_state()`` blocks for ``BLOCK_SECONDS`` at the checkpoint ``at``
    (once, so that a loader that does not report it ends the test)."""

    def __init__(self, n: int, *, at: str) -> None:
        super().__init__(n, cost=COST)
        self.at = at
        self.blocked = False

    def save_state(self) -> dict[str, int]:
        if not self.blocked and _due(self, self.at):
            self.blocked = True
            time.sleep(BLOCK_SECONDS)
        return super().save_state()


class FailingSave(RandomCounter):
    """Worker 0's ``save_state()`` raises ValueError at the checkpoint ``at``."""

    def __init__(self, n: int, *, at: str) -> None:
        super().__init__(n, cost=COST)
        self.at = at

    def save_state(self) -> dict[str, int]:
        if _due(self, self.at):
            raise ValueError(f"cannot save at pos {self.pos}, epoch {self.epoch}")
        return super().save_state()


# -- helpers ---------------------------------------------------------------------------------


def _loader(dataset: Any = None) -> SavableDataLoader:
    return SavableDataLoader(
        dataset if dataset is not None else RandomCounter(N, cost=COST),
        batch_size=BATCH,
        num_workers=WORKERS,
        worker_config=WorkerConfig(command_timeout=COMMAND_TIMEOUT, item_timeout=ITEM_TIMEOUT),
    )


def _stream(loader: SavableDataLoader, epochs: int) -> Iterator[str]:
    for _ in range(epochs):
        for item in loader:
            yield digest(item)


_REFERENCE: list[str] = []


def _reference() -> list[str]:
    if not _REFERENCE:
        with _loader() as loader:
            _REFERENCE.extend(_stream(loader, EPOCHS))
    return _REFERENCE


def _resume(state: Any) -> list[str]:
    """What a clean loader restored from ``state`` yields up to the end of EPOCHS."""
    with _loader() as loader:
        loader.restore_state_rank(state)
        epochs = EPOCHS - state.epoch - (1 if state.between_epochs else 0)
        return list(_stream(loader, epochs))


def _raises_within(
    call: Callable[[], Any], kind: type[Exception], bound: float, *, match: str
) -> tuple[Any, float]:
    TALLY["faults"] += 1
    began = time.monotonic()
    with pytest.raises(kind, match=match) as info:
        call()
    elapsed = time.monotonic() - began
    if elapsed >= bound + MARGIN:
        TALLY["hangs"] += 1
    assert elapsed < bound + MARGIN, f"took {elapsed:.1f} s, bound {bound:g} s + {MARGIN:g} s"
    return info.value, elapsed


def _drain_into(stream: Iterator[str], got: list[str]) -> Callable[[], None]:
    def drain() -> None:
        for item in stream:
            got.append(item)

    return drain


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


# -- save_state() blocks or raises inside a worker -------------------------------------------


@pytest.mark.parametrize("at", ["item", "end"])
def test_a_blocking_save_state_is_a_hung_worker(at: str) -> None:
    reference = _reference()
    with _loader(BlockingSave(N, at=at)) as loader:
        stream = _stream(loader, EPOCHS)
        got = [next(stream) for _ in range(2)]
        pid = loader.worker_stats()[0]["pid"]
        after = r"item \d+" if at == "item" else r"event \d+, the end of its epoch"
        error, _ = _raises_within(
            _drain_into(stream, got),
            WorkerError,
            COMMAND_TIMEOUT,
            match=rf"worker 0 has been taking a checkpoint \(the pipeline's save_state\(\)\) "
            rf"after {after}, for .* beyond WorkerConfig\(command_timeout=2\)",
        )
        # Its command thread still answers: the loader kept its position.
        assert "stays after the last item handed on" in str(error)
        assert not _running(pid)
        kept = loader.save_state_rank()
    assert got + _resume(kept) == reference


@pytest.mark.parametrize("at", ["item", "end"])
def test_a_raising_save_state_is_a_dataset_error(at: str) -> None:
    reference = _reference()
    with _loader(FailingSave(N, at=at)) as loader:
        stream = _stream(loader, EPOCHS)
        got: list[str] = []
        after = r"item \d+" if at == "item" else r"event \d+, the end of its epoch"
        error, _ = _raises_within(
            _drain_into(stream, got),
            DatasetError,
            ITEM_TIMEOUT,
            match=rf"^ValueError: cannot save at pos \d+, epoch \d \(raised in worker 0 while "
            rf"taking a checkpoint \(the pipeline's save_state\(\)\) after {after}, epoch 0\)\. "
            r"The "
            r"loader stays just before that item",
        )
        assert error.worker_id == 0
        assert isinstance(error.__cause__, ValueError)
        assert f"item {error.index}" in str(error) or f"event {error.index}" in str(error)
        kept = loader.save_state_rank()
    # Nothing handed on is lost: the item whose checkpoint failed comes next.
    assert got + _resume(kept) == reference


# -- a frozen worker during a save -----------------------------------------------------------


def test_a_worker_frozen_during_a_save_is_killed_and_close_is_prompt() -> None:
    reference = _reference()
    loader = _loader()
    stream = _stream(loader, EPOCHS)
    head = [next(stream) for _ in range(4)]
    state = loader.save_state_rank()
    pid = loader.worker_stats()[0]["pid"]
    freeze(pid)
    try:
        error, _ = _raises_within(
            loader.save_state_rank,
            WorkerError,
            COMMAND_TIMEOUT,
            match=r"^worker 0 did not answer 'checkpoint' within 2 s",
        )
        assert "The loader stopped its workers" in str(error)
        assert not _running(pid), "the worker the loader gave up on still runs"
        began = time.monotonic()
        loader.close()
        assert time.monotonic() - began < 1.0
        del loader, stream
        gc.collect()
        if _running(pid):
            TALLY["leaked_processes"] += 1
        assert not _running(pid)
    finally:
        thaw(pid)
    assert head + _resume(state) == reference


# -- torch's file_system sharing strategy ----------------------------------------------------

_SHARING_SCRIPT = """
import gc, glob, os, sys
import torch.multiprocessing
strategy = sys.argv[1]
previous = torch.multiprocessing.get_sharing_strategy()
torch.multiprocessing.set_sharing_strategy(strategy)
try:
    from pipelines import RandomCounter
    from savable_loader import SavableDataLoader

    def loader():
        return SavableDataLoader(RandomCounter(40), batch_size=2, num_workers=2)

    pids = set()
    # close() mid-epoch, a batch of the workers' tensors still in hand.
    first = loader()
    held = [next(iter(first)), next(iter(first))]
    pids.update(s["pid"] for s in first.worker_stats())
    first.close()
    # A restore into a running loader, a batch still in hand.
    second = loader()
    iterator = iter(second)
    held += [next(iterator), next(iterator)]
    pids.update(s["pid"] for s in second.worker_stats())
    second.restore_state_rank(second.save_state_rank())
    held.append(next(iter(second)))
    pids.update(s["pid"] for s in second.worker_stats())
    total = sum(float(batch["torch"].sum()) for batch in held)
    second.close()
    del held, iterator
    gc.collect()
    left = [p for pid in pids for p in glob.glob(f"/dev/shm/torch_{pid}_*")]
    print("ok", total > 0, left)
finally:
    torch.multiprocessing.set_sharing_strategy(previous)
"""


def test_only_shared_memory_files_no_process_uses_are_removed(tmp_path: Path) -> None:
    """A file this process maps (a live tensor's, under ``file_system``) stays."""
    from savable_loader._channel import torch_compat as _torch_compat

    for name in ("torch_111_1_0", "torch_111_2_0", "torch_222_1_0"):
        (tmp_path / name).write_bytes(b"x" * 4096)
    with open(tmp_path / "torch_111_1_0", "r+b") as file, mmap.mmap(file.fileno(), 0):
        removed = _torch_compat.remove_leaked_shared_memory([111], folder=str(tmp_path))
        assert [Path(p).name for p in removed] == ["torch_111_2_0"]
    removed = _torch_compat.remove_leaked_shared_memory([111], folder=str(tmp_path))
    assert [Path(p).name for p in removed] == ["torch_111_1_0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["torch_222_1_0"]


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_stopping_workers_leaves_live_tensors_their_shared_memory(strategy: str) -> None:
    """Runs in a subprocess: an unlinked file a live tensor owns aborts the process."""
    TALLY["faults"] += 1
    env = dict(os.environ, PYTHONPATH=pythonpath())
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SHARING_SCRIPT), strategy],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    if result.returncode != 0:
        TALLY["crashes"] += 1
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-3000:]}"
    assert result.stdout.split("\n")[-2] == "ok True []", result.stdout


# -- the tally -------------------------------------------------------------------------------


def test_tally_no_hang_no_crash_no_leaked_process() -> None:
    logger.info(
        "faults tried %d, hangs %d, crashes %d, leaked processes %d",
        TALLY["faults"],
        TALLY["hangs"],
        TALLY["crashes"],
        TALLY["leaked_processes"],
    )
    assert TALLY["hangs"] == TALLY["crashes"] == TALLY["leaked_processes"] == 0
