"""File sources read by position, ``split="global"`` (NOTE [ File sources by position ] in
datasets/file_positions.py): the same global batches on every layout of one global batch
size, restores onto other layouts, and what a restore onto another global batch keeps.
Ranks are simulated in one process with ``WorkerConfig(rank=r, world_size=R)``."""

from __future__ import annotations

import functools
import gzip
import io
import json
import operator
import tarfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from savable_loader import ConfigError, SavableDataLoader, StateError, WorkerConfig
from savable_loader.datasets import Blend, JsonLinesSource, TarSource, TokenSource
from savable_loader.testing import Shape, assert_elastic, assert_resumes_exactly, elastic_builder

SEED = 7
LAYOUTS = [Shape(2, 0, 4), Shape(4, 0, 2), Shape(1, 0, 8)]
WORKER_LAYOUTS = [Shape(2, 0, 4), Shape(4, 1, 2), Shape(1, 2, 8)]
#: Samples per file: 60 in all, which every number of ranks used divides (no padding).
SIZES = (10, 11, 12, 13, 14)


def _lines(folder: Path, compress: bool = False) -> str:
    folder.mkdir()
    for f, size in enumerate(SIZES):
        rows = "".join(json.dumps({"id": f * 100 + i}) + "\n" for i in range(size))
        if compress:
            with gzip.open(folder / f"{f}.jsonl.gz", "wt") as file:
                file.write(rows)
        else:
            (folder / f"{f}.jsonl").write_text(rows)
    return str(folder / ("*.jsonl.gz" if compress else "*.jsonl"))


def _shards(folder: Path) -> str:
    folder.mkdir()
    for f, size in enumerate(SIZES):
        with tarfile.open(folder / f"{f}.tar", "w") as tar:
            for i in range(size):
                for ext, data in (("txt", b"x" * (i * 37 % 300)), ("cls", b"%d" % (f * 100 + i))):
                    info = tarfile.TarInfo(f"{f:02d}_{i:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(folder / "*.tar")


def _noisy(row: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    return {"id": row["id"], "draw": float(rng.random())}


def _label(sample: dict[str, Any]) -> int:
    return int(sample["cls"])


def _pipeline(kind: str, tmp_path: Path) -> Callable[[], Any]:
    if kind == "tar":
        urls = _shards(tmp_path / "shards")
        return lambda: TarSource(urls, split="global", shuffle_shards=True, seed=SEED).map(_label)
    urls = _lines(tmp_path / "lines", compress=kind == "jsonl.gz")
    return lambda: JsonLinesSource(urls, split="global", shuffle_shards=True, seed=SEED).map(
        _noisy, seed=3
    )


def _builder(dataset: Callable[[], Any], **loader: Any) -> Any:
    return elastic_builder(dataset, collate_fn=list, **loader)


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "tar"])
def test_every_layout_of_one_global_batch_gives_the_same_global_batches(tmp_path, kind):
    report = assert_elastic(_builder(_pipeline(kind, tmp_path)), LAYOUTS, save_steps=[0, 3, 7])
    assert report.steps == (8, 8)  # 60 samples over a global batch of 8
    assert report.restores > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["jsonl", "tar"])
def test_layouts_with_workers_give_the_same_global_batches(tmp_path, kind):
    report = assert_elastic(_builder(_pipeline(kind, tmp_path)), WORKER_LAYOUTS, save_steps=[3])
    assert report.restores == 4


def test_a_blend_of_lines_by_position_and_tokens_is_elastic(tmp_path):
    lines = _pipeline("jsonl", tmp_path)
    tokens = tmp_path / "tokens.bin"
    np.arange(20 * 3, dtype=np.uint16).tofile(tokens)

    def _window(window: Any) -> dict[str, Any]:
        return {"id": 10_000 + int(window[0])}

    def build() -> Any:
        windows = TokenSource(str(tokens), seq_len=3, dtype="uint16", shuffle=True, seed=SEED)
        return Blend([lines(), windows.map(_window)], weights=[3, 1], seed=1, stop="all_exhausted")

    report = assert_elastic(_builder(build), LAYOUTS, save_steps=[2, 9])
    assert report.steps == (10, 10)  # 60 + 20 items


def _ids(batches: list[list[Any]]) -> list[int]:
    return [row["id"] for batch in batches for row in batch]


def _epoch_ids(build: Any, ranks: int, batch: int, states: Any = None) -> list[list[int]]:
    out = []
    for rank in range(ranks):
        with build(rank, ranks, 0, batch) as loader:
            if states is not None:
                loader.restore_state_rank(states)
            out.append(_ids(list(loader)))
    return out


def test_a_restore_onto_another_global_batch_reads_the_rest_once_then_new_lanes(tmp_path):
    build = _builder(_pipeline("jsonl", tmp_path))
    consumed, states = [], []
    for rank in range(2):
        with build(rank, 2, 0, 4) as loader:
            stream = iter(loader)
            consumed += _ids([next(stream) for _ in range(3)])
            states.append(loader.save_state_rank())
    assert all(worker.checkpoint.state["parent"]["lanes"] == 8 for worker in states[0].workers)
    rest = [i for rank in _epoch_ids(build, 3, 4, states) for i in rank]
    everything = [f * 100 + i for f, size in enumerate(SIZES) for i in range(size)]
    assert Counter(consumed + rest) == Counter(everything)  # 60 divides by 3: no padding
    following = []
    for rank in range(3):
        with build(rank, 3, 0, 4) as loader:
            loader.restore_state_rank(states)
            for _ in loader:
                pass
            following.append(_ids(list(loader)))
    fresh = []
    for rank in range(3):
        with build(rank, 3, 0, 4) as loader:
            for _ in loader:
                pass
            fresh.append(_ids(list(loader)))
    assert following == fresh  # epoch 1 laid out for 3 x 4


@pytest.mark.parametrize("workers", [0, 2])
def test_resumes_exactly(tmp_path, workers):
    dataset = _pipeline("tar", tmp_path)
    # With workers, the chains go on inline and the peek and the break after the last
    # epoch are left to the in-process case (what processes add is the workers' replay).
    assert_resumes_exactly(
        lambda: SavableDataLoader(dataset(), batch_size=3, num_workers=workers),
        epochs=2,
        inline_chains=workers > 0,
        interruptions=workers == 0,
    )


def test_more_lanes_than_readers_kept_still_read_every_sample_once(tmp_path):
    # 1 rank x batch 70: 70 lanes of at most one sample, more than the 64 readers a
    # worker keeps open; a closed reader reopens its file.
    urls = _lines(tmp_path / "lines")
    source = JsonLinesSource(urls, split="global")
    with SavableDataLoader(source, batch_size=70, collate_fn=list) as loader:
        (batch,) = list(loader)
    assert sorted(row["id"] for row in batch) == sorted(
        f * 100 + i for f, size in enumerate(SIZES) for i in range(size)
    )


def test_a_stream_stage_above_is_refused_naming_split_global(tmp_path):
    urls = _lines(tmp_path / "lines")
    keep = functools.partial(operator.is_not, None)
    with pytest.raises(ConfigError, match=r"split='global'.*filter"):
        SavableDataLoader(JsonLinesSource(urls, split="global").filter(keep), batch_size=4)


@pytest.mark.parametrize("lanes", [0, "8", None, True])
def test_malformed_lanes_in_a_state_are_refused(tmp_path, lanes):
    urls = _lines(tmp_path / "lines")
    with SavableDataLoader(JsonLinesSource(urls, split="global"), batch_size=4) as loader:
        next(iter(loader))
        state = loader.save_state_rank().to_plain()
    for worker in state["workers"]:
        worker["checkpoint"]["state"]["parent"]["lanes"] = lanes
    loader = SavableDataLoader(JsonLinesSource(urls, split="global"), batch_size=4)
    with loader, pytest.raises(StateError, match="lanes"):
        loader.restore_state_rank(state)


def test_config_names_split_global_so_a_state_of_split_samples_is_refused(tmp_path):
    urls = _lines(tmp_path / "lines")
    assert JsonLinesSource(urls, split="global").config()["split"] == "global"
    assert 'split="global"' in JsonLinesSource(urls, split="global").describe()
    with pytest.raises(ConfigError, match='"global"'):
        JsonLinesSource(urls, split="everything")


@pytest.mark.parametrize(("even", "items"), [("pad", 63), ("drop", 60)])
def test_even_evens_the_epoch_out_over_the_ranks_as_with_split_samples(tmp_path, even, items):
    # 61 samples over 3 ranks: "pad" repeats the first positions up to 63, "drop" keeps 60.
    urls = _lines(tmp_path / "lines")
    (tmp_path / "lines" / "9.jsonl").write_text(json.dumps({"id": 999}) + "\n")
    seen = []
    for rank in range(3):
        source = JsonLinesSource(urls, split="global", even=even)
        with SavableDataLoader(
            source,
            batch_size=4,
            worker_config=WorkerConfig(rank=rank, world_size=3),
            collate_fn=list,
        ) as loader:
            seen += [row["id"] for batch in loader for row in batch]
    assert len(seen) == items
    assert len(set(seen)) == min(items, 61)
