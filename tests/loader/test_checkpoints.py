"""The loader inside a model checkpoint: state_dict(), torch.save and DCP (issue 3).

Two-rank DCP runs live in test_distributed.py; these run in one process.
"""

from __future__ import annotations

import codecs
import contextlib
import io
from collections.abc import Iterator

import pytest
import torch
from pipelines import RandomCounter

from savable_loader import SavableDataLoader, StateFormatError, StateMismatchError, WorkerConfig
from savable_loader.state.files import encode_state
from savable_loader.testing import digest


def _loader(num_workers: int = 2, **kwargs: object) -> SavableDataLoader:
    return SavableDataLoader(RandomCounter(14), batch_size=2, num_workers=num_workers, **kwargs)


@contextlib.contextmanager
def _bytes_in_weights_only_load() -> Iterator[None]:
    """Torch 2.4's restricted unpickler refuses bytes (torch 2.5 takes them): allow them as
    docs/how-to/checkpoints.md tells users of torch 2.4 to, for one load."""
    if torch.__version__ >= (2, 5):
        yield
        return
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([codecs.encode])
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def _check_plain(value: object) -> None:
    if isinstance(value, dict):
        assert all(isinstance(key, str) for key in value)
        for item in value.values():
            _check_plain(item)
    elif isinstance(value, list):
        for item in value:
            _check_plain(item)
    else:
        assert value is None or isinstance(value, (str, int, float, bool, bytes))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_is_plain_data_with_a_stable_key_and_round_trips(num_workers: int) -> None:
    loader = _loader(num_workers)
    fresh_keys = set(loader.state_dict())
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state_dict = loader.state_dict()
    _check_plain(state_dict)
    # The keys never depend on the position: DCP loads into a fresh loader's keys.
    assert set(state_dict) == fresh_keys == {"rank_0"}
    rest = [digest(item) for item in iterator]
    loader.close()
    fresh = _loader(num_workers)
    fresh.load_state_dict(state_dict)
    assert [digest(item) for item in fresh] == rest
    fresh.close()


def test_load_state_dict_also_takes_a_plain_rank_state() -> None:
    loader = _loader()
    iterator = iter(loader)
    next(iterator)
    plain = loader.save_state_rank().to_plain()
    rest = [digest(item) for item in iterator]
    loader.close()
    fresh = _loader()
    fresh.load_state_dict(plain)
    assert [digest(item) for item in fresh] == rest
    fresh.close()


def test_torch_save_and_weights_only_load_round_trip_next_to_a_model() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    loader = _loader()
    iterator = iter(loader)
    for _ in range(4):
        next(iterator)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "loader": loader.state_dict()}, buffer)
    rest = [digest(item) for item in iterator]
    loader.close()
    buffer.seek(0)
    with _bytes_in_weights_only_load():
        checkpoint = torch.load(buffer, weights_only=True)
    restored_model = torch.nn.Linear(4, 2)
    restored_model.load_state_dict(checkpoint["model"])
    assert torch.equal(restored_model.weight, model.weight)
    fresh = _loader()
    fresh.load_state_dict(checkpoint["loader"])
    assert [digest(item) for item in fresh] == rest
    fresh.close()


# Without a process group DCP works in one process and says so (torch 2.4 and 2.5 take no
# no_dist=True and word the warning without "disabled").
@pytest.mark.filterwarnings(
    "ignore:torch.distributed is (disabled, )?unavailable or uninitialized:UserWarning"
)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_distributed_checkpoint_round_trips_in_one_process(num_workers: int, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp  # NOTE [ Heavy imports last ] in conftest.py

    loader = _loader(num_workers)
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    model = torch.nn.Linear(3, 3)
    dcp.save({"model": model.state_dict(), "loader": loader}, checkpoint_id=tmp_path)
    rest = [digest(item) for item in iterator]
    loader.close()
    fresh = _loader(num_workers)
    target = {"model": torch.nn.Linear(3, 3).state_dict(), "loader": fresh}
    dcp.load(target, checkpoint_id=tmp_path)
    assert torch.equal(target["model"]["weight"], model.weight.detach())
    assert [digest(item) for item in fresh] == rest
    fresh.close()


def test_a_state_dict_of_another_rank_is_refused_naming_the_ranks() -> None:
    other = SavableDataLoader(
        RandomCounter(14), batch_size=2, worker_config=WorkerConfig(rank=1, world_size=2)
    )
    state_dict = other.state_dict()
    assert set(state_dict) == {"rank_1"}
    loader = SavableDataLoader(
        RandomCounter(14), batch_size=2, worker_config=WorkerConfig(rank=0, world_size=2)
    )
    with pytest.raises(StateMismatchError, match=r"\['rank_1'\].*rank 0 of 2"):
        loader.load_state_dict(state_dict)


def test_malformed_state_dicts_are_refused() -> None:
    loader = _loader(0)
    good = loader.state_dict()["rank_0"]
    with pytest.raises(StateFormatError, match="dict"):
        loader.load_state_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(StateFormatError):
        loader.load_state_dict({"rank_0": good[:-3]})
    with pytest.raises(StateFormatError):
        loader.load_state_dict({"rank_0": b"\x80\x04junk"})
    as_list = encode_state([loader.save_state_rank()])
    with pytest.raises(StateFormatError, match="restore_state_global"):
        loader.load_state_dict({"rank_0": as_list})
