"""Sources and a composed pipeline: SavableDataLoader against the same work by hand.

For each building block, the benchmark writes small real files to a temporary folder and
reads them twice per round, alternating the order (NOTE [ Alternation ] in
``common.py``): through ``savable_loader.datasets`` in a ``SavableDataLoader``, and
through a plain torch ``DataLoader`` over a hand-written dataset doing the same reads,
parsing, sharding and shuffling, with nothing savable. Both use 2 workers, batch 32,
prefetch 2. The table reports items per second and their ratio, and the state size of
each savable pipeline (the state file of the whole loader, and one worker's pipeline
state).

Pipelines:

* ``indexed``: a map-style dataset of 20,000 small arrays, shuffled.
* ``jsonl``: 8 gzip JSON-lines files of 2,500 records each.
* ``tokens``: 4 raw uint16 token files of 2**20 tokens, windows of 256, shuffled.
* ``tar``: 8 tar shards of 300 samples (a 1 KiB ``.txt`` and a ``.cls`` each).
* ``composed``: ``Blend`` of (JSON lines -> map to 256 token ids -> filter -> window
  shuffle of 256) and (token windows -> limit 2,000 per epoch -> repeat forever), weights
  0.6 / 0.4, one epoch ending with the JSON-lines source.

    python benchmarks/bench_sources.py [--quick] [--rounds R] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import common
import msgpack
import numpy as np
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from savable_loader import SavableDataLoader
from savable_loader.datasets import Blend, IndexedDataset, JsonLinesSource, TarSource, TokenSource
from savable_loader.state.files import encode_state

BATCH = 32
WORKERS = 2
SEQ = 256
JSONL_FILES, JSONL_LINES = 8, 2500
TOKEN_FILES, TOKENS = 4, 2**20
TAR_FILES, TAR_SAMPLES = 8, 300
INDEXED_ITEMS = 20_000
COMPOSED_LIMIT = 2000
SHUFFLE_BUFFER = 256


# -- data ---------------------------------------------------------------------------------


def write_data(root: Path) -> dict[str, str]:
    """Writes every input file under ``root``; returns the glob of each kind."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    for f in range(JSONL_FILES):
        with gzip.open(root / f"part-{f:02d}.jsonl.gz", "wt") as out:
            for i in range(JSONL_LINES):
                text = " ".join(rng.choice(words, size=30))
                out.write(json.dumps({"id": f * JSONL_LINES + i, "text": text, "label": i % 5}))
                out.write("\n")
    for f in range(TOKEN_FILES):
        rng.integers(0, 50_000, size=TOKENS, dtype=np.uint16).tofile(root / f"tok-{f}.bin")
    for f in range(TAR_FILES):
        with tarfile.open(root / f"shard-{f:02d}.tar", "w") as tar:
            for i in range(TAR_SAMPLES):
                for ext, payload in (("txt", rng.bytes(1024)), ("cls", str(i % 10).encode())):
                    info = tarfile.TarInfo(f"s{f:02d}_{i:05d}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    return {
        "jsonl": str(root / "*.jsonl.gz"),
        "tokens": str(root / "tok-*.bin"),
        "tar": str(root / "shard-*.tar"),
    }


# -- the same work by hand ------------------------------------------------------------------


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def _files(pattern: str) -> list[str]:
    return sorted(str(p) for p in Path(pattern).parent.glob(Path(pattern).name))


class HandJsonLines(IterableDataset[dict[str, Any]]):
    def __init__(self, pattern: str) -> None:
        self.files = _files(pattern)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker, workers = _worker()
        for path in self.files[worker::workers]:
            with gzip.open(path, "rt") as lines:
                for line in lines:
                    if line.strip():
                        yield json.loads(line)


class HandTar(IterableDataset[dict[str, Any]]):
    def __init__(self, pattern: str) -> None:
        self.files = _files(pattern)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker, workers = _worker()
        for path in self.files[worker::workers]:
            sample: dict[str, Any] = {}
            with tarfile.open(path, "r|") as tar:
                for member in tar:
                    key, ext = member.name.split(".", 1)
                    if sample and sample["__key__"] != key:
                        yield sample
                        sample = {}
                    data = tar.extractfile(member)
                    sample.setdefault("__key__", key)
                    sample["__url__"] = path
                    sample[ext] = data.read() if data is not None else b""
            if sample:
                yield sample


class HandTokens(Dataset[np.ndarray]):
    def __init__(self, pattern: str) -> None:
        self.files = _files(pattern)
        self.windows = [Path(f).stat().st_size // 2 // SEQ for f in self.files]
        self.starts = np.cumsum([0, *self.windows])
        self._maps: list[np.memmap] | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        if self._maps is None:
            self._maps = [np.memmap(f, dtype=np.uint16, mode="r") for f in self.files]
        f = int(np.searchsorted(self.starts, index, side="right")) - 1
        offset = (index - int(self.starts[f])) * SEQ
        return np.asarray(self._maps[f][offset : offset + SEQ], dtype=np.int64)


class HandArrays(Dataset[np.ndarray]):
    def __len__(self) -> int:
        return INDEXED_ITEMS

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(16, index, dtype=np.int64)


def to_ids(record: dict[str, Any]) -> np.ndarray:
    """A JSON record's text as SEQ byte values, padded with zeros (a stand-in tokenizer)."""
    raw = np.frombuffer(record["text"].encode()[:SEQ], dtype=np.uint8).astype(np.int64)
    return np.pad(raw, (0, SEQ - len(raw)))


def keep(ids: np.ndarray) -> bool:
    return int(ids[0]) % 7 != 0


class HandComposed(IterableDataset[np.ndarray]):
    """The composed pipeline by hand: same reads, map, filter, window shuffle and mix."""

    def __init__(self, patterns: dict[str, str]) -> None:
        self.text = HandJsonLines(patterns["jsonl"])
        self.tokens = HandTokens(patterns["tokens"])

    def _text(self, rng: np.random.Generator) -> Iterator[np.ndarray]:
        window: list[np.ndarray] = []
        for record in self.text:
            ids = to_ids(record)
            if keep(ids):
                window.append(ids)
            if len(window) == SHUFFLE_BUFFER:
                yield from (window[i] for i in rng.permutation(len(window)))
                window = []
        yield from (window[i] for i in rng.permutation(len(window)))

    def _tokens(self) -> Iterator[np.ndarray]:
        worker, workers = _worker()
        mine = range(worker, len(self.tokens), workers)
        while True:
            for i in mine[:COMPOSED_LIMIT]:
                yield self.tokens[i]

    def __iter__(self) -> Iterator[np.ndarray]:
        rng = np.random.default_rng(_worker()[0])
        sources = [self._text(rng), self._tokens()]
        while True:
            choice = 0 if rng.random() < 0.6 else 1
            item = next(sources[choice], None)
            if item is None:
                return
            yield item


# -- the savable pipelines ------------------------------------------------------------------


def savable(name: str, patterns: dict[str, str]) -> Any:
    if name == "indexed":
        return IndexedDataset(HandArrays(), shuffle=True, seed=0)
    if name == "jsonl":
        return JsonLinesSource(patterns["jsonl"])
    if name == "tokens":
        return TokenSource(patterns["tokens"], seq_len=SEQ, shuffle=True, seed=0)
    if name == "tar":
        return TarSource(patterns["tar"])
    if name == "composed":
        text = JsonLinesSource(patterns["jsonl"]).map(to_ids).filter(keep)
        tokens = TokenSource(patterns["tokens"], seq_len=SEQ).limit(COMPOSED_LIMIT).repeat()
        return Blend(
            [text.shuffle(buffer_size=SHUFFLE_BUFFER, seed=1), tokens],
            weights=[0.6, 0.4],
            seed=2,
        )
    raise ValueError(name)


def by_hand(name: str, patterns: dict[str, str]) -> tuple[Any, bool]:
    """The hand-written dataset and whether torch should shuffle it (map-style)."""
    return {
        "indexed": (HandArrays(), True),
        "jsonl": (HandJsonLines(patterns["jsonl"]), False),
        "tokens": (HandTokens(patterns["tokens"]), True),
        "tar": (HandTar(patterns["tar"]), False),
        "composed": (HandComposed(patterns), False),
    }[name]


def _collate_tar(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return batch


def loaders(name: str, patterns: dict[str, str]) -> dict[str, Callable[[], Any]]:
    collate = _collate_tar if name == "tar" else None
    dataset, shuffle = by_hand(name, patterns)

    def ours() -> Any:
        return SavableDataLoader(
            savable(name, patterns),
            batch_size=BATCH,
            num_workers=WORKERS,
            collate_fn=collate,
            shuffle=None,
        )

    def torch_loader() -> Any:
        return DataLoader(
            dataset,
            batch_size=BATCH,
            num_workers=WORKERS,
            collate_fn=collate,
            shuffle=shuffle,
            persistent_workers=True,
        )

    return {"ours": ours, "torch": torch_loader}


def batch_rows(batch: Any) -> int:
    """Items in a collated batch: a tensor's first dimension, a dict's first column's."""
    if isinstance(batch, dict):
        return batch_rows(next(iter(batch.values())))
    if isinstance(batch, list):
        return len(batch)
    return int(batch.shape[0])


def measure(build: Callable[[], Any]) -> dict[str, float]:
    """Items per second over one epoch (start-up included: sources open files then)."""
    loader = build()
    try:
        began = time.perf_counter()
        items = 0
        for batch in loader:
            items += batch_rows(batch)
        return {"items": items, "seconds": time.perf_counter() - began}
    finally:
        common.close_loader(loader)


def state_sizes(name: str, patterns: dict[str, str]) -> tuple[int, int]:
    """(state file bytes, largest worker pipeline state bytes) halfway through an epoch."""
    loader = SavableDataLoader(savable(name, patterns), batch_size=BATCH, num_workers=WORKERS)
    try:
        iterator = iter(loader)
        for _ in range(40):
            next(iterator)
        state = loader.save_state_rank()
        # The pipeline's own state, under the loader's batching stage, as msgpack.
        pipeline = max(
            len(msgpack.packb(w.checkpoint.state["parent"], use_bin_type=True))
            for w in state.workers
            if w.checkpoint is not None
        )
        return len(encode_state(state)), pipeline
    finally:
        loader.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 rounds, results not written")
    parser.add_argument("--only", default="indexed,jsonl,tokens,tar,composed")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    names = args.only.split(",")
    rows = []
    samples: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-sources-") as folder:
        patterns = write_data(Path(folder))
        for name in names:
            results = common.alternate(
                {kind: (lambda b=b: measure(b)) for kind, b in loaders(name, patterns).items()},
                rounds,
                progress=name,
            )
            rates = {k: [r["items"] / r["seconds"] for r in v] for k, v in results.items()}
            if results["ours"][0]["items"] != results["torch"][0]["items"] and name != "composed":
                raise SystemExit(
                    f"{name}: ours read {results['ours'][0]['items']} items, by hand "
                    f"{results['torch'][0]['items']}: the two do not do the same work"
                )
            file_bytes, pipeline_bytes = state_sizes(name, patterns)
            samples[name] = rates
            rows.append(
                {
                    "pipeline": name,
                    "items/epoch ours": results["ours"][0]["items"],
                    "items/epoch by hand": results["torch"][0]["items"],
                    "by hand items/s": common.median(rates["torch"]),
                    "ours items/s": common.median(rates["ours"]),
                    "ratio ours/by hand": common.paired_ratio(rates["ours"], rates["torch"]),
                    "state file bytes": file_bytes,
                    "pipeline state bytes/worker": pipeline_bytes,
                }
            )
    common.write_results(
        "bench_sources",
        title="Sources and a composed pipeline: SavableDataLoader vs the same work by hand",
        parameters={
            "batch_size": BATCH,
            "num_workers": WORKERS,
            "rounds": rounds,
            "seq_len": SEQ,
            "quick": args.quick,
        },
        columns=list(rows[0]),
        rows=rows,
        notes=[
            f"{WORKERS} workers, batch {BATCH}, prefetch 2; one epoch per measurement, worker "
            "start-up included; medians over alternating rounds; ratio = median of per-round "
            "ratios.",
            "By hand: a plain torch DataLoader over a hand-written dataset doing the same "
            "reads, parsing, sharding and shuffling, with nothing savable.",
            "State file bytes: the whole loader state (save_state_rank, msgpack with header), "
            "dominated by each worker's captured global generator states (~10 KB per "
            "worker); pipeline state bytes: one worker's savable_loader.datasets state.",
            "composed: the by-hand version draws its mixing and shuffling from one generator "
            "per worker, so its epoch holds a different (similar) number of items.",
        ],
        samples=samples,
        write=not args.quick,
    )


if __name__ == "__main__":
    main()
