"""Hugging Face's ``Trainer`` resumes a ``SavableTrainer``'s loader exactly from its own
checkpoint.

Each test runs this file as a training job, as ``python
tests/distributed/test_hf_trainer.py ...`` would, in a session of its own, forked from a
process that imported the library once (NOTE [ Jobs from a zygote ] in zygote.py); with
two ranks, one process per rank with torchrun's environment variables, DDP over gloo: a tiny ``torch.nn.Module`` that returns a loss
dict, trained on the CPU with ``save_steps=4``; an uninterrupted run, then a run that
SIGKILLs its own process group (every rank and worker) at a chosen step, then
``trainer.train(resume_from_checkpoint=True)``. The model writes each training step
(epoch, step, item ids, augmented values, loss) to a file per rank and every worker each
item it produced; the killed run's steps before the checkpoint's followed by the resumed
run's must be the uninterrupted run's, and the resumed run must not have produced the
batches before its checkpoint again.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from trainer_jobs import check_script_resumes
from zygote import Zygote

pytestmark = pytest.mark.skipif(
    find_spec("transformers") is None or find_spec("accelerate") is None,
    reason="the transformers extra is not installed",
)

ITEMS = 24
BATCH = 2
EPOCHS = 3
EVERY = 4  # save_steps
TIMEOUT = 150  # a hang is still caught; a loaded 2-core CI machine is slow


def _job(out: str, kill: str) -> None:
    """One training run; ``kill`` is ``none``, ``step:<n>`` (SIGKILL as step n begins,
    mid-epoch) or ``after:<n>`` (as step n begins, right after the checkpoint of step n)."""
    import torch
    from torch.utils.data import Dataset
    from transformers import TrainerCallback, TrainingArguments

    from savable_loader import WorkerConfig
    from savable_loader.integrations.hf_trainer import SavableTrainer, TrainerSavableDataLoader

    rank = int(os.environ.get("RANK", "0"))
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    per_epoch = ITEMS // BATCH // ranks

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
            with open(f"{out}/rank{rank}.jsonl", "a") as file:
                file.write(json.dumps(record) + "\n")
            return {"loss": loss}

    kill_step = int(kill.partition(":")[2] or -1)
    model = Model()

    class Steps(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == kill_step and rank == 0:
                os.killpg(0, signal.SIGKILL)
            model.step = state.global_step
            model.epoch = state.global_step // per_epoch

    class Trainer(SavableTrainer):
        """Builds the loader itself, as the how-to page shows."""

        def get_train_dataloader(self) -> TrainerSavableDataLoader:
            loader = TrainerSavableDataLoader(
                self.train_dataset,
                batch_size=self._train_batch_size,
                shuffle=True,
                collate_fn=self.data_collator,
                num_workers=2,
                seed=self.args.seed,
                # A checkpoint after every item (these are cheap), so that a restore
                # replays next to nothing and the count of produced items is tight.
                worker_config=WorkerConfig(checkpoint_share=1.0),
            )
            prepared: TrainerSavableDataLoader = self.accelerator.prepare(loader)
            return prepared

    args = TrainingArguments(
        output_dir=f"{out}/ckpt",
        per_device_train_batch_size=BATCH,
        num_train_epochs=EPOCHS,
        learning_rate=1e-3,
        save_steps=EVERY,
        save_strategy="steps",
        ignore_data_skip=True,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        logging_strategy="no",
        seed=3,
        ddp_backend="gloo" if ranks > 1 else None,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Items(), callbacks=[Steps()])
    resume = Path(f"{out}/ckpt").exists() and any(Path(f"{out}/ckpt").iterdir())
    trainer.train(resume_from_checkpoint=True if resume else None)


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    """The jobs' library imported once (NOTE [ Jobs from a zygote ] in zygote.py)."""
    with Zygote("transformers.trainer", "savable_loader.integrations.hf_trainer") as started:
        yield started


def _check_resume(tmp: Path, ranks: int, kill: str, zygote: Zygote) -> None:
    sizes = {"items": ITEMS, "batch": BATCH, "epochs": EPOCHS, "every": EVERY}
    check_script_resumes(__file__, tmp, ranks, kill, timeout=TIMEOUT, zygote=zygote, **sizes)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_trainer_resumes_exactly_mid_epoch(
    tmp_path_factory: pytest.TempPathFactory, zygote: Zygote
) -> None:
    _check_resume(tmp_path_factory.mktemp("hf_trainer"), 1, "step:18", zygote)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_resume_exactly_after_a_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, zygote: Zygote
) -> None:
    _check_resume(tmp_path_factory.mktemp("hf_trainer"), 2, "after:8", zygote)


def test_a_mid_epoch_resume_with_uneven_accumulation_is_refused() -> None:
    from savable_loader.errors import ConfigError
    from savable_loader.integrations.hf_trainer import _check_accumulation

    class Loader:
        def __len__(self) -> int:
            return 10

    _check_accumulation(Loader(), 2, 3)  # type: ignore[arg-type]  # 2 divides 10
    _check_accumulation(Loader(), 3, 8)  # type: ignore[arg-type]  # 4 updates an epoch: its end
    with pytest.raises(ConfigError, match="gradient_accumulation_steps is 3"):
        _check_accumulation(Loader(), 3, 5)  # type: ignore[arg-type]


def test_a_loader_sharded_by_rank_under_a_trainer_of_one_process_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ A trainer that sees one process ]: without use_cpu=True on CPUs the
    arguments count one process (NOT_PARALLEL) while the loader shards over two ranks, or
    the launcher's WORLD_SIZE counts two; the callback warns as training begins, and the
    loader itself does not warn twice."""
    from transformers import TrainingArguments
    from transformers.training_args import ParallelMode

    from savable_loader import SingleProcessTrainerWarning, WorkerConfig
    from savable_loader.integrations.hf_trainer import (
        SavableLoaderCallback,
        TrainerSavableDataLoader,
    )

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert (args.world_size, args.parallel_mode) == (1, ParallelMode.NOT_PARALLEL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaders = [
            TrainerSavableDataLoader(
                list(range(8)), batch_size=2, worker_config=WorkerConfig(rank=0, world_size=n)
            )
            for n in (1, 2)
        ]
        SavableLoaderCallback().on_train_begin(args, None, None, train_dataloader=loaders[0])
        two = SimpleNamespace(world_size=2)  # as under torchrun with use_cpu=True
        SavableLoaderCallback().on_train_begin(two, None, None, train_dataloader=loaders[1])
    sharded = r"over 2 ranks .* TrainingArguments.world_size is 1: .* 1/2 of the data.*use_cpu"
    with pytest.warns(SingleProcessTrainerWarning, match=sharded):
        SavableLoaderCallback().on_train_begin(args, None, None, train_dataloader=loaders[1])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(SingleProcessTrainerWarning, match=r"WORLD_SIZE is 2 .* all the data"):
        SavableLoaderCallback().on_train_begin(args, None, None, train_dataloader=loaders[0])


if __name__ == "__main__":
    _job(sys.argv[2], sys.argv[3])
