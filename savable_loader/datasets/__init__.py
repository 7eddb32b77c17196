"""Savable pipelines: the dataset protocol, stages (sources and transforms), their cursors.

``SavableDataLoader`` takes any of these as it is, and so does every transform; stages
chain with fluent methods::

    IndexedDataset(data, shuffle=True).map(decode).filter(ok).shuffle(buffer_size=256, seed=0)

A stage of your own derives from :class:`Stage` (a source) or :class:`Transform`, with a
:class:`Cursor` (or :class:`TransformCursor`) that holds the position (NOTE [ The cursor
contract ] in ``datasets/protocol/cursor.py``).

Runs wherever the pipeline runs: in each worker process, or in the main process without
workers; the main process also builds the stages and lists the files. The folders:
``protocol/`` (the stage and cursor contract), ``adapters/`` (objects that keep their own
position), ``transforms/``, ``index/`` (sources read by index) and ``files/`` (sources
read from files). ``adapt`` turns whatever a user passes into a stage; ``global_view``
reads a pipeline by global position (NOTE [ Pipelines read by position ] in
``datasets/global_view.py``).

NOTE [ Old module paths ]
Up to 0.1.0 every stage lived in this folder, and the docs imported some from their
modules (``savable_loader.datasets.tar``). Those paths still import, as the modules that
now hold the stages; new code imports from ``savable_loader.datasets``.
"""

import sys
from typing import Any

from ..storage import retry as _old_retry
from ..storage.retry import RetryPolicy
from ..storage.stats import CacheStats
from .adapt import as_stage
from .adapters import stateful as _old_stateful
from .adapters.stateful import StatefulDataset, from_stateful
from .files import jsonl as _old_jsonl
from .files import table as _old_table
from .files import tar as _old_tar
from .files import tokens as _old_tokens
from .files.jsonl import JsonLinesSource
from .files.table import TableSource
from .files.tar import TarSource
from .files.tokens import TokenSource
from .index import indexed as _old_indexed
from .index.indexed import IndexedDataset
from .protocol import base as _old_base
from .protocol import cursor as _old_cursor
from .protocol import stage as _old_stage
from .protocol.base import SavableDataset
from .protocol.cursor import Cursor, StageState, TransformCursor
from .protocol.stage import Stage
from .transforms import blend as _old_blend
from .transforms import filter as _old_filter
from .transforms import limit as _old_limit
from .transforms import map as _old_map
from .transforms import repeat as _old_repeat
from .transforms import shuffle as _old_shuffle
from .transforms import transform as _old_transform
from .transforms.blend import Blend
from .transforms.filter import Filter
from .transforms.limit import Limit
from .transforms.map import Map
from .transforms.repeat import Repeat
from .transforms.shuffle import Shuffle
from .transforms.transform import Transform

_OLD_PATHS = {
    "base": _old_base,
    "blend": _old_blend,
    "cursor": _old_cursor,
    "filter": _old_filter,
    "indexed": _old_indexed,
    "jsonl": _old_jsonl,
    "limit": _old_limit,
    "map": _old_map,
    "repeat": _old_repeat,
    "retry": _old_retry,
    "shuffle": _old_shuffle,
    "stage": _old_stage,
    "stateful": _old_stateful,
    "table": _old_table,
    "tar": _old_tar,
    "tokens": _old_tokens,
    "transform": _old_transform,
}
for _name, _module in _OLD_PATHS.items():  # NOTE [ Old module paths ]
    sys.modules[f"{__name__}.{_name}"] = _module


def __getattr__(name: str) -> Any:
    """An old module path read as an attribute (NOTE [ Old module paths ])."""
    if name in _OLD_PATHS:
        return _OLD_PATHS[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
