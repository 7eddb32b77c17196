"""Every keyed seed and generator of the library, derived by one function from a registry.

NOTE [ Seeds ]
Every seed the loader uses derives from the loader seed, a :class:`Purpose` and integer
keys through ``numpy.random.SeedSequence``, never from the main process's generators. A
run is reproducible without global seeding, the training loop's own draws cannot change
the data stream, and two purposes never share a stream: :class:`Purpose` is the one
registry of them, ``enum.unique`` refuses two purposes with one number, and
``tests/rng/test_rng_keys.py`` checks it too.

NOTE [ Keys of the global stream ]
What a pipeline draws for an item is keyed by the item's place in the global stream
(``Cursor.item_key()``: the source's epoch and the item's position in that epoch's
canonical order), never by the rank or the worker that happens to read it: a seeded
``Map``'s per-item generator (:attr:`Purpose.MAP_ITEM`) and the global generators seeded
before each item with ``seed_each_item`` (:attr:`Purpose.ITEM_GLOBALS`). Then the same
item gets the same draws on any number of ranks and workers, and after a restore onto
another layout (``docs/explanation/elastic.md``).

NOTE [ Items seeded one by one ]
With ``SavableDataLoader(seed_each_item=True)`` the global generators (``random``,
``numpy.random``, torch's CPU generator) are seeded before each item is produced, from
the loader seed and the item's key (:func:`seed_item`): by an indexed source before it
reads ``data[i]`` (your ``__getitem__``), and by a map before its function runs (keyed
by the map too, so that two maps draw apart). What a ``__getitem__`` or a map's function
draws from them is then a function of the item alone, the same on every layout, and
what the generators hold between items is never drawn from: a checkpoint names the
epoch's seeding instead of their ~10 KB of bytes, and skipping an item needs no read of
it. Draws elsewhere (a filter's predicate, a ``collate_fn``) follow the last seeded item.

The other purposes key per-epoch orders by ``(seed, epoch)`` (layout-free too) or a
worker's own generators by ``(seed, rank, worker)``; those were fixed before this
registry, and the place of the purpose's number among the keys (:data:`_SLOT`) keeps
what states saved by earlier versions derive.
"""

from __future__ import annotations

import enum
import hashlib
import random
import struct

import numpy as np
import torch

__all__ = ["Purpose", "derive_seed", "generator_for", "seed_for", "seed_item"]

_MASK = 0xFFFFFFFFFFFFFFFF


@enum.unique
class Purpose(enum.IntEnum):
    """What a keyed seed or generator is for: its number goes into the entropy."""

    #: A worker's global generators at an epoch's start: keys (rank, worker[, epoch]).
    WORKER_EPOCH = 0x5EED
    #: The rest of an epoch resumed on another layout: keys (worker epoch seed, salt).
    WORKER_SALT = 0x5A17
    #: The generator torch draws its workers' base seed from: keys (rank,).
    BASE_SEED = 0xBA5E
    #: An indexed source's permutation of an epoch: keys (epoch,).
    PERMUTATION = 0x1D
    #: A file source's file order of an epoch: keys (epoch,).
    FILE_ORDER = 0x5A4D
    #: A DataPipe's random steps in an epoch: keys (epoch,).
    DATAPIPE = 0xD7A9
    #: A Stateful object's own stream in an epoch: keys (rank, worker, epoch).
    STATEFUL_STREAM = 0x57A7E
    #: A window shuffle's order of one window: keys (rank, worker, epoch, window).
    WINDOW = 0x5F1
    #: A window shuffle's order of one window of positions: keys (epoch, window).
    WINDOW_POSITIONS = 0x5F2
    #: A blend's draws, a block of positions at a time: keys (rank, worker, epoch, block).
    BLEND_DRAW = 0xB1E
    #: How a blend read by position splits a run of positions' sources in two: keys
    #: (epoch, segment, first position, positions).
    BLEND_SPLIT = 0xB1F
    #: The order of the sources over one leaf of such a split: keys (epoch, segment,
    #: first position).
    BLEND_LEAF = 0xB20
    #: A seeded map's generator for an item without a global key: keys (rank, worker,
    #: epoch, position[, salt]).
    MAP_STREAM_ITEM = 0x3A9
    #: A seeded map's generator for an item: keys (item key...), NOTE [ Keys of the global stream ].
    MAP_ITEM = 0x3AA
    #: The global generators before a source produces an item: keys (item key...).
    ITEM_GLOBALS = 0x1739
    #: The global generators before a map's function runs on an item: keys (stage,
    #: item key...).
    MAP_GLOBALS = 0x1740


#: Where a purpose's number sits among the entropy words (0: the seed itself), for the
#: purposes whose derivation states saved by earlier versions depend on; 1 otherwise.
#: None: not among them (the salted generators were derived so before the registry, and
#: states saved after an elastic restore hold what they drew).
_SLOT: dict[Purpose, int | None] = {
    Purpose.WORKER_SALT: None,
    Purpose.WORKER_EPOCH: 3,
    Purpose.BASE_SEED: 2,
    Purpose.DATAPIPE: 2,
    Purpose.STATEFUL_STREAM: 3,
}


def _entropy(purpose: Purpose, seed: int, keys: tuple[int, ...]) -> list[int]:
    words = [seed & _MASK, *(key & _MASK for key in keys)]
    slot = _SLOT.get(purpose, 1)
    if slot is not None:
        words.insert(slot, int(purpose))
    return words


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed from ``seed`` and integer ``keys``; :func:`seed_for` names the
    purpose."""
    entropy = [seed & _MASK, *(k & _MASK for k in keys)]
    words = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def seed_for(purpose: Purpose, seed: int, *keys: int) -> int:
    """The 63-bit seed of ``purpose`` for ``seed`` and ``keys`` (NOTE [ Seeds ])."""
    return derive_seed(*_entropy(purpose, seed, keys))


def generator_for(purpose: Purpose, seed: int, *keys: int) -> np.random.Generator:
    """A NumPy generator of ``purpose`` for ``seed`` and ``keys`` (NOTE [ Seeds ])."""
    return np.random.default_rng(_entropy(purpose, seed, keys))


def seed_item(purpose: Purpose, seed: int, *keys: int) -> None:
    """Seeds ``random``, ``numpy.random`` and torch's CPU generator for one item (NOTE
    [ Items seeded one by one ]), each from its own 64 bits of one BLAKE2b digest of the
    entropy words: about 30 us, where ``SeedSequence`` alone costs as much and
    ``torch.manual_seed`` ten times more (it seeds every device)."""
    entropy = _entropy(purpose, seed, keys)
    digest = hashlib.blake2b(struct.pack(f"<{len(entropy)}Q", *entropy), digest_size=24)
    words = digest.digest()
    random.seed(int.from_bytes(words[:8], "little"))
    np.random.seed(np.frombuffer(words[8:16], dtype=np.uint32))
    torch.default_generator.manual_seed(int.from_bytes(words[16:], "little") >> 1)
