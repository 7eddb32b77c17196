"""Every stage passes the cursor-level resume check: every save point of three epochs,
through the state file's encoding, skips and chains, for one worker alone and for one
stream of a sharded job. In process, so a stage bug shows in a second."""

from __future__ import annotations

import io
import json
import random
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pipelines import RandomCounter, SkippingCounter, StatefulCounter

from savable_loader import WorkerContext
from savable_loader.datasets import (
    Blend,
    IndexedDataset,
    JsonLinesSource,
    TarSource,
    TokenSource,
    from_stateful,
)
from savable_loader.datasets.transforms.batch import Batch
from savable_loader.testing import ResumeMismatch, assert_cursor_resumes_exactly

ALONE = WorkerContext(rank=0, world_size=1, worker_id=0, num_workers=0, seed=0, batch_size=None)
SHARDED = WorkerContext(rank=1, world_size=2, worker_id=1, num_workers=2, seed=7, batch_size=2)


def _noisy(x: Any) -> dict[str, Any]:
    return {"x": x, "py": random.random(), "np": float(np.random.rand()), "t": torch.rand(1)}


def _augment(x: Any, rng: np.random.Generator) -> tuple[Any, float]:
    return x, float(rng.random())


def _odd(x: Any) -> bool:
    return int(x if not isinstance(x, dict) else x["index"]) % 2 == 1


def _indexed(n: int = 23) -> IndexedDataset[int]:
    return IndexedDataset(list(range(n)), shuffle=True, seed=4)


def _files(folder: Path) -> dict[str, str]:
    for file, count in enumerate([5, 0, 8, 3]):
        lines = [json.dumps({"id": file * 100 + i}) for i in range(count)]
        (folder / f"part-{file}.jsonl").write_text("\n".join(lines) + ("\n" if lines else ""))
    for file, count in enumerate([100, 37, 64]):
        tokens = np.arange(file * 1000, file * 1000 + count, dtype=np.uint16)
        (folder / f"tok-{file}.bin").write_bytes(tokens.tobytes())
    for shard in range(3):
        with tarfile.open(folder / f"shard-{shard}.tar", "w") as tar:
            for key in range(shard + 2):
                for ext in ("txt", "cls"):
                    data = f"{shard}/{key}/{ext}".encode()
                    info = tarfile.TarInfo(f"{shard:02d}{key:03d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return {
        "jsonl": str(folder / "*.jsonl"),
        "tokens": str(folder / "tok-*.bin"),
        "tar": str(folder / "*.tar"),
    }


STAGES: dict[str, Callable[[dict[str, str]], Any]] = {
    "indexed": lambda f: _indexed(),
    "indexed-unshuffled": lambda f: IndexedDataset(list(range(11))),
    "tokens": lambda f: TokenSource(f["tokens"], seq_len=8, shuffle=True, seed=1),
    "jsonl": lambda f: JsonLinesSource(f["jsonl"], shuffle_shards=True, seed=2),
    "tar": lambda f: TarSource(f["tar"], shuffle_shards=True, seed=3),
    "map-global-draws": lambda f: _indexed().map(_noisy),
    "map-seeded": lambda f: _indexed().map(_augment, seed=5),
    "filter": lambda f: _indexed().filter(_odd),
    "shuffle": lambda f: _indexed().shuffle(buffer_size=4, seed=6),
    "shuffle-of-drawing-map": lambda f: _indexed(12).map(_noisy).shuffle(buffer_size=5, seed=6),
    "limit": lambda f: _indexed().limit(7),
    "limit-longer-than-source": lambda f: _indexed(5).limit(9),
    "repeat": lambda f: _indexed(6).repeat(3),
    "endless-repeat-limited": lambda f: _indexed(6).repeat().limit(10),
    "blend-first": lambda f: Blend([_indexed(9), _indexed(14)], weights=[0.5, 0.5], seed=8),
    "blend-all": lambda f: Blend(
        [_indexed(9), _indexed(4).map(_noisy)], weights=[0.3, 0.7], seed=8, stop="all_exhausted"
    ),
    "blend-never-limited": lambda f: Blend(
        [_indexed(13), _indexed(9)], weights=[0.5, 0.5], seed=8, stop="never"
    ).limit(12),
    "batch": lambda f: Batch(_indexed(), batch_size=4),
    "batch-drop-last": lambda f: Batch(_indexed(), batch_size=4, drop_last=True),
    "batch-custom-collate": lambda f: Batch(_indexed().map(_noisy), batch_size=3, collate_fn=list),
    "your-dataset": lambda f: RandomCounter(9, uneven=True),
    "your-dataset-with-skip": lambda f: SkippingCounter(9),
    "your-dataset-batched": lambda f: Batch(SkippingCounter(9), batch_size=2),
    "from-stateful": lambda f: from_stateful(StatefulCounter(9)),
    "from-stateful-replay": lambda f: from_stateful(StatefulCounter(9), resume="replay"),
    "composed": lambda f: Blend(
        [
            JsonLinesSource(f["jsonl"])
            .filter(_odd_id)
            .map(_augment, seed=1)
            .shuffle(buffer_size=3, seed=2),
            TokenSource(f["tokens"], seq_len=4, shuffle=True).limit(5).repeat(2),
        ],
        weights=[0.6, 0.4],
        seed=3,
        stop="all_exhausted",
    ),
}


def _odd_id(record: dict[str, Any]) -> bool:
    return record["id"] % 2 == 1


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_stage_resumes_exactly_at_every_position(name: str, tmp_path: Path) -> None:
    stage = STAGES[name](_files(tmp_path))
    report = assert_cursor_resumes_exactly(stage, [ALONE, SHARDED], epochs=3)
    assert sum(sum(epochs) for epochs in report.items_per_epoch) > 0
    assert report.restores > 0


class _Forgetful(RandomCounter):
    """Forgets its epoch in save_state(): the check must catch it."""

    def save_state(self) -> dict[str, int]:
        return {"pos": self.pos, "epoch": 0}


class _OwnGenerator(RandomCounter):
    """Draws from a generator of its own that its state leaves out."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.rng = random.Random(0)

    def __iter__(self) -> Any:
        for item in super().__iter__():
            yield {**item, "own": self.rng.random()}


class _BadSkip(SkippingCounter):
    """Claims to have passed more items than it did."""

    def skip(self, n: int) -> int:
        super().skip(max(n - 1, 0))
        return n


@pytest.mark.parametrize(
    ("dataset", "fragment"),
    [
        (_Forgetful(5), "diverges"),
        (_OwnGenerator(5), "diverges"),
        (_BadSkip(6), "skip"),
    ],
    ids=["forgotten epoch", "unsaved own generator", "skip that miscounts"],
)
def test_the_check_catches_a_broken_dataset(dataset: Any, fragment: str) -> None:
    with pytest.raises(ResumeMismatch, match=fragment):
        assert_cursor_resumes_exactly(dataset, [ALONE], epochs=2)
