"""Golden state files written by an earlier version keep loading and mean the same.

Each file under ``tests/golden/`` was saved by ``tests/golden/make_golden.py``. A fresh
loader built the same way restores it and must continue exactly as an uninterrupted run
computed now does, so the files pin the format *and* the semantics of a state. If the
format ever changes on purpose, old files must fail with a clear version error, which the
last tests check by bumping the version of a golden file.
"""

from __future__ import annotations

import importlib.util
import struct
import sys
from pathlib import Path
from types import ModuleType

import pytest

from savable_loader import RankState, StateFormatError, load_state
from savable_loader.serialization import HEADER_SIZE, dumps, loads
from savable_loader.state.files import decode_state
from savable_loader.testing import digest

GOLDEN = Path(__file__).parent / "golden"
EPOCHS = 3


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


def _states(name: str) -> list[RankState]:
    state = load_state(GOLDENS[name].path)
    return state if isinstance(state, list) else [state]


def test_every_golden_file_is_committed():
    assert sorted(path.stem for path in GOLDEN.glob("*.msgpack")) == sorted(GOLDENS)


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_golden_state_restores_and_continues_exactly(name):
    golden = GOLDENS[name]
    states = _states(name)
    world_size = len(golden.taken)
    assert len(states) == world_size
    for rank, (state, taken) in enumerate(zip(states, golden.taken, strict=True)):
        assert (state.format_version, state.rank, state.world_size) == (1, rank, world_size)
        with golden.build(rank, world_size) as reference:
            epochs = [[digest(item) for item in reference] for _ in range(EPOCHS)]
        flat = [item for epoch in epochs for item in epoch]
        if taken < 0:
            assert state.between_epochs
            taken = len(epochs[0])
        with golden.build(rank, world_size) as restored:
            restored.restore_state_rank(state)
            remaining = EPOCHS - state.epoch - (1 if state.between_epochs else 0)
            rest = [digest(item) for _ in range(remaining) for item in restored]
        assert rest == flat[taken:], f"{name}, rank {rank}"


def test_golden_two_worker_state_replays():
    """The mid-epoch file holds real checkpoints, not only a start position."""
    (state,) = _states("rank_2_workers_mid_epoch")
    assert [worker.delivered for worker in state.workers] != [0, 0]
    assert all(worker.checkpoint is not None for worker in state.workers)


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
    for state in states:
        state["format_version"] = 2
    with pytest.raises(StateFormatError, match="format_version 2 is newer than 1") as info:
        decode_state(dumps(payload))
    assert "upgrade savable_loader" in str(info.value)


def test_golden_files_are_state_files():
    for golden in GOLDENS.values():
        data = golden.path.read_bytes()
        assert len(data) > HEADER_SIZE
        assert data[:8] == b"SAVLDR\r\n"
