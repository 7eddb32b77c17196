"""The pipeline and the child processes behind ``savable-loader demo``.

NOTE [ Demo ]
``savable-loader demo`` (in :mod:`savable_loader.cli.demo`) starts three processes that each
run :func:`run_child`, a small training loop over :class:`AugmentedImages`:

- ``reference`` trains over every epoch without interruption and records a digest of
  every batch;
- ``interrupted`` does the same, saves the loader's state every few steps to a file
  named after the step (``checkpoints/loader-step000050.msgpack``, as a trainer names
  its checkpoints), and at the step it is told to be killed at writes its progress and
  waits: the parent kills it, workers included, with SIGKILL;
- ``resumed`` loads the newest state file into a fresh loader and trains to the end.

Children report through files in the work folder: one digest per line (flushed every
step, so a kill loses nothing written), and JSON files with their progress and timings
(replaced atomically, so the parent never reads half a file).
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from ..datasets.protocol.base import SavableDataset
from ..loader import SavableDataLoader
from ..state.files import load_state, save_state
from ..testing import digest

__all__ = [
    "BATCH_SIZE",
    "EPOCHS",
    "AugmentedImages",
    "DemoPaths",
    "DemoSettings",
    "run_child",
]

EPOCHS = 2
BATCH_SIZE = 8
IMAGE_SHAPE = (3, 16, 16)
CLASSES = 10
_WAIT_FOR_KILL_SECONDS = 120.0
_CHECKPOINT = re.compile(r"loader-step(\d+)\.msgpack")


class AugmentedImages(SavableDataset[tuple[torch.Tensor, int]]):
    """Synthetic labelled images with random augmentations from the global generators.

    Items come in blocks of ``block`` (the batch size): worker ``w`` of ``W`` (from
    ``get_worker_info()``) serves blocks ``w, w + W, ...``, so the loader's round-robin
    over workers hands out the blocks in order. Each image is made from its index alone;
    the augmentations (a flip from ``random``, a brightness factor from ``numpy.random``,
    noise from torch) come from the worker's global generators.

    Args:
        size: Items per epoch.
        block: Items per block (the loader's batch size, so a batch is one block).

    State:
        ``{"epoch": e, "pos": k}``: the epoch and the position in this worker's items.
    """

    def __init__(self, size: int, *, block: int = BATCH_SIZE) -> None:
        self.size = size
        self.block = block
        self.epoch = 0
        self.pos = 0

    def config(self) -> dict[str, Any]:
        return {"type": "AugmentedImages", "size": self.size, "block": self.block}

    def save_state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def restore_state(self, state: Any | None) -> None:
        state = state or {"epoch": 0, "pos": 0}
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])

    def _shard(self) -> list[int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        blocks = range(worker, -(-self.size // self.block), workers)
        return [
            index
            for b in blocks
            for index in range(b * self.block, min((b + 1) * self.block, self.size))
        ]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        shard = self._shard()
        while self.pos < len(shard):
            index = shard[self.pos]
            self.pos += 1
            yield self._item(index), index % CLASSES
        self.epoch += 1
        self.pos = 0

    def _item(self, index: int) -> torch.Tensor:
        base = torch.Generator().manual_seed(index)
        image = torch.rand(IMAGE_SHAPE, generator=base)
        if random.random() < 0.5:
            image = image.flip(-1)
        image = image * float(np.random.uniform(0.8, 1.2))
        return image + 0.05 * torch.randn(IMAGE_SHAPE)


@dataclass(frozen=True)
class DemoSettings:
    """What the three runs share.

    Attributes:
        workers: Worker processes of the loader.
        steps: Batches per epoch.
        kill_at: Step at which the interrupted run waits to be killed.
        save_every: The interrupted run saves the loader's state every this many steps.
    """

    workers: int
    steps: int
    kill_at: int
    save_every: int

    @property
    def total_steps(self) -> int:
        return self.steps * EPOCHS

    def build_loader(self) -> SavableDataLoader[Any]:
        dataset = AugmentedImages(self.steps * BATCH_SIZE)
        return SavableDataLoader(dataset, batch_size=BATCH_SIZE, num_workers=self.workers)


@dataclass(frozen=True)
class DemoPaths:
    """The files of one demo in its work folder."""

    root: Path

    def digests(self, mode: str) -> Path:
        return self.root / f"{mode}.digests"

    def report(self, mode: str) -> Path:
        return self.root / f"{mode}.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"loader-step{step:06d}.msgpack"

    def saved(self) -> list[tuple[int, Path]]:
        """Returns the state files written so far as (step, path), oldest first."""
        if not self.checkpoints.is_dir():
            return []
        found = []
        for path in self.checkpoints.iterdir():
            match = _CHECKPOINT.fullmatch(path.name)
            if match:
                found.append((int(match.group(1)), path))
        return sorted(found)

    def clear(self) -> None:
        """Removes what an earlier demo left in this folder (only the demo's own files)."""
        for mode in ("reference", "interrupted", "resumed"):
            self.digests(mode).unlink(missing_ok=True)
            self.report(mode).unlink(missing_ok=True)
        for _, path in self.saved():
            path.unlink()


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Replaces ``path`` with ``data`` as JSON; a reader sees the old or the new file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_digests(path: Path) -> list[str]:
    """Returns the digests a child recorded, in step order."""
    if not path.exists():
        return []
    return [line.split()[1] for line in path.read_text().splitlines() if line.strip()]


class _Trainer:
    """A tiny classifier trained by plain SGD: the training loop's own use of torch.

    (``torch.optim`` is left out on purpose: importing it costs seconds of start-up.)
    """

    def __init__(self, lr: float = 0.01) -> None:
        self.model = torch.nn.Linear(int(np.prod(IMAGE_SHAPE)), CLASSES)
        self.lr = lr

    def step(self, batch: Any) -> None:
        images, labels = batch
        loss = torch.nn.functional.cross_entropy(self.model(images.flatten(1)), labels)
        self.model.zero_grad()
        torch.autograd.backward(loss)
        with torch.no_grad():
            for parameter in self.model.parameters():
                if parameter.grad is not None:
                    parameter.sub_(parameter.grad, alpha=self.lr)


def run_child(mode: str, settings: DemoSettings, paths: DemoPaths) -> int:
    """Runs one of the three demo processes (NOTE [ Demo ]); returns its exit code."""
    torch.set_num_threads(1)
    paths.checkpoints.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"mode": mode, "pid": os.getpid()}
    trainer = _Trainer()
    step = 0
    start_epoch = 0
    loader = settings.build_loader()
    with loader, paths.digests(mode).open("a") as digests:
        if mode == "resumed":
            saved = paths.saved()
            if not saved:
                raise FileNotFoundError(f"no saved state in {paths.checkpoints}")
            step, path = saved[-1]
            began = time.perf_counter()
            state = load_state(path)
            loaded = time.perf_counter()
            if isinstance(state, list):
                raise TypeError(f"{path} holds a list of rank states, expected one")
            loader.restore_state_rank(state)
            restored = time.perf_counter()
            start_epoch = state.epoch + (1 if state.between_epochs else 0)
            report.update(
                start_step=step,
                state_file=str(path),
                load_state_ms=(loaded - began) * 1e3,
                restore_state_rank_ms=(restored - loaded) * 1e3,
                replayed=sum(worker.replay for worker in state.workers),
            )
        saves: list[dict[str, Any]] = []
        first = time.perf_counter()
        for _epoch in range(start_epoch, EPOCHS):
            for batch in loader:
                if step == report.get("start_step"):
                    report["first_batch_ms"] = (time.perf_counter() - first) * 1e3
                step += 1
                trainer.step(batch)
                digests.write(f"{step} {digest(batch)}\n")
                digests.flush()
                if mode != "interrupted":
                    continue
                if step % settings.save_every == 0:
                    saves.append(_save(loader, paths.checkpoint(step), step))
                if step == settings.kill_at:
                    report.update(step=step, saves=saves, waiting=True)
                    write_json(paths.report(mode), report)
                    time.sleep(_WAIT_FOR_KILL_SECONDS)
                    return 3  # nobody killed this process: the parent is gone
        report.update(end_step=step, saves=saves)
    write_json(paths.report(mode), report)
    return 0


def _save(loader: SavableDataLoader[Any], path: Path, step: int) -> dict[str, Any]:
    began = time.perf_counter()
    state = loader.save_state_rank()
    captured = time.perf_counter()
    save_state(state, path)
    written = time.perf_counter()
    return {
        "step": step,
        "save_state_rank_ms": (captured - began) * 1e3,
        "save_state_ms": (written - captured) * 1e3,
        "bytes": path.stat().st_size,
    }


def summarize_ms(values: list[float]) -> str:
    """Returns ``"median X ms, max Y ms"`` for a list of durations in ms."""
    if not values:
        return "n/a"
    return f"median {statistics.median(values):.2f} ms, max {max(values):.2f} ms"
