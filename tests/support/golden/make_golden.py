"""Writes the golden state files ``tests/support/golden/*.msgpack`` (run once per format
change).

Usage: ``python tests/support/golden/make_golden.py``. Each file is a state saved by this
version of savable_loader from a pipeline built here with fixed seeds;
``tests/resume/test_golden.py`` restores each into a freshly built loader and checks the
continuation against an uninterrupted run, so a file pins both the format and the
meaning of a state. Committed files must keep loading in later versions: the script
writes only the files that are missing (delete one to write it again), so a run never
rewrites a committed file; rewrite them only together with a deliberate
``FORMAT_VERSION`` bump.

NOTE [ Golden pipelines are pinned ]
A state holds the fingerprint of its pipeline's ``config()``, which names the functions
a stage applies by ``module.qualname`` (``make_golden._noisy``: the script imports
itself under that name, as the test does) and the files a source reads by URL; a file
source's state also holds byte offsets into its files. So the functions below keep their
names, and the file sources read ``memory://`` files that :func:`write_memory_files`
generates byte for byte the same on every machine (the builders call it before building
a pipeline; :data:`MEMORY_DIGEST` pins the bytes). The file sources pass
``split="files"``: the goldens were saved before ``split="samples"`` became the default,
and that is how a user continues such a state (NOTE [ Shard listing and assignment ]). Worker processes see these functions
and files through ``fork``, the default start method on Linux up to Python 3.13.

NOTE [ Derived goldens ]
A golden with ``restored`` set is saved by a loader that first restored the committed
file of another golden (a single state: a chain; a list of every rank's state saved on
another layout: an elastic restore), then took its items. Its reference is that live
loader's continuation, which the test recomputes from the same committed file.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import random
import sys
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import torch
from torch.utils.data import get_worker_info
from torchdata.nodes import IterableWrapper, Mapper

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from pipelines import RandomCounter, Squares, StatefulCounter  # noqa: E402

from savable_loader import (  # noqa: E402
    RankState,
    SavableDataLoader,
    WorkerConfig,
    load_state,
    save_state,
)
from savable_loader.datasets import (  # noqa: E402
    Blend,
    Filter,
    IndexedDataset,
    JsonLinesSource,
    Limit,
    Map,
    Repeat,
    Shuffle,
    TarSource,
    TokenSource,
    from_stateful,
)


@dataclass(frozen=True)
class Golden:
    """One golden file: how to build its loader and where its state was saved.

    Attributes:
        name: File name without ``.msgpack``.
        build: Builds the loader of a rank (``rank``, ``world_size``).
        taken: Items each rank took before saving, in rank order, over epochs (``-1``:
            to the end of the epoch, then the state is saved between epochs). A file
            holds a list of every rank's state when there are several ranks, else one.
        restored: The golden whose committed file each rank's loader restored before
            taking its items (NOTE [ Derived goldens ]); None: a fresh loader.
    """

    name: str
    build: Callable[[int, int], SavableDataLoader]
    taken: tuple[int, ...]
    restored: str | None = None

    @property
    def path(self) -> Path:
        return HERE / f"{self.name}.msgpack"

    @property
    def world_size(self) -> int:
        return len(self.taken)


# -- files on the memory filesystem (NOTE [ Golden pipelines are pinned ]) ---------------

MEMORY = "memory:///savable-loader-golden"
#: sha256 over the names and bytes of :func:`memory_files`, in name order.
MEMORY_DIGEST = "42482b769a8a6740a3fcac0b7bcd0c2865fcb447e68e2c98ecac85fd1a2330d9"
JSONL_LINES = (5, 8, 3, 6, 4, 7, 2)
TOKEN_LENGTHS = (70, 45, 58)
TAR_SAMPLES = (4, 6, 3)


def _jsonl_bytes(file: int, count: int) -> bytes:
    return "".join(
        f'{{"id": {100 * file + line}, "text": "record {file}-{line}"}}\n' for line in range(count)
    ).encode()


def _tar_bytes(shard: int, count: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for sample in range(count):
            key = f"s{shard}/{sample:04d}"
            for ext, data in (("txt", f"sample {shard}-{sample}"), ("cls", str(sample % 3))):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data.encode())
                info.mtime = 0
                info.mode = 0o644
                info.uid = info.gid = 0
                info.uname = info.gname = "golden"
                tar.addfile(info, io.BytesIO(data.encode()))
    return buffer.getvalue()


def memory_files() -> dict[str, bytes]:
    """The golden sources' files: path under :data:`MEMORY` to bytes."""
    files: dict[str, bytes] = {}
    for file, count in enumerate(JSONL_LINES):
        files[f"jsonl/part-{file}.jsonl"] = _jsonl_bytes(file, count)
        files[f"jsonl-gz/part-{file}.jsonl.gz"] = gzip.compress(_jsonl_bytes(file, count), mtime=0)
    for file, count in enumerate(TOKEN_LENGTHS):
        tokens = np.arange(1000 * file, 1000 * file + count, dtype=np.uint16)
        files[f"tokens/tok-{file}.bin"] = tokens.tobytes()
    for shard, count in enumerate(TAR_SAMPLES):
        files[f"tar/shard-{shard}.tar"] = _tar_bytes(shard, count)
    return files


def memory_digest() -> str:
    hasher = hashlib.sha256()
    for name, data in sorted(memory_files().items()):
        hasher.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return hasher.hexdigest()


def write_memory_files() -> None:
    """Writes :func:`memory_files` to fsspec's memory filesystem (idempotent)."""
    fs = fsspec.filesystem("memory")
    for name, data in memory_files().items():
        fs.pipe_file(f"{MEMORY}/{name}", data)


def _urls(folder: str, names: list[str]) -> list[str]:
    write_memory_files()
    return [f"{MEMORY}/{folder}/{name}" for name in names]


def _jsonl_urls(folder: str = "jsonl", suffix: str = "") -> list[str]:
    return _urls(folder, [f"part-{f}.jsonl{suffix}" for f in range(len(JSONL_LINES))])


# -- functions the stages apply (their qualnames are in the fingerprints) ----------------


def _noisy(item: int) -> dict[str, Any]:
    """Draws from the global ``random`` and torch generators."""
    return {"value": item, "py": random.random(), "torch": torch.rand(2)}


def _augment(item: int, rng: np.random.Generator) -> dict[str, Any]:
    return {"value": item, "draw": float(rng.random())}


def _keep(item: dict[str, Any]) -> bool:
    return int(item["index"]) % 3 != 1


def _keep_value(item: dict[str, Any]) -> bool:
    return int(item["value"]) % 5 != 2


def _collate(batch: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A custom collate: the indices and the sum of the noise."""
    indices = torch.tensor([item["index"] for item in batch])
    return indices, torch.stack([item["noise"] for item in batch]).sum(0)


def _from_indexed(item: dict[str, Any]) -> dict[str, Any]:
    return {"source": 0, "value": item["index"], "noise": item["noise"][:1]}


def _from_counter(item: dict[str, Any]) -> dict[str, Any]:
    return {"source": 1, "value": item["index"], "noise": item["torch"][:1]}


def _record_to_ids(record: dict[str, Any]) -> np.ndarray:
    """A record as 8 int64 values: its id, then its text's first bytes."""
    raw = np.frombuffer(record["text"].encode()[:7], dtype=np.uint8).astype(np.int64)
    return np.concatenate([[record["id"]], np.pad(raw, (0, 7 - len(raw)))])


def _odd_id(ids: np.ndarray) -> bool:
    return int(ids[0]) % 4 != 3


def _swap(ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    out = ids.copy()
    i, j = rng.integers(1, len(ids), size=2)
    out[i], out[j] = out[j], out[i]
    return out


def _as_int64(window: np.ndarray) -> np.ndarray:
    return window.astype(np.int64)


def _record_id(record: dict[str, Any]) -> dict[str, Any]:
    return {"id": record["id"], "noise": float(torch.rand(()))}


class _Shard:
    """Counts 0..n-1, keeping this worker's items (a torchdata node shards itself)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(worker, self.n, workers))


def _node_item(index: int) -> dict[str, Any]:
    return {"index": index, "noise": torch.rand(2)}


# -- builders ----------------------------------------------------------------------------


def _no_workers(rank: int, world_size: int) -> SavableDataLoader:
    return SavableDataLoader(RandomCounter(20), batch_size=2, seed=7)


def _two_workers(rank: int, world_size: int) -> SavableDataLoader:
    return SavableDataLoader(RandomCounter(18, uneven=True), batch_size=2, num_workers=2, seed=3)


def _between_epochs(rank: int, world_size: int) -> SavableDataLoader:
    return SavableDataLoader(RandomCounter(12), batch_size=3, num_workers=2, seed=5)


def _two_ranks(rank: int, world_size: int) -> SavableDataLoader:
    return SavableDataLoader(
        Squares(30),
        batch_size=4,
        shuffle=True,
        seed=11,
        worker_config=WorkerConfig(rank=rank, world_size=world_size),
    )


def _indexed_shuffled(rank: int, world_size: int) -> SavableDataLoader:
    source = IndexedDataset(Squares(23), shuffle=True, seed=13)
    return SavableDataLoader(source, batch_size=2, num_workers=2, seed=13)


def _uneven_three_workers(rank: int, world_size: int) -> SavableDataLoader:
    return SavableDataLoader(RandomCounter(8, uneven=True), batch_size=2, num_workers=3, seed=17)


def _no_batching(rank: int, world_size: int) -> SavableDataLoader:
    return SavableDataLoader(RandomCounter(9), batch_size=None, num_workers=1, seed=19)


def _drop_last(rank: int, world_size: int) -> SavableDataLoader:
    return SavableDataLoader(
        RandomCounter(11), batch_size=3, num_workers=2, drop_last=True, seed=23
    )


def _custom_collate(rank: int, world_size: int) -> SavableDataLoader:
    return SavableDataLoader(
        Squares(14), batch_size=3, num_workers=1, collate_fn=_collate, shuffle=True, seed=29
    )


def _last_partial_batch(rank: int, world_size: int) -> SavableDataLoader:
    return SavableDataLoader(
        RandomCounter(10),
        batch_size=3,
        num_workers=2,
        seed=31,
        worker_config=WorkerConfig(checkpoint_share=1.0),
    )


def _jsonl_source(rank: int, world_size: int) -> SavableDataLoader:
    source = JsonLinesSource(_jsonl_urls(), shuffle_shards=True, seed=4, split="files")
    return SavableDataLoader(source, batch_size=2, num_workers=2, seed=37)


def _tokens(rank: int, world_size: int) -> SavableDataLoader:
    urls = _urls("tokens", [f"tok-{f}.bin" for f in range(len(TOKEN_LENGTHS))])
    source = TokenSource(urls, seq_len=8, shuffle=True, seed=6)
    return SavableDataLoader(source, batch_size=2, num_workers=2, seed=41)


def _tar_shards(rank: int, world_size: int) -> SavableDataLoader:
    source = TarSource(
        _urls("tar", [f"shard-{s}.tar" for s in range(len(TAR_SAMPLES))]), split="files"
    )
    return SavableDataLoader(source, batch_size=None, num_workers=1, seed=43)


def _map_global(rank: int, world_size: int) -> SavableDataLoader:
    source = Map(IndexedDataset(list(range(13)), shuffle=True, seed=2), _noisy)
    return SavableDataLoader(source, batch_size=2, seed=47)


def _map_seeded(rank: int, world_size: int) -> SavableDataLoader:
    source = Map(IndexedDataset(list(range(17))), _augment, seed=5)
    return SavableDataLoader(source, batch_size=2, num_workers=2, seed=53)


def _filter(rank: int, world_size: int) -> SavableDataLoader:
    source = Filter(RandomCounter(20), _keep)
    return SavableDataLoader(source, batch_size=2, num_workers=1, seed=59)


def _shuffle_buffer(rank: int, world_size: int) -> SavableDataLoader:
    source = Shuffle(RandomCounter(20), buffer_size=5, seed=8)
    return SavableDataLoader(source, batch_size=2, seed=61)


def _blend(rank: int, world_size: int) -> SavableDataLoader:
    first = Map(IndexedDataset(Squares(14), shuffle=True, seed=1), _from_indexed)
    second = Map(RandomCounter(11), _from_counter)
    source = Blend([first, second], weights=[0.6, 0.4], seed=9, stop="all_exhausted")
    return SavableDataLoader(source, batch_size=2, num_workers=2, seed=67)


def _limit(rank: int, world_size: int) -> SavableDataLoader:
    source = Limit(IndexedDataset(Squares(30), shuffle=True, seed=3), 7)
    return SavableDataLoader(source, batch_size=2, num_workers=1, seed=71)


def _repeat(rank: int, world_size: int) -> SavableDataLoader:
    return SavableDataLoader(Repeat(RandomCounter(5), 3), batch_size=2, seed=73)


def _composed(rank: int, world_size: int) -> SavableDataLoader:
    text = (
        JsonLinesSource(_jsonl_urls(), shuffle_shards=True, seed=5, split="files")
        .map(_record_to_ids)
        .filter(_odd_id)
        .map(_swap, seed=9)
        .shuffle(buffer_size=4, seed=1)
    )
    urls = _urls("tokens", [f"tok-{f}.bin" for f in range(len(TOKEN_LENGTHS))])
    windows = TokenSource(urls, seq_len=8, shuffle=True, seed=3).map(_as_int64).limit(3).repeat(2)
    source = Blend([text, windows], weights=[0.6, 0.4], seed=2, stop="all_exhausted")
    return SavableDataLoader(source, batch_size=2, num_workers=2, seed=79)


def _stateful(rank: int, world_size: int) -> SavableDataLoader:
    return SavableDataLoader(
        from_stateful(StatefulCounter(15)), batch_size=2, num_workers=2, seed=83
    )


def _torchdata_node(rank: int, world_size: int) -> SavableDataLoader:
    node = Mapper(IterableWrapper(_Shard(13)), _node_item)
    return SavableDataLoader(from_stateful(node), batch_size=2, num_workers=1, seed=89)


def _elastic_indexed(num_workers: int, rank: int, world_size: int) -> SavableDataLoader:
    source = (
        IndexedDataset(list(range(41)), shuffle=True, seed=7)
        .map(_augment, seed=3)
        .filter(_keep_value)
        .limit(9)
    )
    return SavableDataLoader(
        source,
        batch_size=2,
        num_workers=num_workers,
        seed=97,
        worker_config=WorkerConfig(rank=rank, world_size=world_size),
    )


def _elastic_indexed_2_workers(rank: int, world_size: int) -> SavableDataLoader:
    return _elastic_indexed(2, rank, world_size)


def _elastic_indexed_3_workers(rank: int, world_size: int) -> SavableDataLoader:
    return _elastic_indexed(3, rank, world_size)


def _elastic_jsonl(num_workers: int, rank: int, world_size: int) -> SavableDataLoader:
    source = JsonLinesSource(
        _jsonl_urls("jsonl-gz", ".gz"), shuffle_shards=True, seed=6, split="files"
    )
    return SavableDataLoader(
        source.map(_record_id),
        batch_size=2,
        num_workers=num_workers,
        seed=101,
        worker_config=WorkerConfig(rank=rank, world_size=world_size),
    )


def _elastic_jsonl_2_workers(rank: int, world_size: int) -> SavableDataLoader:
    return _elastic_jsonl(2, rank, world_size)


def _elastic_jsonl_3_workers(rank: int, world_size: int) -> SavableDataLoader:
    return _elastic_jsonl(3, rank, world_size)


GOLDENS = (
    Golden("rank_0_workers", _no_workers, (5,)),
    Golden("rank_2_workers_mid_epoch", _two_workers, (7,)),
    Golden("rank_between_epochs", _between_epochs, (-1,)),
    Golden("global_2_ranks", _two_ranks, (2, 3)),
    # Loader features.
    Golden("indexed_shuffled_2_workers", _indexed_shuffled, (5,)),
    Golden("uneven_3_workers_one_ended", _uneven_three_workers, (13,)),
    Golden("no_batching", _no_batching, (13,)),
    Golden("drop_last", _drop_last, (4,)),
    Golden("custom_collate", _custom_collate, (3,)),
    Golden("last_partial_batch", _last_partial_batch, (4,)),
    # Sources.
    Golden("jsonl_shuffled_shards", _jsonl_source, (5,)),
    Golden("tokens_shuffled", _tokens, (3,)),
    Golden("tar_shards", _tar_shards, (4,)),
    # Transforms.
    Golden("map_global_generators", _map_global, (3,)),
    Golden("map_seeded", _map_seeded, (3,)),
    Golden("filter", _filter, (4,)),
    Golden("shuffle_mid_window", _shuffle_buffer, (3,)),
    Golden("blend", _blend, (5,)),
    Golden("limit", _limit, (6,)),
    Golden("repeat", _repeat, (5,)),
    Golden("composed", _composed, (5,)),
    # Adapters.
    Golden("from_stateful", _stateful, (3,)),
    Golden("torchdata_node", _torchdata_node, (3,)),
    # Elastic: lists of every rank's state, and states saved after restoring them onto
    # another layout.
    Golden("elastic_indexed_2_ranks", _elastic_indexed_2_workers, (3, 2)),
    Golden(
        "elastic_indexed_resharded",
        _elastic_indexed_3_workers,
        (2,),
        restored="elastic_indexed_2_ranks",
    ),
    Golden("elastic_jsonl_2_ranks", _elastic_jsonl_2_workers, (2, 3)),
    Golden(
        "elastic_jsonl_resharded", _elastic_jsonl_3_workers, (2,), restored="elastic_jsonl_2_ranks"
    ),
    # A chain: restored, a few items taken, saved again.
    Golden("chain_after_restore", _two_workers, (3,), restored="rank_2_workers_mid_epoch"),
)
BY_NAME = {golden.name: golden for golden in GOLDENS}


def positioned(golden: Golden, rank: int) -> SavableDataLoader:
    """Returns rank ``rank``'s loader standing where ``golden``'s state was saved: built,
    restored from the committed file of ``golden.restored`` (if any), its items taken."""
    return position(golden, rank)[0]


def position(golden: Golden, rank: int) -> tuple[SavableDataLoader, Any]:
    """:func:`positioned`, with the iterator that took the last item (None if none did):
    the rest of that epoch comes from it, a new ``iter()`` starting the next epoch."""
    loader = golden.build(rank, golden.world_size)
    iterator = None
    try:
        if golden.restored is not None:
            loader.restore_state_rank(load_state(BY_NAME[golden.restored].path))
        taken = golden.taken[rank]
        if taken < 0:
            for _ in loader:
                pass
        while taken > 0:  # over epochs; stops right after the last item taken
            iterator = iter(loader)
            for _ in iterator:
                taken -= 1
                if taken == 0:
                    break
    except BaseException:
        loader.close()
        raise
    return loader, iterator


def saved_state(golden: Golden, rank: int) -> RankState:
    """Builds rank ``rank``'s loader, takes its items and returns its saved state."""
    with positioned(golden, rank) as loader:
        return loader.save_state_rank()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for golden in GOLDENS:
        if golden.path.exists():
            continue
        states = [saved_state(golden, rank) for rank in range(golden.world_size)]
        save_state(states if golden.world_size > 1 else states[0], golden.path)
        logging.info("wrote %s", golden.path.relative_to(HERE.parents[2]))


if __name__ == "__main__":
    # Run as ``make_golden``, the name the test imports it under, so that the functions
    # above have the qualnames the fingerprints hold (NOTE [ Golden pipelines are pinned ]).
    import make_golden

    make_golden.main()
