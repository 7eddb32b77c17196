"""Savable pipelines: the dataset protocol, stages (sources and transforms), their cursors.

``SavableDataLoader`` takes any of these as it is, and so does every transform; stages
chain with fluent methods::

    IndexedDataset(data, shuffle=True).map(decode).filter(ok).shuffle(buffer_size=256, seed=0)

A stage of your own derives from :class:`Stage` (a source) or :class:`Transform`, with a
:class:`Cursor` (or :class:`TransformCursor`) that holds the position (NOTE [ The cursor
contract ] in ``datasets/protocol/cursor.py``).
"""

from ..storage.retry import RetryPolicy
from ..storage.stats import CacheStats
from .adapt import as_stage
from .adapters.stateful import StatefulDataset, from_stateful
from .files.jsonl import JsonLinesSource
from .files.table import TableSource
from .files.tar import TarSource
from .files.tokens import TokenSource
from .index.indexed import IndexedDataset
from .protocol.base import SavableDataset
from .protocol.cursor import Cursor, StageState, TransformCursor
from .protocol.stage import Stage
from .transforms.blend import Blend
from .transforms.filter import Filter
from .transforms.limit import Limit
from .transforms.map import Map
from .transforms.repeat import Repeat
from .transforms.shuffle import Shuffle
from .transforms.transform import Transform

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
