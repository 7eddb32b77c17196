"""SavableDataLoader's API and named scenarios (issue 2)."""

from __future__ import annotations

import inspect
import random

import numpy as np
import pytest
import torch
from pipelines import RandomCounter, Squares
from torch.utils.data import DataLoader, IterableDataset

from savable_loader import (
    ConfigError,
    RankState,
    SavableDataLoader,
    SavableLoaderError,
    StateError,
    StateFormatError,
    StateMismatchError,
    load_state,
    save_state,
)
from savable_loader.testing import assert_resumes_exactly, digest, roundtrip


def _stream(loader, epochs=2):
    return [[digest(item) for item in loader] for _ in range(epochs)]


def _take(iterator, count):
    return [digest(next(iterator)) for _ in range(count)]


def test_is_a_dataloader_with_the_users_batch_size():
    loader = SavableDataLoader(RandomCounter(5), batch_size=4, drop_last=True)
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert loader.batch_size == 4
    assert loader.drop_last is True
    assert [batch["index"].tolist() for batch in loader] == [[0, 1, 2, 3]]


def test_same_arguments_same_stream_without_global_seeding():
    random.seed(1)
    first = _stream(SavableDataLoader(RandomCounter(9), batch_size=2))
    random.seed(2)
    torch.manual_seed(2)
    np.random.seed(2)
    second = _stream(SavableDataLoader(RandomCounter(9), batch_size=2))
    assert first == second
    other_seed = _stream(SavableDataLoader(RandomCounter(9), batch_size=2, seed=1))
    assert other_seed != first


def test_no_workers_training_loop_draws_do_not_change_the_stream():
    quiet = _stream(SavableDataLoader(RandomCounter(12), batch_size=2), epochs=2)
    loader = SavableDataLoader(RandomCounter(12), batch_size=2)
    noisy = []
    for _ in range(2):
        items = []
        for item in loader:
            items.append(digest(item))
            random.random()
            np.random.rand(3)
            torch.randn(4)
        noisy.append(items)
    assert noisy == quiet


def test_no_workers_pipeline_does_not_touch_the_training_loops_generators():
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    expected = (torch.rand(2).tolist(), random.random(), np.random.rand())
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    for _ in SavableDataLoader(RandomCounter(6), batch_size=2):
        pass
    assert (torch.rand(2).tolist(), random.random(), np.random.rand()) == expected


@pytest.mark.parametrize("num_workers", [0, 2])
def test_restore_into_the_same_loader_while_iterating(num_workers):
    reference = SavableDataLoader(RandomCounter(20), batch_size=2, num_workers=num_workers)
    expected = _stream(reference)
    reference.close()
    with SavableDataLoader(RandomCounter(20), batch_size=2, num_workers=num_workers) as loader:
        iterator = iter(loader)
        assert _take(iterator, 3) == expected[0][:3]
        state = loader.save_state_rank()
        assert _take(iterator, 4) == expected[0][3:7]
        loader.restore_state_rank(state)
        # The live iterator continues from the restored position; in-flight data is gone.
        assert [digest(item) for item in iterator] == expected[0][3:]
        assert [digest(item) for item in loader] == expected[1]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iter_after_break_starts_a_new_epoch(num_workers):
    """As with torch: the loop after a ``break`` reads a whole new epoch (NOTE [ A new
    iter() starts an epoch ]); a dataset holding its own position continues from it."""

    def build():
        return SavableDataLoader(
            list(range(16)), batch_size=2, shuffle=True, num_workers=num_workers
        )

    with build() as loader:
        expected = _stream(loader, epochs=3)
    with build() as loader:
        got = []
        for item in loader:
            got.append(digest(item))
            if len(got) == 3:
                break
        assert got == expected[0][:3]
        assert [digest(item) for item in loader] == expected[1]
        assert [digest(item) for item in loader] == expected[2]


def test_restore_none_returns_to_the_start():
    loader = SavableDataLoader(RandomCounter(10), batch_size=3)
    expected = _stream(loader, epochs=1)
    iterator = iter(loader)
    next(iterator)
    loader.restore_state_rank(None)
    assert _stream(loader, epochs=1) == expected


def test_state_saved_before_iterating_is_the_start():
    loader = SavableDataLoader(RandomCounter(10), batch_size=3, num_workers=2)
    state = loader.save_state_rank()
    assert all(worker.checkpoint is None and worker.delivered == 0 for worker in state.workers)
    fresh = SavableDataLoader(RandomCounter(10), batch_size=3, num_workers=2)
    fresh.restore_state_rank(roundtrip(state))
    assert _stream(fresh) == _stream(loader)
    fresh.close()
    loader.close()


def test_state_files_round_trip(tmp_path):
    loader = SavableDataLoader(RandomCounter(14), batch_size=2, num_workers=2)
    iterator = iter(loader)
    _take(iterator, 5)
    save_state(loader.save_state_rank(), tmp_path / "loader.state")
    rest = [digest(item) for item in iterator]
    loader.close()
    state = load_state(tmp_path / "loader.state")
    assert isinstance(state, RankState)
    fresh = SavableDataLoader(RandomCounter(14), batch_size=2, num_workers=2)
    fresh.restore_state_rank(state)
    assert [digest(item) for item in fresh] == rest
    fresh.close()


def test_state_per_worker_is_small():
    loader = SavableDataLoader(RandomCounter(40), batch_size=4, num_workers=2)
    iterator = iter(loader)
    _take(iterator, 3)
    from savable_loader import serialization

    size = len(serialization.dumps({"kind": "rank", "state": loader.save_state_rank().to_plain()}))
    loader.close()
    assert size / 2 < 32 * 1024


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_workers": 3}, "num_workers"),
        ({"batch_size": 4}, "batch_size"),
        ({"batch_size": 1}, "batch_size"),
        ({"seed": 5}, "seed"),
        ({"drop_last": True}, "drop_last was False when the state was saved and is True now"),
    ],
)
def test_incompatible_state_is_refused_naming_the_field(change, field):
    arguments = {"batch_size": 2, "num_workers": 2, "seed": 0, "drop_last": False}
    loader = SavableDataLoader(RandomCounter(10), **arguments)
    iterator = iter(loader)
    next(iterator)
    state = loader.save_state_rank()
    loader.close()
    other = SavableDataLoader(RandomCounter(10), **{**arguments, **change})
    with pytest.raises(StateMismatchError, match=field) as error:
        other.restore_state_rank(state)
    assert "saved" in str(error.value)
    assert "now" in str(error.value)
    other.close()


def test_another_pipeline_is_refused():
    loader = SavableDataLoader(RandomCounter(10), batch_size=2)
    state = loader.save_state_rank()
    with pytest.raises(StateMismatchError, match="fingerprint"):
        SavableDataLoader(RandomCounter(11), batch_size=2).restore_state_rank(state)


def test_unknown_format_version_and_malformed_states_are_refused():
    state = SavableDataLoader(RandomCounter(10), batch_size=2).save_state_rank().to_plain()
    loader = SavableDataLoader(RandomCounter(10), batch_size=2)
    with pytest.raises(StateFormatError, match="upgrade savable_loader"):
        loader.load_state_dict({**state, "format_version": 99})
    with pytest.raises(StateFormatError, match="workers"):
        loader.load_state_dict({**state, "workers": []})
    with pytest.raises(StateFormatError, match=r"extra|Extra"):
        loader.load_state_dict({**state, "surprise": 1})
    worker = {**state["workers"][0], "delivered": -1}
    with pytest.raises(StateFormatError, match="delivered"):
        loader.load_state_dict({**state, "workers": [worker]})
    with pytest.raises(StateFormatError, match="dict"):
        loader.load_state_dict([1, 2])  # type: ignore[arg-type]
    assert issubclass(StateFormatError, StateError)


def test_restoring_never_changes_the_callers_state():
    loader = SavableDataLoader(RandomCounter(20), batch_size=2, num_workers=2)
    iterator = iter(loader)
    _take(iterator, 5)
    state = loader.save_state_rank()
    loader.close()
    before = state.to_plain()
    streams = []
    for _ in range(2):
        fresh = SavableDataLoader(RandomCounter(20), batch_size=2, num_workers=2)
        fresh.restore_state_rank(state)
        iterator = iter(fresh)
        _take(iterator, 2)
        fresh.save_state_rank()
        streams.append([digest(item) for item in iterator])
        fresh.close()
    assert streams[0] == streams[1]
    assert state.to_plain() == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"in_order": False, "num_workers": 2}, "in_order"),
        ({"batch_size": None, "drop_last": True}, "drop_last"),
        ({"prefetch_factor": 2}, "prefetch_factor"),
        ({"batch_size": 0}, "batch_size"),
        ({"num_workers": -1}, "num_workers"),
    ],
)
def test_arguments_that_cannot_be_honoured_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SavableDataLoader(Squares(4), **kwargs)


def test_in_order_false_without_workers_is_torchs_stream_and_resumes_exactly():
    """Without workers torch delivers in order whatever ``in_order`` says; so do we."""
    takes = "in_order" in inspect.signature(DataLoader.__init__).parameters  # torch 2.6 on
    torchs = DataLoader(Squares(9), batch_size=2, **({"in_order": False} if takes else {}))
    ours = SavableDataLoader(Squares(9), batch_size=2, in_order=False)
    assert [b["index"].tolist() for b in ours] == [b["index"].tolist() for b in torchs]
    assert getattr(ours, "in_order", False) is getattr(torchs, "in_order", False)
    assert_resumes_exactly(
        lambda: SavableDataLoader(Squares(9), batch_size=2, shuffle=True, in_order=False)
    )


def test_shuffle_with_an_iterable_dataset_is_refused_as_torch_refuses_it():
    with pytest.raises(ValueError, match="IterableDataset") as torchs:
        DataLoader(RandomCounter(4), shuffle=True)
    with pytest.raises(ConfigError) as ours:
        SavableDataLoader(RandomCounter(4), shuffle=True)
    assert str(ours.value) == str(torchs.value)


def test_plain_iterable_dataset_iterates_and_refuses_to_save_with_a_hint():
    class Plain(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with SavableDataLoader(Plain()) as loader:
        assert [b.tolist() for b in loader] == [[0], [1], [2]]
        with pytest.raises(ConfigError, match="SavableDataset"):
            loader.save_state_rank()


def test_config_must_be_plain_data():
    class Odd(RandomCounter):
        def config(self):
            return {"fn": print}

    with pytest.raises(ConfigError, match=r"config\.dataset\.fn"):
        SavableDataLoader(Odd(3))


def test_map_style_len_matches_batches():
    for num_workers, drop_last in [(0, False), (0, True), (2, False), (3, True)]:
        loader = SavableDataLoader(
            Squares(23), batch_size=4, num_workers=num_workers, drop_last=drop_last
        )
        assert len(loader) == sum(1 for _ in loader)
        loader.close()


def test_map_style_epoch_visits_every_index_once_in_torch_order():
    loader = SavableDataLoader(Squares(23), batch_size=4, num_workers=3)
    indices = [batch["index"].tolist() for batch in loader]
    loader.close()
    assert indices == [list(range(i, min(i + 4, 23))) for i in range(0, 23, 4)]
    shuffled = SavableDataLoader(Squares(23), batch_size=4, num_workers=3, shuffle=True)
    epochs = [[i for batch in shuffled for i in batch["index"].tolist()] for _ in range(2)]
    shuffled.close()
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(23))
    assert epochs[0] != epochs[1]


def test_close_is_idempotent_and_final():
    loader = SavableDataLoader(RandomCounter(10), batch_size=2, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    loader.close()
    loader.close()
    with pytest.raises(SavableLoaderError, match="closed"):
        iter(loader)
