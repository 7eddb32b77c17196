"""Hugging Face's ``Trainer`` resumes a ``SavableTrainer``'s loader exactly from its own
checkpoint.

Each test runs this file as a training job (``python tests/test_hf_trainer.py ...``, in a
session of its own): a tiny ``torch.nn.Module`` that returns a loss dict, trained on the
CPU with ``save_steps=4``; an uninterrupted run, then a run that SIGKILLs its own process
group (the trainer and its workers) at a chosen step, then
``trainer.train(resume_from_checkpoint=True)``. The model writes each training step
(epoch, step, item ids, augmented values, loss) to a file and every worker each item it
produced; the killed run's steps before the checkpoint's followed by the resumed run's
must be the uninterrupted run's, and the resumed run must not have produced the batches
before its checkpoint again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the transformers extra is not installed")
pytest.importorskip("accelerate", reason="the transformers extra is not installed")

ITEMS = 24
BATCH = 2
EPOCHS = 3
EVERY = 4  # save_steps
PER_EPOCH = ITEMS // BATCH
TIMEOUT = 150  # a hang is still caught; a loaded 2-core CI machine is slow


def _job(out: str, kill: str) -> None:
    """One training run; ``kill`` is ``none``, ``step:<n>`` (SIGKILL as step n begins,
    mid-epoch) or ``after:<n>`` (as step n begins, right after the checkpoint of step n)."""
    import torch
    from torch.utils.data import Dataset
    from transformers import TrainerCallback, TrainingArguments

    from savable_loader.integrations.hf_trainer import SavableTrainer

    class Items(Dataset[dict[str, Any]]):
        def __len__(self) -> int:
            return ITEMS

        def __getitem__(self, index: int) -> dict[str, Any]:
            with open(f"{out}/produced.txt", "a") as file:
                file.write(f"{index}\n")
            # A random augmentation drawn in the worker: resumed only if its RNG is.
            return {"ids": index, "x": torch.tensor([float(index)]) + torch.rand(1)}

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(1, 1)
            self.step = -1
            self.epoch = -1

        def forward(self, ids: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
            loss = self.layer(x).pow(2).mean()
            record = {
                "epoch": self.epoch,
                "step": self.step,
                "ids": ids.tolist(),
                "x": x.flatten().tolist(),
                "loss": loss.item(),
            }
            with open(f"{out}/rank0.jsonl", "a") as file:
                file.write(json.dumps(record) + "\n")
            return {"loss": loss}

    kill_step = int(kill.partition(":")[2] or -1)
    model = Model()

    class Steps(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == kill_step:
                os.killpg(0, signal.SIGKILL)
            model.step = state.global_step
            model.epoch = state.global_step // PER_EPOCH

    args = TrainingArguments(
        output_dir=f"{out}/ckpt",
        per_device_train_batch_size=BATCH,
        num_train_epochs=EPOCHS,
        learning_rate=1e-3,
        save_steps=EVERY,
        save_strategy="steps",
        dataloader_num_workers=2,
        ignore_data_skip=True,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        logging_strategy="no",
        seed=3,
    )
    trainer = SavableTrainer(model=model, args=args, train_dataset=Items(), callbacks=[Steps()])
    resume = Path(f"{out}/ckpt").exists() and any(Path(f"{out}/ckpt").iterdir())
    trainer.train(resume_from_checkpoint=True if resume else None)


def _run(out: Path, kill: str = "none") -> int:
    process = subprocess.Popen(
        [sys.executable, __file__, str(out), kill],
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


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "rank0.jsonl").read_text().splitlines()]


def _produced(out: Path) -> int:
    return len((out / "produced.txt").read_text().splitlines())


_REFERENCE: list[list[dict[str, Any]]] = []


def _reference(tmp: Path) -> list[dict[str, Any]]:
    if not _REFERENCE:
        out = tmp / "reference"
        out.mkdir()
        _run(out)
        _REFERENCE.append(_records(out))
    return _REFERENCE[0]


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "kill", ["step:18", "after:20"], ids=["mid-epoch", "right-after-checkpoint"]
)
def test_trainer_resumes_exactly(tmp_path_factory: pytest.TempPathFactory, kill: str) -> None:
    tmp = tmp_path_factory.mktemp("hf_trainer")
    reference = _reference(tmp)
    assert [r["step"] for r in reference] == list(range(EPOCHS * PER_EPOCH))
    out = tmp / "run"
    out.mkdir()
    assert _run(out, kill) == -signal.SIGKILL
    killed = _records(out)
    (out / "rank0.jsonl").rename(out / "killed.jsonl")
    (out / "produced.txt").unlink()
    _run(out)
    resumed = _records(out)
    start = resumed[0]["step"]
    assert start == int(kill.partition(":")[2]) // EVERY * EVERY, start
    assert start % PER_EPOCH != 0, start  # mid-epoch: a fresh epoch would differ
    before = [record for record in killed if record["step"] < start]
    assert len(before) == start  # the killed run reached the checkpoint
    # Batch for batch (ids, augmented values, losses): nothing replayed or skipped.
    assert before + resumed == reference
    # The resumed run produced the items it trained on, not the epoch's skipped ones.
    trained = sum(len(r["ids"]) for r in resumed)
    skipped = (start % PER_EPOCH) * BATCH
    assert trained <= _produced(out) < trained + skipped, (_produced(out), trained, skipped)
    for epoch in range(EPOCHS):
        seen = sorted(i for r in reference if r["epoch"] == epoch for i in r["ids"])
        assert seen == list(range(ITEMS)), (epoch, seen)  # each epoch reads every item once
    orders = [[r["ids"] for r in reference if r["epoch"] == epoch] for epoch in range(EPOCHS)]
    assert orders[0] != orders[1] != orders[2]  # a new order every epoch


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2])
