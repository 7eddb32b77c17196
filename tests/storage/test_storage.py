"""Tests of savable_loader.storage: local atomic writes, fsspec URLs, and their errors."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

import savable_loader.storage.urls
from savable_loader.errors import ConfigError, StateFileNotFoundError, StorageError
from savable_loader.storage.urls import read_bytes, write_bytes


@pytest.fixture
def memory_url() -> Iterator[str]:
    url = f"memory://savable-loader-tests/{uuid.uuid4().hex}/state.bin"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url)


def _files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


# Local paths.


def test_local_round_trip(tmp_path: Path) -> None:
    target = tmp_path / "state.bin"
    write_bytes(target, b"\x00data\xff")
    assert read_bytes(target) == b"\x00data\xff"
    assert read_bytes(str(target)) == b"\x00data\xff"
    assert read_bytes(f"file://{target}") == b"\x00data\xff"
    assert _files(tmp_path) == ["state.bin"]


def test_file_url_round_trip(tmp_path: Path) -> None:
    write_bytes(f"file://{tmp_path}/state.bin", b"abc")
    assert (tmp_path / "state.bin").read_bytes() == b"abc"


def test_missing_parent_folders_are_created(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c" / "state.bin"
    write_bytes(str(target), b"x")
    assert target.read_bytes() == b"x"


def test_empty_payload(tmp_path: Path) -> None:
    write_bytes(tmp_path / "empty", b"")
    assert read_bytes(tmp_path / "empty") == b""


def test_overwrite_replaces_the_content(tmp_path: Path) -> None:
    target = tmp_path / "state.bin"
    write_bytes(target, b"old" * 1000)
    write_bytes(target, b"new")
    assert read_bytes(target) == b"new"
    assert _files(tmp_path) == ["state.bin"]


def test_write_through_a_symlink_keeps_the_link(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    link = tmp_path / "latest.bin"
    link.symlink_to(tmp_path / "real" / "state.bin")
    write_bytes(link, b"first")
    write_bytes(link, b"second")
    assert link.is_symlink()
    assert (tmp_path / "real" / "state.bin").read_bytes() == b"second"
    assert _files(tmp_path / "real") == ["state.bin"]


def test_new_file_mode_follows_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        write_bytes(tmp_path / "state.bin", b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "state.bin").stat().st_mode & 0o777 == 0o640


def test_write_goes_through_a_temporary_file_beside_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    renames: list[tuple[str, str]] = []
    real_replace = os.replace

    def recording_replace(src: str, dst: str) -> None:
        renames.append((src, dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", recording_replace)
    write_bytes(tmp_path / "state.bin", b"x")
    [(src, dst)] = renames
    assert Path(src).parent == tmp_path
    assert Path(src).name.startswith(".state.bin.tmp-")
    assert dst == str(tmp_path / "state.bin")


@pytest.mark.parametrize("failing", ["replace", "fsync", "write"])
def test_failed_overwrite_keeps_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    target = tmp_path / "state.bin"
    write_bytes(target, b"previous")
    cause = OSError(errno.EIO, "Input/output error")

    def fail(*args: object) -> None:
        raise cause

    if failing == "write":
        monkeypatch.setattr(
            savable_loader.storage.urls, "open", _open_with_failing_write(cause), raising=False
        )
    else:
        monkeypatch.setattr(os, failing, fail)
    with pytest.raises(
        StorageError, match=r"Cannot write .*state\.bin: input/output error\."
    ) as info:
        write_bytes(target, b"next" * 1000)
    monkeypatch.undo()
    assert info.value.__cause__ is cause
    assert target.read_bytes() == b"previous"
    assert _files(tmp_path) == ["state.bin"]  # no temporary file left


def _open_with_failing_write(cause: OSError) -> object:
    class FailingFile:
        def __init__(self, fd: int, mode: str) -> None:
            self._file = open(fd, mode)  # noqa: SIM115

        def __enter__(self) -> FailingFile:
            return self

        def __exit__(self, *exc: object) -> None:
            self._file.close()

        def write(self, data: bytes) -> int:
            self._file.write(data[: len(data) // 2])
            raise cause

    return FailingFile


def test_interrupt_during_write_cleans_up_and_propagates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "state.bin"
    write_bytes(target, b"previous")

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_bytes(target, b"next")
    monkeypatch.undo()
    assert target.read_bytes() == b"previous"
    assert _files(tmp_path) == ["state.bin"]


_CRASHING_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from savable_loader.storage import write_bytes

    marker, target = sys.argv[1], sys.argv[2]

    def stuck_fsync(fd):
        open(marker, "w").close()
        time.sleep(600)

    os.fsync = stuck_fsync
    write_bytes(target, b"new!" * 8_000_000)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_writer_killed_mid_write_leaves_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "state.bin"
    marker = tmp_path / "child-is-writing"
    previous = os.urandom(100_000)
    write_bytes(target, previous)
    root = Path(savable_loader.__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    child = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_WRITER, str(marker), str(target)],
        env=env,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert child.poll() is None, child.communicate()[1].decode()
            assert time.monotonic() < deadline, "the child never reached fsync"
            time.sleep(0.02)
        # The child has written the whole new payload to its temporary file and is
        # stuck before the rename: the reader still sees the previous file.
        [temporary] = [p for p in tmp_path.iterdir() if p.name.startswith(".state.bin.tmp-")]
        assert temporary.stat().st_size == 32_000_000
        assert read_bytes(target) == previous
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.communicate()
    assert child.returncode == -signal.SIGKILL
    assert read_bytes(target) == previous
    write_bytes(target, b"after the crash")
    assert read_bytes(target) == b"after the crash"


def test_missing_local_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "state.bin"
    with pytest.raises(StorageError, match=r"Cannot read .*nope/state\.bin: not found\.") as info:
        read_bytes(missing)
    assert isinstance(info.value, StateFileNotFoundError)
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.filename == str(missing)
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_reading_a_folder(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="it is a folder") as info:
        read_bytes(tmp_path)
    assert not isinstance(info.value, FileNotFoundError)


def test_writing_onto_a_folder(tmp_path: Path) -> None:
    (tmp_path / "state.bin").mkdir()
    with pytest.raises(StorageError, match="it is a folder"):
        write_bytes(tmp_path / "state.bin", b"x")
    assert _files(tmp_path) == ["state.bin"]


def test_parent_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StorageError, match="Cannot write"):
        write_bytes(tmp_path / "file" / "state.bin", b"x")


def test_storage_options_for_a_local_path_are_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"Storage options \['anon'\] were given for the local path"
    ):
        write_bytes(tmp_path / "state.bin", b"x", anon=True)
    with pytest.raises(ConfigError):
        read_bytes(tmp_path / "state.bin", anon=True)


# fsspec URLs.


def test_memory_round_trip(memory_url: str) -> None:
    write_bytes(memory_url, b"\x00abc")
    assert read_bytes(memory_url) == b"\x00abc"
    write_bytes(memory_url, b"replaced")
    assert read_bytes(memory_url) == b"replaced"


def test_missing_memory_file(memory_url: str) -> None:
    with pytest.raises(StateFileNotFoundError, match=r"Cannot read memory://.*: not found\."):
        read_bytes(memory_url)


def test_unknown_protocol() -> None:
    with pytest.raises(StorageError, match="fsspec knows no storage protocol 'nosuchproto'"):
        write_bytes("nosuchproto://bucket/state.bin", b"x")
    with pytest.raises(StorageError, match="nosuchproto"):
        read_bytes("nosuchproto://bucket/state.bin")


def test_missing_backend_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing_backend(url: str, **options: object) -> None:
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec, "url_to_fs", missing_backend)
    with pytest.raises(StorageError, match=r"pip install savable-loader\[s3\]") as info:
        write_bytes("s3://bucket/state.bin", b"x")
    assert "Install s3fs" in str(info.value)
    with pytest.raises(StorageError, match=r"pip install savable-loader\[s3\]"):
        read_bytes("simplecache::s3://bucket/state.bin")


def test_network_error_becomes_storage_error(
    monkeypatch: pytest.MonkeyPatch, memory_url: str
) -> None:
    cause = ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    def reset(*args: object, **kwargs: object) -> None:
        raise cause

    fs_class = type(fsspec.filesystem("memory"))
    monkeypatch.setattr(fs_class, "pipe_file", reset)
    monkeypatch.setattr(fs_class, "cat_file", reset)
    with pytest.raises(StorageError, match="connection reset by peer") as info:
        write_bytes(memory_url, b"x")
    assert info.value.__cause__ is cause
    with pytest.raises(StorageError, match=r"Cannot read memory://"):
        read_bytes(memory_url)
