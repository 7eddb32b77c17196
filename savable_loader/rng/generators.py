"""Capture, restore and derive the random streams a pipeline draws from.

NOTE [ Which generators are captured ]
A user's dataset may draw from the three process-global generators: Python's ``random``,
NumPy's legacy global ``numpy.random`` and torch's default CPU generator. A worker
checkpoint captures all three, so a restored worker continues the exact same streams.
Capture keeps the in-process objects (:class:`RngSnapshot`, cheap: a few tens of
microseconds, mostly NumPy's ``get_state``); the conversion to bytes for a saved state
(:class:`~savable_loader.state.RngState`) happens only when a save asks for that
checkpoint. CUDA generators are not captured: data pipelines run on the CPU.

NOTE [ Untouched generators ]
Most pipelines never draw from the global generators, and their states (about 10 KB of
bytes per worker) would be most of a saved state. A worker's generators are seeded at
each epoch's start from ``(seed, rank, worker id, epoch)`` (NOTE [ Generators per epoch ]
in ``_worker/runtime.py``), so while nothing has drawn from them since, a checkpoint can say
"as seeded for epoch e" instead of holding the bytes, and a restore seeds them again.
The runtime keeps the snapshot taken right after seeding (``seeded_epoch`` set) and, at
each checkpoint, compares the fresh capture with it (:class:`Seeded`): every word, position
and cached Gaussian of all three generators (Python's 625 words and ``gauss_next``;
NumPy's key, ``pos``, ``has_gauss`` and ``gauss``; torch's whole ``get_rng_state()``).
Equal states give equal future draws whatever happened in between, so the marker is
exact by construction, not by an argument about how unlikely a return to the seeded
state is. The first difference ends the comparisons until the next seeding: from then
on the checkpoints of that epoch hold bytes. The comparison costs a few microseconds on
top of the capture the checkpoint takes anyway.

NOTE [ Seeded windows ]
A stage that keeps the generators' states for a later re-read (``Shuffle`` keeps them at
each window's start) would put those ~10 KB into every state too. While a runtime runs
its pipeline it is the active :class:`Seedings` (:class:`Scope`), which tells whether a
capture equals its generators as seeded for an epoch and still untouched (the same exact
comparison as NOTE [ Untouched generators ]) and rebuilds that seeding on demand. Such a
stage keeps the epoch instead of the bytes (:func:`seeded_epoch_of`) and, on restore,
asks the active runtime for those generators again (:func:`seeded_for`); outside a
runtime, or once something drew, it keeps the bytes as before. The active runtime is held
weakly: asyncio copies the context into callbacks, so s3fs reads left it in fsspec's loop
thread, whose freeing its torch tensors as the interpreter exited aborted the process.

NOTE [ Own generators ]
Some pipelines read under generator states of their own rather than the process's: the
whole pipeline without workers (NOTE [ No workers ] in ``_worker/runtime.py``), a replay in the
main process (an elastic restore), a shuffle re-reading its window, an adapted object in
replay mode. :class:`OwnGenerators` holds such states and is the one place that swaps
them in: ``with generators:`` applies them, and on leaving keeps what the step drew and
puts the process's states back.
"""

from __future__ import annotations

import array
import contextvars
import ctypes
import dataclasses
import random
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..state.models import RngState

__all__ = [
    "OwnGenerators",
    "RngSnapshot",
    "Scope",
    "Seeded",
    "Seedings",
    "apply",
    "capture",
    "seed_globals",
    "seeded_epoch_of",
    "seeded_for",
]

_PY_STATE_VERSION = 3
_MT_WORDS = 624


@dataclass(frozen=True)
class RngSnapshot:
    """The three global generators' states, as the generators themselves return them.

    ``seeded_epoch`` is set on the snapshot taken right after the runtime seeded the
    generators for that epoch (NOTE [ Untouched generators ]); None otherwise.
    """

    python: bytes
    python_gauss: float | None
    numpy: tuple[Any, ...]
    torch: torch.Tensor
    seeded_epoch: int | None = None

    def to_state(self) -> RngState:
        """Converts to the serialisable :class:`RngState` (plain bytes and numbers)."""
        _, key, pos, has_gauss, cached_gaussian = self.numpy
        return RngState(
            python=self.python,
            python_gauss=self.python_gauss,
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
            python=state.python,
            python_gauss=state.python_gauss,
            numpy=("MT19937", key, state.numpy_pos, state.numpy_has_gauss, state.numpy_gauss),
            torch=torch.frombuffer(bytearray(state.torch), dtype=torch.uint8).clone(),
        )


def capture() -> RngSnapshot:
    """Returns the current states of ``random``, ``numpy.random`` and torch's CPU generator."""
    return RngSnapshot(
        python=_PYTHON.get(),
        python_gauss=random._inst.gauss_next,  # type: ignore[attr-defined]
        numpy=_NUMPY.get(),
        torch=torch.get_rng_state(),
    )


class Seeded:
    """The generators right after the runtime seeded them for an epoch, kept to tell
    whether a later capture is the same (NOTE [ Untouched generators ]).

    Args:
        snapshot: The capture taken right after the seeding.
        epoch: The epoch they were seeded for.
    """

    __slots__ = ("_numpy_key", "_torch", "snapshot")

    def __init__(self, snapshot: RngSnapshot, epoch: int) -> None:
        self.snapshot = dataclasses.replace(snapshot, seeded_epoch=epoch)
        self._numpy_key = np.ascontiguousarray(snapshot.numpy[1]).tobytes()
        self._torch = snapshot.torch.numpy().tobytes()

    def matches(self, other: RngSnapshot) -> bool:
        """Whether ``other`` holds the same states of all three generators: every word,
        position and cached Gaussian. The cheapest parts are compared first."""
        seeded = self.snapshot
        _, key, pos, has_gauss, gauss = other.numpy
        _, _, seeded_pos, seeded_has_gauss, seeded_gauss = seeded.numpy
        return (
            other.python == seeded.python
            and other.python_gauss == seeded.python_gauss
            and int(pos) == int(seeded_pos)
            and int(has_gauss) == int(seeded_has_gauss)
            and float(gauss) == float(seeded_gauss)
            and np.ascontiguousarray(key).tobytes() == self._numpy_key
            and other.torch.numpy().tobytes() == self._torch
        )


def apply(snapshot: RngSnapshot) -> None:
    """Sets the three global generators to ``snapshot``."""
    _PYTHON.set(snapshot.python)
    random._inst.gauss_next = snapshot.python_gauss  # type: ignore[attr-defined]
    _NUMPY.set(snapshot.numpy)
    torch.set_rng_state(snapshot.torch)


class OwnGenerators:
    """Generator states kept apart from the process's (NOTE [ Own generators ]).

    ``with generators:`` applies :attr:`snapshot` to the three global generators; on
    leaving, :attr:`snapshot` becomes what they hold then, and the states they held
    before are applied again. Not reentrant.

    Args:
        snapshot: The states to start from.
    """

    __slots__ = ("_outer", "snapshot")

    def __init__(self, snapshot: RngSnapshot) -> None:
        self.snapshot = snapshot
        self._outer: RngSnapshot | None = None

    @classmethod
    def seeded(cls, seed: int) -> OwnGenerators:
        """Generators as :func:`seed_globals` ``(seed)`` leaves them; the process's own
        generators are left as they are."""
        generators = cls(capture())
        with generators:
            seed_globals(seed)
        return generators

    @classmethod
    def of(cls, state: RngState) -> OwnGenerators:
        """Generators in the states a saved :class:`RngState` holds."""
        return cls(RngSnapshot.from_state(state))

    def __enter__(self) -> OwnGenerators:
        self._outer = capture()
        apply(self.snapshot)
        return self

    def __exit__(self, *exc: object) -> None:
        outer, self._outer = self._outer, None
        if outer is not None:
            self.snapshot = capture()
            apply(outer)


class Seedings(Protocol):
    """What a runtime tells of its generators' seedings (NOTE [ Seeded windows ])."""

    def epoch_of(self, snapshot: RngSnapshot) -> int | None:
        """The epoch whose untouched seeding ``snapshot`` equals, or None."""

    def seeded_for(self, epoch: int) -> RngSnapshot:
        """The generators as seeded for ``epoch``; the process's are left as they are."""


_ACTIVE: contextvars.ContextVar[weakref.ref[Seedings] | None] = contextvars.ContextVar(
    "savable_loader_seedings", default=None
)


class Scope:
    """``with Scope(seedings, generators):`` makes ``seedings`` active (NOTE [ Seeded
    windows ]) and applies ``generators`` (None: the process's own) for the block."""

    __slots__ = ("_generators", "_seedings", "_token")

    def __init__(self, seedings: Seedings, generators: OwnGenerators | None) -> None:
        self._seedings = seedings
        self._generators = generators
        self._token: contextvars.Token[weakref.ref[Seedings] | None] | None = None

    def __enter__(self) -> Scope:
        self._token = _ACTIVE.set(weakref.ref(self._seedings))
        if self._generators is not None:
            self._generators.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._generators is not None:
            self._generators.__exit__(*exc)
        if self._token is not None:
            _ACTIVE.reset(self._token)


def seeded_epoch_of(snapshot: RngSnapshot) -> int | None:
    """The epoch whose untouched seeding by the active runtime ``snapshot`` equals; None
    outside a runtime or when it differs (NOTE [ Seeded windows ])."""
    active = _ACTIVE.get()
    seedings = None if active is None else active()
    return None if seedings is None else seedings.epoch_of(snapshot)


def seeded_for(epoch: int) -> RngSnapshot | None:
    """The active runtime's generators as seeded for ``epoch``; None outside a runtime."""
    active = _ACTIVE.get()
    seedings = None if active is None else active()
    return None if seedings is None else seedings.seeded_for(epoch)


class _PythonGlobalState:
    """Reads and writes ``random``'s Mersenne Twister as 625 uint32 LE (words, then index).

    NOTE [ Fast Python state ]
    ``random.getstate()`` builds a tuple of 625 Python ints, which dominates a checkpoint
    taken with cold caches. CPython's ``_random.Random`` object holds the index and the
    624 words inline; their place is found on a probe ``Random`` by searching its memory
    for the words ``getstate()`` reports, then checked both ways (read after draws,
    write then ``getstate()``) and used only when every check agrees and the machine is
    little-endian. Otherwise ``getstate``/``setstate`` are used. ``gauss_next`` is a
    plain attribute of ``random.Random`` and is read as such.
    """

    def __init__(self) -> None:
        self._offset = self._locate()

    def get(self) -> bytes:
        if self._offset is None:
            return _words_to_bytes(random.getstate()[1])
        raw = ctypes.string_at(id(random._inst) + self._offset, 4 * (_MT_WORDS + 1))
        return raw[4:] + raw[:4]

    def set(self, data: bytes) -> None:
        if len(data) != 4 * (_MT_WORDS + 1):
            raise ValueError(f"python random state has {len(data)} bytes, expected 2500")
        if self._offset is None:
            gauss = random._inst.gauss_next  # type: ignore[attr-defined]
            random.setstate((_PY_STATE_VERSION, _bytes_to_words(data), gauss))
            return
        index = int.from_bytes(data[-4:], "little")
        if index > _MT_WORDS:
            # NOTE [ Generator states are checked at the door ] in state/generators.py:
            # an index past 624 would make the next draw read and write past the object.
            raise ValueError(f"python random state has index {index}, outside 0..{_MT_WORDS}")
        raw = data[-4:] + data[:-4]
        ctypes.memmove(id(random._inst) + self._offset, raw, len(raw))

    @staticmethod
    def _locate() -> int | None:
        if sys.byteorder != "little" or sys.implementation.name != "cpython":
            return None
        try:
            import _random

            probe = random.Random(20240229)
            probe.random()
            words = probe.getstate()[1]
            memory = ctypes.string_at(id(probe), _random.Random.__basicsize__)
            found = memory.find(_words_to_bytes(words[:_MT_WORDS]))
            if found < 4 or memory.find(_words_to_bytes(words[:_MT_WORDS]), found + 1) != -1:
                return None
            offset = found - 4
        except (AttributeError, ImportError, TypeError, ValueError):
            return None
        return offset if _PythonGlobalState._verify(probe, offset) else None

    @staticmethod
    def _verify(probe: random.Random, offset: int) -> bool:
        for draws in (0, 1, 700):
            for _ in range(draws):
                probe.random()
            words = probe.getstate()[1]
            raw = ctypes.string_at(id(probe) + offset, 4 * (_MT_WORDS + 1))
            if raw[4:] + raw[:4] != _words_to_bytes(words):
                return False
            expected = probe.getstate()
            probe.random()
            ctypes.memmove(id(probe) + offset, raw, len(raw))
            if probe.getstate() != expected:
                return False
        return True


class _NumpyGlobalState:
    """Reads and writes ``numpy.random``'s legacy global state, fast when it safely can.

    NOTE [ Fast NumPy state ]
    ``numpy.random.get_state()`` copies the 624-word key element by element and costs
    about 70 us, most of a checkpoint. NumPy publishes the Mersenne Twister's state
    struct (``BitGenerator.ctypes.state_address``: 624 words, then the position), but
    not the legacy Gaussian cache (``has_gauss``, ``gauss``) that ``RandomState`` keeps
    next to its ``bitgen_t``. That cache's place is found once, on a probe
    ``RandomState``, as the struct that points at the probe's ``bitgen_t``; the fast
    path is then checked against ``get_state``/``set_state`` on the probe (after Gaussian
    draws that set and clear the cache) and used only if every check agrees. Otherwise,
    or on an unexpected NumPy, the public functions are used.
    """

    def __init__(self) -> None:
        self._offsets = self._locate()

    def get(self) -> tuple[Any, ...]:
        rs = np.random.mtrand._rand
        offsets = self._offsets
        if offsets is None:
            return tuple(rs.get_state(legacy=True))
        state, aug = rs._bit_generator.ctypes.state_address, id(rs) + offsets
        return (
            "MT19937",
            np.frombuffer(ctypes.string_at(state, _MT_WORDS * 4), dtype=np.uint32),
            ctypes.c_int.from_address(state + _MT_WORDS * 4).value,
            ctypes.c_int.from_address(aug + _HAS_GAUSS).value,
            ctypes.c_double.from_address(aug + _GAUSS).value,
        )

    def set(self, value: tuple[Any, ...]) -> None:
        rs = np.random.mtrand._rand
        offsets = self._offsets
        if offsets is None:
            rs.set_state(value)
            return
        _, key, pos, has_gauss, gauss = value
        state, aug = rs._bit_generator.ctypes.state_address, id(rs) + offsets
        words = np.ascontiguousarray(key, dtype=np.uint32)
        if words.shape != (_MT_WORDS,):
            raise ValueError(f"numpy key has shape {words.shape}, expected ({_MT_WORDS},)")
        ctypes.memmove(state, words.ctypes.data, _MT_WORDS * 4)
        ctypes.c_int.from_address(state + _MT_WORDS * 4).value = int(pos)
        ctypes.c_int.from_address(aug + _HAS_GAUSS).value = int(has_gauss)
        ctypes.c_double.from_address(aug + _GAUSS).value = float(gauss)

    @staticmethod
    def _locate() -> int | None:
        try:
            probe = np.random.RandomState(20240229)
            if type(probe._bit_generator).__name__ != "MT19937":
                return None
            base, size = id(probe), type(probe).__basicsize__
            words = (ctypes.c_size_t * (size // ctypes.sizeof(ctypes.c_size_t))).from_address(base)
            pointer = ctypes.sizeof(ctypes.c_size_t)
            state = probe._bit_generator.ctypes.state_address
            bitgens = [base + i * pointer for i, word in enumerate(words) if word == state]
            if len(bitgens) != 1:
                return None
            augs = [i * pointer for i, word in enumerate(words) if word == bitgens[0]]
            if len(augs) != 1:
                return None
            offsets = augs[0]
        except (AttributeError, TypeError, ValueError):
            return None
        return offsets if _NumpyGlobalState._verify(probe, offsets) else None

    @staticmethod
    def _verify(probe: Any, offsets: int) -> bool:
        fast = _NumpyGlobalState.__new__(_NumpyGlobalState)
        fast._offsets = offsets
        saved = np.random.mtrand._rand
        try:
            np.random.mtrand._rand = probe
            for draws in (0, 1, 2, 3):
                for _ in range(draws):
                    probe.standard_normal()
                expected = probe.get_state(legacy=True)
                got = fast.get()
                if not _same_numpy_state(expected, got):
                    return False
                probe.random_sample(7)
                probe.standard_normal()
                fast.set(got)
                if not _same_numpy_state(probe.get_state(legacy=True), expected):
                    return False
            return True
        finally:
            np.random.mtrand._rand = saved


def _same_numpy_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return (
        a[0] == b[0]
        and np.array_equal(a[1], b[1])
        and int(a[2]) == int(b[2])
        and int(a[3]) == int(b[3])
        and float(a[4]) == float(b[4])
    )


_HAS_GAUSS = ctypes.sizeof(ctypes.c_void_p)
_GAUSS = _HAS_GAUSS + ctypes.sizeof(ctypes.c_double)


def seed_globals(seed: int) -> None:
    """Seeds ``random``, ``numpy.random`` and torch's CPU generator from one derived seed.

    Torch's CPU generator only, as ``torch.manual_seed`` leaves it: ``torch.manual_seed``
    also queues a seeding of every accelerator (CUDA, XPU, MTIA), recording the caller's
    stack for each (about 4 ms a call on a CPU-only build, twice per worker start), and
    would leave the main process's CUDA generator seeded by the loader, which torch's
    ``DataLoader`` never touches."""
    random.seed(seed)
    np.random.seed(np.random.SeedSequence(seed).generate_state(4, dtype=np.uint32))
    torch.default_generator.manual_seed(seed)


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


_NUMPY = _NumpyGlobalState()
_PYTHON = _PythonGlobalState()
