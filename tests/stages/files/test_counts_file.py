"""Counts files (NOTE [ Counts files ] in ``datasets/files/counts_file.py``): a source built with
``counts=`` takes the samples of its unchanged files from the file instead of reading
them, splits and resumes exactly as when it counts, recounts what changed, and refuses a
counts file it cannot trust with the library's own errors."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from s3_server import REGION, S3, S3FS_WARNINGS
from sample_files import LENGTHS, write_jsonl, write_tar
from stage_harness import check_stage
from test_split_samples import KINDS, _contexts

from savable_loader import ConfigError, SavableDataLoader, StorageError
from savable_loader.datasets import JsonLinesSource, RetryPolicy, TarSource
from savable_loader.datasets.files.counts_file import FORMAT, same_file
from savable_loader.datasets.files.sharded import ShardedSource
from savable_loader.testing.proxy import FaultProxy


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The URLs whose samples are counted by reading them, in calls to ``count_items``."""
    calls: list[str] = []
    for source in (TarSource, JsonLinesSource):
        original = source.count_items

        def counting(self: Any, file: Any, url: str, original: Any = original) -> int:
            calls.append(url)
            return int(original(self, file, url))

        monkeypatch.setattr(source, "count_items", counting)
    return calls


def _streams(source: ShardedSource[Any], ident: Any, ranks: int = 2) -> list[list[int]]:
    """What every stream of ``ranks`` ranks x 2 workers reads in epochs 0 and 1."""
    streams = []
    for context in _contexts(ranks, 2, 3):
        cursor = source.cursor(context)
        first = [ident(item) for item in cursor]
        streams.append(first + [ident(item) for item in cursor])
    return streams


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_counts_file_replaces_the_counting_pass(
    tmp_path: Path, kind: str, counted: list[str]
) -> None:
    build, write, ident = KINDS[kind]
    pattern = write(tmp_path)
    build(pattern).write_counts(tmp_path / "counts.json")
    assert len(counted) == len(LENGTHS)  # write_counts counts every file once
    counted.clear()
    plain = build(pattern, shuffle_shards=True, seed=3)
    indexed = build(pattern, shuffle_shards=True, seed=3, counts=tmp_path / "counts.json")
    assert indexed.sample_counts() == tuple(LENGTHS)
    assert counted == []  # nothing read to count
    assert indexed.config() == plain.config()  # where counts come from changes no state
    for ranks in (2, 3):
        assert _streams(indexed, ident, ranks) == _streams(plain, ident, ranks)


def test_the_counts_file_names_files_beside_it_relative_to_its_folder(tmp_path: Path) -> None:
    pattern = write_tar(tmp_path)
    TarSource(pattern).write_counts(tmp_path / "counts.json")
    content = json.loads((tmp_path / "counts.json").read_text())
    assert content["format"] == FORMAT
    assert content["version"] == 1
    assert content["source"] == "TarSource"
    names = [entry["name"] for entry in content["files"]]
    assert names == [f"shard-{shard:02d}.tar" for shard in range(len(LENGTHS))]
    assert [entry["samples"] for entry in content["files"]] == LENGTHS
    sizes = [(tmp_path / name).stat().st_size for name in names]
    assert [entry["size"] for entry in content["files"]] == sizes
    # Elsewhere, a counts file names the files by their whole paths.
    elsewhere = tmp_path / "index" / "counts.json"
    TarSource(pattern).write_counts(elsewhere)
    names = [entry["name"] for entry in json.loads(elsewhere.read_text())["files"]]
    assert names == [str(tmp_path / f"shard-{shard:02d}.tar") for shard in range(len(LENGTHS))]
    assert TarSource(pattern, counts=elsewhere).sample_counts() == tuple(LENGTHS)


def test_a_changed_file_is_counted_again_and_the_split_follows_it(
    tmp_path: Path, counted: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    pattern = write_jsonl(tmp_path)
    JsonLinesSource(pattern).write_counts(tmp_path / "counts.json")
    counted.clear()
    times = {path: path.stat().st_mtime_ns for path in tmp_path.glob("*.jsonl")}
    lengths = [*LENGTHS]
    lengths[3] += 4  # a larger file: another size
    write_jsonl(tmp_path, lengths)
    for path, mtime in times.items():
        os.utime(path, ns=(mtime, mtime))  # the others, rewritten unchanged, as they were
    # Rewritten with the same bytes: the same size, another modification time.
    os.utime(tmp_path / "part-00.jsonl", ns=(1, 1))
    source = JsonLinesSource(pattern, counts=tmp_path / "counts.json")
    with caplog.at_level("INFO", logger="savable_loader.datasets.files.sharded"):
        assert source.sample_counts() == tuple(lengths)
    assert sorted(counted) == [str(tmp_path / "part-00.jsonl"), str(tmp_path / "part-03.jsonl")]
    assert "2 of 6 files counted" in caplog.text
    fresh = JsonLinesSource(pattern)
    assert _streams(source, KINDS["jsonl"][2]) == _streams(fresh, KINDS["jsonl"][2])


def test_files_the_counts_file_does_not_name_are_counted(
    tmp_path: Path, counted: list[str]
) -> None:
    write_tar(tmp_path)
    first = [str(tmp_path / f"shard-{shard:02d}.tar") for shard in range(3)]
    TarSource(first).write_counts(tmp_path / "counts.json")
    counted.clear()
    every = sorted(str(path) for path in tmp_path.glob("*.tar"))
    source = TarSource(every, counts=tmp_path / "counts.json")  # literal paths: info() each
    assert source.sample_counts() == tuple(LENGTHS)
    assert sorted(counted) == every[3:]


def test_same_file_compares_the_etag_when_both_have_one_else_the_mtime() -> None:
    base = {"size": 10, "etag": '"a"', "mtime": "1"}
    assert same_file(base, {**base, "mtime": "2"})  # S3: LIST and HEAD dates may differ
    assert not same_file(base, {**base, "etag": '"b"'})
    assert not same_file(base, {**base, "size": 11})
    assert same_file({**base, "etag": None}, {**base, "etag": None})
    assert not same_file({**base, "etag": None}, {**base, "etag": None, "mtime": "2"})
    assert not same_file({**base, "etag": None, "mtime": None}, {**base, "etag": None})


def _entry(**fields: Any) -> dict[str, Any]:
    return {"name": "shard-00.tar", "samples": 7, "size": 10, "etag": None, "mtime": "1", **fields}


def _document(**fields: Any) -> dict[str, Any]:
    return {"format": FORMAT, "version": 1, "source": "TarSource", "files": [_entry()], **fields}


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "not a counts file"),
        (b"\xff\xfe{", "not a counts file"),
        (b"[1, 2]", "not a counts file"),
        (json.dumps({**_document(), "format": "other"}).encode(), r"\(format: "),
        (json.dumps(_document(version=2)).encode(), r"\(version: "),
        (json.dumps(_document(files=[_entry(samples=-1)])).encode(), r"files\.0\.samples"),
        (json.dumps(_document(files=[_entry(samples=True)])).encode(), r"files\.0\.samples"),
        (json.dumps(_document(files=[_entry(name="")])).encode(), r"files\.0\.name"),
        (json.dumps(_document(files=[_entry(extra=1)])).encode(), r"files\.0\.extra"),
        (json.dumps(_document(files={"a": 1})).encode(), r"\(files: "),
        (json.dumps(_document(source="JsonLinesSource")).encode(), "written by a JsonLinesSource"),
    ],
    ids=[
        "empty",
        "not-utf8",
        "not-an-object",
        "format",
        "version",
        "negative",
        "bool",
        "no-name",
        "extra-field",
        "files-not-a-list",
        "other-source",
    ],
)
def test_a_bad_counts_file_is_a_config_error_naming_it(
    tmp_path: Path, content: bytes, match: str
) -> None:
    pattern = write_tar(tmp_path)
    (tmp_path / "counts.json").write_bytes(content)
    source = TarSource(pattern, counts=tmp_path / "counts.json")
    with pytest.raises(ConfigError, match=match) as error:
        source.sample_counts()
    assert str(tmp_path / "counts.json") in str(error.value)


def test_a_missing_counts_file_says_how_to_write_one(tmp_path: Path) -> None:
    pattern = write_tar(tmp_path)
    source = TarSource(pattern, counts=tmp_path / "missing.json")
    with pytest.raises(StorageError, match=r"does not exist; write it once with TarSource"):
        source.sample_counts()
    # A loader that needs the counts says so when it is built, before any worker starts.
    with pytest.raises(StorageError, match=r"missing\.json"):
        SavableDataLoader(source, batch_size=2, num_workers=2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"counts": 3}, "counts must be a path or URL or None"),
        ({"counts": "c.json", "split": "files"}, 'counts applies to split="samples"'),
    ],
)
def test_bad_counts_arguments_are_refused(tmp_path: Path, kwargs: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TarSource(write_tar(tmp_path), **kwargs)


def test_a_loader_over_a_counted_source_resumes_exactly(tmp_path: Path) -> None:
    pattern = write_tar(tmp_path)
    TarSource(pattern).write_counts(tmp_path / "counts.json")
    check_stage(
        lambda: TarSource(pattern, shuffle_shards=True, seed=5, counts=tmp_path / "counts.json"),
        num_workers=2,
        num_points=2,
    )


# -- on S3 --------------------------------------------------------------------------------


@pytest.fixture
def proxy(endpoint_url: str) -> Iterator[FaultProxy]:
    with FaultProxy(endpoint_url) as running:
        yield running


def _shards_and_counts(s3: S3, proxy: FaultProxy, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """Tar shards under ``tar/`` and their counts file ``tar/counts.json`` on S3; returns
    their local folder and storage options that reach S3 through ``proxy``."""
    local = tmp_path / "local"
    local.mkdir()
    write_tar(local)
    for path in sorted(local.glob("*.tar")):
        s3.put(f"tar/{path.name}", path.read_bytes())
    options = {**s3.options(), "client_kwargs": {"endpoint_url": proxy.url, "region_name": REGION}}
    TarSource(s3.url("tar/*.tar"), storage_options=options).write_counts(s3.url("tar/counts.json"))
    return local, options


@S3FS_WARNINGS
def test_on_s3_the_counts_come_from_one_request(
    s3: S3, proxy: FaultProxy, tmp_path: Path, counted: list[str]
) -> None:
    local, options = _shards_and_counts(s3, proxy, tmp_path)
    pattern = s3.url("tar/*.tar")
    assert len(counted) == len(LENGTHS)
    counted.clear()
    before = proxy.stats.requests
    source = TarSource(pattern, storage_options=options, counts=s3.url("tar/counts.json"))
    # The glob's listing and the GET of the counts file, sent together while the source
    # is built; the signatures come from the listing.
    assert proxy.stats.requests - before == 2
    assert source.sample_counts() == tuple(LENGTHS)
    assert proxy.stats.requests - before == 2
    assert counted == []
    # Literal URLs: one HEAD per file besides, in the counting threads.
    urls = [s3.url(f"tar/shard-{shard:02d}.tar") for shard in range(len(LENGTHS))]
    before = proxy.stats.requests
    literal = TarSource(urls, storage_options=options, counts=s3.url("tar/counts.json"))
    assert literal.sample_counts() == tuple(LENGTHS)
    assert proxy.stats.requests - before == 1 + len(LENGTHS)
    assert counted == []
    # A replaced object has another ETag: it is counted again, read through.
    s3.put("tar/shard-01.tar", (local / "shard-03.tar").read_bytes())
    again = TarSource(pattern, storage_options=options, counts=s3.url("tar/counts.json"))
    assert again.sample_counts() == (LENGTHS[0], LENGTHS[3], *LENGTHS[2:])
    assert counted == [s3.url("tar/shard-01.tar")]


@S3FS_WARNINGS
def test_with_a_cache_a_restart_asks_only_for_the_listing(
    s3: S3, proxy: FaultProxy, tmp_path: Path, counted: list[str]
) -> None:
    """A job restarted on the same node (NOTE [ Counts files ]): the counts file beside the
    shards was downloaded into the cache with them, so building the source and taking its
    counts send one request, the listing, whose signature vouches for the cached copy; a
    counts file written again since is downloaded again, never read stale."""
    local, options = _shards_and_counts(s3, proxy, tmp_path)
    pattern, counts = s3.url("tar/*.tar"), s3.url("tar/counts.json")
    counted.clear()

    def build() -> tuple[TarSource, int]:
        before = proxy.stats.requests
        source = TarSource(pattern, storage_options=options, counts=counts, cache_dir=cache)
        source.sample_counts()
        return source, proxy.stats.requests - before

    cache = tmp_path / "cache"
    first, requests = build()  # an empty cache: the listing and the counts file's download
    assert (first.sample_counts(), requests) == (tuple(LENGTHS), 2)
    again, requests = build()  # the same node again: the listing alone
    assert (again.sample_counts(), requests) == (tuple(LENGTHS), 1)
    # Written again for a replaced shard: the copy's signature is no longer the listing's.
    s3.put("tar/shard-01.tar", (local / "shard-03.tar").read_bytes())
    TarSource(pattern, storage_options=s3.options()).write_counts(counts)
    counted.clear()
    changed, requests = build()  # the listing, then the cache's download of a changed file
    assert (changed.sample_counts(), requests) == ((LENGTHS[0], LENGTHS[3], *LENGTHS[2:]), 3)
    assert counted == []  # from the new counts file, not counted
    assert build()[1] == 1


class _RefusingCounts(FaultProxy):
    """Answers the first ``refusals`` GETs of a counts file ``503 SlowDown``."""

    def __init__(self, upstream: str, refusals: int) -> None:
        super().__init__(upstream)
        self.refusals = refusals

    def decide(self, method: str, path: str) -> str | None:
        fault = super().decide(method, path)
        with self.lock:
            if method == "GET" and path.endswith("counts.json") and self.refusals:
                self.refusals -= 1
                return "slow_down"
        return fault


@S3FS_WARNINGS
@pytest.mark.parametrize("refusals", [1, 3])
def test_a_refused_early_request_of_the_counts_file_is_asked_again(
    s3: S3, endpoint_url: str, tmp_path: Path, counted: list[str], refusals: int
) -> None:
    """The counts file is requested while the source lists (NOTE [ Counts files ]); that
    request failing costs a request again, retried as any read, never a count."""
    write_tar(tmp_path)
    for path in sorted(tmp_path.glob("*.tar")):
        s3.put(f"tar/{path.name}", path.read_bytes())
    pattern = s3.url("tar/*.tar")
    TarSource(pattern, storage_options=s3.options()).write_counts(s3.url("tar/counts.json"))
    counted.clear()
    with _RefusingCounts(endpoint_url, refusals) as proxy:
        options = {
            **s3.options(),
            "client_kwargs": {"endpoint_url": proxy.url, "region_name": REGION},
        }
        source = TarSource(
            pattern,
            storage_options=options,
            counts=s3.url("tar/counts.json"),
            retry=RetryPolicy(attempts=refusals + 1, base_delay=0.0, max_delay=0.0),
        )
        assert source.sample_counts() == tuple(LENGTHS)
        assert proxy.refusals == 0
    assert counted == []
