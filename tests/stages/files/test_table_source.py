"""TableSource: rows of a table with the bytes of the files they name; exact resume,
equal ranks, elastic, fetched ahead without changing a byte (NOTE [ Index-driven source ])."""

from __future__ import annotations

import csv
import json
import pickle
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from s3_server import S3, S3FS_WARNINGS
from stage_harness import check_stage

from savable_loader import ConfigError, SavableDataLoader, StorageError, WorkerConfig, WorkerContext
from savable_loader.datasets import TableSource
from savable_loader.datasets.files import table_read
from savable_loader.storage import retry
from savable_loader.storage.listing import LIST_AFTER

pytestmark = [S3FS_WARNINGS]

N = 24
ONE = WorkerContext(0, 1, 0, 0, 0, None)


def _payload(i: int) -> bytes:
    return b"file %d " % i * (i + 1)


def _rows(n: int, folder: str) -> list[dict[str, Any]]:
    """Rows with a relative path, an absolute one (every third: a null) and metadata."""
    return [
        {
            "id": i,
            "label": f"class-{i % 3}",
            "image": f"files/{i}.bin",
            "caption": None if i % 3 == 0 else f"{folder}/captions/{i}.txt",
        }
        for i in range(n)
    ]


def _write_table(rows: list[dict[str, Any]], path: Path, fmt: str) -> Path:
    if fmt == "parquet":
        import pyarrow as pa  # NOTE [ Heavy imports last ] in conftest.py
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif fmt == "csv":
        with path.open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _dataset(tmp_path: Path, fmt: str = "parquet", n: int = N) -> tuple[Path, list[dict[str, Any]]]:
    (tmp_path / "files").mkdir(exist_ok=True)
    (tmp_path / "captions").mkdir(exist_ok=True)
    for i in range(n):
        (tmp_path / "files" / f"{i}.bin").write_bytes(_payload(i))
        (tmp_path / "captions" / f"{i}.txt").write_text(f"caption {i}")
    rows = _rows(n, str(tmp_path))
    extension = "jsonl" if fmt == "jsonl" else fmt
    return _write_table(rows, tmp_path / f"table.{extension}", fmt), rows


def _ident(item: dict[str, Any]) -> tuple[int, bytes]:
    return (item["__row__"], item["image"])


def _collate(batch: list[dict[str, Any]]) -> list[tuple[int, bytes]]:
    return [_ident(item) for item in batch]


def _ids(batch: list[tuple[int, bytes]]) -> list[int]:
    return [row for row, _ in batch]


# -- what an item is ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl"])
def test_items_are_the_rows_with_their_files_bytes(tmp_path: Path, fmt: str) -> None:
    table, rows = _dataset(tmp_path, fmt)
    source = TableSource(table, files=["image", "caption"])
    items = list(source.cursor(ONE))
    assert [item["__row__"] for item in items] == list(range(N))
    for item, row in zip(items, rows, strict=True):
        i = row["id"]
        assert item["image"] == _payload(i)
        assert item["__urls__"]["image"] == str(tmp_path / "files" / f"{i}.bin")
        if row["caption"] is None and fmt != "csv":
            assert item["caption"] is None
            assert item["__urls__"]["caption"] is None
        elif row["caption"] is not None:
            assert item["caption"] == f"caption {i}".encode()
        # CSV values are strings; Parquet and JSON keep their types.
        assert item["id"] == (str(i) if fmt == "csv" else i)
        assert item["label"] == row["label"]
        assert list(item)[:4] == ["id", "label", "image", "caption"]
    source.close_cache()


def test_several_tables_are_concatenated_in_sorted_order(tmp_path: Path) -> None:
    _, rows = _dataset(tmp_path, "jsonl")
    _write_table(rows[10:], tmp_path / "b.jsonl", "jsonl")
    _write_table(rows[:10], tmp_path / "a.jsonl", "jsonl")
    source = TableSource(str(tmp_path / "[ab].jsonl"), files="image", threads=0)
    assert len(source) == N
    assert [item["id"] for item in source.cursor(ONE)] == list(range(N))
    assert source.config()["tables"] == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]


def test_paths_are_relative_to_their_own_tables_folder(tmp_path: Path) -> None:
    for part in ("a", "b"):
        (tmp_path / part).mkdir()
        (tmp_path / part / "x.bin").write_bytes(part.encode())
        _write_table([{"image": "x.bin"}], tmp_path / part / "rows.csv", "csv")
    source = TableSource([str(tmp_path / p / "rows.csv") for p in "ba"], files="image")
    assert [item["image"] for item in source.cursor(ONE)] == [b"a", b"b"]


def test_config_names_the_table_and_not_the_access(tmp_path: Path) -> None:
    table, _ = _dataset(tmp_path, "csv")
    plain = TableSource(table, files="image", shuffle=True, seed=3, even="drop")
    other = TableSource(
        table, files="image", shuffle=True, seed=3, even="drop", threads=0, prefetch=0
    )
    assert plain.config() == other.config()
    assert plain.config()["rows"] == N
    assert plain.config()["files"] == ["image"]
    assert plain.config()["even"] == "drop"
    assert "even" not in TableSource(table, files="image").config()
    assert str(plain) == "TableSource(24 rows of 1 csv table, files=['image'])"


# -- order and sharding --------------------------------------------------------------------


def test_shuffle_is_a_new_permutation_every_epoch(tmp_path: Path) -> None:
    table, _ = _dataset(tmp_path)
    cursor = TableSource(table, files="image", shuffle=True, seed=5).cursor(ONE)
    epochs = [[item["__row__"] for item in cursor] for _ in range(2)]
    assert all(sorted(epoch) == list(range(N)) for epoch in epochs)
    assert epochs[0] != epochs[1]
    assert epochs[0] != list(range(N))


@pytest.mark.parametrize(("ranks", "even"), [(2, "pad"), (5, "pad"), (5, "drop")])
def test_every_rank_yields_as_many_batches(tmp_path: Path, ranks: int, even: str) -> None:
    table, _ = _dataset(tmp_path, n=23)
    counts, seen = [], Counter[int]()
    for rank in range(ranks):
        source = TableSource(table, files="image", shuffle=True, even=even)  # type: ignore[arg-type]
        config = WorkerConfig(rank=rank, world_size=ranks)
        with SavableDataLoader(
            source, batch_size=2, worker_config=config, collate_fn=_collate
        ) as loader:
            batches = list(loader)
        counts.append(len(batches))
        seen.update(i for batch in batches for i in _ids(batch))
    assert len(set(counts)) == 1
    length = -(-23 // ranks) * ranks if even == "pad" else 23 // ranks * ranks
    assert sum(seen.values()) == length
    assert set(seen) <= set(range(23))


# -- exact resume ------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_resumes_exactly(tmp_path: Path, workers: int) -> None:
    table, _ = _dataset(tmp_path)
    check_stage(
        lambda: TableSource(table, files=["image", "caption"], shuffle=True, prefetch=4),
        num_workers=workers,
        batch_size=3,
        num_points=4,
        collate_fn=_collate,
    )


def test_a_restored_loader_yields_what_the_uninterrupted_one_does(tmp_path: Path) -> None:
    table, _ = _dataset(tmp_path, "jsonl")

    def loader() -> SavableDataLoader:
        source = TableSource(table, files="image", shuffle=True, seed=1)
        return SavableDataLoader(source, batch_size=4, num_workers=2, collate_fn=_collate)

    with loader() as first:
        stream = iter(first)
        head = [_ids(next(stream)) for _ in range(3)]
        state = first.save_state_rank()
        rest = [_ids(batch) for batch in stream]
        following = [_ids(batch) for batch in first]
    with loader() as second:
        second.restore_state_rank(state)
        assert [_ids(batch) for batch in second] == rest
        assert [_ids(batch) for batch in second] == following
    assert sorted(i for batch in head + rest for i in batch) == list(range(N))
    assert sorted(i for batch in following for i in batch) == list(range(N))


def test_is_elastic(tmp_path: Path) -> None:
    table, _ = _dataset(tmp_path)

    def loader(workers: int, rank: int = 0, ranks: int = 1) -> SavableDataLoader:
        source = TableSource(table, files="image", shuffle=True, seed=2)
        config = WorkerConfig(rank=rank, world_size=ranks)
        return SavableDataLoader(
            source, batch_size=2, num_workers=workers, worker_config=config, collate_fn=_collate
        )

    with loader(2) as old:
        stream = iter(old)
        consumed = [i for _ in range(5) for i in _ids(next(stream))]
        states = [old.save_state_rank()]
    rest = []
    for rank in range(2):
        with loader(0, rank, 2) as new:
            new.restore_state_rank(states)
            rest += [i for batch in new for i in _ids(batch)]
    assert Counter(consumed + rest) == Counter(range(N))


# -- fetching ahead ----------------------------------------------------------------------


def _stream(source: TableSource, takes: list[int], context: WorkerContext = ONE) -> list[Any]:
    cursor = source.cursor(context)
    out: list[Any] = []
    for n in takes:
        out.append([_ident(item) for item in cursor.take(n)])
        out.append(_ident(next(cursor)) if cursor.pos < cursor.shard_length else None)
    cursor.close()
    return out


def test_prefetching_changes_nothing_read(tmp_path: Path) -> None:
    table, _ = _dataset(tmp_path, "csv")
    takes = [1, 3, 5, 2, 8, 4, 1, 7, 6]
    context = WorkerContext(0, 1, 1, 2, 0, 3)
    streams = [
        _stream(TableSource(table, files="image", shuffle=True, **kw), takes, context)
        for kw in ({"threads": 0}, {"threads": 3, "prefetch": 0}, {"threads": 4, "prefetch": 9})
    ]
    assert streams[0] == streams[1] == streams[2]


def test_fetched_files_wait_in_a_bounded_window(tmp_path: Path) -> None:
    table, _ = _dataset(tmp_path, "csv")
    source = TableSource(table, files=["image", "caption"], threads=2, prefetch=3)
    cursor = source.cursor(ONE)
    for _ in range(5):
        next(cursor)
        assert len(cursor.ahead) <= 2 * 3  # type: ignore[attr-defined]
    cursor.skip(7)  # what the skipped rows fetched is let go at the next read
    item = next(cursor)
    assert item["__row__"] == 12
    assert all(f"/{i}." not in url for i in range(12) for url in cursor.ahead)  # type: ignore[attr-defined]
    source.close_cache()


def _fetch_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "table-fetch"]


def test_close_cache_stops_the_threads_and_reading_again_restarts_them(tmp_path: Path) -> None:
    table, _ = _dataset(tmp_path)
    source = TableSource(table, files="image", threads=3, prefetch=6)
    cursor = source.cursor(ONE)
    first = [_ident(next(cursor)) for _ in range(4)]
    assert _fetch_threads()
    source.close_cache()
    source.close_cache()  # idempotent
    deadline = time.monotonic() + 5
    while _fetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _fetch_threads()
    rest = [_ident(item) for item in cursor]  # cancelled fetches are read again
    assert [row for row, _ in first + rest] == list(range(N))
    assert rest[-1] == (N - 1, _payload(N - 1))
    copy = pickle.loads(pickle.dumps(source))  # the threads stay behind
    assert [_ident(item) for item in copy.cursor(ONE)] == first + rest
    copy.close_cache()
    source.close_cache()


# -- storage: retries, the cache, S3 -----------------------------------------------------


class _FlakyTables(MemoryFileSystem):
    """In-memory files whose opens (and whole reads, ``cat_file``) fail, with a transient
    error, on chosen open counts."""

    protocol = "flakytable"
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    failing: ClassVar[set[int]] = set()
    opens: ClassVar[list[int]] = [0]
    lock = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        return super()._strip_protocol(str(path).removeprefix("flakytable://"))

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if mode == "rb":
            self._count_open()
        return super()._open(path, mode, **kwargs)

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        self._count_open()
        return super().cat_file(path, start, end, **kwargs)

    def _count_open(self) -> None:
        with self.lock:
            self.opens[0] += 1
            if self.opens[0] in self.failing:
                raise ConnectionResetError(104, "Connection reset by peer")


fsspec.register_implementation("flakytable", _FlakyTables, clobber=True)


@pytest.fixture
def flaky(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A table and its files on ``flakytable://``; retries do not sleep."""
    monkeypatch.setattr(retry, "sleep", lambda seconds: None)
    _FlakyTables.store.clear()
    _FlakyTables.failing = set()
    fs = _FlakyTables()
    for i in range(N):
        fs.pipe_file(f"/data/files/{i}.bin", _payload(i))
    rows = [{"id": i, "image": f"files/{i}.bin"} for i in range(N)]
    fs.pipe_file("/data/rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    yield "flakytable:///data/rows.jsonl"
    _FlakyTables.failing = set()


@pytest.mark.parametrize("threads", [0, 4])
def test_a_retried_transient_error_gives_the_same_stream(flaky: str, threads: int) -> None:
    clean = _stream(TableSource(flaky, files="image", shuffle=True, threads=0), [2, 5, 3, 9])
    _FlakyTables.opens[0] = 0
    _FlakyTables.failing = {1, 3, 4, 9, 10, 11, 20}
    source = TableSource(flaky, files="image", shuffle=True, threads=threads, prefetch=5)
    assert _stream(source, [2, 5, 3, 9]) == clean
    assert _FlakyTables.opens[0] >= max(_FlakyTables.failing)  # every fault was raised
    source.close_cache()


def test_a_file_that_keeps_failing_raises_a_storage_error(flaky: str) -> None:
    source = TableSource(
        flaky,
        files="image",
        threads=2,
        retry=retry.RetryPolicy(attempts=2, base_delay=0.0, max_delay=0.0),
    )
    _FlakyTables.opens[0] = 0
    _FlakyTables.failing = set(range(1, 1000))
    with pytest.raises(StorageError, match=r"flakytable:///data/files/0\.bin"):
        next(iter(source.cursor(ONE)))
    source.close_cache()


def test_a_remote_table_and_files_through_the_cache(tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")
    for i in range(N):
        fs.pipe_file(f"/table-cache/files/{i}.bin", _payload(i))
    rows = [{"id": i, "image": f"files/{i}.bin"} for i in range(N)]
    fs.pipe_file("/table-cache/rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    url = "memory://table-cache/rows.jsonl"
    first = TableSource(url, files="image", cache_dir=tmp_path, shuffle=True)
    items = [_ident(item) for item in first.cursor(ONE)]
    assert sorted(items) == [(i, _payload(i)) for i in range(N)]
    assert first.cache_stats().misses == N + 1  # type: ignore[union-attr]
    first.close_cache()
    again = TableSource(url, files="image", cache_dir=tmp_path, shuffle=True)
    assert [_ident(item) for item in again.cursor(ONE)] == items
    stats = again.cache_stats()
    assert stats is not None
    assert (stats.misses, stats.hits, stats.bytes_downloaded) == (0, N + 1, 0)
    again.close_cache()
    fs.rm("/table-cache", recursive=True)


def test_s3_table_and_files_through_the_cache(s3: S3, tmp_path: Path) -> None:
    for i in range(8):
        s3.put(f"samples/files/{i}.bin", _payload(i))
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": i, "image": f"files/{i}.bin", "label": i % 2} for i in range(8)]
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    url = s3.put("samples/rows.parquet", buffer.getvalue().to_pybytes())

    def build() -> TableSource:
        return TableSource(
            url, files="image", shuffle=True, storage_options=s3.options(), cache_dir=tmp_path
        )

    source = build()
    items = list(source.cursor(ONE))
    assert sorted((item["id"], item["image"], item["label"]) for item in items) == [
        (i, _payload(i), i % 2) for i in range(8)
    ]
    assert items[0]["__urls__"]["image"].startswith("s3://")
    source.close_cache()
    # One source for every loader of the check: a stage holds no position, and its S3
    # client (about 0.2 s to build) is then built once.
    check_stage(lambda: source, num_workers=0, num_points=3, collate_fn=_collate)
    source.close_cache()


class _CountedInfo:
    """A filesystem whose ``info()`` calls are counted (the cache's asks for a signature)."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self.infos = 0

    def info(self, path: str, **kwargs: Any) -> Any:
        self.infos += 1
        return self.fs.info(path, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)


def _listed_table(folder: str, n: int) -> str:
    fs = fsspec.filesystem("memory")
    for i in range(n):
        fs.pipe_file(f"/{folder}/files/{i}.bin", _payload(i))
    rows = [{"id": i, "image": f"files/{i}.bin"} for i in range(n)]
    fs.pipe_file(f"/{folder}/rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    return f"memory://{folder}/rows.jsonl"


def _wait_for_listing(source: TableSource, url: str) -> None:
    deadline = time.monotonic() + 10
    while source.folder_listings().known(url) is None:
        assert time.monotonic() < deadline, "the folder was never listed"
        time.sleep(0.01)


def test_listed_folders_spare_the_signature_request_and_notice_a_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = LIST_AFTER + 8
    url = _listed_table("listed", n)
    source = TableSource(url, files="image", cache_dir=tmp_path, list_folders=True, threads=0)
    counted = _CountedInfo(source.filesystem(url))
    monkeypatch.setattr(source, "filesystem", lambda _: counted)
    cursor = source.cursor(ONE)
    first = [_ident(next(cursor)) for _ in range(LIST_AFTER)]
    assert counted.infos == LIST_AFTER  # asked until the folder's turn to be listed
    _wait_for_listing(source, "memory://listed/files/0.bin")
    changed = b"replaced after the listing"
    fsspec.filesystem("memory").pipe_file(f"/listed/files/{LIST_AFTER}.bin", changed)
    rest = [_ident(item) for item in cursor]
    expected = [(i, _payload(i)) for i in range(n)]
    expected[LIST_AFTER] = (LIST_AFTER, changed)
    assert first + rest == expected
    assert counted.infos == LIST_AFTER + 1  # only the changed file's size was asked
    stats = source.cache_stats()
    assert stats is not None
    assert (stats.misses, stats.hits) == (n + 1, 0)
    source.close_cache()
    fsspec.filesystem("memory").rm("/listed", recursive=True)


def test_s3_an_entry_cached_without_listings_is_reused_with_them(s3: S3, tmp_path: Path) -> None:
    n = LIST_AFTER + 4
    for i in range(n):
        s3.put(f"listed/files/{i}.bin", _payload(i))
    rows = [{"id": i, "image": f"files/{i}.bin"} for i in range(n)]
    url = s3.put("listed/rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())

    def build(listed: bool) -> TableSource:
        return TableSource(
            url,
            files="image",
            threads=0,
            list_folders=listed,
            storage_options=s3.options(),
            cache_dir=tmp_path,
        )

    plain = build(False)
    items = [_ident(item) for item in plain.cursor(ONE)]
    assert items == [(i, _payload(i)) for i in range(n)]
    plain.close_cache()
    listed = build(True)
    cursor = listed.cursor(ONE)
    again = [_ident(next(cursor)) for _ in range(LIST_AFTER)]
    _wait_for_listing(listed, s3.url("listed/files/0.bin"))
    assert again + [_ident(item) for item in cursor] == items
    stats = listed.cache_stats()
    assert stats is not None  # a listed signature equals the one info() gave: all hits
    assert (stats.misses, stats.hits) == (0, n + 1)
    listed.close_cache()


# -- bad input ------------------------------------------------------------------------------


def test_a_missing_file_is_a_storage_error_naming_it_when_its_row_is_read(tmp_path: Path) -> None:
    table, _ = _dataset(tmp_path, "jsonl")
    (tmp_path / "files" / "2.bin").unlink()
    source = TableSource(table, files="image", threads=2)
    cursor = source.cursor(ONE)
    assert [item["id"] for item in cursor.take(2)] == [0, 1]
    with pytest.raises(StorageError, match=r"files/2\.bin"):
        next(cursor)
    source.close_cache()


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("empty.csv", "", "empty"),
        ("header.csv", "id,image\n", "no row"),
        ("empty.jsonl", "\n\n", "no row"),
        ("bad.jsonl", '{"image": "a"}\n{"image": \n', "cannot parse"),
        ("list.jsonl", "[1, 2]\n", "not an object"),
        ("deep.jsonl", '{"image": ' + "[" * 100_000 + "]" * 100_000 + "}\n", "nested too deep"),
        ("short.csv", "id,image\n1\n", "line 2 .* 1 fields"),
        ("bad.parquet", "not parquet at all", "cannot parse .* as Parquet"),
        ("rows.txt", "id,image\n", "format"),
        ("other.csv", "id,path\n1,x\n", "no column 'image'"),
        ("typed.jsonl", '{"image": 3}\n', "must hold URLs"),
        ("latin.csv", b"id,image\n1,\xe9\n", "not UTF-8"),
        ("clash.jsonl", '{"image": "a", "__row__": 1}\n', "reserved"),
    ],
)
def test_a_bad_table_is_a_config_error(
    tmp_path: Path, name: str, content: str | bytes, match: str
) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        TableSource(path, files="image")


def test_a_parquet_files_column_of_numbers_is_refused(tmp_path: Path) -> None:
    path = _write_table([{"image": 1}], tmp_path / "t.parquet", "parquet")
    with pytest.raises(ConfigError, match="must hold URLs"):
        TableSource(path, files="image")


def test_tables_of_other_columns_or_formats_are_refused(tmp_path: Path) -> None:
    a = _write_table([{"id": 1, "image": "x"}], tmp_path / "a.csv", "csv")
    b = _write_table([{"id": 1, "path": "x"}], tmp_path / "b.csv", "csv")
    c = _write_table([{"id": 1, "image": "x"}], tmp_path / "c.jsonl", "jsonl")
    with pytest.raises(ConfigError, match="share their columns"):
        TableSource([a, b])
    with pytest.raises(ConfigError, match="mix formats"):
        TableSource([a, c])


def test_a_missing_table_is_a_storage_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match=r"nowhere\.csv"):
        TableSource(tmp_path / "nowhere.csv")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"files": 3},
        {"files": ["image", 4]},
        {"shuffle": "yes"},
        {"seed": 1.5},
        {"threads": -1},
        {"threads": True},
        {"prefetch": -2},
        {"format": "xml"},
        {"even": "odd"},
        {"cache_limit": 10},
    ],
)
def test_bad_arguments_are_config_errors(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    table, _ = _dataset(tmp_path, "csv", n=3)
    with pytest.raises(ConfigError):
        TableSource(table, **kwargs)


def test_parquet_without_pyarrow_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table, _ = _dataset(tmp_path, "parquet", n=3)
    real = table_read.importlib.import_module

    def no_pyarrow(name: str) -> Any:
        if name.startswith("pyarrow"):
            raise ImportError(f"No module named {name!r}")
        return real(name)

    monkeypatch.setattr(table_read.importlib, "import_module", no_pyarrow)
    with pytest.raises(ConfigError, match=r"pip install savable-loader\[parquet\]"):
        TableSource(table, files="image")
    csv_table, _ = _dataset(tmp_path, "csv", n=3)
    assert len(TableSource(csv_table, files="image")) == 3  # other formats need no pyarrow
