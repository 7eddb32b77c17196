"""TokenSource: windows of flat token files, exact resume, sharding, lazy file access."""

from __future__ import annotations

import pickle
import tracemalloc
from collections import Counter
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from stage_harness import check_stage

from savable_loader import ConfigError, SavableDataLoader, WorkerContext
from savable_loader.datasets.files.tokens import TokenSource

slow = pytest.mark.slow
SEQ = 8
# Uneven lengths: tails of 3, 0 and 7 tokens are dropped, one file has no window at all.
BIN_SIZES = [83, 48, 5, 71]
NPY_SIZES = [45, 60]


def _write(tmp_path: Path) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    bins = [rng.integers(0, 2**16, size, dtype=np.uint16) for size in BIN_SIZES]
    for i, tokens in enumerate(bins):
        tokens.tofile(tmp_path / f"part-{i}.bin")
    npys = [rng.integers(0, 2**32, size, dtype=np.uint32) for size in NPY_SIZES]
    for i, tokens in enumerate(npys):
        np.save(tmp_path / f"shard-{i}.npy", tokens)
    return {"bin": bins, "npy": npys}


@pytest.fixture
def files(tmp_path: Path) -> dict[str, list[np.ndarray]]:
    return _write(tmp_path)


def _windows(arrays: list[np.ndarray]) -> list[tuple[int, ...]]:
    return [
        tuple(int(t) for t in a[i : i + SEQ])
        for a in arrays
        for i in range(0, len(a) - SEQ + 1, SEQ)
    ]


def _source(tmp_path: Path, kind: str = "bin", **kwargs: object) -> TokenSource:
    pattern, dtype = (
        (f"{tmp_path}/part-*.bin", "uint16") if kind == "bin" else (f"{tmp_path}/*.npy", "uint32")
    )
    return TokenSource(pattern, seq_len=SEQ, dtype=dtype, **kwargs)  # type: ignore[arg-type]


def _context(rank: int, world: int, worker: int, workers: int, batch: int | None) -> WorkerContext:
    return WorkerContext(rank, world, worker, workers, 0, batch)


def _epoch(source: TokenSource, context: WorkerContext) -> list[np.ndarray]:
    return list(source.cursor(context))


@pytest.mark.parametrize("kind", ["bin", "npy"])
def test_windows_are_the_file_contents_in_order(
    tmp_path: Path, files: dict[str, list[np.ndarray]], kind: str
) -> None:
    source = _source(tmp_path, kind)
    items = _epoch(source, _context(0, 1, 0, 0, None))
    assert all(item.dtype == np.int64 and item.shape == (SEQ,) for item in items)
    assert [tuple(int(t) for t in item) for item in items] == _windows(files[kind])
    assert len(source.windows) == len(_windows(files[kind]))


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("batch", [None, 2])
def test_every_window_once_per_epoch_over_ranks_and_workers(
    tmp_path: Path, files: dict[str, list[np.ndarray]], shuffle: bool, batch: int | None
) -> None:
    source = _source(tmp_path, "bin", shuffle=shuffle, seed=5)
    expected = Counter(_windows(files["bin"]))
    orders = []
    for epoch in range(2):
        seen: Counter[tuple[int, ...]] = Counter()
        order = []
        for rank in range(2):
            for worker in range(3):
                cursor = source.cursor(_context(rank, 2, worker, 3, batch))
                cursor.restore({"epoch": epoch, "pos": 0, "order": 2})
                items = [tuple(int(t) for t in item) for item in cursor]
                seen.update(items)
                order += items
        assert seen == expected
        orders.append(order)
    assert (orders[0] != orders[1]) == shuffle


def test_loader_batches_are_long_tensors(
    tmp_path: Path, files: dict[str, list[np.ndarray]]
) -> None:
    batches = list(SavableDataLoader(_source(tmp_path, "npy"), batch_size=2))
    assert batches[0].dtype == torch.int64
    assert batches[0].shape == (2, SEQ)
    flat = [tuple(row.tolist()) for batch in batches for row in batch]
    assert flat == _windows(files["npy"])


CASES = [(False, 2, "bin"), (True, None, "npy"), (True, 2, "bin")]


@pytest.mark.parametrize(("shuffle", "batch", "kind"), CASES)
def test_resumes_exactly_without_workers(
    tmp_path: Path, files: dict[str, list[np.ndarray]], shuffle: bool, batch: int | None, kind: str
) -> None:
    check_stage(
        lambda: _source(tmp_path, kind, shuffle=shuffle, seed=1), num_workers=0, batch_size=batch
    )


@pytest.mark.parametrize(("shuffle", "batch", "kind"), [CASES[0], CASES[2]])
def test_resumes_exactly_sharded(
    tmp_path: Path, files: dict[str, list[np.ndarray]], shuffle: bool, batch: int | None, kind: str
) -> None:
    """Stream 1 of 2 in process (NOTE [ Stages in process ] in stage_harness.py); the
    next test reads through worker processes, each mapping the files itself."""
    check_stage(
        lambda: _source(tmp_path, kind, shuffle=shuffle, seed=1),
        num_workers=0,
        batch_size=batch,
        dense=not shuffle,
        sharded=True,
    )


@slow
def test_resumes_exactly_with_workers(tmp_path: Path, files: dict[str, list[np.ndarray]]) -> None:
    shuffle, batch, kind = CASES[1]
    check_stage(
        lambda: _source(tmp_path, kind, shuffle=shuffle, seed=1),
        num_workers=2,
        batch_size=batch,
        dense=not shuffle,
    )


def test_reading_a_window_does_not_read_the_file(tmp_path: Path) -> None:
    tokens = 4_000_000  # 8 MB of uint16
    np.zeros(tokens, dtype=np.uint16).tofile(tmp_path / "big.bin")
    source = TokenSource(str(tmp_path / "big.bin"), seq_len=1024)
    cursor = source.cursor(_context(0, 1, 0, 0, None))
    cursor.skip(1000)
    tracemalloc.start()
    try:
        for _ in range(5):
            next(cursor)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"reading 5 windows allocated {peak} bytes"


def test_pickling_drops_open_files(tmp_path: Path, files: dict[str, list[np.ndarray]]) -> None:
    source = _source(tmp_path, "bin")
    before = len(pickle.dumps(source))
    _epoch(source, _context(0, 1, 0, 0, None))
    assert any(isinstance(h, np.memmap) for h in source.windows._open.values())
    assert len(pickle.dumps(source)) == before
    copy = pickle.loads(pickle.dumps(source))
    assert [w.tolist() for w in _epoch(copy, _context(0, 1, 0, 0, None))] == [
        list(w) for w in _windows(files["bin"])
    ]


def test_fsspec_urls_are_read_by_byte_range() -> None:
    fs = fsspec.filesystem("memory")
    arrays = [np.arange(size, dtype=np.uint16) + 1000 * i for i, size in enumerate([30, 21])]
    try:
        for i, tokens in enumerate(arrays):
            fs.pipe_file(f"/tokens-test/{i}.bin", tokens.tobytes())
        source = TokenSource("memory://tokens-test/*.bin", seq_len=SEQ)
        assert source.config()["urls"] == [
            "memory:///tokens-test/0.bin",
            "memory:///tokens-test/1.bin",
        ]
        assert source.config()["sizes"] == [30, 21]
        items = _epoch(source, _context(0, 1, 0, 0, None))
        assert [tuple(int(t) for t in item) for item in items] == _windows(arrays)
        check_stage(lambda: TokenSource("memory://tokens-test/*.bin", seq_len=4), num_workers=0)
    finally:
        fs.rm("/tokens-test", recursive=True)


def test_config_and_describe(tmp_path: Path, files: dict[str, list[np.ndarray]]) -> None:
    source = _source(tmp_path, "bin", shuffle=True, seed=3)
    config = source.config()
    assert config == {
        "type": "TokenSource",
        "urls": [str(tmp_path / f"part-{i}.bin") for i in range(4)],
        "sizes": BIN_SIZES,
        "seq_len": SEQ,
        "dtype": "uint16",
        "shuffle": True,
        "seed": 3,
    }
    assert str(source) == "TokenSource(4 files, seq_len=8)"
    assert (
        str(TokenSource(str(tmp_path / "part-0.bin"), seq_len=4))
        == "TokenSource(1 file, seq_len=4)"
    )
    explicit = TokenSource(
        [str(tmp_path / "part-1.bin"), str(tmp_path / "part-0.bin")], seq_len=SEQ
    )
    assert explicit.config()["sizes"] == [48, 83]


def test_bad_files_and_arguments_are_refused(
    tmp_path: Path, files: dict[str, list[np.ndarray]]
) -> None:
    np.save(tmp_path / "x.npy", np.zeros(9, dtype=np.uint16))
    with pytest.raises(ConfigError, match="uint16 tokens, not dtype=uint32"):
        TokenSource(str(tmp_path / "x.npy"), seq_len=4, dtype="uint32")
    np.save(tmp_path / "two.npy", np.zeros((3, 4), dtype=np.uint16))
    with pytest.raises(ConfigError, match="2-D"):
        TokenSource(str(tmp_path / "two.npy"), seq_len=4)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ConfigError, match="not a multiple"):
        TokenSource(str(tmp_path / "odd.bin"), seq_len=4)
    with pytest.raises(ConfigError, match="no file matches"):
        TokenSource(str(tmp_path / "*.tokens"), seq_len=4)
    with pytest.raises(ConfigError, match="cannot read"):
        TokenSource(str(tmp_path / "missing.bin"), seq_len=4)
    with pytest.raises(ConfigError, match="at least one file"):
        TokenSource([], seq_len=4)
    with pytest.raises(ConfigError, match="seq_len"):
        TokenSource(str(tmp_path / "part-0.bin"), seq_len=0)
    with pytest.raises(ConfigError, match="integer dtype"):
        TokenSource(str(tmp_path / "part-0.bin"), seq_len=4, dtype="float32")
    with pytest.raises(ConfigError, match="not a numpy dtype"):
        TokenSource(str(tmp_path / "part-0.bin"), seq_len=4, dtype="tokens")
