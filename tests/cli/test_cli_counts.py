"""``savable-loader counts``: a counts file written from the shell reads back as the one
``write_counts`` writes (NOTE [ Counts files ] in ``datasets/files/counts_file.py``), local or
on S3 with the credentials of the environment; bad usage exits 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from s3_server import S3, S3FS_WARNINGS
from sample_files import LENGTHS, write_jsonl, write_tar

from savable_loader.cli import main
from savable_loader.datasets import JsonLinesSource, TarSource


def _no_counting(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Any, file: Any, url: str) -> int:
        raise AssertionError(f"{url} was counted")

    for source in (TarSource, JsonLinesSource):
        monkeypatch.setattr(source, "count_items", refuse)


@pytest.mark.parametrize(
    ("kind", "build", "write"),
    [("tar", TarSource, write_tar), ("jsonl", JsonLinesSource, write_jsonl)],
)
def test_the_command_writes_what_write_counts_writes(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    build: Any,
    write: Any,
) -> None:
    pattern = write(tmp_path)
    out = tmp_path / "counts.json"
    assert main(["counts", kind, pattern, "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"{out}: {sum(LENGTHS)} samples in {len(LENGTHS)} files\n"
    build(pattern).write_counts(tmp_path / "python.json")
    assert json.loads(out.read_text()) == json.loads((tmp_path / "python.json").read_text())
    _no_counting(monkeypatch)
    assert build(pattern, counts=out).sample_counts() == tuple(LENGTHS)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--storage-options", "{nope"], "--storage-options is not JSON"),
        (["--storage-options", "[1]"], "--storage-options must be a JSON object"),
        (["--storage-options", "{1: 2}"], "--storage-options is not JSON"),
    ],
)
def test_bad_storage_options_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], message: str
) -> None:
    pattern = write_tar(tmp_path)
    code = main(["counts", "tar", pattern, "--out", str(tmp_path / "c.json"), *arguments])
    assert code == 2
    error = capsys.readouterr().err
    assert message in error
    assert error.count("\n") == 1
    assert not (tmp_path / "c.json").exists()


def test_a_glob_that_matches_nothing_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["counts", "jsonl", str(tmp_path / "*.jsonl"), "--out", str(tmp_path / "c.json")])
    assert code == 2
    assert capsys.readouterr().err == (
        f"savable-loader counts: error: JsonLinesSource: {str(tmp_path / '*.jsonl')!r} "
        "matches no file\n"
    )
    assert not (tmp_path / "c.json").exists()


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["counts", "tar", "x.tar"]) == 2  # no --out
    assert main(["counts", "parquet", "x", "--out", "c.json"]) == 2
    assert "usage: savable-loader counts" in capsys.readouterr().err


def _upload(s3: S3, folder: Path, kind: str) -> None:
    """Writes the test files of ``kind`` in ``folder`` and uploads them under ``kind/``."""
    (write_tar if kind == "tar" else write_jsonl)(folder)
    for path in sorted(folder.glob(f"*.{kind}")):
        s3.put(f"{kind}/{path.name}", path.read_bytes())


@S3FS_WARNINGS
def test_on_s3_the_command_takes_the_credentials_of_the_environment(
    s3: S3, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _upload(s3, tmp_path, "tar")
    options = s3.use_environment()  # AWS_* variables: no storage options needed
    out = s3.url("tar/counts.json")
    assert main(["counts", "tar", s3.url("tar/*.tar"), "--out", out]) == 0
    assert capsys.readouterr().out.startswith(f"{out}: {sum(LENGTHS)} samples")
    _no_counting(monkeypatch)
    source = TarSource(s3.url("tar/*.tar"), storage_options=options, counts=out)
    assert source.sample_counts() == tuple(LENGTHS)


@S3FS_WARNINGS
def test_remote_files_with_storage_options_and_a_local_counts_file(
    s3: S3, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _upload(s3, tmp_path, "jsonl")
    options = s3.options()
    out = tmp_path / "counts.json"  # local: the options are the files' only
    pattern = s3.url("jsonl/*.jsonl")
    arguments = ["--out", str(out), "--storage-options", json.dumps(options)]
    assert main(["counts", "jsonl", pattern, *arguments]) == 0
    capsys.readouterr()
    names = [entry["name"] for entry in json.loads(out.read_text())["files"]]
    assert names == [s3.url(f"jsonl/part-{part:02d}.jsonl") for part in range(len(LENGTHS))]
    _no_counting(monkeypatch)
    source = JsonLinesSource(pattern, storage_options=options, counts=out)
    assert source.sample_counts() == tuple(LENGTHS)
