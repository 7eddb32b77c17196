"""Savable datasets: the protocol, adapters, sources and transforms."""

from .base import SavableDataset
from .indexed import IndexedDataset
from .stateful import StatefulDataset, from_stateful

__all__ = ["IndexedDataset", "SavableDataset", "StatefulDataset", "from_stateful"]
