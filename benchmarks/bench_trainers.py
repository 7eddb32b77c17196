"""Time to the first batch after a resume, inside Hugging Face Accelerate and ``Trainer``.

One job per trainer, run twice: with this project's integration (the loader restores its
position) and with the trainer's default resume (a torch ``DataLoader`` and
Accelerate's ``skip_first_batches``, which the ``Trainer`` also calls). A first process
trains to step ``--at`` of a ``--items / --batch``-step epoch, checkpoints there, trains
a few more steps recording their batches, and exits; then ``--rounds`` new processes
each resume from that checkpoint and time from the resume call (``load_state``, or
``trainer.train(resume_from_checkpoint=...)``) to the first training step, and check
whether their first batches are the ones the first process trained after the
checkpoint: the same items (ids), and the same values (ids and augmentations).
Items cost ``--item-us`` of CPU work each (``common.burn``), over 2 workers, shuffled,
each with a random augmentation.

    python benchmarks/bench_trainers.py [--items 4000] [--at 400] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = {
    "accelerate-savable": "AccelerateSavableDataLoader, load_state",
    "accelerate-skip": "torch DataLoader, load_state + skip_first_batches",
    "accelerate-iterable-skip": "torch DataLoader over an IterableDataset, load_state + skip_first_batches",
    "trainer-savable": "SavableTrainer, resume_from_checkpoint",
    "trainer-default": "Trainer, resume_from_checkpoint (skips batches)",
    "trainer-iterable-default": "Trainer over an IterableDataset, resume_from_checkpoint (skips batches)",
}
CHECK = 5  # batches compared after the checkpoint


def _dataset(items: int, units: int) -> Any:
    import torch
    from common import burn

    class Items(torch.utils.data.Dataset[dict[str, Any]]):
        def __len__(self) -> int:
            return items

        def __getitem__(self, index: int) -> dict[str, Any]:
            burn(units)
            return {"ids": index, "x": torch.tensor([float(index)]) + torch.rand(1)}

    class Stream(torch.utils.data.IterableDataset[dict[str, Any]]):
        """The same items in one fixed shuffled order, read in turn by the workers."""

        def __iter__(self) -> Any:
            info = torch.utils.data.get_worker_info()
            worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
            order = torch.randperm(items, generator=torch.Generator().manual_seed(0)).tolist()
            for position in range(worker, items, workers):
                yield Items()[order[position]]

    return Items(), Stream()


class _Model:
    @staticmethod
    def build(on_batch: Any) -> Any:
        import torch

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.layer = torch.nn.Linear(1, 1)

            def forward(self, ids: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
                on_batch(ids, x)
                return {"loss": self.layer(x).pow(2).mean()}

        return Model()


def _job(mode: str, folder: str, phase: str, options: argparse.Namespace) -> None:
    """``phase`` is ``train`` (to step at + CHECK, checkpoint at ``at``) or ``resume``."""
    from common import units_for

    dataset, stream = _dataset(options.items, units_for(options.item_us))
    if "iterable" in mode:
        dataset = stream
    seen: list[list[Any]] = []
    start = [0.0]
    first = [0.0]
    limit = options.at + CHECK if phase == "train" else CHECK

    def on_batch(ids: Any, x: Any) -> None:
        if not seen:
            first[0] = time.perf_counter() - start[0]
        seen.append([ids.tolist(), x.flatten().tolist()])
        if phase == "train" and len(seen) <= options.at:
            return
        if len(seen) == limit:
            tail = seen[-CHECK:]
            Path(f"{folder}/{phase}.json").write_text(json.dumps({"ids": tail, "ttfb": first[0]}))
            os._exit(0)

    model = _Model.build(on_batch)
    if mode.startswith("accelerate"):
        _accelerate(mode, folder, phase, options, dataset, model, start)
    else:
        _trainer(mode, folder, phase, options, dataset, model, start)


def _accelerate(
    mode: str, folder: str, phase: str, options: Any, dataset: Any, model: Any, start: list[float]
) -> None:
    import torch
    from accelerate import Accelerator

    from savable_loader.integrations.accelerate import AccelerateSavableDataLoader

    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if mode == "accelerate-savable":
        loader: Any = AccelerateSavableDataLoader(
            dataset, batch_size=options.batch, shuffle=True, num_workers=2, seed=0
        )
    else:
        shuffle = mode == "accelerate-skip"
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=options.batch, shuffle=shuffle, num_workers=2
        )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if mode == "accelerate-savable":
        accelerator.register_for_checkpointing(loader)
    step = 0
    start[0] = time.perf_counter()
    if phase == "resume":
        accelerator.load_state(f"{folder}/ckpt")
        step = options.at
        if mode != "accelerate-savable":
            loader = accelerator.skip_first_batches(loader, options.at)
    while True:
        for batch in loader:
            loss = model(batch["ids"], batch["x"])["loss"]
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if phase == "train" and step == options.at:
                accelerator.save_state(f"{folder}/ckpt")


def _trainer(
    mode: str, folder: str, phase: str, options: Any, dataset: Any, model: Any, start: list[float]
) -> None:
    from transformers import Trainer, TrainingArguments

    from savable_loader.integrations.hf_trainer import SavableTrainer

    savable = mode == "trainer-savable"
    length = {"max_steps": 2 * options.items // options.batch} if "iterable" in mode else {}
    args = TrainingArguments(
        **length,
        output_dir=f"{folder}/ckpt",
        per_device_train_batch_size=options.batch,
        num_train_epochs=2,
        learning_rate=1e-3,
        save_steps=options.at,
        save_strategy="steps",
        dataloader_num_workers=2,
        ignore_data_skip=savable,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        logging_strategy="no",
        seed=0,
    )

    cls = SavableTrainer if savable else Trainer
    trainer = cls(model=model, args=args, train_dataset=dataset)
    start[0] = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if phase == "resume" else None)


def _run(mode: str, folder: str, phase: str, options: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--job", mode, folder, phase]
    command += ["--items", str(options.items), "--at", str(options.at)]
    command += ["--batch", str(options.batch), "--item-us", str(options.item_us)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    result: dict[str, Any] = json.loads(Path(f"{folder}/{phase}.json").read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=4000)
    parser.add_argument("--at", type=int, default=400)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--item-us", type=float, default=2000.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--job", nargs=3, metavar=("MODE", "FOLDER", "PHASE"))
    options = parser.parse_args()
    if options.job:
        _job(*options.job, options)
        return
    steps = options.items // options.batch
    print(f"resume at step {options.at} of a {steps}-step epoch, {options.item_us:.0f} us/item")
    print(f"| Mode | Time to first batch (median of {options.rounds}) | Same items | Same values |")
    print("|---|---|---|---|")
    for mode in options.modes.split(","):
        with tempfile.TemporaryDirectory() as folder:
            reference = _run(mode, folder, "train", options)
            times, items, values = [], True, True
            for _ in range(options.rounds):
                resumed = _run(mode, folder, "resume", options)
                times.append(resumed["ttfb"])
                items &= [i for i, _ in resumed["ids"]] == [i for i, _ in reference["ids"]]
                values &= resumed["ids"] == reference["ids"]
        answers = " | ".join("yes" if same else "no" for same in (items, values))
        print(f"| {MODES[mode]} | {statistics.median(times):.2f} s | {answers} |")


if __name__ == "__main__":
    main()
