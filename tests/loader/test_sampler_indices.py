"""A sampler's indices reach the dataset as the sampler gave them, as with torch: lists for
bulk loading, keys of a dict, NumPy integers, tensors (NOTE [ Samplers are sources ] in
``savable_loader/datasets/index/sampled.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from savable_loader import SavableDataLoader
from savable_loader.datasets.index.sampled import EpochOrder
from savable_loader.testing import assert_resumes_exactly


class Bulk(Dataset[torch.Tensor]):
    """Torch's bulk loading: ``batch_size=None`` and a sampler of index lists."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, indices: list[int]) -> torch.Tensor:
        return torch.as_tensor(indices) * 10


class Keyed(Dataset[int]):
    values: ClassVar[dict[str, int]] = {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, key: str) -> int:
        return self.values[key]


class TypeNames(Dataset[str]):
    """Each item is the name of its index's type."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: Any) -> str:
        return type(index).__name__


class ShuffledKeys(Sampler[str]):
    """A sampler of dict keys in a new order every epoch, drawn from its ``generator`` (as
    torch's ``RandomSampler`` draws from its own)."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(7)

    def __iter__(self) -> Iterator[str]:
        keys = sorted(Keyed.values)
        order = torch.randperm(len(keys), generator=self.generator).tolist()
        return iter([keys[i] for i in order])

    def __len__(self) -> int:
        return len(Keyed.values)


def _plain(batches: Any) -> list[Any]:
    return [b.tolist() if isinstance(b, torch.Tensor) else b for b in batches]


CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "bulk": (Bulk, {"batch_size": None, "sampler": [[0, 1, 2], [3, 4], [5]]}),
    "keys": (Keyed, {"batch_size": 2, "sampler": ["a", "c", "e", "b"]}),
    "key_batches": (Keyed, {"batch_sampler": [["e", "a"], ["d"], ["b", "c"]]}),
    "types": (TypeNames, {"batch_size": None, "sampler": [1, np.int64(2), torch.tensor(3), 2.5]}),
    "numpy": (TypeNames, {"batch_size": None, "sampler": [np.int32(0), np.int32(3)]}),
    "mixed_batches": (TypeNames, {"batch_sampler": [[1, "x"], [np.int64(2), True]]}),
}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_indices_reach_the_dataset_as_with_torch(case: str, num_workers: int) -> None:
    dataset, options = CASES[case]
    expected = _plain(DataLoader(dataset(), num_workers=num_workers, **options))
    with SavableDataLoader(dataset(), num_workers=num_workers, **options) as ours:
        assert _plain(ours) == expected


def test_integers_of_one_type_are_kept_compactly_and_read_back_as_that_type() -> None:
    order = EpochOrder.of(0, iter(np.arange(5, dtype=np.int64)), batched=False)
    assert isinstance(order.indices, np.ndarray)
    assert [type(order.group(g)) for g in range(5)] == [np.int64] * 5
    batched = EpochOrder.of(0, [[0, 1], [2]], batched=True)
    assert isinstance(batched.indices, np.ndarray)
    assert batched.group(1) == [2]
    assert type(batched.group(0)[0]) is int
    mixed = EpochOrder.of(0, [0, 1, "k", 2**70], batched=False)
    assert [mixed.group(g) for g in range(4)] == [0, 1, "k", 2**70]


def test_a_sampler_of_keys_resumes_exactly() -> None:
    def build() -> SavableDataLoader:
        return SavableDataLoader(
            Keyed(), batch_size=2, sampler=ShuffledKeys(), num_workers=2, seed=3
        )

    report = assert_resumes_exactly(build, epochs=2, num_points=4, chain_items=(1,))
    assert report.restores >= 4
