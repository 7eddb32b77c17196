"""Hugging Face Accelerate resumes an ``AccelerateSavableDataLoader`` exactly from
``accelerator.save_state``.

Each test runs this file as a training job (``python tests/test_accelerate.py ...``, in a
session of its own; with two ranks it starts one process per rank with torchrun's
environment variables, over gloo): the loader goes through ``accelerator.prepare()`` with
the model and optimizer and is registered for checkpointing; ``save_state`` every 4 steps.
An uninterrupted run, then a run that SIGKILLs its own process group (every rank and
worker) at a chosen step, then a run that ``load_state``s the last checkpoint. Every rank
writes each training step (epoch, step, item ids, augmented values, loss) to a file, and
every worker each item it produced; the killed run's steps before the checkpoint's
followed by the resumed run's must be the uninterrupted run's, and the resumed run must
not have produced the batches before its checkpoint again.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate", reason="the accelerate extra is not installed")

ITEMS = 24
BATCH = 2
EPOCHS = 3
EVERY = 4  # save_state every 4 steps
TIMEOUT = 150  # a hang is still caught; a loaded 2-core CI machine is slow


def _job(out: str, kill: str) -> None:
    """One training run on this process's rank; ``kill`` is ``none``, ``step:<n>``
    (SIGKILL before training step n) or ``after:<n>`` (right after step n's checkpoint)."""
    import torch
    from accelerate import Accelerator
    from torch.utils.data import Dataset

    from savable_loader import WorkerConfig
    from savable_loader.integrations.accelerate import AccelerateSavableDataLoader

    class Items(Dataset[tuple[int, torch.Tensor]]):
        def __len__(self) -> int:
            return ITEMS

        def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
            with open(f"{out}/produced.txt", "a") as file:
                file.write(f"{index}\n")
            # A random augmentation drawn in the worker: resumed only if its RNG is.
            return index, torch.tensor([float(index)]) + torch.rand(1)

    class Progress:
        """The loop's own counters, saved beside the loader."""

        def __init__(self) -> None:
            self.epoch = 0
            self.step = 0

        def state_dict(self) -> dict[str, int]:
            return {"epoch": self.epoch, "step": self.step}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.epoch, self.step = state["epoch"], state["step"]

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    loader = AccelerateSavableDataLoader(
        Items(),
        batch_size=BATCH,
        shuffle=True,
        num_workers=2,
        seed=3,
        # A checkpoint after every item (these are cheap), so that a restore replays
        # next to nothing and the count of produced items below is tight.
        worker_config=WorkerConfig(checkpoint_share=1.0),
    )
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    if prepared is not loader:
        raise RuntimeError(f"prepare() re-created the loader: {type(prepared).__name__}")
    progress = Progress()
    accelerator.register_for_checkpointing(loader, progress)
    latest = Path(f"{out}/ckpt/latest")
    if latest.exists():
        accelerator.load_state(latest.read_text())
    kind, _, at = kill.partition(":")
    kill_step = int(at) if at else -1
    for epoch in range(progress.epoch, EPOCHS):
        for ids, x in loader:
            if kind == "step" and progress.step == kill_step and rank == 0:
                os.killpg(0, signal.SIGKILL)
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            record = {
                "epoch": epoch,
                "step": progress.step,
                "ids": ids.tolist(),
                "x": x.flatten().tolist(),
                "loss": loss.item(),
            }
            with open(f"{out}/rank{rank}.jsonl", "a") as file:
                file.write(json.dumps(record) + "\n")
            progress.step += 1
            if progress.step % EVERY == 0:
                folder = f"{out}/ckpt/step_{progress.step}"
                accelerator.save_state(folder)
                accelerator.wait_for_everyone()
                if accelerator.is_main_process:
                    Path(f"{latest}.tmp").write_text(folder)
                    os.replace(f"{latest}.tmp", latest)
                accelerator.wait_for_everyone()
                if kind == "after" and progress.step - 1 == kill_step and rank == 0:
                    os.killpg(0, signal.SIGKILL)
        progress.epoch += 1
    accelerator.end_training()


def _launch(out: str, ranks: int, kill: str) -> int:
    """Starts one job process per rank with torchrun's environment; returns the first
    failing exit code, or 0."""
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
        command = [sys.executable, __file__, "job", out, kill]
        children.append(subprocess.Popen(command, env=env))
    codes = [child.wait() for child in children]
    return next((code for code in codes if code != 0), 0)


def _run(out: Path, ranks: int, kill: str = "none") -> int:
    command = [sys.executable, __file__, "launch", str(out), str(ranks), kill]
    process = subprocess.Popen(
        command,
        start_new_session=True,  # the kill takes the job's group, not pytest
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    try:
        _, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    if kill == "none" or process.returncode != -signal.SIGKILL:
        assert process.returncode == 0, err[-3000:]
    return process.returncode


def _records(out: Path, rank: int) -> list[dict[str, Any]]:
    lines = (out / f"rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _produced(out: Path) -> int:
    return len((out / "produced.txt").read_text().splitlines())


_REFERENCES: dict[int, list[list[dict[str, Any]]]] = {}


def _reference(tmp: Path, ranks: int) -> list[list[dict[str, Any]]]:
    if ranks not in _REFERENCES:
        out = tmp / "reference"
        out.mkdir()
        _run(out, ranks)
        _REFERENCES[ranks] = [_records(out, rank) for rank in range(ranks)]
    return _REFERENCES[ranks]


def _check_resume(tmp: Path, ranks: int, kill: str) -> None:
    reference = _reference(tmp, ranks)
    out = tmp / "run"
    out.mkdir()
    assert _run(out, ranks, kill) == -signal.SIGKILL
    killed = [_records(out, rank) for rank in range(ranks)]
    for rank in range(ranks):
        (out / f"rank{rank}.jsonl").rename(out / f"killed{rank}.jsonl")
    (out / "produced.txt").unlink()
    _run(out, ranks)
    per_epoch = ITEMS // BATCH // ranks
    for rank in range(ranks):
        resumed = _records(out, rank)
        start = resumed[0]["step"]
        assert 0 < start < len(reference[rank]), start
        assert start % EVERY == 0, start
        assert start % per_epoch != 0, start  # mid-epoch: a fresh epoch would differ
        before = [record for record in killed[rank] if record["step"] < start]
        assert len(before) == start  # the killed run reached the checkpoint
        # Batch for batch (ids, augmented values, losses): nothing replayed or skipped.
        assert before + resumed == reference[rank], rank
    # The resumed run produced the items it trained on, not the epoch's skipped ones:
    # a skip-based resume would have produced its checkpoint's share of the epoch again.
    trained = sum(len(r["ids"]) for rank in range(ranks) for r in _records(out, rank))
    skipped = (start % per_epoch) * BATCH * ranks
    assert trained <= _produced(out) < trained + skipped, (_produced(out), trained, skipped)
    for epoch in range(EPOCHS):
        seen = sorted(
            i
            for rank in range(ranks)
            for r in reference[rank]
            for i in r["ids"]
            if r["epoch"] == epoch
        )
        assert seen == list(range(ITEMS)), (epoch, seen)  # each epoch reads every item once
    orders = [[r["ids"] for r in reference[0] if r["epoch"] == epoch] for epoch in range(EPOCHS)]
    assert orders[0] != orders[1] != orders[2]  # a new order every epoch


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_single_process_resumes_exactly_mid_epoch(tmp_path_factory: pytest.TempPathFactory) -> None:
    _check_resume(tmp_path_factory.mktemp("accelerate"), 1, "step:18")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_resume_exactly_after_a_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    _check_resume(tmp_path_factory.mktemp("accelerate"), 2, "after:7")


if __name__ == "__main__":
    if sys.argv[1] == "launch":
        ranks = int(sys.argv[3])
        if ranks == 1:
            _job(sys.argv[2], sys.argv[4])
        else:
            sys.exit(_launch(sys.argv[2], ranks, sys.argv[4]))
    else:
        _job(sys.argv[2], sys.argv[3])
