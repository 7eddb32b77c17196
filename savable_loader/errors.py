"""The library's exception types.

Every error the library raises on purpose derives from :class:`SavableLoaderError`, so a
training script can catch the library's failures apart from its own. Errors about bad
arguments also derive from :class:`ValueError` (as torch's ``DataLoader`` raises for
them), and errors about worker processes from :class:`RuntimeError` (as torch raises for
a dead worker), so existing ``except`` clauses keep working.
"""

from __future__ import annotations

__all__ = [
    "ApproximateResumeWarning",
    "ConfigError",
    "DatasetError",
    "SavableLoaderError",
    "StateError",
    "StateFormatError",
    "StateMismatchError",
    "StorageError",
    "UnsavableDatasetError",
    "WorkerError",
]


class SavableLoaderError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(SavableLoaderError, ValueError):
    """An argument cannot be honoured exactly (for example ``in_order=False``)."""


class UnsavableDatasetError(ConfigError):
    """A save (or a restore of a saved state) of a loader whose dataset cannot save its
    position: an ``IterableDataset`` with neither ``save_state()``/``restore_state()`` nor
    ``state_dict()``/``load_state_dict()``. Iterating such a loader works as with torch's
    ``DataLoader``; the message names the dataset and what to add."""


class StateError(SavableLoaderError):
    """A state cannot be restored into this loader, or cannot be read at all."""


class StateFormatError(StateError):
    """A state file or state object is malformed: corrupt, truncated, foreign, unknown version."""


class StateMismatchError(StateError):
    """A well-formed state was saved by a loader this one is not compatible with.

    The message names the field, the saved value, the current value and the fix.
    """


class StorageError(SavableLoaderError):
    """Reading or writing a state at a URL failed (missing file, permissions, network)."""


class WorkerError(SavableLoaderError, RuntimeError):
    """A worker process died, hung, or did not answer a command within its timeout."""


class DatasetError(SavableLoaderError):
    """The user's pipeline raised while producing an item; the original is the ``__cause__``.

    The message names the worker, the item (the sequence number the worker was
    producing) and, with workers, holds the worker's traceback. The loader stays just
    before that item: iterating again retries it.

    Attributes:
        worker_id: The worker that raised (0 without workers), or None if unknown.
        index: The sequence number of the item the worker was producing, or None.
    """

    def __init__(self, message: str, *, worker_id: int | None = None, index: int | None = None):
        super().__init__(message)
        self.worker_id = worker_id
        self.index = index


class ApproximateResumeWarning(UserWarning):
    """A restore onto another layout was asked to be approximate and had to be.

    The message says which stage could not move its position and what the resumed
    stream repeats or skips (NOTE [ Elastic resume ] in ``datasets/elastic.py``).
    """
