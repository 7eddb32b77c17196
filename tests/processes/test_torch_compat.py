"""Pins the torch behaviour savable_loader relies on (NOTE [ Private torch names ])."""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import time

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from savable_loader._channel import torch_compat as _torch_compat

pytestmark = pytest.mark.slow


class _Shard(IterableDataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        return iter([(worker, i) for i in range(self.lengths[worker])])


def test_round_robin_skips_ended_workers_and_every_epoch_starts_at_worker_zero():
    loader = DataLoader(_Shard([1, 3, 2]), batch_size=None, num_workers=3, persistent_workers=True)
    try:
        for _ in range(2):  # the second epoch goes through _reset
            assert list(loader) == [[0, 0], [1, 0], [2, 0], [1, 1], [2, 1], [1, 2]]
    finally:
        _torch_compat.drop_persistent_iterator(loader, loader._iterator)


def test_persistent_iterator_can_be_dropped_and_its_workers_are_seen():
    loader = DataLoader(_Shard([5, 5]), batch_size=None, num_workers=2, persistent_workers=True)
    iterator = iter(loader)
    next(iterator)
    assert _torch_compat.worker_count(iterator) == 2
    assert all(_torch_compat.worker_alive(iterator, w) for w in range(2))
    _torch_compat.drop_persistent_iterator(loader, iterator)
    assert loader._iterator is None
    assert not any(_torch_compat.worker_alive(iterator, w) for w in range(2))
    fresh = iter(loader)
    assert fresh is not iterator
    assert sorted(fresh) == [[w, i] for w in range(2) for i in range(5)]
    _torch_compat.drop_persistent_iterator(loader, fresh)


def test_base_seed_draws_from_the_loader_generator_not_the_global_one():
    torch.manual_seed(3)
    expected = torch.rand(1)
    torch.manual_seed(3)
    loader = DataLoader(_Shard([2]), batch_size=None, num_workers=0, generator=torch.Generator())
    list(loader)
    assert torch.equal(torch.rand(1), expected)


class _Slow(IterableDataset):
    """Worker 0's item 1 takes 1.5 s; the others come at once."""

    def __iter__(self):
        info = get_worker_info()
        for i in range(4):
            if info.id == 0 and i == 1:
                time.sleep(1.5)
            yield (info.id, i)


def test_an_expired_timeout_raises_and_asking_again_loses_nothing():
    """NOTE [ Watchdog ]: the loader polls torch's iterator with a short timeout."""
    loader = DataLoader(_Slow(), batch_size=None, num_workers=2, timeout=0.2)
    iterator = iter(loader)
    got, timeouts = [], 0
    try:
        while True:
            try:
                got.append(next(iterator))
            except StopIteration:
                break
            except RuntimeError as error:
                if not _torch_compat.is_timeout(error):
                    raise
                timeouts += 1
    finally:
        _torch_compat.drop_persistent_iterator(loader, iterator)
    assert timeouts >= 3
    assert got == [[w, i] for i in range(4) for w in range(2)]


def test_delivery_is_in_order_on_every_supported_torch():
    """NOTE [ Delivery order before in_order ]: a slow worker holds back the others, both
    where ``in_order=True`` is passed (torch 2.6 on) and where torch has no such argument."""
    takes = "in_order" in inspect.signature(DataLoader.__init__).parameters
    assert _torch_compat.in_order_argument() == ({"in_order": True} if takes else {})
    loader = DataLoader(
        _Slow(), batch_size=None, num_workers=2, **_torch_compat.in_order_argument()
    )
    assert list(loader) == [[w, i] for i in range(4) for w in range(2)]


def test_a_worker_can_be_killed():
    loader = DataLoader(_Shard([50, 50]), batch_size=None, num_workers=2, persistent_workers=True)
    iterator = iter(loader)
    next(iterator)
    _torch_compat.kill_worker(iterator, 1)
    deadline = time.monotonic() + 10
    while _torch_compat.worker_alive(iterator, 1) and time.monotonic() < deadline:
        with contextlib.suppress(RuntimeError):  # torch's SIGCHLD handler reports the death
            time.sleep(0.02)
    assert not _torch_compat.worker_alive(iterator, 1)
    assert _torch_compat.worker_alive(iterator, 0)
    with contextlib.suppress(RuntimeError):
        _torch_compat.drop_persistent_iterator(loader, iterator)


def test_worker_death_is_reported_after_the_iterator_is_built():
    seen = []
    previous = signal.signal(signal.SIGCHLD, lambda signum, frame: seen.append(signum))
    try:
        with _torch_compat.deferred_worker_death():
            os.kill(os.getpid(), signal.SIGCHLD)
            time.sleep(0.05)
            assert seen == []
        assert seen == [signal.SIGCHLD]
        os.kill(os.getpid(), signal.SIGCHLD)
        time.sleep(0.05)
        assert seen == [signal.SIGCHLD] * 2
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_a_done_event_lock_left_held_by_a_dead_worker_does_not_block_the_main_process():
    """NOTE [ The workers-done event ]: the main process reads and sets the event without
    its condition lock, which a worker killed at the wrong moment leaves held."""
    loader = DataLoader(_Shard([40, 40]), batch_size=None, num_workers=2, persistent_workers=True)
    iterator = iter(loader)
    next(iterator)
    real = iterator._workers_done_event
    _torch_compat.unblock_done_event(iterator)
    lock = real._cond._lock
    assert lock.acquire(timeout=5)  # as a worker that died holding it
    try:
        assert not lock.acquire(timeout=0.2), "the real event would block here"
        began = time.monotonic()
        assert iterator._workers_done_event.is_set() is False
        iterator._workers_done_event.set()
        assert iterator._workers_done_event.is_set() is True
        assert time.monotonic() - began < 3 * _torch_compat._LOCK_WAIT + 1.0
    finally:
        lock.release()
    assert real.is_set()  # the workers see what the main process set
    iterator._shutdown_workers()


def test_shared_memory_files_of_stopped_workers_are_removed(tmp_path):
    """NOTE [ Shared memory of a killed worker ]: only the given pids' torch files go."""
    for name in ("torch_111_1_0", "torch_111_2_5", "torch_222_1_0", "other_111"):
        (tmp_path / name).write_bytes(b"x")
    removed = _torch_compat.remove_leaked_shared_memory([111], folder=str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == ["torch_111_1_0", "torch_111_2_5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other_111", "torch_222_1_0"]


class _Marker:
    pass


def _show_marker(worker_id):
    info = get_worker_info()
    assert type(info.dataset).__name__ == "_WhoIsTheDataset"
    _torch_compat.set_worker_dataset(info, _Marker())
    assert isinstance(get_worker_info().dataset, _Marker)


class _WhoIsTheDataset(IterableDataset):
    def __iter__(self):
        return iter([type(get_worker_info().dataset).__name__])


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_worker_info_is_built_before_worker_init_fn_and_its_dataset_can_be_replaced(context):
    """NOTE [ The worker's dataset ]: the info ``worker_init_fn`` sees is the one the
    dataset's ``__iter__`` sees, and ``set_worker_dataset`` replaces its ``dataset``."""
    loader = DataLoader(
        _WhoIsTheDataset(),
        batch_size=None,
        num_workers=1,
        worker_init_fn=_show_marker,
        multiprocessing_context=context,
    )
    assert list(loader) == ["_Marker"]


class _ModulesSinceStart(IterableDataset):
    """Yields the names of the modules the worker imported to pickle its first tensor as
    torch's queue does (``ForkingPickler``, with torch's reductions)."""

    def __iter__(self):
        import sys
        from multiprocessing.reduction import ForkingPickler

        before = set(sys.modules)
        ForkingPickler.dumps(torch.zeros(2))
        yield sorted(set(sys.modules) - before)


def test_a_workers_first_tensor_imports_nothing_of_torch():
    """NOTE [ A worker's first tensor ] in ``_channel/torch_compat.py``: torch 2.4's
    tensor pickling imported SymPy in every forked worker (about 1 s an epoch)."""
    from savable_loader import SavableDataLoader

    with SavableDataLoader(
        _ModulesSinceStart(), batch_size=None, num_workers=1, multiprocessing_context="fork"
    ) as loader:
        (imported,) = list(loader)
    assert [name for name in imported if name.split(".")[0] in ("torch", "sympy")] == []
