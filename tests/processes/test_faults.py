"""Faults: a worker killed (SIGKILL), hung in a sleep or frozen (SIGSTOP), in every phase.

Each cell injects one fault and asserts that a :class:`WorkerError` naming the worker is
raised within its bound (``command_timeout``, or ``item_timeout`` for an item that
hangs, plus a margin), that nothing hangs (pytest's timeout), and that a *new* loader
restored from the last good state yields exactly the uninterrupted stream's
continuation, the next epoch included. Every cell adds its faults, hangs and items lost
or duplicated to ``TALLY``; the last test asserts that no hang and no item lost or
duplicated was seen, and logs the counts (``pytest -s -o log_cli=true``).

The matrix (kind x phase), with the tests that cover each cell:

=================  ==============================  ==============================
phase              SIGKILL                         hang in a sleep
=================  ==============================  ==============================
while iterating    ``test_kill_while_iterating``   ``test_hang_while_iterating``
                   (also test_workers.py::test_    (WorkerConfig.item_timeout;
                   dead_worker_while_iterating_    NOTE [ Watchdog ] in
                   raises_worker_error_and_last_   _stream.py)
                   state_resumes, test_dataset_
                   errors.py::test_a_dead_worker_
                   leaves_the_loader_broken_until_
                   a_restore)
save_state_rank    ``test_kill_during_save_rank``  ``test_hang_during_save_rank``
                   (also test_workers.py::test_    (the save does not wait for the
                   dead_worker_during_save_raises  item in progress: it succeeds,
                   _worker_error_naming_it)        exact; the hang is reported by
                                                   the next item within
                                                   item_timeout)
save_state_global  ``test_kill_during_save_global  ``test_hang_during_save_global``
(2 gloo ranks)     `` (also test_distributed.py::  (as for save_state_rank, on
                   test_dead_worker_during_global  rank 1)
                   _save_raises_worker_error_on_
                   every_rank)
restore (workers   ``test_kill_during_restore``,   ``test_hang_during_restore``
start and replay)  ``test_kill_during_restore_at_  (bounded by command_timeout)
                   once`` (while torch still
                   starts the other workers)
=================  ==============================  ==============================

A third kind, a frozen worker (SIGSTOP: its command thread cannot answer either), is
covered during save_state_rank by test_workers.py::test_stopped_worker_raises_worker_
error_within_the_command_timeout and here with a resume (``test_frozen_during_save_rank``).
While iterating it is outside the fault model: the main process may be receiving one of
the frozen worker's tensors, which torch passes as a file descriptor fetched from the
worker with no timeout (docs/explanation/reliability.md). The main process killed in the middle of
``save_state`` to a local path is tests/storage/test_storage.py::test_writer_killed_mid_write_
leaves_the_previous_file.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gloo import in_rank_order, run_ranks
from pipelines import RandomCounter
from processes import freeze, kill, thaw
from torch.utils.data import get_worker_info

from savable_loader import ConfigError, SavableDataLoader, WorkerConfig, WorkerError
from savable_loader.testing import digest

pytestmark = pytest.mark.slow

logger = logging.getLogger(__name__)

N = 40
EPOCHS = 2
BATCH = 2
WORKERS = 2
COST = 0.002
COMMAND_TIMEOUT = 3.0
ITEM_TIMEOUT = 2.0
#: Beyond the bound: torch's shutdown of the other workers, process start-up, slow CI.
MARGIN = 6.0
JOB_TIMEOUT = 90.0

#: Across the module: faults injected, hangs seen, items lost and duplicated.
TALLY: collections.Counter[str] = collections.Counter()


# -- pipelines -------------------------------------------------------------------------------


class HangAt(RandomCounter):
    """Worker 0 sleeps ``seconds`` before yielding item ``index`` (a hang, in a sleep), in
    every epoch or, with ``epoch``, in that one only.

    Its ``config()`` is RandomCounter's, so its states restore into a RandomCounter.
    """

    def __init__(
        self, n: int, *, index: int, seconds: float = 60.0, epoch: int | None = None
    ) -> None:
        super().__init__(n, cost=COST)
        self.index = index
        self.seconds = seconds
        self.hang_epoch = epoch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        for item in super().__iter__():
            if (
                info is not None
                and info.id == 0
                and item["index"] == self.index
                and self.hang_epoch in (None, item["epoch"])
            ):
                time.sleep(self.seconds)
            yield item


class SlowRestore(RandomCounter):
    """Worker 0 writes its pid to ``pid_file`` and sleeps ``seconds`` when it restores a
    saved state (a worker starting after a restore)."""

    def __init__(self, n: int, *, pid_file: str, seconds: float) -> None:
        super().__init__(n, cost=COST)
        self.pid_file = pid_file
        self.seconds = seconds

    def restore_state(self, state: Any) -> None:
        super().restore_state(state)
        info = get_worker_info()
        if state is not None and info is not None and info.id == 0:
            # Written whole (a rename): the test kills the pid as soon as the file is there.
            Path(self.pid_file + ".tmp").write_text(str(os.getpid()))
            os.replace(self.pid_file + ".tmp", self.pid_file)
            time.sleep(self.seconds)


class DiesOnRestore(RandomCounter):
    """Worker 0 kills itself as soon as it restores a saved state: most often while the
    main process is still starting the other workers."""

    def restore_state(self, state: Any) -> None:
        super().restore_state(state)
        info = get_worker_info()
        if state is not None and info is not None and info.id == 0:
            os.kill(os.getpid(), signal.SIGKILL)


# -- helpers ---------------------------------------------------------------------------------


def _config() -> WorkerConfig:
    return WorkerConfig(command_timeout=COMMAND_TIMEOUT, item_timeout=ITEM_TIMEOUT)


def _loader(dataset: Any = None, **kwargs: Any) -> SavableDataLoader:
    return SavableDataLoader(
        dataset if dataset is not None else RandomCounter(N, cost=COST),
        batch_size=BATCH,
        num_workers=WORKERS,
        worker_config=kwargs.pop("worker_config", _config()),
        **kwargs,
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
    """What a new, clean loader restored from ``state`` yields up to the end of EPOCHS."""
    with _loader() as loader:
        loader.restore_state_rank(state)
        epochs = EPOCHS - state.epoch - (1 if state.between_epochs else 0)
        return list(_stream(loader, epochs))


def _account(head: list[str], tail: list[str], reference: list[str]) -> None:
    """Adds the items lost and duplicated by ``head + tail`` to TALLY, then asserts."""
    got = collections.Counter(head + tail)
    want = collections.Counter(reference)
    TALLY["items_checked"] += len(reference)
    TALLY["lost"] += sum((want - got).values())
    TALLY["duplicated"] += sum((got - want).values())
    assert head + tail == reference


def _raises_within(
    call: Callable[[], Any], bound: float, *, match: str
) -> tuple[WorkerError, float]:
    """Runs ``call``, which must raise WorkerError matching ``match`` within ``bound``
    plus MARGIN seconds; counts the fault, and a hang if the bound is missed."""
    TALLY["faults"] += 1
    began = time.monotonic()
    with pytest.raises(WorkerError, match=match) as info:
        call()
    elapsed = time.monotonic() - began
    if elapsed >= bound + MARGIN:
        TALLY["hangs"] += 1
    assert elapsed < bound + MARGIN, f"took {elapsed:.1f} s, bound {bound:g} s + {MARGIN:g} s"
    return info.value, elapsed


def _drain(iterator: Iterator[str], into: list[str]) -> None:
    for item in iterator:
        into.append(item)


def _pids(loader: SavableDataLoader) -> list[int]:
    return [stats["pid"] for stats in loader.worker_stats()]


# -- while iterating -------------------------------------------------------------------------


def test_kill_while_iterating() -> None:
    reference = _reference()
    with _loader() as loader:
        stream = _stream(loader, EPOCHS)
        head = [next(stream) for _ in range(5)]
        state = loader.save_state_rank()
        kill(_pids(loader)[1])
        rest: list[str] = []
        _raises_within(
            lambda: _drain(stream, rest), COMMAND_TIMEOUT, match=r"worker\(s\) \[1\] died"
        )
    _account(head, _resume(state), reference)


def test_hang_while_iterating() -> None:
    reference = _reference()
    with _loader(HangAt(N, index=12)) as loader:
        stream = _stream(loader, EPOCHS)
        head = [next(stream) for _ in range(3)]
        state = loader.save_state_rank()
        rest: list[str] = []
        error, _ = _raises_within(
            lambda: _drain(stream, rest),
            ITEM_TIMEOUT,
            match=r"worker 0 has been producing item 3 for .* beyond "
            r"WorkerConfig\(item_timeout=2\)",
        )
        # Everything before the stuck item arrived, in order.
        assert head + rest == reference[: len(head) + len(rest)]
        assert "stays after the last item handed on" in str(error)
    _account(head, _resume(state), reference)


def test_slow_items_do_not_fail_without_an_item_timeout() -> None:
    """item_timeout=None waits for a slow item as torch does (one, in the first epoch)."""
    reference = _reference()
    config = WorkerConfig(command_timeout=COMMAND_TIMEOUT, item_timeout=None)
    slow = HangAt(N, index=2, seconds=2 * COMMAND_TIMEOUT, epoch=0)
    with _loader(slow, worker_config=config) as loader:
        got = list(_stream(loader, EPOCHS))
    _account(got, [], reference)


def test_the_loaders_own_timeout_keeps_torchs_meaning() -> None:
    with _loader(HangAt(N, index=2, seconds=30.0), timeout=1.0) as loader:
        began = time.monotonic()
        with pytest.raises(RuntimeError, match=r"DataLoader timed out after 1.0 seconds"):
            list(loader)
        assert time.monotonic() - began < 1.0 + MARGIN
        assert loader.timeout == 1.0


@pytest.mark.parametrize("value", [0, -1.0])
def test_item_timeout_must_be_positive(value: float) -> None:
    with pytest.raises(ConfigError, match="item_timeout must be positive or None"):
        WorkerConfig(item_timeout=value)


# -- during save_state_rank ------------------------------------------------------------------


def test_kill_during_save_rank() -> None:
    reference = _reference()
    with _loader() as loader:
        stream = _stream(loader, EPOCHS)
        head = [next(stream) for _ in range(7)]
        state = loader.save_state_rank()
        kill(_pids(loader)[1])
        # NOTE [ Worker deaths are found where they are asked about ] in _stream.py.
        _raises_within(
            loader.save_state_rank,
            COMMAND_TIMEOUT,
            match=r"worker\(s\) \[1\] died during a save",
        )
    _account(head, _resume(state), reference)


def test_hang_during_save_rank() -> None:
    reference = _reference()
    with _loader(HangAt(N, index=12)) as loader:
        stream = _stream(loader, EPOCHS)
        head = [next(stream) for _ in range(3)]
        time.sleep(
            1.0
        )  # worker 0 is inside its batch 3 (items 12 and 14), the save comes meanwhile
        began = time.monotonic()
        state = loader.save_state_rank()  # the save does not wait for the item
        assert time.monotonic() - began < COMMAND_TIMEOUT
        rest: list[str] = []
        _raises_within(
            lambda: _drain(stream, rest), ITEM_TIMEOUT, match=r"worker 0 has been producing"
        )
    _account(head, _resume(state), reference)


def test_frozen_during_save_rank() -> None:
    reference = _reference()
    with _loader() as loader:
        stream = _stream(loader, EPOCHS)
        head = [next(stream) for _ in range(4)]
        state = loader.save_state_rank()
        pid = _pids(loader)[0]
        freeze(pid)
        try:
            _raises_within(
                loader.save_state_rank,
                COMMAND_TIMEOUT,
                match=r"worker 0 did not answer 'checkpoint' within 3 s",
            )
        finally:
            thaw(pid)
    _account(head, _resume(state), reference)


# -- during a restore (the restored workers start and replay) --------------------------------


def _saved_mid_epoch(count: int) -> tuple[list[str], Any]:
    with _loader() as loader:
        stream = _stream(loader, EPOCHS)
        head = [next(stream) for _ in range(count)]
        return head, loader.save_state_rank()


def test_kill_during_restore(tmp_path: Path) -> None:
    reference = _reference()
    head, state = _saved_mid_epoch(9)
    pid_file = tmp_path / "worker0.pid"
    loader = _loader(SlowRestore(N, pid_file=str(pid_file), seconds=30.0))

    def kill_when_it_restores() -> None:
        deadline = time.monotonic() + 20
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_when_it_restores, daemon=True)
    with loader:
        loader.restore_state_rank(state)
        killer.start()
        _raises_within(lambda: next(iter(loader)), COMMAND_TIMEOUT, match=r"worker\(s\) \[0\] died")
        killer.join(timeout=20)
    _account(head, _resume(state), reference)


@pytest.mark.parametrize("attempt", range(3))
def test_kill_during_restore_at_once(attempt: int) -> None:
    reference = _reference()
    head, state = _saved_mid_epoch(9)
    with _loader(DiesOnRestore(N, cost=COST)) as loader:
        loader.restore_state_rank(state)
        _raises_within(lambda: next(iter(loader)), COMMAND_TIMEOUT, match=r"worker\(s\) \[0\] died")
    _account(head, _resume(state), reference)


def test_hang_during_restore(tmp_path: Path) -> None:
    reference = _reference()
    head, state = _saved_mid_epoch(9)
    loader = _loader(SlowRestore(N, pid_file=str(tmp_path / "pid"), seconds=60.0))
    with loader:
        loader.restore_state_rank(state)
        error, _ = _raises_within(
            lambda: next(iter(loader)),
            COMMAND_TIMEOUT,
            match=r"worker 0 has been starting \(restoring its checkpoint and replaying\) "
            r"for .* beyond WorkerConfig\(command_timeout=3\)",
        )
        # Nothing was handed on since the restore: the loader kept the restored position.
        assert "stays after the last item handed on" in str(error)
        kept = loader.save_state_rank()
    assert kept.to_plain() == state.to_plain()
    _account(head, _resume(state), reference)


# -- during save_state_global (2 gloo ranks) -------------------------------------------------


def _rank_job(rank: int, fault: str, tmp: Path) -> dict[str, Any]:
    """One rank of a global-save fault: returns its reference, head, outcome and tail."""
    from savable_loader import load_state, save_state

    config = _config()
    with _loader(worker_config=config) as clean:
        reference = list(_stream(clean, EPOCHS))
    dataset = HangAt(N, index=12) if fault == "hang" and rank == 1 else None
    loader = _loader(dataset, worker_config=config)
    outcome: tuple[str, str, float] = ("ok", "", 0.0)
    hang: tuple[str, str, float] = ("ok", "", 0.0)
    with loader:
        stream = _stream(loader, EPOCHS)
        head = [next(stream) for _ in range(3)]
        good = loader.save_state_global(global_dst_rank=0)
        if good is not None:
            save_state(good, tmp / f"{fault}.good.msgpack")
        if fault == "kill" and rank == 1:
            kill(_pids(loader)[0])
            time.sleep(0.2)
        if fault == "hang":
            time.sleep(1.0)  # rank 1's worker 0 is inside its batch 3 (items 12, 14)
        began = time.monotonic()
        try:
            saved = loader.save_state_global(global_dst_rank=0)
            if saved is not None:
                save_state(saved, tmp / f"{fault}.during.msgpack")
        except Exception as error:
            outcome = (type(error).__name__, str(error), time.monotonic() - began)
        else:
            outcome = ("ok", "", time.monotonic() - began)
        if fault == "hang" and rank == 1:
            began = time.monotonic()
            rest: list[str] = []
            try:
                _drain(stream, rest)
            except Exception as error:
                hang = (type(error).__name__, str(error), time.monotonic() - began)
    import torch.distributed as dist

    dist.barrier()
    # The last good state: saved before the fault, or during it when the save succeeded.
    name = f"{fault}.during.msgpack" if outcome[0] == "ok" else f"{fault}.good.msgpack"
    with _loader(worker_config=config) as resumed:
        states = load_state(tmp / name) if rank == 0 else None
        resumed.restore_state_global(states, src_rank=0)
        state = resumed.save_state_rank()
        epochs = EPOCHS - state.epoch - (1 if state.between_epochs else 0)
        tail = list(_stream(resumed, epochs))
    return {
        "reference": reference,
        "head": head,
        "save": outcome,
        "hang": hang,
        "tail": tail,
        "from": name,
    }


def _fault_job(fault: str, rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    return _rank_job(rank, fault, tmp)


def _launch(fault: str, tmp: Path, world_size: int = 2) -> list[dict[str, Any]]:
    job = functools.partial(_fault_job, fault)
    reports = run_ranks(job, world_size, tmp, timeout=JOB_TIMEOUT)
    if sorted(set(range(world_size)) - set(reports)):
        TALLY["hangs"] += 1
    return in_rank_order(reports, world_size, fault)


def test_kill_during_save_global(tmp_path: Path) -> None:
    TALLY["faults"] += 1
    for rank, report in enumerate(_launch("kill", tmp_path)):
        name, text, elapsed = report["save"]
        assert name == "WorkerError", f"rank {rank}: {name}: {text}"
        assert "failed on rank(s) [1]" in text
        assert "worker(s) [0] died during a save" in text
        assert elapsed < COMMAND_TIMEOUT + MARGIN
        assert report["from"] == "kill.good.msgpack"
        _account(report["head"], report["tail"], report["reference"])


def test_hang_during_save_global(tmp_path: Path) -> None:
    TALLY["faults"] += 1
    for rank, report in enumerate(_launch("hang", tmp_path)):
        name, text, elapsed = report["save"]
        # The save does not wait for the item in progress on rank 1: it succeeds.
        assert name == "ok", f"rank {rank}: {name}: {text}"
        assert elapsed < COMMAND_TIMEOUT
        assert report["from"] == "hang.during.msgpack"
        _account(report["head"], report["tail"], report["reference"])
        name, text, elapsed = report["hang"]
        if rank == 1:
            assert name == "WorkerError", text
            assert "worker 0 has been producing item 3" in text
            assert elapsed < ITEM_TIMEOUT + MARGIN
        else:
            assert name == "ok", text


# -- the tally -------------------------------------------------------------------------------


def test_tally_no_hang_no_item_lost_or_duplicated() -> None:
    logger.info(
        "faults tried %d, hangs %d, items checked %d, lost %d, duplicated %d",
        TALLY["faults"],
        TALLY["hangs"],
        TALLY["items_checked"],
        TALLY["lost"],
        TALLY["duplicated"],
    )
    assert TALLY["hangs"] == 0
    assert TALLY["lost"] == 0
    assert TALLY["duplicated"] == 0


def test_the_default_item_timeout_bounds_a_hang() -> None:
    assert WorkerConfig().item_timeout == WorkerConfig().command_timeout == 60.0
