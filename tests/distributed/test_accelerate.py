"""Hugging Face Accelerate resumes an ``AccelerateSavableDataLoader`` exactly from
``accelerator.save_state``.

Each test runs this file as a training job, as ``python
tests/distributed/test_accelerate.py ...`` would, in a session of its own, forked from a
process that imported the library once (NOTE [ Jobs from a zygote ] in zygote.py); with
two ranks, one process per rank with torchrun's environment variables, over gloo: the loader goes through ``accelerator.prepare()`` with
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
import sys
import warnings
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import pytest
from trainer_jobs import check_script_resumes
from zygote import Zygote

pytestmark = pytest.mark.skipif(
    find_spec("accelerate") is None, reason="the accelerate extra is not installed"
)

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


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    """The jobs' library imported once (NOTE [ Jobs from a zygote ] in zygote.py)."""
    with Zygote("accelerate", "savable_loader.integrations.accelerate") as started:
        yield started


def _check_resume(tmp: Path, ranks: int, kill: str, zygote: Zygote) -> None:
    sizes = {"items": ITEMS, "batch": BATCH, "epochs": EPOCHS, "every": EVERY}
    check_script_resumes(__file__, tmp, ranks, kill, timeout=TIMEOUT, zygote=zygote, **sizes)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_single_process_resumes_exactly_mid_epoch(
    tmp_path_factory: pytest.TempPathFactory, zygote: Zygote
) -> None:
    _check_resume(tmp_path_factory.mktemp("accelerate"), 1, "step:18", zygote)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_resume_exactly_after_a_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, zygote: Zygote
) -> None:
    _check_resume(tmp_path_factory.mktemp("accelerate"), 2, "after:7", zygote)


@pytest.fixture
def one_process() -> Iterator[None]:
    """An ``Accelerator(cpu=True)`` of one process in this process, forgotten afterwards."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    Accelerator(cpu=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _loader(world_size: int) -> object:
    from savable_loader import WorkerConfig
    from savable_loader.integrations.accelerate import AccelerateSavableDataLoader

    config = WorkerConfig(rank=0, world_size=world_size)
    return AccelerateSavableDataLoader(list(range(8)), batch_size=2, worker_config=config)


@pytest.mark.usefixtures("one_process")
def test_a_loader_sharded_by_rank_under_one_accelerate_process_warns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [ A trainer that sees one process ]: the Accelerator counts one process (as
    without cpu=True under torchrun on CPUs) while the loader shards over two ranks, or
    the launcher's WORLD_SIZE counts two."""
    from savable_loader import SingleProcessTrainerWarning

    sharded = r"over 2 ranks .* accelerator.num_processes is 1: .* 1/2 of the data.*cpu=True"
    with pytest.warns(SingleProcessTrainerWarning, match=sharded):
        _loader(2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    launched = r"WORLD_SIZE is 2 but accelerator.num_processes is 1: .* all the data.*cpu=True"
    with pytest.warns(SingleProcessTrainerWarning, match=launched):
        _loader(1)


@pytest.mark.usefixtures("one_process")
def test_a_loader_whose_ranks_the_accelerator_counts_does_not_warn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One process and one rank; two processes (as Accelerate counts them under torchrun
    with cpu=True) and two ranks."""
    from accelerate.state import AcceleratorState, PartialState

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _loader(1)
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setitem(PartialState._shared_state, "num_processes", 2)
        assert AcceleratorState().num_processes == 2
        _loader(2)


if __name__ == "__main__":
    _job(sys.argv[2], sys.argv[3])
