"""Arguments and errors (issue 14): what can never be saved is refused at construction, and
a missing state file is a ``FileNotFoundError``.

A loader argument that ends up in the saved state must be one the state format can carry
(msgpack ints, strict ints in ``state/models.py``), else the loader would run until its
first save and fail there. Those are refused when the loader is built, with the reason;
where torch's ``DataLoader`` refuses the argument itself, with torch's message.
"""

from __future__ import annotations

import errno
import pickle
import uuid
from pathlib import Path
from typing import Any

import pytest
from pipelines import Squares
from s3_server import S3

from savable_loader import (
    SavableDataLoader,
    SavableLoaderError,
    StateFileNotFoundError,
    StorageError,
    load_state,
)

# -- a missing state file ---------------------------------------------------------------


def _start_fresh_or_resume(url: Any, **storage_options: Any) -> list[int]:
    """The usual idiom: no checkpoint yet means start from the beginning."""
    with SavableDataLoader(Squares(4), batch_size=2) as loader:
        try:  # noqa: SIM105 (the idiom as users write it)
            loader.restore_state_rank(load_state(url, **storage_options))
        except FileNotFoundError:
            pass
        return [batch["index"].tolist() for batch in loader]


def _check_not_found(caught: pytest.ExceptionInfo[Any], url: str) -> None:
    error = caught.value
    assert isinstance(error, StateFileNotFoundError)
    assert isinstance(error, StorageError)
    assert isinstance(error, SavableLoaderError)
    assert str(error) == f"Cannot read {url}: not found."
    assert error.errno == errno.ENOENT
    assert error.filename == url
    assert isinstance(error.__cause__, FileNotFoundError)


def test_a_missing_local_state_file_is_a_file_not_found_error(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "checkpoint" / "loader.state"
    assert _start_fresh_or_resume(missing) == [[0, 1], [2, 3]]
    with pytest.raises(FileNotFoundError) as caught:
        load_state(missing)
    _check_not_found(caught, str(missing))
    with pytest.raises(FileNotFoundError) as caught:
        load_state(f"file://{missing}")
    _check_not_found(caught, f"file://{missing}")


def test_a_missing_memory_state_file_is_a_file_not_found_error() -> None:
    url = f"memory://savable-loader-tests/{uuid.uuid4().hex}/loader.state"
    assert _start_fresh_or_resume(url) == [[0, 1], [2, 3]]
    with pytest.raises(FileNotFoundError) as caught:
        load_state(url)
    _check_not_found(caught, url)


@pytest.mark.parametrize("where", ["key", "bucket"])
def test_a_missing_s3_object_is_a_file_not_found_error(s3: S3, where: str) -> None:
    url = (
        s3.url("never-written.state")
        if where == "key"
        else f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}/loader.state"
    )
    assert _start_fresh_or_resume(url, **s3.options()) == [[0, 1], [2, 3]]
    with pytest.raises(FileNotFoundError) as caught:
        load_state(url, **s3.options())
    _check_not_found(caught, url)


def test_the_not_found_error_pickles(tmp_path: Path) -> None:
    with pytest.raises(StateFileNotFoundError) as caught:
        load_state(tmp_path / "missing")
    copy = pickle.loads(pickle.dumps(caught.value))
    assert type(copy) is StateFileNotFoundError
    assert str(copy) == str(caught.value)
    assert (copy.errno, copy.filename) == (errno.ENOENT, str(tmp_path / "missing"))


def test_other_storage_errors_are_not_file_not_found_errors(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="it is a folder") as caught:
        load_state(tmp_path)
    assert not isinstance(caught.value, FileNotFoundError)
    with pytest.raises(StorageError, match="fsspec knows no storage protocol") as caught:
        load_state("nosuchproto://bucket/loader.state")
    assert not isinstance(caught.value, FileNotFoundError)
