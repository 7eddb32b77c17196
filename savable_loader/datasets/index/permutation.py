"""A keyed permutation of ``[0, n)`` computed position by position, in constant memory.

NOTE [ Computed epoch orders ]
An epoch's shuffled order is a bijection ``p -> perm(p)`` of ``[0, n)`` keyed by the
seed and the epoch, computed where it is needed instead of stored: position ``p`` maps
to its index in O(1) time and memory, for one position or a NumPy array of them, so
``n = 10**10`` costs what ``n = 10**6`` does. The bijection is a Feistel network on the
smallest domain ``[0, 2**(2h))`` that holds ``n`` (``h`` bits a half): each of its
``ROUNDS`` rounds swaps the halves and mixes one into the other with a keyed 64-bit hash
(splitmix64's finalizer), which is a bijection of the domain whatever the hash is. A
position whose image falls at or beyond ``n`` is mapped again until it lands below ``n``
(cycle walking); since the domain is less than four times ``n``, that takes under four
steps on average and the result is a bijection of ``[0, n)``. Six rounds mix the bits of a
position through every bit of its image; the test suite checks bijectivity and that
orders of nearby keys and seeds differ.

The orders it gives are not those of ``numpy.random.Generator.permutation``, which the
versions before it stored (``order`` 1 in ``IndexedDataset``'s state); a state records
which it was saved with, and keeps it (NOTE [ Indexed order and sharding ] in
``datasets/index/indexed.py``).
"""

from __future__ import annotations

from typing import overload

import numpy as np

__all__ = ["KeyedPermutation"]

ROUNDS = 6
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(value: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 values (wrapping arithmetic)."""
    value = (value ^ (value >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    value = (value ^ (value >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray = value ^ (value >> np.uint64(31))
    return mixed


class KeyedPermutation:
    """A bijection of ``[0, n)`` keyed by ``key`` (NOTE [ Computed epoch orders ]).

    Args:
        n: The size of the domain, at least 0.
        key: Any int; two keys give two unrelated orders.
    """

    def __init__(self, n: int, key: int) -> None:
        if n < 0:
            raise ValueError(f"a permutation of {n} items")
        self.n = n
        self.half = max(1, ((max(n, 2) - 1).bit_length() + 1) // 2)
        self._low = np.uint64((1 << self.half) - 1)
        keys = []
        state = key & _MASK64
        for _ in range(ROUNDS):
            state = (state + _GOLDEN) & _MASK64
            keys.append(int(_mix(np.array([state], dtype=np.uint64))[0]))
        self._keys = np.array(keys, dtype=np.uint64)

    def __len__(self) -> int:
        return self.n

    @overload
    def __call__(self, positions: int) -> int: ...

    @overload
    def __call__(self, positions: np.ndarray) -> np.ndarray: ...

    def __call__(self, positions: int | np.ndarray) -> int | np.ndarray:
        """The indices at ``positions`` (an int, or an integer array), each in ``[0, n)``."""
        if isinstance(positions, (int, np.integer)):
            return int(self._apply(np.array([positions], dtype=np.uint64))[0])
        array = np.asarray(positions)
        return self._apply(array.astype(np.uint64)).astype(np.int64).reshape(array.shape)

    def _apply(self, values: np.ndarray) -> np.ndarray:
        values = self._feistel(values.ravel())
        bound = np.uint64(self.n)
        outside = np.flatnonzero(values >= bound)
        while len(outside):  # cycle walking: a few steps, under four on average
            values[outside] = self._feistel(values[outside])
            outside = outside[values[outside] >= bound]
        return values

    def _feistel(self, values: np.ndarray) -> np.ndarray:
        shift, low = np.uint64(self.half), self._low
        left, right = values >> shift, values & low
        with np.errstate(over="ignore"):
            for key in self._keys:
                left, right = right, left ^ (_mix(right ^ key) & low)
        return (left << shift) | right
