"""The values a Stateful object's state may hold (NOTE [ Values of a Stateful object's
state ]): tensors, NumPy values, tuples and dicts keyed by something other than str are
saved as plain data and come back as they were; a crafted tag is a StateError."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

from savable_loader import SavableDataLoader, WorkerConfig
from savable_loader.datasets.adapters.stateful_values import TAG, decode, encode
from savable_loader.errors import StateError
from savable_loader.plain import find_non_plain, plain_copy
from savable_loader.testing import assert_resumes_exactly


def _through_a_file(value: Any) -> Any:
    """``value`` encoded, made plain and sent through msgpack, as a state file does."""
    plain = plain_copy(encode(value))
    assert find_non_plain(plain) is None
    return decode(msgpack.unpackb(msgpack.packb(plain, use_bin_type=True), raw=False))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # not contiguous
        torch.tensor(7, dtype=torch.int8),  # zero dimensions
        torch.empty(0, 5),
        torch.tensor([True, False, True]),
        torch.randn(4, dtype=torch.bfloat16),
        torch.randn(3, dtype=torch.float16),
        torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
        torch.tensor([2**64 - 1], dtype=torch.uint64),
        torch.get_rng_state(),
        torch.Generator().manual_seed(3).get_state(),
    ],
)
def test_a_tensor_comes_back_with_its_dtype_shape_and_values(tensor):
    back = _through_a_file({"t": tensor})["t"]
    assert back.dtype == tensor.dtype
    assert back.shape == tensor.shape
    assert back.view(torch.uint8).tolist() == tensor.contiguous().view(torch.uint8).tolist()
    back.view(torch.uint8).zero_()  # writable


def test_a_tensor_that_needs_grad_is_saved_as_its_values():
    weight = torch.ones(3, requires_grad=True) * 2
    back = _through_a_file(weight)
    assert not back.requires_grad
    assert back.tolist() == [2.0, 2.0, 2.0]


def test_numpy_values_come_back_with_their_types():
    value = {
        "array": np.arange(6, dtype=np.uint16).reshape(2, 3),
        "float": np.float32(1.5),
        "int": np.int64(-3),
        "flag": np.bool_(True),
        "text": np.array(["ab", "c"]),
        "empty": np.zeros((0, 2)),
        "fortran": np.asfortranarray(np.arange(6).reshape(2, 3)),
    }
    back = _through_a_file(value)
    for key, want in value.items():
        got = back[key]
        assert type(got) is type(want), key
        assert got.dtype == want.dtype, key
        assert np.shape(got) == np.shape(want), key
        assert np.array_equal(got, want), key


def test_the_global_generators_states_load_back():
    """The states objects commonly save: their loads accept what comes back (``random``
    refuses a list where it gave a tuple)."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    want = (random.random(), np.random.random(), torch.rand(()).item())
    python, numpy, torch_state = _through_a_file(states)
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(torch_state)
    assert (random.random(), np.random.random(), torch.rand(()).item()) == want


def test_tuples_and_keys_that_are_not_str():
    value = {
        0: "int key",
        (1, "a"): [(2, 3), {"nested": (4,)}],
        None: 1.5,
        True: b"bytes",
        "plain": {"list": [1, 2], "dict": {"x": None}},
        "empty": (),
    }
    back = _through_a_file(value)
    assert back == value
    assert isinstance(back[(1, "a")][0], tuple)
    assert isinstance(back[(1, "a")][1]["nested"], tuple)
    assert type(back["plain"]["list"]) is list


def test_a_dict_of_yours_holding_the_tag_is_never_read_as_a_tag():
    value = {TAG: "tensor", "dtype": "float32", "shape": [1], "data": b"\0\0\0\0"}
    assert _through_a_file(value) == value
    assert _through_a_file([value, {TAG: 1}]) == [value, {TAG: 1}]


def test_plain_values_pass_as_they_are():
    value = {"i": 3, "f": 0.5, "s": "x", "b": b"y", "n": None, "l": [1, [2]], "t": True}
    assert encode(value) == value
    assert decode(value) == value


@pytest.mark.parametrize(
    "value",
    [
        torch.eye(2).to_sparse(),
        np.array([object()], dtype=object),
        np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]),
    ],
    ids=["sparse", "objects", "structured"],
)
def test_what_cannot_be_written_is_refused_with_a_message(value):
    with pytest.raises(StateError, match="cannot be saved"):
        encode({"x": value})


@pytest.mark.parametrize(
    ("crafted", "message"),
    [
        ({TAG: "pickle", "data": b"x"}, "unknown kind 'pickle'"),
        ({TAG: "tensor", "dtype": "float32", "shape": [2], "data": b"\0" * 4}, "needs 8 bytes"),
        ({TAG: "tensor", "dtype": "object", "shape": [1], "data": b"\0"}, "unknown dtype"),
        ({TAG: "tensor", "dtype": "qint8", "shape": [1], "data": b"\0"}, "unknown dtype"),
        ({TAG: "tensor", "dtype": "float32", "shape": [-1], "data": b""}, "bad shape"),
        ({TAG: "tensor", "dtype": "float32", "shape": [True], "data": b"\0" * 4}, "bad shape"),
        ({TAG: "tensor", "dtype": "float32", "shape": "2", "data": b""}, "'shape' as list"),
        ({TAG: "tensor", "dtype": "float32", "shape": [1], "data": "abcd"}, "'data' as bytes"),
        ({TAG: "tensor", "dtype": "float32", "shape": [1] * 65, "data": b""}, "bad shape"),
        ({TAG: "ndarray", "dtype": "|O", "shape": [1], "data": b"\0" * 8}, "refused dtype"),
        ({TAG: "ndarray", "dtype": "not a dtype", "shape": [1], "data": b""}, "bad dtype"),
        ({TAG: "ndarray", "dtype": "<i4", "shape": [3], "data": b"\0" * 4}, "does not match"),
        ({TAG: "dict", "items": [[1, 2, 3]]}, r"\[key, value\] pairs"),
        ({TAG: "dict", "items": [[[1], 2]]}, "not hashable"),
        ({TAG: "tuple", "items": "ab"}, "'items' as list"),
        ({TAG: "tensor"}, "'dtype' as str"),
        ({TAG: ["a"]}, "unknown kind"),
        ({TAG: "ndarray", "dtype": "<f4", "shape": [2**62, 0], "data": b""}, "cannot be built"),
        ({TAG: "ndarray", "dtype": "<f4", "shape": [0] * 65, "data": b""}, "bad shape"),
        ({TAG: "tensor", "dtype": "int8", "shape": [2**62, 2**62], "data": b""}, "needs"),
    ],
)
def test_a_crafted_tag_is_a_state_error(crafted, message):
    with pytest.raises(StateError, match=message):
        decode({"state": [crafted]})


class _Drawing(IterableDataset):
    """Keyed by worker, with tuples and the generators' states in its ``state_dict()``;
    each item draws from all three global generators, so a restore is exact only if the
    loaded generator states are the ones the stream went on from."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.read: dict[int, int] = {}

    def _worker(self) -> tuple[int, int]:
        info = get_worker_info()
        return (0, 1) if info is None else (info.id, info.num_workers)

    def __iter__(self):
        worker, workers = self._worker()
        while (start := self.read.get(worker, 0) * workers + worker) < self.n:
            self.read[worker] = self.read.get(worker, 0) + 1
            noise = (random.random(), float(np.random.random()), float(torch.rand(())))
            yield {"i": start, "noise": torch.tensor(noise)}
        self.read[worker] = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "read": dict(self.read),
            "generators": (random.getstate(), np.random.get_state(), torch.get_rng_state()),
            "weights": np.linspace(0, 1, 3),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert all(type(worker) is int for worker in state["read"])
        assert isinstance(state["weights"], np.ndarray)
        self.read = dict(state["read"])
        python, numpy, torch_state = state["generators"]
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(torch_state)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_with_such_values_resumes_exactly(num_workers):
    """Every save point, through a state file, with 0 and 2 workers."""
    report = assert_resumes_exactly(
        lambda: SavableDataLoader(
            _Drawing(11),
            batch_size=2,
            num_workers=num_workers,
            worker_config=WorkerConfig(checkpoint_share=1.0),
        ),
        num_points=4,
        chain_items=(1,),
        inline_chains=True,
    )
    assert report.items_per_epoch[0] > 0
