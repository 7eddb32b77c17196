"""Time to the first batch after a resume, inside PyTorch Lightning, Hugging Face
Accelerate and the Hugging Face ``Trainer``.

One job per trainer, run with this project's integration (the loader restores its
position) and with the trainer's default resume of a torch ``DataLoader``: Accelerate's
``skip_first_batches``, which the ``Trainer`` also calls, and Lightning's own resume,
which does not skip (NOTE [ Lightning's resume of a plain DataLoader ]), beside a
Lightning loader that skips by iterating. A first process trains to step ``--at`` of a
``--items / --batch``-step epoch, checkpoints there, trains a few more steps recording
their batches, and exits; then ``--rounds`` new processes each resume from that
checkpoint and time from the resume call (``load_state``,
``trainer.train(resume_from_checkpoint=...)`` or ``trainer.fit(..., ckpt_path=...)``) to
the first training step, and check whether their first batches are the ones the first
process trained after the checkpoint: the same items (ids), and the same values (ids and
augmentations). Items cost ``--item-us`` of CPU work each (``common.burn``), over 2
workers, shuffled, each with a random augmentation.

Writes ``benchmarks/results/bench_trainers.json`` and ``.md`` (not with ``--quick``).

NOTE [ Lightning's resume of a plain DataLoader ]
Lightning 2.x (``fit_loop.py``, ``training_epoch_loop.py``, ``fetchers.py``) restores
its progress counters from a mid-epoch checkpoint and calls ``load_state_dict()`` on the
train loaders that have one (``CombinedLoader._load_state_dicts``). A torch
``DataLoader`` has none: Lightning warns that the loader is not resumable, creates a new
iterator, which starts the epoch from its first batch (in a new shuffled order unless
the loader has a seeded generator), and adds the checkpoint's batch count to its
fetcher's count, so the resumed epoch ends after ``len(loader) - at`` batches: it trains
on the epoch's first batches again and never on its last ones. It skips nothing. The
exact alternative a user would write is ``lightning-skip``: a ``DataLoader`` with a seeded
generator (the same order and worker seeds as the interrupted run) whose first
``iter()`` after a resume reads and drops the batches the checkpoint's progress counts,
as Accelerate's ``skip_first_batches`` does for an ``IterableDataset``.

    python benchmarks/bench_trainers.py [--items 4000] [--at 400] [--rounds 3] [--quick]
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
    "lightning-savable": "LightningSavableDataLoader + SavableLoaderCallback, fit(ckpt_path=...)",
    "lightning-default": "torch DataLoader, fit(ckpt_path=...) (restarts the epoch, skips nothing)",
    "lightning-skip": "torch DataLoader (seeded), fit(ckpt_path=...) + iter() drops the trained batches",
}
TRAINERS = {"accelerate": "Accelerate", "trainer": "HF Trainer", "lightning": "Lightning"}
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
            order = [ids for ids, _ in seen]
            found = {"ids": tail, "order": order, "ttfb": first[0]}
            Path(f"{folder}/{phase}.json").write_text(json.dumps(found))
            os._exit(0)

    model = _Model.build(on_batch)
    if mode.startswith("accelerate"):
        _accelerate(mode, folder, phase, options, dataset, model, start)
    elif mode.startswith("lightning"):
        _lightning(mode, folder, phase, options, dataset, model, start)
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


def _lightning(
    mode: str, folder: str, phase: str, options: Any, dataset: Any, model: Any, start: list[float]
) -> None:
    """NOTE [ Lightning's resume of a plain DataLoader ] says what each mode resumes."""
    import logging

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from savable_loader.integrations.lightning import (
        LightningSavableDataLoader,
        SavableLoaderCallback,
    )

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class SkipOnResume(torch.utils.data.DataLoader[Any]):
        """A torch ``DataLoader`` whose next ``iter()`` reads and drops ``skip`` batches."""

        skip = 0

        def __iter__(self) -> Any:
            iterator = super().__iter__()
            skip, self.skip = self.skip, 0
            for _ in range(skip):
                next(iterator)
            return iterator

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.skip = 0

        def train_dataloader(self) -> Any:
            kwargs = {"batch_size": options.batch, "shuffle": True, "num_workers": 2}
            if mode == "lightning-savable":
                return LightningSavableDataLoader(dataset, seed=0, **kwargs)
            if mode == "lightning-default":
                return torch.utils.data.DataLoader(dataset, **kwargs)
            loader = SkipOnResume(dataset, generator=torch.Generator().manual_seed(0), **kwargs)
            loader.skip = self.skip
            return loader

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            # The batches of the interrupted epoch that the checkpoint counts as trained.
            progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
            self.skip = progress["current"]["processed"]

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            return self.model(batch["ids"], batch["x"])["loss"]

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    checkpoint = ModelCheckpoint(
        dirpath=f"{folder}/ckpt", filename="at", every_n_train_steps=options.at
    )
    callbacks: list[Any] = [checkpoint]
    if mode == "lightning-savable":
        callbacks.append(SavableLoaderCallback())
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start[0] = time.perf_counter()
    trainer.fit(Module(), ckpt_path=f"{folder}/ckpt/at.ckpt" if phase == "resume" else None)


def _run(mode: str, folder: str, phase: str, options: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--job", mode, folder, phase]
    command += ["--items", str(options.items), "--at", str(options.at)]
    command += ["--batch", str(options.batch), "--item-us", str(options.item_us)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    result: dict[str, Any] = json.loads(Path(f"{folder}/{phase}.json").read_text())
    return result


def _measure(mode: str, options: argparse.Namespace) -> dict[str, Any]:
    """Trains once, resumes ``options.rounds`` times; the times and the comparisons."""
    with tempfile.TemporaryDirectory() as folder:
        reference = _run(mode, folder, "train", options)
        times, items, values, starts = [], True, True, set()
        for index in range(options.rounds):
            resumed = _run(mode, folder, "resume", options)
            times.append(resumed["ttfb"])
            first = resumed["order"][0]
            starts.add(reference["order"].index(first) if first in reference["order"] else -1)
            items &= [i for i, _ in resumed["ids"]] == [i for i, _ in reference["ids"]]
            values &= resumed["ids"] == reference["ids"]
            print(f"  {mode}: round {index + 1}/{options.rounds}", file=sys.stderr)
    return {"times": times, "items": items, "values": values, "starts": sorted(starts)}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("lightning", "accelerate", "transformers"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=4000)
    parser.add_argument("--at", type=int, default=400)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--item-us", type=float, default=2000.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--quick", action="store_true", help="400 items, checkpoint at 40, 1 round; writes nothing"
    )
    parser.add_argument("--job", nargs=3, metavar=("MODE", "FOLDER", "PHASE"))
    options = parser.parse_args()
    if options.quick:
        options.items, options.at, options.rounds = 400, 40, 1
    if options.job:
        _job(*options.job, options)
        return
    import common

    steps = options.items // options.batch
    print(f"resume at step {options.at} of a {steps}-step epoch, {options.item_us:.0f} us/item")
    modes = options.modes.split(",")
    measured = {mode: _measure(mode, options) for mode in modes}
    rows = []
    for mode, found in measured.items():
        times = found["times"]
        rows.append(
            {
                "Trainer": TRAINERS[mode.split("-")[0]],
                "Mode": mode,
                "Loader and resume": MODES[mode],
                f"Time to first batch (s, median of {options.rounds})": statistics.median(times),
                "min..max (s)": f"{min(times):.3f}..{max(times):.3f}",
                "First batch is step": ", ".join(
                    str(start) if start >= 0 else "none" for start in found["starts"]
                ),
                "Same items": "yes" if found["items"] else "no",
                "Same values": "yes" if found["values"] else "no",
            }
        )
    common.write_results(
        "bench_trainers",
        title="Trainers: time to the first batch after a resume",
        parameters={
            "items": options.items,
            "checkpoint_step": options.at,
            "steps_per_epoch": steps,
            "batch_size": options.batch,
            "item_us": options.item_us,
            "num_workers": 2,
            "rounds": options.rounds,
            "batches_compared": CHECK,
            "modes": modes,
            "trainers": _versions(),
            "quick": options.quick,
        },
        columns=list(rows[0]),
        rows=rows,
        notes=[
            "Time to first batch: from the resume call (accelerator.load_state, "
            "trainer.train(resume_from_checkpoint=True), trainer.fit(ckpt_path=...)) in a "
            "new process to the first training step.",
            "First batch is step: the step of the checkpointing run (0-based, in its first "
            f"{options.at + CHECK}) whose item ids the first batch after the resume has; "
            f"{options.at} is where the checkpoint was, none: not among them (another order).",
            f"Same items / same values: the first {CHECK} batches after the resume have the "
            "item ids / the ids and augmented values of the batches the checkpointing run "
            "trained after the checkpoint, in every round.",
            "lightning-default is Lightning's own resume of a torch DataLoader: a new "
            "iterator from the epoch's first batch, no skip (NOTE [ Lightning's resume of "
            "a plain DataLoader ] in benchmarks/bench_trainers.py).",
        ],
        samples={mode: found["times"] for mode, found in measured.items()},
        write=not options.quick,
    )


if __name__ == "__main__":
    main()
