"""A new ``iter()`` starts a new epoch, as with torch; interrupts and save errors keep the
position (NOTE [ A new iter() starts an epoch ] in ``_main/iterator.py``, NOTE [ Interrupts ]
in ``_worker/runtime.py``). The comparisons with torch's ``DataLoader`` are in
``test_torch_semantics.py``; these check what only this loader has: the state after a
cut, chains of cuts and restores, and the failures around them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from savable_loader import DatasetError, SavableDataLoader, WorkerError
from savable_loader.datasets import IndexedDataset
from savable_loader.testing import digest, roundtrip


def _pipeline() -> Any:
    return IndexedDataset(list(range(20)), shuffle=True, seed=3).map(
        lambda x, rng: (x, int(rng.integers(1000))), seed=4
    )


def _loader(num_workers: int, **kwargs: Any) -> SavableDataLoader[Any]:
    return SavableDataLoader(
        _pipeline(),
        batch_size=2,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        **kwargs,
    )


def _take(iterator: Any, count: int) -> list[str]:
    return [digest(next(iterator)) for _ in range(count)]


def _epochs(loader: SavableDataLoader[Any], count: int) -> list[list[str]]:
    return [[digest(batch) for batch in loader] for _ in range(count)]


# Each pattern is a list of (new iterator?, batches read); the loader is saved after each
# step, and every state restores into a fresh loader that then goes on as the saver did.
PATTERNS = {
    "peek then loop": [(True, 1), (True, 3)],
    "break twice": [(True, 3), (True, 2), (True, 0), (True, 4)],
    "same iterator after a cut": [(True, 2), (True, 1), (False, 2)],
}


def _save_after(steps: list[tuple[bool, int]], num_workers: int) -> tuple[Any, list[Any]]:
    """Runs ``steps`` on a loader, saves, and returns the state and what the loader reads
    next: the rest of its current iterator, then one more epoch."""
    with _loader(num_workers) as saver:
        iterator = None
        for new, count in steps:
            if new:
                iterator = iter(saver)
            _take(iterator, count)
        state = roundtrip(saver.save_state_rank())
        return state, [[digest(batch) for batch in iterator], *_epochs(saver, 1)]


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_states_saved_around_cuts_restore_exactly(num_workers: int, pattern: str) -> None:
    steps = PATTERNS[pattern]
    ends = [len(steps)] if num_workers else range(1, len(steps) + 1)
    for end in ends:
        state, expected = _save_after(steps[:end], num_workers)
        with _loader(num_workers) as restored:
            restored.restore_state_rank(state)
            assert _epochs(restored, 2) == expected, f"saved after step {end}"


def test_every_new_iterator_is_a_whole_epoch_of_its_own() -> None:
    with _loader(0) as loader:
        first = _take(iter(loader), 1)
        second = _epochs(loader, 1)[0]
        third = _take(iter(loader), 3)
        fourth = _epochs(loader, 1)[0]
    with _loader(0) as reference:
        epochs = _epochs(reference, 4)
    assert first == epochs[0][:1]
    assert second == epochs[1]
    assert third == epochs[2][:3]
    assert fourth == epochs[3]


def test_a_state_saved_after_a_break_restores_mid_epoch() -> None:
    """The max_steps pattern: stop after k batches, save, restart with more steps."""
    with _loader(0) as saver:
        for step, _ in enumerate(saver):
            if step == 3:
                break
        state = roundtrip(saver.save_state_rank())
        rest = [digest(batch) for batch in iter(saver)]  # a new iter(): a new epoch
    with _loader(0) as reference:
        epochs = _epochs(reference, 2)
    with _loader(0) as restored:
        restored.restore_state_rank(state)
        assert _epochs(restored, 2) == [epochs[0][4:], epochs[1]]
    assert rest == epochs[1]


def test_load_state_dict_then_the_first_iter_continues() -> None:
    with _loader(0) as saver:
        _take(iter(saver), 3)
        state = saver.state_dict()
    with _loader(0) as reference:
        epoch = _epochs(reference, 1)[0]
    with _loader(0) as restored:
        restored.load_state_dict(state)
        assert [digest(batch) for batch in restored] == epoch[3:]


class _Interrupting:
    """Raises KeyboardInterrupt once, at item ``at``."""

    def __init__(self, n: int, at: int) -> None:
        self.n, self.at, self.fired = n, at, False

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.at and not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        return index


def test_keyboard_interrupt_keeps_the_position() -> None:
    """Ctrl-C inside ``__getitem__`` passes through; the same iterator then retries the
    interrupted batch (nothing lost), a save restores there, and later epochs are whole."""
    loader = SavableDataLoader(_Interrupting(8, at=3), batch_size=2)
    iterator = iter(loader)
    assert next(iterator).tolist() == [0, 1]
    with pytest.raises(KeyboardInterrupt):
        next(iterator)
    state = roundtrip(loader.save_state_rank())
    assert [batch.tolist() for batch in iterator] == [[2, 3], [4, 5], [6, 7]]
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    restored = SavableDataLoader(_Interrupting(8, at=-1), batch_size=2)
    restored.restore_state_rank(state)
    assert [batch.tolist() for batch in restored] == [[2, 3], [4, 5], [6, 7]]


def test_keyboard_interrupt_then_a_new_loop_is_a_new_epoch() -> None:
    loader = SavableDataLoader(_Interrupting(6, at=2), batch_size=2)
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:
            pass
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4, 5]]


class _SaveFails:
    """A savable dataset whose ``save_state()`` raises while ``fail`` is set."""

    def __init__(self) -> None:
        self.pos, self.fail = 0, False

    def __iter__(self) -> Any:
        while self.pos < 6:
            self.pos += 1
            yield self.pos - 1
        self.pos = 0

    def save_state(self) -> dict[str, int]:
        if self.fail:
            raise OSError("disk full")
        return {"pos": self.pos}

    def restore_state(self, state: dict[str, int] | None) -> None:
        self.pos = state["pos"] if state else 0


def test_a_failing_save_state_without_workers_is_a_dataset_error() -> None:
    from torch.utils.data import IterableDataset

    class Dataset(_SaveFails, IterableDataset):  # type: ignore[misc]
        pass

    dataset = Dataset()
    loader = SavableDataLoader(dataset, batch_size=None)
    iterator = iter(loader)
    assert [next(iterator), next(iterator)] == [0, 1]
    dataset.fail = True
    with pytest.raises(DatasetError, match="disk full") as raised:
        loader.save_state_rank()
    assert isinstance(raised.value.__cause__, OSError)
    dataset.fail = False
    state = roundtrip(loader.save_state_rank())
    assert list(iterator) == [2, 3, 4, 5]
    restored_dataset = Dataset()
    restored = SavableDataLoader(restored_dataset, batch_size=None)
    restored.restore_state_rank(state)
    assert list(restored) == [2, 3, 4, 5]


def _die_if_marked(worker_id: int) -> None:
    if os.path.exists(os.environ["SAVABLE_TEST_DIE_MARK"]):
        os._exit(3)


@pytest.mark.slow
def test_a_worker_dying_during_a_cut_leaves_the_loader_where_it_stood(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mark = tmp_path / "die"
    monkeypatch.setenv("SAVABLE_TEST_DIE_MARK", str(mark))
    with _loader(2) as reference:
        epochs = _epochs(reference, 2)
    with _loader(2, worker_init_fn=_die_if_marked) as loader:
        assert _take(iter(loader), 3) == epochs[0][:3]
        mark.touch()
        with pytest.raises(WorkerError):
            iter(loader)
        state = roundtrip(loader.save_state_rank())
        mark.unlink()
        assert _epochs(loader, 1) == [epochs[1]]  # the retried cut starts epoch 1
    with _loader(2) as restored:
        restored.restore_state_rank(state)
        assert _epochs(restored, 1) == [epochs[0][3:]]
