"""Savable datasets: the protocol, adapters, sources and transforms.

Every class here is a :class:`SavableDataset`, so ``SavableDataLoader`` takes it as it is;
the building blocks are stages (:class:`Stage`) with fluent methods::

    IndexedDataset(data, shuffle=True).map(decode).filter(ok).shuffle(buffer_size=256, seed=0)
"""

from .base import SavableDataset
from .blend import Blend
from .filter import Filter
from .indexed import IndexedDataset
from .jsonl import JsonLinesSource
from .limit import Limit
from .map import Map
from .repeat import Repeat
from .shuffle import Shuffle
from .stage import Cursor, Stage
from .stateful import StatefulDataset, from_stateful
from .tar import TarSource
from .tokens import TokenSource

__all__ = [
    "Blend",
    "Cursor",
    "Filter",
    "IndexedDataset",
    "JsonLinesSource",
    "Limit",
    "Map",
    "Repeat",
    "SavableDataset",
    "Shuffle",
    "Stage",
    "StatefulDataset",
    "TarSource",
    "TokenSource",
    "from_stateful",
]
