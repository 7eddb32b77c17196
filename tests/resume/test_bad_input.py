"""Bad state files and hand-edited states are refused at the door (reliability issue).

Every case asserts the exception type and a fragment of its message saying what is
wrong, and that the loader the restore was refused by is unchanged: it still yields its
own stream exactly. Byte-level cases of the file format itself (every truncation, every
bit flip, every pickle protocol, zip, gzip...) are in ``test_serialization.py``; here
each kind of damage goes through the public path a user takes (``load_state`` of a file,
``load_state_dict``, ``restore_state_rank``), on a real state. Mismatched loaders are
named in ``test_loader.py`` (worker count, batch size, seed, pipeline); here their
messages are checked for both values and the fix, and world size and rank are added.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import pickle
import random
import shlex
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from pipelines import RandomCounter

from savable_loader import (
    RankState,
    SavableDataLoader,
    StateError,
    StateFormatError,
    StateMismatchError,
    WorkerConfig,
    load_state,
)
from savable_loader.serialization import HEADER_SIZE, MAGIC, dumps
from savable_loader.state.files import encode_state
from savable_loader.testing import digest

N, BATCH, TAKEN = 24, 2, 3


def _loader(num_workers: int = 0, **kwargs: Any) -> SavableDataLoader:
    return SavableDataLoader(RandomCounter(N), batch_size=BATCH, num_workers=num_workers, **kwargs)


def _reference(num_workers: int) -> list[str]:
    with _loader(num_workers) as loader:
        return [digest(item) for _ in range(2) for item in loader]


@pytest.fixture(scope="module")
def saved() -> dict[str, Any]:
    """A real mid-epoch state (0 workers, a checkpoint in it) as plain data."""
    with _loader() as loader:
        iterator = iter(loader)
        for _ in range(5):
            next(iterator)
        return loader.save_state_rank().to_plain()


def _file(body: bytes, *, version: int = 1, length: int | None = None) -> bytes:
    digest_ = hashlib.blake2b(body, digest_size=32).digest()
    size = len(body) if length is None else length
    return MAGIC + struct.pack(">HHQ", version, 0, size) + digest_ + body


def _flip(data: bytes, byte: int) -> bytes:
    flipped = bytearray(data)
    flipped[byte] ^= 0x10
    return bytes(flipped)


class _Exploit:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


# -- files: (name, bytes from the encoded real state, fragment) ---------------------------

FileCase = tuple[str, Callable[[bytes, Path], bytes], str]

FILE_CASES: list[FileCase] = [
    ("empty", lambda good, marker: b"", r"empty \(0 bytes\)"),
    ("signature only", lambda good, marker: good[:5], "ends inside the 8-byte savable_loader"),
    ("header cut", lambda good, marker: good[:30], "shorter than the 52-byte"),
    ("body cut", lambda good, marker: good[: HEADER_SIZE + 10], "truncated: its header announces"),
    ("last byte cut", lambda good, marker: good[:-1], "truncated"),
    ("bytes appended", lambda good, marker: good + b"\0", "unexpected bytes after the"),
    ("bit flip in body", lambda good, marker: _flip(good, len(good) // 2), "checksum of its"),
    ("bit flip in digest", lambda good, marker: _flip(good, 30), "checksum"),
    ("bit flip in magic", lambda good, marker: _flip(good, 2), "Not a savable_loader state file"),
    ("bit flip in length", lambda good, marker: _flip(good, 19), "bytes"),
    ("random bytes", lambda good, marker: random.Random(0).randbytes(300), "Not a savable_loader"),
    (
        "json of the state",
        lambda good, marker: json.dumps(
            {
                k: v
                for k, v in msgpack.unpackb(good[HEADER_SIZE:])["state"].items()
                if k != "workers"
            }
        ).encode(),
        "looks like JSON text",
    ),
    (
        "pickle of the state",
        lambda good, marker: pickle.dumps(msgpack.unpackb(good[HEADER_SIZE:])),
        "looks like a Python pickle",
    ),
    (
        "pickle that runs code",
        lambda good, marker: pickle.dumps(_Exploit(marker)),
        "never unpickles files",
    ),
    (
        "pickle that runs code, protocol 0",
        lambda good, marker: pickle.dumps(_Exploit(marker), protocol=0),
        "looks like a Python pickle",
    ),
    (
        "pickle that runs code behind a valid header",
        lambda good, marker: _file(pickle.dumps(_Exploit(marker))),
        "body is not valid msgpack",
    ),
    ("torch.save", lambda good, marker: _torch_save(marker), "torch.save checkpoint"),
    ("bare msgpack", lambda good, marker: good[HEADER_SIZE:], "may be bare msgpack"),
    (
        "newer file format",
        lambda good, marker: _file(good[HEADER_SIZE:], version=2),
        "file format version 2, but this savable_loader reads versions up to 1",
    ),
    (
        "file format 0",
        lambda good, marker: _file(good[HEADER_SIZE:], version=0),
        "version 0, which no savable_loader writes",
    ),
    (
        "1 GB claimed in the header",
        lambda good, marker: _file(good[HEADER_SIZE:], length=2**30),
        "announces a body of 1073741824 bytes but only",
    ),
    (
        "2**64-1 bytes claimed",
        lambda good, marker: _file(good[HEADER_SIZE:], length=2**64 - 1),
        "announces a body of 18446744073709551615 bytes",
    ),
    (
        "4 billion items claimed in the body",
        lambda good, marker: _file(b"\xdd\xff\xff\xff\xff"),
        "body is not valid msgpack",
    ),
    (
        "not a loader state",
        lambda good, marker: dumps({"weights": [1, 2]}),
        "holds no loader state",
    ),
    ("a list", lambda good, marker: dumps([1, 2]), "holds no loader state"),
    (
        "global without a list",
        lambda good, marker: dumps({"kind": "global", "states": {}}),
        "holds a list of rank states",
    ),
    (
        "rank without a state",
        lambda good, marker: dumps({"kind": "rank"}),
        "a loader state is a dict, got NoneType",
    ),
]


def _torch_save(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"loader": _Exploit(marker)}, buffer)
    return buffer.getvalue()


# -- hand-edited states: (name, edit of the plain state, exception, fragment) -------------

Edit = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Edit:
    """An edit setting the field at ``path`` (dots and list indices: ``workers.0.delivered``)."""

    def edit(state: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = state
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[int(last) if last.isdigit() else last] = value

    return edit


def _drop(path: str) -> Edit:
    def edit(state: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = state
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        del node[last]

    return edit


CK = "workers.0.checkpoint"
#: Edits a state file cannot even hold: its writer refuses them (test_serialization.py).
NOT_IN_A_FILE = (
    "2**64 delivered",
    "10**30 epoch",
    "pipeline state with a tuple",
    "pipeline state with an int key",
)
EDIT_CASES: list[tuple[str, Edit, type[StateError], str]] = [
    # Unknown versions.
    ("format_version 3", _set("format_version", 3), StateFormatError, "format_version 3 is newer"),
    ("format_version 0", _set("format_version", 0), StateFormatError, "format_version 0 is not 2"),
    # Negative indices.
    (
        "negative delivered",
        _set("workers.0.delivered", -1),
        StateFormatError,
        "workers.0.delivered",
    ),
    ("negative epoch", _set("epoch", -3), StateFormatError, "epoch\n  Input should be greater"),
    ("negative next_worker", _set("next_worker", -1), StateFormatError, "next_worker"),
    ("negative rank", _set("rank", -1), StateFormatError, "rank\n  Input should be greater"),
    ("negative worker_id", _set("workers.0.worker_id", -1), StateFormatError, "worker_id"),
    ("negative checkpoint seq", _set(f"{CK}.seq", -1), StateFormatError, "checkpoint.seq"),
    ("negative numpy_pos", _set(f"{CK}.rng.numpy_pos", -1), StateFormatError, "numpy_pos"),
    # Wrong types.
    ("delivered as str", _set("workers.0.delivered", "5"), StateFormatError, "valid integer"),
    ("delivered as float", _set("workers.0.delivered", 5.0), StateFormatError, "valid integer"),
    ("ended as int", _set("workers.0.ended", 1), StateFormatError, "valid boolean"),
    ("batch_size as float", _set("batch_size", 2.0), StateFormatError, "batch_size"),
    ("fingerprint as int", _set("fingerprint", 7), StateFormatError, "fingerprint"),
    ("workers as dict", _set("workers", {"0": {}}), StateFormatError, "workers"),
    ("worker as list", _set("workers.0", [0, 1, False, None]), StateFormatError, "workers.0"),
    (
        "pipeline state with a tuple",
        _set(f"{CK}.state", {"parent": (1, 2), "exhausted": False}),
        StateFormatError,
        "parent: tuple is not plain data",
    ),
    (
        "pipeline state with an int key",
        _set(f"{CK}.state", {"parent": {1: 2}, "exhausted": False}),
        StateFormatError,
        "dict key 1 is int, not str",
    ),
    ("rng as None", _set(f"{CK}.rng", None), StateFormatError, "rng"),
    ("python rng cut", _set(f"{CK}.rng.python", b"\0" * 10), StateFormatError, "rng.python"),
    ("state is a str", lambda s: None, StateFormatError, "takes a state, a list of every"),
    # Extra fields.
    ("extra top-level field", _set("surprise", 1), StateFormatError, "surprise\n  Extra inputs"),
    ("extra worker field", _set("workers.0.surprise", 1), StateFormatError, "workers.0.surprise"),
    ("extra checkpoint field", _set(f"{CK}.x", 1), StateFormatError, "checkpoint.x"),
    ("extra rng field", _set(f"{CK}.rng.x", 1), StateFormatError, "rng.x"),
    # Missing fields.
    (
        "missing fingerprint",
        _drop("fingerprint"),
        StateFormatError,
        "fingerprint\n  Field required",
    ),
    ("missing workers", _drop("workers"), StateFormatError, "workers\n  Field required"),
    ("missing delivered", _drop("workers.0.delivered"), StateFormatError, "Field required"),
    ("missing rng", _drop(f"{CK}.rng"), StateFormatError, "checkpoint.rng\n  Field required"),
    ("missing format_version", _drop("format_version"), StateFormatError, "format_version"),
    # Absurd sizes and inconsistent fields.
    ("10**12 workers", _set("num_workers", 10**12), StateFormatError, "num_workers"),
    (
        "2**64 delivered",
        _set("workers.0.delivered", 2**64),
        StateFormatError,
        r"workers\[0\]\.delivered is 18446744073709551616, beyond any run",
    ),
    (
        "10**30 epoch",
        _set("epoch", 10**30),
        StateFormatError,
        "epoch is 1000000000000000000000000000000",
    ),
    (
        "delivered without a checkpoint",
        _set(CK, None),
        StateFormatError,
        r"workers\[0\] has delivered=5, ended=False but no checkpoint",
    ),
    ("2 MiB torch rng", _set(f"{CK}.rng.torch", b"\0" * (2 << 20)), StateFormatError, "rng.torch"),
    ("numpy_pos 625", _set(f"{CK}.rng.numpy_pos", 625), StateFormatError, "numpy_pos"),
    ("no worker entries", _set("workers", []), StateFormatError, "0 worker entries"),
    ("world_size 0", _set("world_size", 0), StateFormatError, "world_size"),
    ("rank past world", _set("rank", 1), StateFormatError, "rank 1 is not below world_size 1"),
    ("next_worker past", _set("next_worker", 1), StateFormatError, "next_worker 1 is not a worker"),
    ("worker_id out of order", _set("workers.0.worker_id", 1), StateFormatError, "worker_id 1"),
    ("checkpoint ahead", _set(f"{CK}.seq", 99), StateFormatError, "is past delivered"),
    # Well formed, but not this loader's.
    (
        "another pipeline",
        _set("fingerprint", "0123456789abcdef"),
        StateMismatchError,
        "fingerprint was 0123456789abcdef",
    ),
    ("another seed", _set("seed", 5), StateMismatchError, "seed was 5 when the state was saved"),
    # A batch size its fingerprint was not computed with.
    ("another batch size", _set("batch_size", 4), StateMismatchError, "fingerprint was"),
]


def _edited(saved: dict[str, Any], name: str, edit: Edit) -> Any:
    if name == "state is a str":
        return "a state"
    state = copy.deepcopy(saved)
    edit(state)
    return state


def _assert_unchanged(loader: SavableDataLoader, expected: list[str]) -> None:
    """``loader`` took ``TAKEN`` items through ``loader.taken_from``; that iterator must
    still yield the rest of its epoch, and a new one the next epoch."""
    rest = [digest(item) for item in loader.taken_from] + [digest(item) for item in loader]
    assert rest == expected[TAKEN:]


@pytest.fixture
def started() -> Iterator[tuple[SavableDataLoader, list[str]]]:
    expected = _reference(0)
    with _loader() as loader:
        iterator = iter(loader)
        for _ in range(TAKEN):
            next(iterator)
        loader.taken_from = iterator  # type: ignore[attr-defined]
        yield loader, expected


@pytest.mark.parametrize(("name", "make", "fragment"), FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_bad_file_is_refused_and_runs_nothing(tmp_path, saved, started, name, make, fragment):
    loader, expected = started
    marker = tmp_path / "pwned"
    good = encode_state(RankState.from_plain(saved))
    path = tmp_path / "loader.state"
    path.write_bytes(make(good, marker))
    with pytest.raises(StateFormatError, match=fragment):
        loader.restore_state_rank(load_state(path))  # type: ignore[arg-type]
    with pytest.raises(StateFormatError, match=fragment):
        loader.load_state_dict({"rank_0": path.read_bytes()})
    assert not marker.exists()
    _assert_unchanged(loader, expected)


@pytest.mark.parametrize(
    ("name", "edit", "error", "fragment"), EDIT_CASES, ids=[c[0] for c in EDIT_CASES]
)
def test_hand_edited_state_is_refused(tmp_path, saved, started, name, edit, error, fragment):
    loader, expected = started
    state = _edited(saved, name, edit)
    with pytest.raises(error, match=fragment):
        loader.restore_state_rank(state)
    if not isinstance(state, dict):
        with pytest.raises(StateFormatError, match="takes the dict state_dict"):
            loader.load_state_dict(state)  # type: ignore[arg-type]
    else:
        with pytest.raises(error, match=fragment):
            loader.load_state_dict(state)
    if isinstance(state, dict) and name not in NOT_IN_A_FILE:
        # The same edit inside a well-formed file is refused by load_state (or the restore).
        path = tmp_path / "edited.state"
        path.write_bytes(dumps({"kind": "rank", "state": state}))
        with pytest.raises(error, match=fragment):
            loader.restore_state_rank(load_state(path))  # type: ignore[arg-type]
    _assert_unchanged(loader, expected)


def test_a_global_list_with_one_bad_entry_is_refused_whole(tmp_path, saved):
    bad = _edited(saved, "negative epoch", _set("epoch", -1))
    path = tmp_path / "global.state"
    path.write_bytes(dumps({"kind": "global", "states": [saved, bad]}))
    with pytest.raises(StateFormatError, match="epoch"):
        load_state(path)


@pytest.mark.parametrize(
    ("other", "field", "saved_value", "current", "fix"),
    [
        ({"num_workers": 2}, "num_workers", 0, 2, "restore on the number of workers and ranks"),
        ({"batch_size": 3}, "batch_size", 2, 3, "build the loader with batch_size=2"),
        (
            {"worker_config": WorkerConfig(rank=0, world_size=2)},
            "world_size",
            1,
            2,
            "restore on the number of workers and ranks",
        ),
        ({"seed": 1}, "seed", 0, 1, "build the loader with seed=0"),
    ],
)
def test_mismatch_names_the_field_both_values_and_the_fix(
    saved, other, field, saved_value, current, fix
):
    arguments: dict[str, Any] = {"batch_size": BATCH, "num_workers": 0, **other}
    with SavableDataLoader(RandomCounter(N), **arguments) as loader:
        expected = [digest(item) for _ in range(2) for item in loader]
        loader.restore_state_rank(None)
        with pytest.raises(StateMismatchError) as info:
            loader.restore_state_rank(saved)
        message = str(info.value)
        assert f"{field} was {saved_value} when the state was saved and is {current} now" in message
        assert fix in message
        assert [digest(item) for _ in range(2) for item in loader] == expected


def test_rank_mismatch_names_both_ranks(saved):
    state = _edited(saved, "world 2", _set("world_size", 2))
    with (
        SavableDataLoader(
            RandomCounter(N), batch_size=BATCH, worker_config=WorkerConfig(rank=1, world_size=2)
        ) as loader,
        pytest.raises(StateMismatchError, match=r"rank was 0 .* is 1 now; restore each"),
    ):
        loader.restore_state_rank(state)


def test_another_pipeline_names_both_fingerprints(saved):
    with SavableDataLoader(RandomCounter(N + 1), batch_size=BATCH) as loader:
        with pytest.raises(StateMismatchError) as info:
            loader.restore_state_rank(saved)
        assert f"fingerprint was {saved['fingerprint']}" in str(info.value)
        assert f"is {loader.fingerprint} now" in str(info.value)
        assert "Rebuild the pipeline exactly" in str(info.value)


def test_every_case_leaves_a_running_multi_worker_loader_unchanged(tmp_path, saved):
    """All bad inputs, one after another, on one loader with live workers."""
    expected = _reference(2)
    marker = tmp_path / "pwned"
    good = encode_state(RankState.from_plain(saved))
    with _loader(2) as loader:
        iterator = iter(loader)
        got = [digest(next(iterator)) for _ in range(TAKEN)]
        refused = 0
        for _name, make, _ in FILE_CASES:
            path = tmp_path / "state"
            path.write_bytes(make(good, marker))
            with pytest.raises(StateFormatError):
                loader.restore_state_rank(load_state(path))  # type: ignore[arg-type]
            refused += 1
        for name, edit, _error, _ in EDIT_CASES:
            state = _edited(saved, name, edit)
            with pytest.raises(StateError):  # num_workers differs besides: any refusal
                loader.restore_state_rank(state)
            refused += 1
        got += [digest(item) for item in iterator]  # the live iterator goes on
        got += [digest(item) for item in loader]
    assert refused == len(FILE_CASES) + len(EDIT_CASES)
    assert not marker.exists()
    assert got == expected
