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
from pipelines import RandomCounter, Squares
from s3_server import S3
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from savable_loader import (
    ConfigError,
    SavableDataLoader,
    SavableLoaderError,
    StateFileNotFoundError,
    StorageError,
    WorkerConfig,
    load_state,
    save_state,
)

# -- arguments the state cannot carry --------------------------------------------------


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**100])
def test_a_seed_outside_the_state_formats_range_is_refused(seed: int) -> None:
    with pytest.raises(ConfigError, match=rf"seed={seed} is outside -2\*\*63\.\.2\*\*64-1"):
        SavableDataLoader(Squares(4), seed=seed)


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63)])
def test_the_seeds_at_the_ends_of_the_range_save_and_resume(tmp_path: Path, seed: int) -> None:
    with SavableDataLoader(Squares(6), batch_size=2, shuffle=True, seed=seed) as loader:
        iterator = iter(loader)
        next(iterator)
        save_state(loader.save_state_rank(), tmp_path / "state")
        rest = [batch["index"].tolist() for batch in iterator]
    with SavableDataLoader(Squares(6), batch_size=2, shuffle=True, seed=seed) as resumed:
        resumed.restore_state_rank(load_state(tmp_path / "state"))
        assert [batch["index"].tolist() for batch in resumed] == rest


@pytest.mark.parametrize("seed", [True, False])
def test_a_bool_seed_is_refused(seed: bool) -> None:
    with pytest.raises(ConfigError, match=rf"seed must be an int, not a bool \({seed}\)"):
        SavableDataLoader(Squares(4), seed=seed)


@pytest.mark.parametrize("num_workers", [True, False])
def test_a_bool_num_workers_is_refused(num_workers: bool) -> None:
    # Torch takes True for 1 worker; the state's worker count is a strict int.
    with pytest.raises(
        ConfigError, match=rf"num_workers must be a non-negative int, not a bool \({num_workers}\)"
    ):
        SavableDataLoader(Squares(4), num_workers=num_workers)


def test_more_workers_than_a_state_holds_are_refused() -> None:
    with pytest.raises(ConfigError, match="num_workers=4097 is more than the 4096 workers"):
        SavableDataLoader(Squares(4), num_workers=4097)


@pytest.mark.parametrize(
    "arguments",
    [
        {},
        {"sampler": SequentialSampler(range(4))},
        {"batch_sampler": BatchSampler(SequentialSampler(range(4)), 2, drop_last=False)},
    ],
    ids=["batch_size", "with_sampler", "with_batch_sampler"],
)
@pytest.mark.parametrize("batch_size", [True, False])
def test_a_bool_batch_size_is_refused_with_torchs_message(
    arguments: dict[str, Any], batch_size: bool
) -> None:
    with pytest.raises(ValueError) as torchs:
        DataLoader(Squares(4), batch_size=batch_size, sampler=arguments.get("sampler"))
    with pytest.raises(ConfigError) as ours:
        SavableDataLoader(Squares(4), batch_size=batch_size, **arguments)
    assert str(ours.value) == str(torchs.value)
    assert (
        str(ours.value) == f"batch_size should be a positive integer value, but got {batch_size=}"
    )


def test_a_bool_batch_size_is_refused_for_an_iterable_dataset() -> None:
    with pytest.raises(ConfigError, match="but got batch_size=True"):
        SavableDataLoader(RandomCounter(4), batch_size=True)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"rank": True, "world_size": 2}, r"rank must be an int, not a bool \(True\)"),
        ({"rank": 0, "world_size": True}, r"world_size must be an int, not a bool \(True\)"),
        ({"rank": 0.0, "world_size": 1}, r"rank must be an int or None, got 0\.0"),
    ],
)
def test_a_worker_config_the_state_cannot_carry_is_refused(
    arguments: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        WorkerConfig(**arguments)


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
