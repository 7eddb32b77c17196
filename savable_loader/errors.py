"""The library's exception types.

Every error the library raises on purpose derives from :class:`SavableLoaderError`, so a
training script can catch the library's failures apart from its own. Errors about bad
arguments also derive from :class:`ValueError` (as torch's ``DataLoader`` raises for
them), and errors about worker processes from :class:`RuntimeError` (as torch raises for
a dead worker), so existing ``except`` clauses keep working. For the same reason a
missing state file raises :class:`StateFileNotFoundError`, which is also a
:class:`FileNotFoundError`.
"""

from __future__ import annotations

import errno
import os

__all__ = [
    "ApproximateResumeWarning",
    "ConfigError",
    "DatasetError",
    "SavableLoaderError",
    "SingleProcessTrainerWarning",
    "StateError",
    "StateFileNotFoundError",
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
    """Reading or writing a state at a URL failed (missing file, permissions, network).

    A missing file is the subclass :class:`StateFileNotFoundError`; every other failure
    is a plain ``StorageError``. The message names the URL; the cause is chained.
    """


class StateFileNotFoundError(StorageError, FileNotFoundError):
    """No state file exists at the URL :func:`~savable_loader.load_state` was given.

    Also a :class:`FileNotFoundError`, so the usual "no checkpoint yet, start fresh"
    idiom works for local paths and fsspec URLs (``memory://``, ``s3://``...) alike::

        try:
            loader.restore_state_global(load_state(url))
        except FileNotFoundError:
            pass  # first run: start from the beginning

    ``str(error)`` is the library's message (``Cannot read <url>: not found.``); as on
    any ``FileNotFoundError``, ``errno`` is ``ENOENT`` and ``filename`` the URL.
    """

    def __init__(self, message: str, url: str = "") -> None:
        super().__init__(message)
        self.errno = errno.ENOENT
        self.strerror = os.strerror(errno.ENOENT)
        self.filename = url

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[type[StateFileNotFoundError], tuple[str, str]]:
        return type(self), (str(self), self.filename)


class WorkerError(SavableLoaderError, RuntimeError):
    """A worker process died, hung, or did not answer a command within its timeout."""


class DatasetError(SavableLoaderError):
    """The user's pipeline raised while producing an item; the original is the ``__cause__``.

    The message names the worker, the item (the sequence number the worker was
    producing) and, with workers, holds the worker's traceback. When a map-style
    dataset's read (or ``collate_fn``) or a plain ``IterableDataset`` raised, the error is
    also of the original type, as torch re-raises it, and the loader goes on as torch's
    does; otherwise the loader stays just before that item and the same iterator's
    ``next()`` retries it.

    Attributes:
        worker_id: The worker that raised (0 without workers), or None if unknown.
        index: The sequence number of the item the worker was producing, or whose
            checkpoint it was taking (the pipeline's ``save_state()``), or None.
    """

    def __init__(self, message: str, *, worker_id: int | None = None, index: int | None = None):
        super().__init__(message)
        self.worker_id = worker_id
        self.index = index


class ApproximateResumeWarning(UserWarning):
    """A restore onto another layout was asked to be approximate and had to be.

    The message says which stage could not move its position and what the resumed
    stream repeats or skips (NOTE [ Elastic resume ] in ``datasets/protocol/elastic.py``).
    """


class SingleProcessTrainerWarning(UserWarning):
    """The loader shards by rank while the trainer trains on a single process.

    Issued by the trainer integrations (``savable_loader.integrations``) when
    ``torch.distributed`` (or the launcher's ``WORLD_SIZE``) counts several processes but
    the trainer reports one: each process then trains a model of its own. The message
    names the trainer's setting that fixes it (``Accelerator(cpu=True)``,
    ``TrainingArguments(use_cpu=True)``, the Lightning ``Trainer``'s ``devices``).
    """
