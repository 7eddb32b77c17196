"""The public surface is small and pinned."""

from __future__ import annotations

import savable_loader


def test_all_is_sorted_and_pinned():
    assert savable_loader.__all__ == sorted(savable_loader.__all__)
    assert savable_loader.__all__ == [
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
    for name in savable_loader.__all__:
        assert hasattr(savable_loader, name)


def test_error_hierarchy():
    errors = savable_loader
    for error in (
        errors.StateError,
        errors.WorkerError,
        errors.StorageError,
        errors.ConfigError,
        errors.DatasetError,
    ):
        assert issubclass(error, errors.SavableLoaderError)
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.WorkerError, RuntimeError)
    assert issubclass(errors.StateMismatchError, errors.StateError)
    assert issubclass(errors.UnsavableDatasetError, errors.ConfigError)
    assert issubclass(errors.StateFileNotFoundError, errors.StorageError)
    assert issubclass(errors.StateFileNotFoundError, FileNotFoundError)


def test_datasets_all_is_sorted_and_pinned():
    import savable_loader.datasets as datasets

    assert datasets.__all__ == sorted(datasets.__all__)
    assert datasets.__all__ == [
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
    for name in datasets.__all__:
        assert hasattr(datasets, name)


def test_the_old_module_paths_of_the_stages_still_import():
    """Up to 0.1.0 the docs imported stages from their modules (NOTE [ Old module paths ])."""
    import importlib

    import savable_loader.datasets as datasets

    old = {
        "blend": "Blend",
        "filter": "Filter",
        "indexed": "IndexedDataset",
        "jsonl": "JsonLinesSource",
        "limit": "Limit",
        "map": "Map",
        "repeat": "Repeat",
        "retry": "RetryPolicy",
        "shuffle": "Shuffle",
        "stage": "Stage",
        "stateful": "StatefulDataset",
        "table": "TableSource",
        "tar": "TarSource",
        "tokens": "TokenSource",
        "transform": "Transform",
    }
    for module, name in old.items():
        loaded = importlib.import_module(f"savable_loader.datasets.{module}")
        assert getattr(loaded, name) is getattr(datasets, name)
        assert getattr(datasets, module) is loaded
    assert importlib.import_module("savable_loader.datasets.retry").DEFAULT_POLICY.attempts == 8
    assert not hasattr(datasets, "no_such_module")
