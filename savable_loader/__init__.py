"""savable_loader: a ``DataLoader`` whose position can be saved and restored exactly."""

from ._version import __version__
from .checkpoint_dir import load_checkpoint, save_checkpoint
from .config import WorkerConfig, WorkerContext
from .datasets.protocol.base import SavableDataset
from .errors import (
    ApproximateResumeWarning,
    ConfigError,
    DatasetError,
    SavableLoaderError,
    SingleProcessTrainerWarning,
    StateError,
    StateFileNotFoundError,
    StateFormatError,
    StateMismatchError,
    StorageError,
    UnsavableDatasetError,
    WorkerError,
)
from .loader import SavableDataLoader
from .state.files import load_state, save_state
from .state.models import RankState

__all__ = [
    "ApproximateResumeWarning",
    "ConfigError",
    "DatasetError",
    "RankState",
    "SavableDataLoader",
    "SavableDataset",
    "SavableLoaderError",
    "SingleProcessTrainerWarning",
    "StateError",
    "StateFileNotFoundError",
    "StateFormatError",
    "StateMismatchError",
    "StorageError",
    "UnsavableDatasetError",
    "WorkerConfig",
    "WorkerContext",
    "WorkerError",
    "__version__",
    "load_checkpoint",
    "load_state",
    "save_checkpoint",
    "save_state",
]
