"""A map-style dataset's ``__getitems__`` reads each batch in one call, as torch's
``DataLoader`` reads it, and replays exactly (NOTE [ A batch read at once ] in
``savable_loader/datasets/index/indexed.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from savable_loader import ConfigError, SavableDataLoader
from savable_loader.testing import assert_resumes_exactly


class Batched(Dataset[dict[str, Any]]):
    """Each item says how many indices the call that read it had (0: ``data[i]``), and
    with ``noisy`` one draw of torch's global generator per call."""

    def __init__(self, n: int = 14, *, noisy: bool = False) -> None:
        self.n, self.noisy = n, noisy

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"i": index, "call": 0}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        noise = float(torch.rand(())) if self.noisy else 0.0
        return [{"i": i, "call": len(indices), "noise": noise} for i in indices]


class Short(Batched):
    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        return super().__getitems__(indices)[:-1]


def _plain(loader: Any) -> list[Any]:
    return [
        {
            key: value.tolist() if isinstance(value, torch.Tensor) else value
            for key, value in b.items()
        }
        for b in loader
    ]


CASES: dict[str, dict[str, Any]] = {
    "batches": {"batch_size": 4},
    "drop_last": {"batch_size": 4, "drop_last": True},
    "generator": {"batch_size": 3, "shuffle": True},
    "batch_sampler": {"batch_sampler": [[5, 1], [0, 2, 3], [13]]},
    "unbatched": {"batch_size": None},
}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_batches_are_read_with_torchs_calls(case: str, num_workers: int) -> None:
    def options() -> dict[str, Any]:
        drawn = {"generator": torch.Generator().manual_seed(2)} if case == "generator" else {}
        return {**CASES[case], **drawn, "num_workers": num_workers}

    expected = _plain(DataLoader(Batched(), **options()))
    with SavableDataLoader(Batched(), **options()) as ours:
        assert _plain(ours) == expected
    if case == "unbatched":  # torch reads item by item without a batch
        assert all(item["call"] == 0 for item in expected)
    else:
        assert all(call == len(batch["i"]) for batch in expected for call in batch["call"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_drawing_getitems_resumes_exactly(num_workers: int) -> None:
    def build() -> SavableDataLoader[Any]:
        return SavableDataLoader(
            Batched(noisy=True), batch_size=3, shuffle=True, num_workers=num_workers, seed=5
        )

    # Chains saved inline (from the resumed loader, which goes on): the same saves and
    # restores with one fresh loader fewer a chain. With workers, the peek and the break
    # after the last epoch are test_resume.py's (the start of an epoch, as without them).
    report = assert_resumes_exactly(
        build,
        epochs=2,
        num_points=4,
        chain_items=(1,),
        inline_chains=True,
        interruptions=num_workers == 0,
    )
    assert report.restores >= 4


def test_a_getitems_that_loses_items_is_a_clear_error() -> None:
    with (
        SavableDataLoader(Short(), batch_size=4) as loader,
        pytest.raises(ConfigError, match=r"Short.__getitems__ returned 3 items for 4 indices"),
    ):
        next(iter(loader))


def test_a_hugging_face_dataset_reads_as_with_torch() -> None:
    datasets = pytest.importorskip("datasets", reason="needs the hf extra (Hugging Face datasets)")
    table = datasets.Dataset.from_dict({"a": list(range(10)), "b": [str(i) for i in range(10)]})
    expected = list(DataLoader(table, batch_size=4))
    with SavableDataLoader(table, batch_size=4) as ours:
        got = list(ours)
    assert [batch["b"] for batch in got] == [batch["b"] for batch in expected]
    assert all(torch.equal(x["a"], y["a"]) for x, y in zip(got, expected, strict=True))
