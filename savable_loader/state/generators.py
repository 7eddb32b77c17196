"""Saved generator states checked as strictly as the generators' own setters check them.

NOTE [ Generator states are checked at the door ]
A state file is untrusted input, and generator states are the part of it that reaches
memory directly: the fast paths of ``rng/generators.py`` copy Python's Mersenne Twister state into
the interpreter's ``random`` object with ``ctypes`` (NOTE [ Fast Python state ]), where
an index past 624 makes the next draw read and write outside the object (a segfault,
or worse). So every generator state a loader state holds is checked when the state is
validated, before a restore starts anything, by exactly the rules of the public setters:

- Python ``random``: the words and index go through ``random.Random.setstate`` on a
  scratch generator (it refuses an index outside 0..624);
- ``numpy.random``: the key length and ``pos`` in 0..624 are model fields (NumPy's own
  ``set_state`` does not check ``pos``, so the model is stricter than NumPy);
- torch: the bytes go through ``torch.Generator().set_state`` on a scratch CPU generator
  (it refuses a wrong size and an invalid Mersenne Twister: ``left``, ``next``, ``seeded``).

The checks cost a few microseconds per state. The fast setters check the Python index
once more before they copy (``rng/generators.py``), so a state that bypasses validation still
cannot reach memory.
"""

from __future__ import annotations

import random
import struct

import torch

__all__ = ["check_python", "check_torch"]

_PY_STATE_VERSION = 3
_MT_WORDS = 624
_WORDS = struct.Struct(f"<{_MT_WORDS + 1}I")
#: Takes the states to check; what it then holds is never drawn from.
_SCRATCH = random.Random(0)


def check_python(data: bytes, gauss: float | None) -> None:
    """Checks Python ``random``'s state as 625 uint32 LE (624 words, then the index).

    Raises:
        ValueError: ``random.setstate`` refuses it; the message says why.
    """
    if len(data) != 4 * (_MT_WORDS + 1):
        raise ValueError(f"Python random state has {len(data)} bytes, expected 2500")
    words = _WORDS.unpack(data)
    index = words[-1]
    if index > _MT_WORDS:
        raise ValueError(
            f"Python random state has index {index} (0x{index:x}), outside 0..{_MT_WORDS}"
        )
    try:
        _SCRATCH.setstate((_PY_STATE_VERSION, words, gauss))
    except (TypeError, ValueError, OverflowError) as error:
        raise ValueError(f"random.setstate refuses the Python random state: {error}") from None


def check_torch(data: bytes) -> None:
    """Checks a torch CPU generator's state (as ``torch.get_rng_state()`` returns it).

    Raises:
        ValueError: ``torch.Generator.set_state`` refuses it; the message says why.
    """
    try:
        torch.Generator().set_state(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    except (RuntimeError, ValueError) as error:
        raise ValueError(
            f"torch refuses the generator state ({len(data)} bytes): {error}"
        ) from None
