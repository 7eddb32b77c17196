"""PyTorch Lightning resumes a ``LightningSavableDataLoader`` exactly from its own checkpoint.

Each test runs this file as a training job, as ``python
tests/distributed/test_lightning.py ...`` would, in a session of its own, forked from a
process that imported Lightning once (NOTE [ Jobs from a zygote ] in zygote.py);
Lightning's DDP launcher starts rank 1 by running the same command:
an uninterrupted run, then a run that SIGKILLs its own process group, every rank and
worker, at a chosen step, then ``trainer.fit(ckpt_path="last")``. Every rank writes each
training step (epoch, global step, item ids, loss) to a file; the killed run's steps
before the checkpoint's followed by the resumed run's must be the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from trainer_jobs import Job, Records, records, run_job
from zygote import Zygote

pytestmark = pytest.mark.skipif(
    find_spec("lightning") is None, reason="the lightning extra is not installed"
)

STEPS_PER_EPOCH = 6  # per rank: 24 items, batch_size 2, over 2 ranks; 12 on one rank
EPOCHS = 3
TIMEOUT = 150  # a hang is still caught; a loaded 2-core CI machine is slow


def _job(out: str, ranks: int, distributed_sampler: str, ckpt: str, kill: str) -> None:
    """One training run; ``kill`` is ``none``, ``step:<n>`` (SIGKILL in training_step of
    global step n, mid-epoch) or ``after:<n>`` (right after the checkpoint of step n)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import Dataset, DistributedSampler

    from savable_loader.integrations.lightning import (
        LightningSavableDataLoader,
        SavableLoaderCallback,
    )

    class Items(Dataset[tuple[int, torch.Tensor]]):
        def __len__(self) -> int:
            return 24

        def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
            # A random augmentation drawn in the worker: resumed only if its RNG is.
            return index, torch.tensor([float(index)]) + torch.rand(1)

    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> Any:
            sampler = None
            if distributed_sampler == "own":
                sampler = DistributedSampler(Items(), shuffle=True, seed=7)
            return LightningSavableDataLoader(
                Items(),
                batch_size=2,
                shuffle=None if sampler is not None else True,
                sampler=sampler,
                num_workers=2,
                seed=3,
            )

    kind, _, at = kill.partition(":")
    kill_step = int(at) if at else -1

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if kind == "step" and self.global_step == kill_step and self.global_rank == 0:
                os.killpg(0, signal.SIGKILL)
            ids, x = batch
            loss = self.layer(x).pow(2).mean()
            record = {
                "epoch": self.current_epoch,
                "step": self.global_step,
                "ids": ids.tolist(),
                "x": x.flatten().tolist(),
                "loss": loss.item(),
            }
            with open(f"{out}/rank{self.global_rank}.jsonl", "a") as file:
                file.write(json.dumps(record) + "\n")
            return loss

        def on_train_batch_end(self, *args: Any) -> None:
            # After ModelCheckpoint's hook: the checkpoint of this step is on disk.
            if kind == "after" and self.global_step == kill_step and self.global_rank == 0:
                os.killpg(0, signal.SIGKILL)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    every = {"every_n_train_steps": 4} if ckpt == "steps" else {"every_n_epochs": 1}
    trainer = pl.Trainer(
        max_epochs=EPOCHS,
        accelerator="cpu",
        devices=ranks,
        strategy="ddp" if ranks > 1 else "auto",
        use_distributed_sampler=distributed_sampler == "lightning",
        callbacks=[
            ModelCheckpoint(dirpath=f"{out}/ckpt", save_last=True, save_top_k=-1, **every),
            SavableLoaderCallback(),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    resume = "last" if Path(f"{out}/ckpt/last.ckpt").exists() else None
    trainer.fit(Model(), datamodule=Data(), ckpt_path=resume)


def _command(out: Path, ranks: int, sampler: str, ckpt: str, kill: str) -> list[str]:
    return [sys.executable, __file__, str(out), str(ranks), sampler, ckpt, kill]


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    """Lightning imported once for rank 0 of every job (NOTE [ Jobs from a zygote ] in
    zygote.py); Lightning's launcher starts rank 1 as a new interpreter."""
    with Zygote("lightning.pytorch", "savable_loader.integrations.lightning") as started:
        yield started


def _run(zygote: Zygote, out: Path, ranks: int, sampler: str, ckpt: str, kill: str = "none") -> int:
    return run_job(_command(out, ranks, sampler, ckpt, kill), kill, TIMEOUT, zygote=zygote)


def _killed_and_resumed(
    zygote: Zygote, out: Path, ranks: int, sampler: str, ckpt: str, kill: str
) -> list[Records]:
    """Runs the job killed as ``kill`` says, then resumed; returns the killed run's records
    (the resumed run's are in ``out``)."""
    assert _run(zygote, out, ranks, sampler, ckpt, kill) == -signal.SIGKILL
    killed = [records(out, rank) for rank in range(ranks)]
    for rank in range(ranks):
        (out / f"rank{rank}.jsonl").rename(out / f"killed{rank}.jsonl")
    _run(zygote, out, ranks, sampler, ckpt)
    return killed


_REFERENCES: dict[tuple[int, str], list[Records]] = {}


def _check_resume(
    zygote: Zygote, tmp: Path, ranks: int, sampler: str, ckpt: str, kill: str
) -> None:
    """The uninterrupted run's records come once per number of ranks and sampler: it saves
    every 4 steps, and serves the per-epoch checkpoint cases too (a save does not change
    the stream; if it did, a resume with other save points would differ). The first test
    that needs it runs it beside its killed and resumed runs (NOTE [ The reference beside
    the killed run ] in trainer_jobs.py)."""
    key = (ranks, sampler)
    out = tmp / "run"
    out.mkdir()
    if key in _REFERENCES:
        killed = _killed_and_resumed(zygote, out, ranks, sampler, ckpt, kill)
    else:
        uninterrupted = tmp / "reference"
        uninterrupted.mkdir()
        command = _command(uninterrupted, ranks, sampler, "steps", "none")
        with Job(command, "none", TIMEOUT, zygote=zygote) as job:
            killed = _killed_and_resumed(zygote, out, ranks, sampler, ckpt, kill)
            job.wait()
        _REFERENCES[key] = [records(uninterrupted, rank) for rank in range(ranks)]
    reference = _REFERENCES[key]
    per_epoch = STEPS_PER_EPOCH * (2 // ranks)
    for rank in range(ranks):
        resumed = records(out, rank)
        start = resumed[0]["step"]
        assert 0 < start < len(reference[rank]), start
        if ckpt == "epochs":
            assert start % per_epoch == 0, start
        before = [record for record in killed[rank] if record["step"] < start]
        assert len(before) == start  # the killed run reached the checkpoint
        # Batch for batch (ids, augmented values, losses): nothing replayed or skipped.
        assert before + resumed == reference[rank], rank
    ids = [tuple(r["ids"]) for rank in range(ranks) for r in reference[rank]]
    assert len(ids) == EPOCHS * 24 // 2
    for epoch in range(EPOCHS):
        seen = sorted(
            i
            for rank in range(ranks)
            for r in reference[rank]
            for i in r["ids"]
            if r["epoch"] == epoch
        )
        assert seen == list(range(24)), (epoch, seen)  # each epoch reads every item once
    orders = [[r["ids"] for r in reference[0] if r["epoch"] == epoch] for epoch in range(EPOCHS)]
    assert orders[0] != orders[1] != orders[2]  # a new order every epoch (set_epoch reached)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("ckpt", "kill"),
    [("steps", "step:10"), ("epochs", "step:12")],
    ids=["mid-epoch", "after-epoch-checkpoint"],
)
def test_single_process_resumes_exactly(
    tmp_path_factory: pytest.TempPathFactory, zygote: Zygote, ckpt: str, kill: str
) -> None:
    _check_resume(zygote, tmp_path_factory.mktemp("pl"), 1, "lightning", ckpt, kill)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("sampler", "ckpt", "kill"),
    [("lightning", "steps", "step:9"), ("own", "steps", "after:8")],
    ids=["use_distributed_sampler", "own-DistributedSampler-after-checkpoint"],
)
def test_ddp_resumes_exactly(
    tmp_path_factory: pytest.TempPathFactory, zygote: Zygote, sampler: str, ckpt: str, kill: str
) -> None:
    _check_resume(zygote, tmp_path_factory.mktemp("pl"), 2, sampler, ckpt, kill)


def _check_warnings() -> None:
    """The callback's check (NOTE [ A trainer that sees one process ]) with real
    ``Trainer``s: one process while the loader shards over two ranks, or while the
    launcher's WORLD_SIZE counts two, warns; a ``Trainer`` that counts the loader's ranks
    does not."""
    import warnings

    import lightning.pytorch as pl

    from savable_loader import SingleProcessTrainerWarning, WorkerConfig
    from savable_loader.integrations.lightning import LightningSavableDataLoader, _check_processes

    def warned(trainer: pl.Trainer, world_size: int) -> list[str]:
        config = WorkerConfig(rank=0, world_size=world_size)
        loader = LightningSavableDataLoader(list(range(8)), batch_size=2, worker_config=config)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _check_processes(trainer, [loader])
        return [str(w.message) for w in caught if w.category is SingleProcessTrainerWarning]

    one = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    two = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    assert (one.world_size, two.world_size) == (1, 2)
    assert warned(one, 1) == warned(two, 2) == []
    [message] = warned(one, 2)
    assert "over 2 ranks" in message, message
    assert "1/2 of the data" in message, message
    assert 'devices per machine and num_nodes, with strategy="ddp"' in message, message
    os.environ["WORLD_SIZE"] = "2"
    [message] = warned(one, 1)
    assert "WORLD_SIZE is 2 but the Trainer's world_size is 1" in message, message
    assert "all the data" in message, message


@pytest.mark.timeout(200)
def test_a_loader_sharded_by_rank_under_a_trainer_of_one_process_warns(zygote: Zygote) -> None:
    """:func:`_check_warnings`, in a process of its own: Lightning imports torch._dynamo,
    which slows every later loader of the test process (NOTE [ Heavy imports last ] in
    conftest.py)."""
    assert run_job([sys.executable, __file__, "warnings"], "none", TIMEOUT, zygote=zygote) == 0


if __name__ == "__main__":
    if sys.argv[1] == "warnings":
        _check_warnings()
    else:
        _job(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
