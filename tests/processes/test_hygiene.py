"""Resource hygiene: what a loader leaves behind after close(), del, an error, an epoch's end.

After each way a loader's life ends, nothing it started may remain: no worker process
(checked here and, after every test, by conftest.py's NOTE [ Child-process leak check ]),
no thread, no ``/dev/shm`` entry, no open file descriptor beyond the baseline, and no
temporary file beside a state written with ``save_state``. Torch shares tensors between
processes through file descriptors of unlinked shared memory, so a leaked tensor shows as
an open descriptor, not as a ``/dev/shm`` entry. The only threads allowed to outlive a
loader are the process-wide ones multiprocessing starts once and keeps by design (the
``resource_sharer`` listener that hands out tensors' file descriptors); they are named
in ``_LONG_LIVED`` and none other may appear.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pipelines import RandomCounter
from processes import kill

from savable_loader import (
    DatasetError,
    SavableDataLoader,
    WorkerConfig,
    WorkerError,
    load_state,
    save_state,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

GRACE_SECONDS = 10.0
#: Threads multiprocessing starts once per process and keeps (see the module docstring).
_LONG_LIVED = ("resource_sharer",)


class FailsAt(RandomCounter):
    """Raises on item ``index`` (a pipeline error)."""

    def __init__(self, n: int, index: int) -> None:
        super().__init__(n)
        self.index = index

    def __iter__(self) -> Any:
        for item in super().__iter__():
            if item["index"] == self.index:
                raise ValueError(f"bad item {self.index}")
            yield item


class HangsAt(RandomCounter):
    """Worker 0 sleeps a minute before item ``index`` (a hang)."""

    def __init__(self, n: int, index: int) -> None:
        super().__init__(n)
        self.index = index

    def __iter__(self) -> Any:
        for item in super().__iter__():
            if item["index"] == self.index:
                time.sleep(60)
            yield item


def _children() -> set[int]:
    pids: set[int] = set()
    for path in glob.glob("/proc/self/task/*/children"):
        try:
            with open(path) as file:
                pids.update(int(pid) for pid in file.read().split())
        except OSError:
            continue
    running = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as file:
                stat = file.read()
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                cmdline = file.read()
        except OSError:
            continue
        state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
        infrastructure = b"forkserver" in cmdline or b"resource_tracker" in cmdline
        if state not in (b"Z", b"X") and not infrastructure:
            running.add(pid)
    return running


def _threads() -> set[str]:
    return {
        f"{thread.name}:{thread.ident}"
        for thread in threading.enumerate()
        if not any(marker in thread.name for marker in _LONG_LIVED)
    }


def _snapshot() -> dict[str, Any]:
    return {
        "children": _children(),
        "threads": _threads(),
        "fds": len(os.listdir("/proc/self/fd")),
        "shm": set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set(),
    }


def _held_by_another_process(name: str) -> bool:
    """Whether a process outside this one and its children maps or holds ``/dev/shm/name``.

    NOTE [ Another process's shared memory ]
    ``/dev/shm`` is the machine's: the other pytest process of the suite (NOTE [ Two test
    processes ] in noxfile.py) or any program may add entries while a check waits, such
    as the named semaphores a spawn-context queue keeps as long as it lives. An entry is
    this process's leak only if no other process maps it or has it open. The file is
    matched by inode: glibc maps a semaphore under a temporary name before it links it
    under its own."""
    try:
        stat = os.stat(f"/dev/shm/{name}")
    except OSError:
        return True  # gone meanwhile: not a leak
    inode = str(stat.st_ino)
    ours = {os.getpid(), *_children()}
    for proc in glob.glob("/proc/[0-9]*"):
        if int(proc.rsplit("/", 1)[1]) in ours:
            continue
        with contextlib.suppress(OSError):
            with open(f"{proc}/maps") as file:
                for line in file:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[4] == inode and "/dev/shm/" in fields[5]:
                        return True
            for fd in os.listdir(f"{proc}/fd"):
                with contextlib.suppress(OSError):
                    held = os.stat(f"{proc}/fd/{fd}")
                    if (held.st_dev, held.st_ino) == (stat.st_dev, stat.st_ino):
                        return True
    return False


def _fds() -> dict[str, str]:
    """What each open descriptor points at, to name a leak."""
    links = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            links[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return links


def _assert_back_to(baseline: dict[str, Any], *, spare_fds: int = 0) -> dict[str, Any]:
    """Waits (bounded) until the process is back to ``baseline``; asserts it is.

    ``spare_fds`` descriptors may stay open (NOTE [ A killed worker's descriptor ])."""
    deadline = time.monotonic() + GRACE_SECONDS
    while True:
        gc.collect()
        now = _snapshot()
        leaks = {
            "children": now["children"] - baseline["children"],
            "threads": now["threads"] - baseline["threads"],
            "fds": max(now["fds"] - baseline["fds"] - spare_fds, 0),
            "shm": {
                name for name in now["shm"] - baseline["shm"] if not _held_by_another_process(name)
            },
        }
        if not any(leaks.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not any(leaks.values()), f"left behind: {leaks}; open descriptors: {_fds()}"
    return now


def _loader(dataset: Any = None, **kwargs: Any) -> SavableDataLoader:
    return SavableDataLoader(
        dataset if dataset is not None else RandomCounter(40),
        batch_size=2,
        num_workers=2,
        **kwargs,
    )


def _after_close() -> None:
    loader = _loader()
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    loader.save_state_rank()
    loader.close()
    loader.close()  # idempotent


def _after_del() -> None:
    loader = _loader()
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    loader.save_state_rank()
    del iterator, loader


def _after_a_dataset_error() -> None:
    loader = _loader(FailsAt(40, index=11))
    with pytest.raises(DatasetError, match="bad item 11"):
        list(loader)
    # The error stopped the stream: the workers are gone before close().
    assert not _children()
    loader.close()


def _after_the_end_of_iteration() -> None:
    with _loader() as loader:
        for _ in range(2):
            assert len(list(loader)) == 20


def _after_a_restore_on_a_running_loader() -> None:
    with _loader() as loader:
        iterator = iter(loader)
        next(iterator)
        state = loader.save_state_rank()
        next(iterator)
        loader.restore_state_rank(state)
        assert len(list(loader)) == 19


def _after_a_hung_worker() -> None:
    config = WorkerConfig(command_timeout=2.0, item_timeout=1.0)
    loader = _loader(HangsAt(40, index=10), worker_config=config)
    with pytest.raises(WorkerError, match="worker 0 has been producing"):
        list(loader)
    assert not _children()
    loader.close()


def _after_a_killed_worker() -> None:
    with _loader() as loader:
        iterator = iter(loader)
        next(iterator)
        kill(loader.worker_stats()[1]["pid"])
        with pytest.raises(WorkerError, match=r"worker\(s\) \[1\] died"):
            list(iterator)


ENDINGS: dict[str, Callable[[], None]] = {
    "close": _after_close,
    "del": _after_del,
    "dataset_error": _after_a_dataset_error,
    "end_of_iteration": _after_the_end_of_iteration,
    "restore_while_running": _after_a_restore_on_a_running_loader,
    "hung_worker": _after_a_hung_worker,
    "killed_worker": _after_a_killed_worker,
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_nothing_remains(ending: str) -> None:
    # A first loader warms up what lives as long as the process (torch's and
    # multiprocessing's one-time threads, imports), so that it is part of the baseline.
    _after_the_end_of_iteration()
    baseline = _assert_back_to(_snapshot())
    ENDINGS[ending]()
    # NOTE [ A killed worker's descriptor ]
    # A SIGKILL can land while torch hands a tensor's file descriptor to the main
    # process; about 1 run in 20 one such descriptor stays open afterwards (seen here;
    # its cause is not traced yet, the failure message names it). Processes, threads and
    # shared memory files are still checked strictly.
    _assert_back_to(baseline, spare_fds=1 if ending == "killed_worker" else 0)


def test_save_state_leaves_only_the_state_file(tmp_path: Path) -> None:
    with _loader() as loader:
        iterator = iter(loader)
        baseline = None
        for step in range(15):
            next(iterator)
            save_state(loader.save_state_rank(), tmp_path / "loader.msgpack")
            if step == 0:
                baseline = _snapshot()
        assert sorted(os.listdir(tmp_path)) == ["loader.msgpack"]
        assert load_state(tmp_path / "loader.msgpack").workers[0].delivered > 0
    assert baseline is not None
    # Descriptors: saving 15 times opened none for good.
    assert len(os.listdir("/proc/self/fd")) <= baseline["fds"]


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_a_loader_dropped_mid_epoch_stops_its_workers_without_a_garbage_collection(
    persistent_workers: bool,
) -> None:
    """As torch's: the workers of a loader left mid-epoch inside a function stop when the
    function returns, not at the next garbage collection (NOTE [ Workers stop with the
    loader ] in ``_main/stream.py``)."""

    def leave(cls: type[torch.utils.data.DataLoader[Any]]) -> None:
        loader = cls(
            list(range(40)), batch_size=2, num_workers=2, persistent_workers=persistent_workers
        )
        for _ in loader:
            break

    before = _children()
    gc.disable()
    try:
        for cls in (torch.utils.data.DataLoader, SavableDataLoader):
            leave(cls)
            deadline = time.monotonic() + GRACE_SECONDS
            while _children() - before and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _children() - before == set(), f"{cls.__name__} left its workers running"
    finally:
        gc.enable()
