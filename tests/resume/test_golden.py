"""Golden state files written by an earlier version keep loading and mean the same.

Each file under ``tests/support/golden/`` was saved by
``tests/support/golden/make_golden.py``. A fresh loader built the same way restores it and
must continue exactly as an uninterrupted run computed now does, so the files pin the
format *and* the semantics of a state. A file
saved after a restore (a chain, or an elastic restore onto another layout) must continue
exactly as the live loader it was saved from, recomputed now from the committed file it
restored. The files hold format-1 states; the restore test reads them through
``load_state`` only, so it keeps checking them once a later format migrates them on load.
The last tests check that a file of a newer format fails with a clear version error.
"""

from __future__ import annotations

import importlib.util
import struct
import sys
from types import ModuleType
from typing import Any

import msgpack
import pytest
from paths import GOLDEN

from savable_loader import StateFormatError, load_state
from savable_loader.serialization import HEADER_SIZE, dumps, loads
from savable_loader.state.files import decode_state
from savable_loader.state.models import FORMAT_VERSION
from savable_loader.testing import digest

EPOCHS = 3


@pytest.fixture(autouse=True)
def stored_orders(monkeypatch: pytest.MonkeyPatch) -> None:
    """The goldens were saved before computed orders (NOTE [ Computed epoch orders ] in
    ``datasets/index/permutation.py``): their states restore with the stored permutations
    they were saved with, and the uninterrupted runs they are compared with are fresh
    runs of that version, which drew those permutations too."""
    from savable_loader.datasets import global_view
    from savable_loader.datasets.index import reshard as indexed_rest

    monkeypatch.setattr(indexed_rest, "FRESH_ORDER", 1)
    # Saved before a shuffled pipeline was read by position (NOTE [ Pipelines read by
    # position ] in datasets/global_view.py): such a state goes on stream by stream.
    monkeypatch.setattr(global_view, "FRESH", False)


def _make_golden() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_golden", module)
    spec.loader.exec_module(module)
    return module


make_golden = _make_golden()
GOLDENS = {golden.name: golden for golden in make_golden.GOLDENS}


def _states(name: str) -> list[Any]:
    state = load_state(GOLDENS[name].path)
    return state if isinstance(state, list) else [state]


def _payload_states(name: str) -> list[dict[str, Any]]:
    """The rank states as the file holds them (plain data, not a loaded model)."""
    payload = loads(GOLDENS[name].path.read_bytes())
    assert isinstance(payload, dict)
    return [payload["state"]] if payload["kind"] == "rank" else payload["states"]


def _dataset_states(name: str) -> list[Any]:
    """Every worker checkpoint's dataset state in the file, decoded."""
    return [
        msgpack.unpackb(worker["checkpoint"]["dataset_state"], raw=False, strict_map_key=False)
        for state in _payload_states(name)
        for worker in state["workers"]
        if worker["checkpoint"] is not None
    ]


def _keys(tree: Any) -> set[str]:
    if isinstance(tree, dict):
        return set(tree).union(*(_keys(value) for value in tree.values()))
    if isinstance(tree, list):
        return set().union(*(_keys(value) for value in tree))
    return set()


def _continue(loader: Any, epochs: int) -> list[str]:
    """Digests of what ``epochs`` iterations of ``loader`` yield (the first one continues
    an epoch left half-read)."""
    return [digest(item) for _ in range(epochs) for item in loader]


def _expected(golden: Any, rank: int) -> tuple[int, list[str]]:
    """How many iterations a restored loader runs, and the digests they must yield."""
    if golden.restored is not None:
        # NOTE [ Derived goldens ] in make_golden.py: the live loader the state came from.
        live, iterator = make_golden.position(golden, rank)
        with live:
            if iterator is None:
                return EPOCHS - 1, _continue(live, EPOCHS - 1)
            return EPOCHS - 1, [digest(item) for item in iterator] + _continue(live, EPOCHS - 2)
    with golden.build(rank, golden.world_size) as reference:
        epochs = [[digest(item) for item in reference] for _ in range(EPOCHS)]
    taken = golden.taken[rank]
    if taken < 0:
        return EPOCHS - 1, [item for epoch in epochs[1:] for item in epoch]
    # The epoch of the last item taken (a save right after an epoch's last item, before
    # its StopIteration, still stands in that epoch).
    epoch, end = 0, len(epochs[0])
    while taken > end:
        epoch += 1
        end += len(epochs[epoch])
    flat = [item for epoch in epochs for item in epoch]
    return EPOCHS - epoch, flat[taken:]


def test_every_golden_file_is_committed():
    assert sorted(path.stem for path in GOLDEN.glob("*.msgpack")) == sorted(GOLDENS)


def test_the_memory_files_of_the_file_sources_are_unchanged():
    """The file sources' goldens hold byte offsets into these files."""
    assert make_golden.memory_digest() == make_golden.MEMORY_DIGEST


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_golden_file_holds_format_1_states_of_its_ranks(name):
    golden = GOLDENS[name]
    states = _payload_states(name)
    assert [state["format_version"] for state in states] == [1] * golden.world_size
    assert [(state["rank"], state["world_size"]) for state in states] == [
        (rank, golden.world_size) for rank in range(golden.world_size)
    ]


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_golden_state_restores_and_continues_exactly(name):
    golden = GOLDENS[name]
    states = _states(name)
    assert len(states) == golden.world_size
    for rank, state in enumerate(states):
        iterations, expected = _expected(golden, rank)
        with golden.build(rank, golden.world_size) as restored:
            restored.restore_state_rank(state)
            rest = _continue(restored, iterations)
        assert rest == expected, f"{name}, rank {rank}"
        assert expected, f"{name}, rank {rank}: nothing left to compare"


def test_golden_two_worker_state_replays():
    """The mid-epoch file holds real checkpoints, not only a start position."""
    (state,) = _payload_states("rank_2_workers_mid_epoch")
    assert [worker["delivered"] for worker in state["workers"]] != [0, 0]
    assert all(worker["checkpoint"] is not None for worker in state["workers"])


def test_golden_files_hold_the_state_shapes_they_cover():
    """Each golden covers the state it is named for: checked on the files' plain data, so
    that a change of the writer cannot silently turn one into a plainer state."""
    (uneven,) = _payload_states("uneven_3_workers_one_ended")
    assert uneven["next_worker"] != 0
    assert [worker["ended"] for worker in uneven["workers"]] == [True, False, False]
    (shuffled,) = _payload_states("indexed_shuffled_2_workers")
    assert shuffled["next_worker"] == 1
    (partial,) = _payload_states("last_partial_batch")
    assert any(worker["checkpoint"]["exhausted"] for worker in partial["workers"])
    assert not any(worker["ended"] for worker in partial["workers"])
    (unbatched,) = _payload_states("no_batching")
    assert unbatched["batch_size"] is None
    (window,) = _dataset_states("shuffle_mid_window")
    assert window["window"] > 0
    assert 0 < window["emitted"] < 5
    assert all("passes" in state for state in _dataset_states("repeat"))
    assert all("count" in state for state in _dataset_states("limit"))
    for state in _dataset_states("elastic_indexed_resharded"):
        assert {"done_below", "done", "salt", "quota"} <= _keys(state)
    for state in _dataset_states("elastic_jsonl_resharded"):
        assert {"done_below", "done", "started"} <= _keys(state)
        assert state["parent"]["started"]
    for name in ("elastic_indexed_2_ranks", "elastic_jsonl_2_ranks"):
        assert len(_payload_states(name)) == 2


def test_golden_file_with_a_newer_file_format_fails_with_a_version_error():
    data = GOLDENS["rank_0_workers"].path.read_bytes()
    bumped = data[:8] + struct.pack(">H", 2) + data[10:]
    with pytest.raises(StateFormatError, match="file format version 2") as info:
        decode_state(bumped)
    assert "a newer savable_loader wrote it" in str(info.value)
    assert "Upgrade savable_loader" in str(info.value)


@pytest.mark.parametrize("name", ["rank_0_workers", "global_2_ranks"])
def test_golden_state_with_a_newer_state_format_fails_with_a_version_error(name):
    payload = loads(GOLDENS[name].path.read_bytes())
    assert isinstance(payload, dict)
    states = [payload["state"]] if payload["kind"] == "rank" else payload["states"]
    newer = FORMAT_VERSION + 1
    for state in states:
        state["format_version"] = newer
    with pytest.raises(
        StateFormatError, match=f"format_version {newer} is newer than {FORMAT_VERSION}"
    ) as info:
        decode_state(dumps(payload))
    assert "upgrade savable_loader" in str(info.value)


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_format_1_states_are_migrated_on_load(name):
    """A format-1 file loads as the current format; its pipeline state is the dataset's
    state under the batching stage, with the checkpoint's exhausted flag moved there."""
    payload = loads(GOLDENS[name].path.read_bytes())
    assert isinstance(payload, dict)
    raw = [payload["state"]] if payload["kind"] == "rank" else payload["states"]
    for old, new in zip(raw, _states(name), strict=True):
        assert (old["format_version"], new.format_version) == (1, FORMAT_VERSION)
        for old_worker, new_worker in zip(old["workers"], new.workers, strict=True):
            old_checkpoint, checkpoint = old_worker["checkpoint"], new_worker.checkpoint
            if old_checkpoint is None:
                assert checkpoint is None
                continue
            assert checkpoint is not None
            assert checkpoint.seq == old_checkpoint["seq"]
            assert checkpoint.state == {
                "parent": msgpack.unpackb(old_checkpoint["dataset_state"], raw=False),
                "exhausted": old_checkpoint["exhausted"],
            }


def test_golden_files_are_state_files():
    for golden in GOLDENS.values():
        data = golden.path.read_bytes()
        assert len(data) > HEADER_SIZE
        assert data[:8] == b"SAVLDR\r\n"
