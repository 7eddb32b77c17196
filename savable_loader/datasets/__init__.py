"""Savable pipelines: the dataset protocol, stages (sources and transforms), their cursors.

``SavableDataLoader`` takes any of these as it is, and so does every transform; stages
chain with fluent methods::

    IndexedDataset(data, shuffle=True).map(decode).filter(ok).shuffle(buffer_size=256, seed=0)

A stage of your own derives from :class:`Stage` (a source) or :class:`Transform`, with a
:class:`Cursor` (or :class:`TransformCursor`) that holds the position (NOTE [ The cursor
contract ] in ``cursor.py``).
"""

from .adapt import as_stage
from .base import SavableDataset
from .blend import Blend
from .cursor import Cursor, StageState, TransformCursor
from .filter import Filter
from .indexed import IndexedDataset
from .jsonl import JsonLinesSource
from .limit import Limit
from .map import Map
from .repeat import Repeat
from .retry import RetryPolicy
from .shuffle import Shuffle
from .stage import Stage
from .stateful import StatefulDataset, from_stateful
from .storage_stats import CacheStats
from .table import TableSource
from .tar import TarSource
from .tokens import TokenSource
from .transform import Transform

__all__ = [
    "Blend",
    "CacheStats",
    "Cursor",
    "Filter",
    "IndexedDataset",
    "JsonLinesSource",
    "Limit",
    "Map",
    "Repeat",
    "RetryPolicy",
    "SavableDataset",
    "Shuffle",
    "Stage",
    "StageState",
    "StatefulDataset",
    "TableSource",
    "TarSource",
    "TokenSource",
    "Transform",
    "TransformCursor",
    "as_stage",
    "from_stateful",
]
