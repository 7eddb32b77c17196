"""Crafted state files: a state file is untrusted input (reliability issue 14).

Each case holds a valid checksum (or is a valid state object) and is built to reach a
weak spot past the format checks of ``test_bad_input.py``: generator states copied into
memory, counters that make a restore loop, decoders that raise something else than the
library's errors, files that cost unbounded memory or never end. Every case must end in
the library's documented error at ``load_state`` or at the restore, promptly. Cases that
crashed the process run in a subprocess, so that a segfault fails a test, not pytest.
"""

from __future__ import annotations

import copy
import hashlib
import io
import os
import random
import re
import struct
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgpack
import pytest
from paths import GOLDEN, pythonpath
from pipelines import RandomCounter

from savable_loader import SavableDataLoader, StateFormatError, StorageError, load_state
from savable_loader.cli import main
from savable_loader.serialization import HEADER_SIZE, MAGIC, dumps, loads

HERE = Path(__file__).resolve().parent
N, BATCH = 24, 2


def _saved(**kwargs: Any) -> dict[str, Any]:
    """A mid-epoch state of ``RandomCounter`` (it draws from all three generators)."""
    with SavableDataLoader(RandomCounter(N), batch_size=BATCH, **kwargs) as loader:
        iterator = iter(loader)
        for _ in range(5):
            next(iterator)
        return loader.save_state_rank().to_plain()


def _run(script: str) -> subprocess.CompletedProcess[str]:
    """Runs ``script`` in a fresh interpreter (a segfault kills it, not pytest)."""
    env = {**os.environ, "PYTHONPATH": pythonpath(HERE)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=HERE,
    )


def _with_index(python_state: bytes, index: int) -> bytes:
    return python_state[:-4] + struct.pack("<I", index)


# -- generator states --------------------------------------------------------------------

_RESTORE_SCRIPT = """
import pickle
from savable_loader import SavableDataLoader, StateError
{build}
state = pickle.loads(bytes.fromhex({state!r}))
for num_workers in (0, 2):
    with loader(num_workers) as restored:
        try:
            restored.restore_state_rank(state)
        except StateError as error:
            print("refused", type(error).__name__, str(error).splitlines()[1:3])
            continue
        print("accepted", num_workers)
        try:
            next(iter(restored))
        except Exception as error:
            print("first next raised", type(error).__name__)
"""


def _check_refused_in_subprocess(build: str, state: dict[str, Any], fragment: str) -> None:
    import pickle

    script = _RESTORE_SCRIPT.format(build=build, state=pickle.dumps(state).hex())
    result = _run(script)
    assert result.returncode == 0, f"the process died ({result.returncode}): {result.stderr}"
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stdout
    assert all(line.startswith("refused StateFormatError") for line in lines), result.stdout
    assert all(fragment in line for line in lines), result.stdout


def test_python_generator_index_out_of_range_is_refused_at_restore():
    """Before: accepted, then SIGSEGV at the first draw (0 workers), WorkerError with 2."""
    state = _saved()
    rng = state["workers"][0]["checkpoint"]["rng"]
    rng["python"] = _with_index(rng["python"], 0x80000000)
    build = """
from pipelines import RandomCounter
def loader(num_workers):
    return SavableDataLoader(RandomCounter(24), batch_size=2, num_workers=num_workers)
"""
    _check_refused_in_subprocess(build, state, "index 2147483648 (0x80000000), outside 0..624")


def _draw(item: int) -> tuple[int, float]:
    return item, random.random()


def test_a_shuffle_window_generator_is_checked_at_restore_too():
    """A Shuffle keeps the generators of its window's start in its state once something
    drew from them (the second window here); they are swapped in to re-read the window,
    through the same unchecked copy."""
    build = """
from savable_loader.datasets import IndexedDataset
from test_crafted_states import _draw
def loader(num_workers):
    stage = IndexedDataset(list(range(40))).map(_draw).filter(bool).shuffle(buffer_size=8, seed=1)
    return SavableDataLoader(stage, batch_size=2, num_workers=num_workers)
"""
    namespace: dict[str, Any] = {"SavableDataLoader": SavableDataLoader}
    exec(textwrap.dedent(build), namespace)
    with namespace["loader"](0) as loader:
        iterator = iter(loader)
        for _ in range(5):
            next(iterator)
        state = loader.save_state_rank().to_plain()
    window = state["workers"][0]["checkpoint"]["state"]["parent"]
    assert (window["window"], window["emitted"]) == (1, 2)
    window["rng"]["python"] = _with_index(window["rng"]["python"], 0x80000000)
    _check_refused_in_subprocess(build, state, "generator state at state.parent.rng is invalid")


@pytest.mark.parametrize(
    ("name", "torch_state", "fragment"),
    [
        ("wrong size", b"\1" * 100, "size to be 100"),
        ("garbage", b"\xff" * 5056, "Invalid mt19937 state"),
        ("zeros", b"\0" * 5056, "Invalid mt19937 state"),
    ],
)
def test_torch_generator_state_is_checked_at_load_and_restore(
    tmp_path, name, torch_state, fragment
):
    """Before: accepted by load_state and the restore, DatasetError at the first next()."""
    state = _saved()
    state["workers"][0]["checkpoint"]["rng"]["torch"] = torch_state
    path = tmp_path / "state"
    path.write_bytes(dumps({"kind": "rank", "state": state}))
    with pytest.raises(StateFormatError, match=fragment):
        load_state(path)
    with SavableDataLoader(RandomCounter(N), batch_size=BATCH) as loader:
        with pytest.raises(StateFormatError, match=fragment):
            loader.restore_state_rank(state)
        assert len(list(loader)) == N // BATCH  # the refused restore left it as it was


def test_python_index_is_checked_by_the_fast_setter_itself():
    """A state that bypassed validation still cannot reach memory."""
    from savable_loader import rng

    snapshot = rng.capture()
    crafted = rng.RngSnapshot(
        python=_with_index(snapshot.python, 625),
        python_gauss=None,
        numpy=snapshot.numpy,
        torch=snapshot.torch,
    )
    with pytest.raises(ValueError, match=r"outside 0\.\.624"):
        rng.apply(crafted)
    rng.apply(snapshot)


def test_a_saved_order_generator_is_checked_at_restore():
    import torch

    def build() -> SavableDataLoader:
        return SavableDataLoader(
            list(range(N)), batch_size=BATCH, shuffle=True, generator=torch.Generator()
        )

    with build() as loader:
        iterator = iter(loader)
        next(iterator)
        state = loader.save_state_rank().to_plain()
    assert state["order"] is not None
    state["order"]["before"]["generators"] = [b"\xff" * 5056]
    with (
        build() as loader,
        pytest.raises(StateFormatError, match=r"generators\[0\]: torch refuses"),
    ):
        loader.restore_state_rank(state)


# -- format-1 dataset states ---------------------------------------------------------------


def _format_1(dataset_state: bytes) -> dict[str, Any]:
    golden = GOLDEN / "rank_0_workers.msgpack"
    payload = loads(golden.read_bytes())
    assert isinstance(payload, dict)
    payload["state"]["workers"][0]["checkpoint"]["dataset_state"] = dataset_state
    return payload


FORMAT_1_CASES = [
    ("array key", b"\x81\x91\x01\x02", "a map key is not a str"),
    ("map key", b"\x81\x81\xa1a\x01\x02", "a map key is not a str"),
    ("int key", msgpack.packb({1: 2}), "dict key 1 is int, not str"),
    ("not msgpack", b"\xc1", r"dataset_state is not valid msgpack \(\w"),
    ("trailing bytes", msgpack.packb({"pos": 1}) + b"\0", "received extra data"),
    ("900 levels", b"\x91" * 900 + b"\x01", "nested more than 500 levels"),
]


@pytest.mark.parametrize(
    ("name", "dataset_state", "fragment"), FORMAT_1_CASES, ids=[c[0] for c in FORMAT_1_CASES]
)
def test_a_bad_format_1_dataset_state_is_refused_at_load(tmp_path, name, dataset_state, fragment):
    """Before: array and map keys raised TypeError out of load_state."""
    path = tmp_path / "state"
    path.write_bytes(dumps(_format_1(dataset_state)))
    with pytest.raises(StateFormatError, match=fragment):
        load_state(path)


@pytest.mark.parametrize(
    ("name", "dataset_state", "fragment"), FORMAT_1_CASES, ids=[c[0] for c in FORMAT_1_CASES]
)
def test_inspect_prints_one_line_for_a_bad_format_1_dataset_state(
    tmp_path, capsys, name, dataset_state, fragment
):
    """Before: a traceback for array and map keys."""
    path = tmp_path / "state"
    path.write_bytes(dumps(_format_1(dataset_state)))
    assert main(["inspect", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert "Traceback" not in captured.err


def _format_2(tmp_path: Path, dataset_state: bytes) -> Path:
    """A format-2 state file whose worker 0 holds the raw msgpack ``dataset_state`` as its
    dataset state (spliced into the body: the packer refuses such data), with a valid
    checksum."""
    with SavableDataLoader(RandomCounter(N), batch_size=BATCH) as loader:
        next(iter(loader))
        payload = {"kind": "rank", "state": loader.save_state_rank().to_plain()}
    assert payload["state"]["format_version"] == 2
    marker = b"\0crafted dataset state\0"
    payload["state"]["workers"][0]["checkpoint"]["state"] = marker
    packed = msgpack.packb(marker, use_bin_type=True)
    body = dumps(payload)[HEADER_SIZE:]
    assert body.count(packed) == 1
    body = body.replace(packed, dataset_state)
    digest = hashlib.blake2b(body, digest_size=32).digest()
    path = tmp_path / "state"
    path.write_bytes(struct.pack(">8sHHQ32s", MAGIC, 1, 0, len(body), digest) + body)
    return path


# msgpack names the key's type as "list" (1.1) or "<class 'list'>" (1.0).
FORMAT_2_CASES = [
    ("array key", b"\x81\x91\x01\x02", r"list'?>? is not allowed for map key"),
    ("map key", b"\x81\x81\xa1a\x01\x02", r"dict'?>? is not allowed for map key"),
    ("int key", b"\x81\x01\x02", r"int'?>? is not allowed for map key"),
    ("900 levels", b"\x91" * 900 + b"\x01", "nested more than 500 levels"),
]


@pytest.mark.parametrize(
    ("name", "dataset_state", "fragment"), FORMAT_2_CASES, ids=[c[0] for c in FORMAT_2_CASES]
)
def test_a_bad_format_2_dataset_state_is_refused_at_load(tmp_path, name, dataset_state, fragment):
    with pytest.raises(StateFormatError, match=fragment):
        load_state(_format_2(tmp_path, dataset_state))


@pytest.mark.parametrize(
    ("name", "dataset_state", "fragment"), FORMAT_2_CASES, ids=[c[0] for c in FORMAT_2_CASES]
)
def test_inspect_prints_one_line_for_a_bad_format_2_dataset_state(
    tmp_path, capsys, name, dataset_state, fragment
):
    assert main(["inspect", str(_format_2(tmp_path, dataset_state))]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert re.search(fragment, captured.err), captured.err
    assert "Traceback" not in captured.err


# -- bounded reads -------------------------------------------------------------------------


def _measured(path: Any, **kwargs: Any) -> tuple[BaseException, int, float]:
    """What ``load_state(path)`` raises, its peak of Python allocations and its time."""
    tracemalloc.start()
    began = time.perf_counter()
    try:
        load_state(path, **kwargs)
    except BaseException as error:
        raised = error
    else:
        raise AssertionError("load_state accepted it")
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return raised, peak, time.perf_counter() - began


def test_a_1_gib_garbage_file_is_refused_after_its_header(tmp_path):
    """Before: 1.3 GB of memory and 3.5 s to say it is not a state file."""
    path = tmp_path / "garbage"
    with open(path, "wb") as file:
        file.write(b"garbage!")
        file.truncate(1 << 30)  # sparse: no GB on disk
    error, peak, seconds = _measured(path)
    assert isinstance(error, StateFormatError)
    assert "does not start with the signature" in str(error)
    assert peak < 1 << 20
    assert seconds < 1


def test_a_valid_header_announcing_1_gib_is_refused_before_the_body(tmp_path):
    """Before: 2.3 GB of memory and 3.9 s, to find a bad checksum."""
    body = 1 << 30
    path = tmp_path / "huge"
    with open(path, "wb") as file:
        file.write(MAGIC + struct.pack(">HHQ", 1, 0, body) + b"\0" * 32)
        file.truncate(HEADER_SIZE + body)
    error, peak, seconds = _measured(path)
    assert isinstance(error, StateFormatError)
    assert "too large: it has 1,073,741,876 bytes" in str(error)
    assert "max_bytes=1,073,741,824" in str(error)
    assert peak < 1 << 20
    assert seconds < 1


def test_max_bytes_bounds_a_file_whose_header_understates_it(tmp_path):
    state = dumps({"kind": "rank", "state": _saved()})
    path = tmp_path / "state"
    path.write_bytes(state + b"\0" * 1000)
    with pytest.raises(StateFormatError, match=f"too large: it has {len(state) + 1000:,} bytes"):
        load_state(path, max_bytes=len(state) + 999)
    path.write_bytes(state)
    load_state(path, max_bytes=len(state))  # exactly at the bound
    with pytest.raises(StateFormatError, match="too large"):
        load_state(path, max_bytes=len(state) - 1)
    with pytest.raises(StateFormatError, match="max_bytes must be an int"):
        load_state(path, max_bytes=10)


class _Unsized(io.BytesIO):
    """A file that knows neither its size nor how to seek (a stream)."""

    size = None

    def seekable(self) -> bool:
        return False


def test_max_bytes_bounds_a_stream_of_unknown_size(monkeypatch):
    """An fsspec file that does not know its size is read up to max_bytes + 1 bytes."""
    import fsspec

    state = dumps({"kind": "rank", "state": _saved()})
    fs = fsspec.filesystem("memory")
    monkeypatch.setattr(fs, "open", lambda path, mode="rb", **_: _Unsized(state + bytes(5000)))
    with pytest.raises(StateFormatError, match="too large: more than max_bytes"):
        load_state("memory://crafted/state", max_bytes=len(state) + 100)
    big = dumps({"kind": "rank", "state": {"blob": bytes(100_000)}})
    monkeypatch.setattr(fs, "open", lambda path, mode="rb", **_: _Unsized(big[:70_000]))
    with pytest.raises(StateFormatError, match="too large: its header announces 100,"):
        load_state("memory://crafted/state", max_bytes=90_000)
    monkeypatch.setattr(fs, "open", lambda path, mode="rb", **_: _Unsized(state))
    assert load_state("memory://crafted/state", max_bytes=len(state)).to_plain()  # type: ignore[union-attr]


def test_dev_zero_is_refused_without_reading_it():
    error, peak, _ = _measured("/dev/zero")
    assert isinstance(error, StorageError)
    assert "it is a device" in str(error)
    assert peak < 1 << 20


def test_a_fifo_is_refused_instead_of_blocking(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    outcome: list[BaseException] = []

    def read() -> None:
        outcome.append(_measured(path)[0])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock the reader before failing
        with open(path, "wb"):
            pass
        reader.join(10)
        pytest.fail("load_state blocked on a FIFO")
    assert isinstance(outcome[0], StorageError)
    assert "FIFO" in str(outcome[0])


def test_inspect_refuses_a_huge_file_with_one_line(tmp_path, capsys):
    path = tmp_path / "garbage"
    with open(path, "wb") as file:
        file.truncate(1 << 30)
    assert main(["inspect", str(path)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_state_reads_back_unchanged_through_the_bounded_reader(tmp_path):
    state = _saved()
    path = tmp_path / "state"
    path.write_bytes(dumps({"kind": "rank", "state": state}))
    loaded = load_state(path)
    assert not isinstance(loaded, list)
    assert loaded.to_plain() == copy.deepcopy(state)


# -- counters ------------------------------------------------------------------------------


def _indexed(num_workers: int, *, endless: bool = False) -> SavableDataLoader:
    from savable_loader.datasets import IndexedDataset

    stage = IndexedDataset(list(range(40)))
    return SavableDataLoader(
        stage.repeat() if endless else stage, batch_size=BATCH, num_workers=num_workers
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_replay_beyond_any_save_is_refused_at_restore(num_workers):
    """Before: the restore took delivered=2**62 on an endless repeat, and the first next()
    replayed forever."""
    with _indexed(0, endless=True) as loader:
        iterator = iter(loader)
        for _ in range(5):
            next(iterator)
        state = loader.save_state_rank().to_plain()
    state["workers"][0]["delivered"] = 2**62
    with (
        _indexed(num_workers, endless=True) as loader,
        pytest.raises(StateFormatError, match=r"workers\[0\]\.delivered is 4611686018427387904"),
    ):
        loader.restore_state_rank(state)


def test_the_replay_bound_is_exact():
    from savable_loader.state.bounds import MAX_REPLAY

    with _indexed(0, endless=True) as loader:
        state = loader.save_state_rank().to_plain()
        iterator = iter(loader)
        next(iterator)
        state = loader.save_state_rank().to_plain()
    seq = state["workers"][0]["checkpoint"]["seq"]
    state["workers"][0]["delivered"] = seq + MAX_REPLAY
    with _indexed(0, endless=True) as loader:
        loader.restore_state_rank(state)  # accepted (replaying it would take a while)
        state["workers"][0]["delivered"] += 1
        with pytest.raises(StateFormatError, match=f"at most {MAX_REPLAY} to replay"):
            loader.restore_state_rank(state)


def test_a_worker_checkpoints_at_least_every_checkpoint_gap_events(monkeypatch):
    """What bounds a saved replay: the ring takes a checkpoint at least that often."""
    from savable_loader._worker import ring as _ring

    monkeypatch.setattr(_ring, "CHECKPOINT_GAP", 4)
    ring = _ring.CheckpointRing(max_lag=100, share=0.0)
    seq = iter(range(100))

    def capture() -> Any:
        return _ring.Entry(next(seq), None, None)  # type: ignore[arg-type]

    ring.take(capture)
    for _ in range(12):
        ring.maybe_take(1e-9, capture)
    assert [entry.seq for entry in ring.entries()] == [0, 1, 2, 3]
    assert ring.taken == 4


_EPOCH_SCRIPT = """
from savable_loader import SavableDataLoader, StateError
from savable_loader.datasets import IndexedDataset
def loader(num_workers):
    return SavableDataLoader(IndexedDataset(list(range(40))), batch_size=2, num_workers=num_workers)
with loader(0) as saving:
    iterator = iter(saving)
    next(iterator)
    state = saving.save_state_rank().to_plain()
state["epoch"] = 10**12
state["workers"][0]["checkpoint"]["state"]["parent"]["epoch"] = 10**12
with loader(2) as restored:
    try:
        restored.restore_state_rank(state)
    except StateError as error:
        print("refused", type(error).__name__, error)
    else:
        print("accepted")
"""


def test_a_huge_epoch_onto_another_worker_count_is_refused_at_restore():
    """Before: the reshard walked the pipeline through 10**12 epochs (never returned)."""
    try:
        result = _run(_EPOCH_SCRIPT)
    except subprocess.TimeoutExpired:
        pytest.fail("the restore did not return within 120 s")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("refused StateFormatError"), result.stdout
    assert "epoch is 1000000000000" in result.stdout
    assert "at most 65536" in result.stdout


# -- positions past the end of the data (NOTE [ Checking a replay ] in _compat.py) --------


class _Squares:
    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> int:
        return index * index


def _past_the_end(build: Any, extra: int) -> tuple[Any, Any]:
    """A state saved after two batches, with ``delivered`` moved ``extra`` batches on."""
    from savable_loader.state.models import RankState

    with build() as loader:
        iterator = iter(loader)
        next(iterator), next(iterator)
        state = loader.save_state_rank()
    payload = state.model_dump()
    worker = payload["workers"][0]
    worker["delivered"] += extra
    return state, RankState.model_validate(payload)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_delivered_past_the_end_of_a_map_style_dataset_is_refused_at_restore(num_workers):
    from savable_loader import SavableDataLoader, StateError

    def build() -> Any:
        return SavableDataLoader(_Squares(), batch_size=3, num_workers=num_workers, seed=1)

    # 20 items are 7 batches; worker 0 of two holds 4 of them and delivered 1 of the 2.
    fits = 5 if num_workers == 0 else 3
    _, bad = _past_the_end(build, fits + 50)
    with build() as loader, pytest.raises(StateError, match=r"workers\[0\]\.delivered is"):
        loader.restore_state_rank(bad)
    _, edge = _past_the_end(build, fits)
    with build() as loader:
        loader.restore_state_rank(edge)  # worker 0 at its last batch: a valid position
        assert len(list(loader)) == (0 if num_workers == 0 else 2)  # worker 1's rest


def test_a_delivered_past_a_files_run_or_a_limit_is_refused_at_restore(tmp_path):
    from savable_loader import SavableDataLoader, StateError, WorkerConfig
    from savable_loader.datasets import JsonLinesSource, Limit

    for part, count in enumerate([5, 9, 2]):
        (tmp_path / f"{part}.jsonl").write_text("".join(f'{{"i": {i}}}\n' for i in range(count)))
    config = WorkerConfig(rank=1, world_size=2)

    def files() -> Any:
        return SavableDataLoader(
            JsonLinesSource(str(tmp_path / "*")), batch_size=2, worker_config=config
        )

    _, bad = _past_the_end(files, 50)
    with files() as loader, pytest.raises(StateError, match="past the end of the data"):
        loader.restore_state_rank(bad)

    def limited() -> Any:
        return SavableDataLoader(Limit(RandomCounter(1000), 9), batch_size=2)

    _, bad = _past_the_end(limited, 4)  # 9 items: 5 batches, 2 taken, 3 left
    with limited() as loader, pytest.raises(StateError, match="has 3 left"):
        loader.restore_state_rank(bad)


def _two_files(tmp_path: Path) -> str:
    for part, count in enumerate([5, 9]):
        (tmp_path / f"{part}.jsonl").write_text("".join(f'{{"i": {i}}}\n' for i in range(count)))
    return str(tmp_path / "*")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_files_split_shard_past_the_files_is_refused_at_restore(tmp_path, num_workers):
    """Before: accepted, then the first next() failed (a worker error with workers)."""
    from savable_loader import StateError
    from savable_loader.datasets import JsonLinesSource

    urls = _two_files(tmp_path)

    def build() -> Any:
        source = JsonLinesSource(urls, split="files")
        return SavableDataLoader(source, batch_size=BATCH, num_workers=num_workers)

    state, _ = _past_the_end(build, 0)
    payload = state.model_dump()
    source_state = payload["workers"][0]["checkpoint"]["state"]["parent"]
    assert source_state["shard"] == 0
    source_state["shard"] = 10**6
    files = 2 if num_workers == 0 else 1
    with (
        build() as loader,
        pytest.raises(StateError, match=f"shard 1000000 is past the stream's {files} files"),
    ):
        loader.restore_state_rank(payload)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_delivered_past_the_end_of_a_shuffle_is_refused_at_restore(num_workers):
    """Before: accepted, then the first next() failed without naming the field."""
    from savable_loader import StateError
    from savable_loader.datasets import IndexedDataset

    def build() -> Any:
        stage = IndexedDataset(list(range(40))).shuffle(buffer_size=8, seed=3)
        return SavableDataLoader(stage, batch_size=BATCH, num_workers=num_workers)

    # 40 items are 20 batches; worker 0 of two holds 10 of them and delivered 1.
    fits = 18 if num_workers == 0 else 9
    _, bad = _past_the_end(build, fits + 1)
    with (
        build() as loader,
        pytest.raises(StateError, match=r"workers\[0\]\.delivered is \d+, .* left in that"),
    ):
        loader.restore_state_rank(bad)
    _, edge = _past_the_end(build, fits)
    with build() as loader:
        loader.restore_state_rank(edge)  # worker 0 at its last batch: a valid position
        assert len(list(loader)) == (0 if num_workers == 0 else 9)  # worker 1's rest


def _own_iterable(tmp_path: Path, num_workers: int) -> Any:
    return SavableDataLoader(RandomCounter(N), batch_size=BATCH, num_workers=num_workers)


def _files_split(tmp_path: Path, num_workers: int) -> Any:
    from savable_loader.datasets import JsonLinesSource

    source = JsonLinesSource(_two_files(tmp_path), split="files")
    return SavableDataLoader(source, batch_size=BATCH, num_workers=num_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    ("build", "batches"),
    [(_own_iterable, (12, 6)), (_files_split, (7, 3))],
    ids=["own iterable", "files split"],
)
def test_a_replay_past_the_end_names_the_field_and_both_values(
    tmp_path, build, batches, num_workers
):
    """Where nothing tells what is left before reading (a user's iterable, whole files
    whose samples are not counted), the restore takes the state and the replay refuses
    it. Before: "the pipeline ended after 10 of the 60 batches to replay", naming neither
    the field nor the position the pipeline reaches."""
    from savable_loader import StateError

    _, bad = _past_the_end(lambda: build(tmp_path, num_workers), 50)
    delivered = bad.workers[0].delivered
    reachable = batches[0] if num_workers == 0 else batches[1]
    with build(tmp_path, num_workers) as loader:
        loader.restore_state_rank(bad)
        with pytest.raises(
            StateError,
            match=rf"workers\[0\]\.delivered is {delivered}, .* at most {reachable} is "
            "reachable",
        ):
            next(iter(loader))
