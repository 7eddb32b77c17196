"""The registry of keyed purposes (NOTE [ Seeds ] in ``savable_loader/rng/keys.py``)."""

from __future__ import annotations

import ast
import enum
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from savable_loader import rng
from savable_loader.rng import Purpose, derive_seed, generator_for, seed_for, seed_item

PACKAGE = Path(rng.__file__).resolve().parents[1]


def test_no_two_purposes_share_a_number():
    numbers = [member.value for member in Purpose.__members__.values()]
    assert len(numbers) == len(set(numbers))


def test_a_duplicate_purpose_is_refused_when_the_registry_is_built():
    with pytest.raises(ValueError, match="duplicate values"):

        @enum.unique
        class _Twice(enum.IntEnum):
            ONE = 1
            ALSO_ONE = 1


def test_no_module_keeps_a_purpose_number_of_its_own():
    """Every keyed derivation goes through the registry: no ``_*PURPOSE`` constant and no
    inline ``np.random.default_rng([...])`` key list outside ``rng/``."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "rng":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id.endswith("PURPOSE"):
                        offenders.append(f"{path.name}: {target.id}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "default_rng"
                and node.args
                and isinstance(node.args[0], ast.List)
            ):
                offenders.append(f"{path.name}:{node.lineno}: default_rng([...])")
    assert offenders == []


@pytest.mark.parametrize(
    ("purpose", "keys", "entropy"),
    [
        # The derivations states saved by earlier versions depend on keep their values.
        (Purpose.WORKER_EPOCH, (1, 2), (7, 1, 2, 0x5EED)),
        (Purpose.WORKER_EPOCH, (1, 2, 3), (7, 1, 2, 0x5EED, 3)),
        (Purpose.BASE_SEED, (1,), (7, 1, 0xBA5E)),
        (Purpose.PERMUTATION, (3,), (7, 0x1D, 3)),
        (Purpose.FILE_ORDER, (3,), (7, 0x5A4D, 3)),
        (Purpose.DATAPIPE, (3,), (7, 3, 0xD7A9)),
        (Purpose.STATEFUL_STREAM, (1, 2, 3), (7, 1, 2, 0x57A7E, 3)),
        (Purpose.WORKER_SALT, (9,), (7, 9)),
    ],
)
def test_seeds_that_states_depend_on_keep_their_values(purpose, keys, entropy):
    assert seed_for(purpose, 7, *keys) == derive_seed(*entropy)


@pytest.mark.parametrize(
    ("purpose", "keys"),
    [
        (Purpose.WINDOW, (0, 1, 2, 3)),
        (Purpose.BLEND_DRAW, (0, 1, 2, 3)),
        (Purpose.MAP_STREAM_ITEM, (0, 1, 2, 3)),
    ],
)
def test_generators_that_states_depend_on_keep_their_draws(purpose, keys):
    expected = np.random.default_rng([7, int(purpose), *keys]).random(4)
    assert np.array_equal(generator_for(purpose, 7, *keys).random(4), expected)


def test_one_key_under_two_purposes_gives_two_streams():
    draws = {purpose: generator_for(purpose, 7, 1, 2).random() for purpose in Purpose}
    assert len(set(draws.values())) == len(draws)


def test_seed_item_seeds_all_three_generators_by_the_key_alone():
    def draws() -> tuple[float, float, float]:
        return random.random(), float(np.random.random()), float(torch.rand(()))

    seed_item(Purpose.ITEM_GLOBALS, 7, 0, 5)
    first = draws()
    draws()  # what happened between two items does not matter
    seed_item(Purpose.ITEM_GLOBALS, 7, 0, 5)
    assert draws() == first
    seed_item(Purpose.ITEM_GLOBALS, 7, 0, 6)
    other = draws()
    assert all(a != b for a, b in zip(first, other, strict=True))
    seed_item(Purpose.MAP_GLOBALS, 7, 0, 5)
    assert draws() != first
