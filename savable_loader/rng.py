"""Capture, restore and derive the random streams a pipeline draws from.

NOTE [ Which generators are captured ]
A user's dataset may draw from the three process-global generators: Python's ``random``,
NumPy's legacy global ``numpy.random`` and torch's default CPU generator. A worker
checkpoint captures all three, so a restored worker continues the exact same streams.
Capture keeps the in-process objects (:class:`RngSnapshot`, cheap: a few tens of
microseconds, mostly NumPy's ``get_state``); the conversion to bytes for a saved state
(:class:`~savable_loader.state.RngState`) happens only when a save asks for that
checkpoint. CUDA generators are not captured: data pipelines run on the CPU.

NOTE [ Seeds ]
Every seed the loader uses derives from (loader seed, rank, worker id, purpose) through
``numpy.random.SeedSequence``, never from the main process's generators. A run is
reproducible without global seeding, ranks and workers never share a stream, and the
training loop's own draws cannot change the data stream.
"""

from __future__ import annotations

import array
import random
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .state.models import RngState

__all__ = ["RngSnapshot", "apply", "capture", "derive_seed", "seed_globals"]

_PY_STATE_VERSION = 3
_MT_WORDS = 624


@dataclass(frozen=True)
class RngSnapshot:
    """The three global generators' states, as the generators themselves return them."""

    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch: torch.Tensor

    def to_state(self) -> RngState:
        """Converts to the serialisable :class:`RngState` (plain bytes and numbers)."""
        version, words, gauss_next = self.python
        if version != _PY_STATE_VERSION:
            raise ValueError(f"unsupported random state version {version}")
        _, key, pos, has_gauss, cached_gaussian = self.numpy
        return RngState(
            python=_words_to_bytes(words),
            python_gauss=gauss_next,
            numpy_key=np.ascontiguousarray(key, dtype="<u4").tobytes(),
            numpy_pos=int(pos),
            numpy_has_gauss=int(has_gauss),
            numpy_gauss=float(cached_gaussian),
            torch=self.torch.numpy().tobytes(),
        )

    @classmethod
    def from_state(cls, state: RngState) -> RngSnapshot:
        """Rebuilds the snapshot a :class:`RngState` was made from."""
        key = np.frombuffer(state.numpy_key, dtype="<u4").astype(np.uint32)
        return cls(
            python=(_PY_STATE_VERSION, _bytes_to_words(state.python), state.python_gauss),
            numpy=("MT19937", key, state.numpy_pos, state.numpy_has_gauss, state.numpy_gauss),
            torch=torch.frombuffer(bytearray(state.torch), dtype=torch.uint8).clone(),
        )


def capture() -> RngSnapshot:
    """Returns the current states of ``random``, ``numpy.random`` and torch's CPU generator."""
    return RngSnapshot(
        python=random.getstate(),
        numpy=np.random.get_state(legacy=True),  # type: ignore[arg-type]
        torch=torch.get_rng_state(),
    )


def apply(snapshot: RngSnapshot) -> None:
    """Sets the three global generators to ``snapshot``."""
    random.setstate(snapshot.python)
    np.random.set_state(snapshot.numpy)
    torch.set_rng_state(snapshot.torch)


def derive_seed(seed: int, *keys: int) -> int:
    """Derives a 63-bit seed from ``seed`` and integer ``keys`` (rank, worker id, purpose)."""
    entropy = [seed & 0xFFFFFFFFFFFFFFFF, *(k & 0xFFFFFFFFFFFFFFFF for k in keys)]
    words = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def seed_globals(seed: int) -> None:
    """Seeds ``random``, ``numpy.random`` and torch's CPU generator from one derived seed."""
    random.seed(seed)
    np.random.seed(np.random.SeedSequence(seed).generate_state(4, dtype=np.uint32))
    torch.manual_seed(seed)


def _words_to_bytes(words: tuple[int, ...]) -> bytes:
    data = array.array("I", words)
    if sys.byteorder != "little":
        data.byteswap()
    return data.tobytes()


def _bytes_to_words(data: bytes) -> tuple[int, ...]:
    words = array.array("I")
    words.frombytes(data)
    if sys.byteorder != "little":
        words.byteswap()
    if len(words) != _MT_WORDS + 1:
        raise ValueError(f"python random state has {len(words)} words, expected {_MT_WORDS + 1}")
    return tuple(words)
