"""save_state / load_state / ``inspect`` against a real S3 HTTP endpoint.

The endpoint is moto's server mode (``tests/support/s3_server.py``), started by this module on a
free loopback port and stopped at its end; the bucket is created with boto3. Nothing is
mocked in process: the bytes go through fsspec, s3fs and botocore over HTTP, as they would
to AWS. Credentials and the endpoint reach s3fs either as storage options or the usual
way, through the ``AWS_*`` environment variables (botocore reads ``AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

import json
import random
import uuid
from typing import Any

import pytest
from s3_server import BUCKET, S3, S3FS_WARNINGS

from savable_loader import RankState, SavableDataLoader, WorkerConfig, load_state, save_state
from savable_loader.cli import main
from savable_loader.errors import StateFormatError, StorageError

pytestmark = [S3FS_WARNINGS]


def _batches(iterable: Any) -> list[list[int]]:
    return [batch.tolist() for batch in iterable]


def _take(loader: SavableDataLoader, count: int) -> list[list[int]]:
    iterator = iter(loader)
    return [next(iterator).tolist() for _ in range(count)]


def _state_after(batches: int, **kwargs: Any) -> RankState:
    with SavableDataLoader(list(range(30)), batch_size=4, **kwargs) as loader:
        _take(loader, batches)
        return loader.save_state_rank()


# save_state / load_state.


@pytest.mark.parametrize(
    ("num_workers", "how"), [(0, "options"), (2, "options"), (0, "environment")]
)
def test_resume_from_s3(s3: S3, num_workers: int, how: str) -> None:
    options = s3.access(how)
    url = s3.url("ckpt/loader.state")
    with SavableDataLoader(list(range(30)), batch_size=4, num_workers=num_workers) as original:
        iterator = iter(original)
        head = [next(iterator).tolist() for _ in range(3)]
        save_state(original.save_state_rank(), url, **options)
        # The rest of this epoch, and the whole next one.
        expected = _batches(iterator) + _batches(original)

    assert s3.keys() == [s3.key("ckpt/loader.state")]
    state = load_state(url, **options)
    assert isinstance(state, RankState)
    with SavableDataLoader(list(range(30)), batch_size=4, num_workers=num_workers) as resumed:
        resumed.restore_state_rank(state)
        got = _batches(resumed) + _batches(resumed)

    assert got == expected
    assert len(head) + len(expected) == 8 + 8  # 30 items in batches of 4, two epochs
    assert got[0] != head[0]


def test_list_of_rank_states_round_trips(s3: S3) -> None:
    options = s3.use_environment()
    url = s3.url("global.state")
    states = [
        _state_after(2, worker_config=WorkerConfig(rank=rank, world_size=2)) for rank in (0, 1)
    ]
    save_state(states, url, **options)

    loaded = load_state(url, **options)

    assert isinstance(loaded, list)
    assert [state.to_plain() for state in loaded] == [state.to_plain() for state in states]
    assert [(state.rank, state.world_size) for state in loaded] == [(0, 2), (1, 2)]
    for rank, state in enumerate(loaded):
        config = WorkerConfig(rank=rank, world_size=2)
        with SavableDataLoader(list(range(30)), batch_size=4, worker_config=config) as loader:
            loader.restore_state_rank(state)
            # Rank r holds items r, r+2, ...; two batches of 4 were taken.
            assert next(iter(loader)).tolist() == [16 + rank, 18 + rank, 20 + rank, 22 + rank]


# Errors.


@pytest.mark.parametrize("where", ["key", "bucket"])
def test_missing_object_is_not_found(s3: S3, where: str) -> None:
    if where == "key":
        url = s3.url("never-written.state")
    else:
        url = f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}/loader.state"

    with pytest.raises(StorageError, match="not found") as caught:
        load_state(url, **s3.options())

    assert url in str(caught.value)


@pytest.mark.parametrize("damage", ["random", "truncated"])
def test_corrupt_object_is_a_format_error(s3: S3, damage: str) -> None:
    options = s3.options()
    url = s3.url("corrupt.state")
    if damage == "random":
        body = random.Random(0).randbytes(300)
    else:
        save_state(_state_after(1), url, **options)
        whole = s3.client.get_object(Bucket=BUCKET, Key=s3.key("corrupt.state"))["Body"].read()
        body = whole[: len(whole) // 2]
    s3.client.put_object(Bucket=BUCKET, Key=s3.key("corrupt.state"), Body=body)

    with pytest.raises(StateFormatError):
        load_state(url, **options)


def test_overwrite_keeps_the_newest(s3: S3) -> None:
    options = s3.options()
    url = s3.url("loader.state")
    older, newer = _state_after(1), _state_after(5)
    assert older.to_plain() != newer.to_plain()

    save_state(older, url, **options)
    save_state(newer, url, **options)

    loaded = load_state(url, **options)
    assert isinstance(loaded, RankState)
    assert loaded.to_plain() == newer.to_plain()
    assert s3.keys() == [s3.key("loader.state")]


# The inspect command, configured through the environment as a user would.


def test_inspect_prints_the_summary(s3: S3, capsys: pytest.CaptureFixture[str]) -> None:
    url = s3.url("ckpt/loader.state")
    state = _state_after(3)
    save_state(state, url, **s3.options())
    size = s3.client.head_object(Bucket=BUCKET, Key=s3.key("ckpt/loader.state"))["ContentLength"]
    s3.use_environment()
    import s3fs  # NOTE [ Heavy imports last ] in conftest.py

    s3fs.S3FileSystem.clear_instance_cache()

    assert main(["inspect", url]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert f"savable_loader state file: {url}" in out
    assert f"{size:,} bytes" in out
    assert "rank 0 of 1: no workers, batch size 4, seed 0" in out
    assert f"fingerprint {state.fingerprint}" in out

    assert main(["inspect", "--json", url]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["url"] == url
    assert summary["file_size"] == size
    assert summary["kind"] == "rank"
    assert summary["ranks"][0]["fingerprint"] == state.fingerprint


def test_inspect_missing_object_exits_2(s3: S3, capsys: pytest.CaptureFixture[str]) -> None:
    s3.use_environment()
    url = s3.url("never-written.state")

    assert main(["inspect", url]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == f"savable-loader inspect: {url}: Cannot read {url}: not found."
