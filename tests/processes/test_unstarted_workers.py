"""Workers that hang before any of the loader's code runs in them (NOTE [ Workers that
never started ] in ``savable_loader/_main/iterator.py``): the loader keeps its position, starts
its workers again and the stream is the uninterrupted one; a worker that never starts
still ends in a ``WorkerError``.

The hang is made where the real one happens, in torch's worker process before
``worker_init_fn``: torch's ``_worker_loop`` is wrapped in the test process, so forked
workers run the wrapper, which sleeps in the chosen worker's first ``hangs`` starts.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset
from torch.utils.data._utils import worker as torch_worker

from savable_loader import SavableDataLoader, WorkerConfig, WorkerError

TIMEOUT = 2.0
EPOCHS = 2


class Noisy(Dataset[torch.Tensor]):
    """Items with a random augmentation, so a replay that draws differently shows."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        return index + torch.rand(())


def _loader(**kwargs: Any) -> SavableDataLoader:
    return SavableDataLoader(
        Noisy(),
        batch_size=2,
        shuffle=True,
        num_workers=2,
        worker_config=WorkerConfig(command_timeout=TIMEOUT),
        **kwargs,
    )


def _stream(loader: SavableDataLoader, epochs: int = EPOCHS) -> list[list[float]]:
    return [batch.tolist() for _ in range(epochs) for batch in loader]


@pytest.fixture
def hang_before_init(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``hang_before_init(worker_id, hangs)``: from now on, forked worker ``worker_id``
    sleeps in torch's start-up the first ``hangs`` times it starts."""
    real = torch_worker._worker_loop
    signature = inspect.signature(real)

    def arm(worker_id: int, hangs: int) -> None:
        def loop(*args: Any, **kwargs: Any) -> Any:
            if signature.bind(*args, **kwargs).arguments["worker_id"] == worker_id:
                for attempt in range(hangs):
                    try:  # the first worker process to claim this attempt hangs
                        os.close(os.open(tmp_path / f"hang-{attempt}", os.O_CREAT | os.O_EXCL))
                    except FileExistsError:
                        continue
                    time.sleep(120)
            return real(*args, **kwargs)

        monkeypatch.setattr(torch_worker, "_worker_loop", loop)

    return arm


def test_a_worker_that_never_started_is_started_again_and_the_stream_is_unchanged(
    hang_before_init: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with _loader() as loader:
        reference = _stream(loader)
    hang_before_init(1, hangs=1)
    with caplog.at_level(logging.WARNING), _loader() as loader:
        assert _stream(loader) == reference
    (record,) = [r for r in caplog.records if "starts its workers again" in r.getMessage()]
    assert f"worker 1 did not answer 'progress' within {TIMEOUT:g} s" in record.getMessage()


def test_a_restart_mid_epoch_continues_from_the_other_workers_position(
    hang_before_init: Any,
) -> None:
    """Worker 0 hands on items before the restarted stream stalls on worker 1, so the
    position joins worker 0's checkpoint with where worker 1 started."""
    with _loader() as loader:
        reference = _stream(loader)
    with _loader() as loader:
        stream = iter(loader)
        head = [next(stream).tolist() for _ in range(4)]  # worker 0 is next
        state = loader.save_state_rank()
    hang_before_init(1, hangs=1)
    with _loader() as loader:
        loader.restore_state_rank(state)
        assert head + _stream(loader) == reference


def test_a_worker_that_never_starts_is_a_worker_error_after_two_restarts(
    hang_before_init: Any,
) -> None:
    hang_before_init(0, hangs=3)
    began = time.monotonic()
    with _loader() as loader, pytest.raises(WorkerError) as info:
        next(iter(loader))
    elapsed = time.monotonic() - began
    message = str(info.value)
    assert "worker 0 did not answer 'progress'" in message
    assert "it hung in torch's worker start-up, before worker_init_fn" in message
    assert "the loader stays after the last item handed on" in message
    assert elapsed < 3 * (TIMEOUT + 2) + 10


def test_a_save_while_a_worker_never_started_succeeds_and_resumes_exactly(
    hang_before_init: Any,
) -> None:
    """The save waits ``command_timeout`` for the worker that never started, then knows
    every position anyway: it returns the state, and the workers start again next."""
    with _loader() as loader:
        reference = _stream(loader)
    hang_before_init(1, hangs=1)
    with _loader() as loader:
        stream = iter(loader)
        head = [next(stream).tolist()]  # worker 0's; worker 1 hangs in its start-up
        state = loader.save_state_rank()
        rest = [batch.tolist() for batch in stream] + _stream(loader, EPOCHS - 1)
    assert head + rest == reference
    with _loader() as resumed:
        resumed.restore_state_rank(state)
        assert _stream(resumed) == rest
