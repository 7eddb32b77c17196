"""What every loader of the peer comparison iterates: one dataset class, several workloads.

NOTE [ One dataset for every loader ]
``PeerDataset`` is an ``IterableDataset`` over an endless stream of item positions,
sharded with ``get_worker_info()``: worker w of W yields positions w, w + W, w + 2W, ...
Its state is the number of items this worker produced (``{"pos": n}``), offered under
both protocols: ``save_state``/``restore_state`` (savable_loader) and
``state_dict``/``load_state_dict`` (torch's ``Stateful``, which torchdata's
``StatefulDataLoader`` calls in each worker). Megatron-Energon needs its own base class
and shards by its own (rotating) worker ids, so ``adapters`` subclasses Energon's
``SavableDataset`` around the same :meth:`Workload.item`. Every item draws from the
global ``random``, ``numpy.random`` and ``torch`` generators, as users' augmentations
do: the dataset's own state holds no generator, so whether the continuation after a
restore is exact depends on what the loader captures.

NOTE [ Counting recomputed items ]
With ``log_dir`` set, each process appends the position of every item it produces to
``<log_dir>/<pid>.log``. The harness counts, after a restore, the produced positions
that the saving loader had already delivered: the items recomputed, however a loader
recomputes them (replay in the workers, fast-forward in the main process, ...).
"""

from __future__ import annotations

import dataclasses
import io
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import common
import numpy as np
import torch
from torch.utils.data import get_worker_info

from savable_loader import SavableDataset

TENSOR_SIZE = 16
IMAGE_SIZE = (128, 96)  # width, height of the generated images
CROP = 80

# File descriptors of the position logs, by (pid, path): opened once per process.
_log_fds: dict[tuple[int, str], int] = {}


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one item costs and contains.

    Attributes:
        name: The label in tables and plots.
        kind: ``"synthetic"`` (CPU work, a small tensor) or ``"images"`` (decode and
            augment one of ``image_paths``).
        cost_us: Nominal CPU cost of a synthetic item.
        units: Repetitions of ``common.burn`` for that cost (``common.units_for``).
        image_paths: The images of the ``"images"`` workload; item i reads
            ``image_paths[i % len(image_paths)]``.
        log_dir: Where each process logs the positions it produces (NOTE [ Counting
            recomputed items ]); None logs nothing.
    """

    name: str
    kind: str
    cost_us: float = 0.0
    units: int = 0
    image_paths: tuple[str, ...] = ()
    log_dir: str | None = None

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "units": self.units,
            "images": len(self.image_paths),
        }

    def logging_to(self, log_dir: str | None) -> Workload:
        return dataclasses.replace(self, log_dir=log_dir)

    def item(self, index: int) -> dict[str, Any]:
        """Produces the item at stream position ``index``."""
        if self.log_dir is not None:
            _log(self.log_dir, index)
        if self.kind == "synthetic":
            common.burn(self.units)
            return {
                "x": torch.rand(TENSOR_SIZE),
                "index": index,
                "aug": random.randrange(1000) + int(np.random.randint(1000)),
            }
        if self.kind == "images":
            return _image_item(self.image_paths[index % len(self.image_paths)], index)
        raise ValueError(f"unknown workload kind {self.kind!r}")


def _log(log_dir: str, index: int) -> None:
    key = (os.getpid(), log_dir)
    fd = _log_fds.get(key)
    if fd is None:
        path = os.path.join(log_dir, f"{os.getpid()}.log")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        _log_fds[key] = fd
    os.write(fd, f"{index}\n".encode())


def logged_positions(log_dir: str) -> list[int]:
    """Every position logged under ``log_dir`` (by all processes, duplicates kept)."""
    positions: list[int] = []
    for path in sorted(Path(log_dir).glob("*.log")):
        positions += [int(line) for line in path.read_text().split()]
    return positions


def _image_item(path: str, index: int) -> dict[str, Any]:
    """Decodes an image, crops a random ``CROP`` square, flips it half the time, jitters
    its brightness: NumPy, Python and torch generators each make one choice."""
    from PIL import Image

    with open(path, "rb") as file:
        data = file.read()
    with Image.open(io.BytesIO(data)) as image:
        pixels = np.asarray(image.convert("RGB"))
    height, width = pixels.shape[:2]
    top = int(np.random.randint(0, height - CROP + 1))
    left = random.randrange(0, width - CROP + 1)
    crop = pixels[top : top + CROP, left : left + CROP]
    if torch.rand(()) < 0.5:
        crop = crop[:, ::-1]
    tensor = torch.from_numpy(np.ascontiguousarray(crop)).permute(2, 0, 1).float() / 255.0
    tensor = (tensor * (0.8 + 0.4 * torch.rand(()))).clamp_(0.0, 1.0)
    return {"image": tensor, "index": index}


def make_images(directory: Path, *, count: int = 200, fmt: str = "JPEG") -> tuple[str, ...]:
    """Writes ``count`` small images (gradients, rectangles and noise; seeded, so every
    run decodes the same bytes) and returns their paths."""
    from PIL import Image

    generator = np.random.default_rng(0)
    width, height = IMAGE_SIZE
    ys, xs = np.mgrid[0:height, 0:width]
    directory.mkdir(parents=True, exist_ok=True)
    suffix = ".jpg" if fmt == "JPEG" else ".png"
    paths = []
    for i in range(count):
        base = generator.uniform(0, 255, size=3)
        slope = generator.uniform(-1.5, 1.5, size=(2, 3))
        pixels = base + xs[..., None] * slope[0] + ys[..., None] * slope[1]
        for _ in range(4):
            x0, y0 = generator.integers(0, width - 8), generator.integers(0, height - 8)
            x1, y1 = x0 + generator.integers(8, 48), y0 + generator.integers(8, 48)
            pixels[y0:y1, x0:x1] = generator.uniform(0, 255, size=3)
        pixels = pixels + generator.normal(0, 12, size=pixels.shape)
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
        path = directory / f"{i:04d}{suffix}"
        image.save(path, fmt, quality=90) if fmt == "JPEG" else image.save(path, fmt)
        paths.append(str(path))
    return tuple(paths)


def workloads(costs_us: Sequence[float], image_paths: tuple[str, ...]) -> list[Workload]:
    """The synthetic workloads, one per cost, then the image pipeline."""
    result = [
        Workload(
            name=f"synthetic {cost:g} us" if cost < 1000 else f"synthetic {cost / 1000:g} ms",
            kind="synthetic",
            cost_us=cost,
            units=common.units_for(cost),
        )
        for cost in costs_us
    ]
    result.append(
        Workload(name="images (JPEG decode + crop/flip)", kind="images", image_paths=image_paths)
    )
    return result


class PeerDataset(SavableDataset[dict[str, Any]]):
    """The endless, worker-sharded stream of :meth:`Workload.item` (NOTE [ One dataset
    for every loader ]).

    State: ``{"pos": n}``, the items this worker produced.
    """

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.pos = 0

    def config(self) -> dict[str, Any]:
        return {"type": "PeerDataset", "workload": self.workload.config()}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        while True:
            index = self.pos * workers + worker
            self.pos += 1
            yield self.workload.item(index)

    def save_state(self) -> dict[str, int]:
        return {"pos": self.pos}

    def restore_state(self, state: Any | None) -> None:
        self.pos = 0 if state is None else int(state["pos"])

    # torch's Stateful protocol, for torchdata's StatefulDataLoader.
    def state_dict(self) -> dict[str, int]:
        return self.save_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.restore_state(state_dict)
