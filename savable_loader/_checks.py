"""The loader's arguments checked before anything is built (STYLE point 7)."""

from __future__ import annotations

from .errors import ConfigError

__all__ = ["check_arguments"]


def check_arguments(
    num_workers: int, prefetch_factor: int | None, in_order: bool, seed: int
) -> None:
    """Refuses arguments the loader cannot honour exactly.

    Batching arguments are checked by the batching stage (``datasets/batch.py``); the
    sampling arguments by torch itself (``_pipeline.py``).

    Raises:
        ConfigError: An argument is invalid or its position cannot be saved; the
            message says why and what to pass instead.
    """
    if not in_order:
        raise ConfigError(
            "in_order=False delivers batches in the order workers finish them, which a "
            "restore cannot reproduce; use in_order=True"
        )
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"num_workers must be a non-negative int, got {num_workers!r}")
    if num_workers == 0 and prefetch_factor is not None:
        raise ConfigError("prefetch_factor applies to worker processes; num_workers is 0")
    if prefetch_factor is not None and (
        not isinstance(prefetch_factor, int) or prefetch_factor < 1
    ):
        raise ConfigError(f"prefetch_factor must be a positive int, got {prefetch_factor!r}")
    if not isinstance(seed, int):
        raise ConfigError(f"seed must be an int, got {seed!r}")
