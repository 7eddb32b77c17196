"""The loader's arguments checked before anything is built (STYLE point 7)."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

__all__ = ["check_arguments"]


def check_arguments(
    *,
    sampler: Any,
    batch_sampler: Any,
    num_workers: int,
    generator: Any,
    prefetch_factor: int | None,
    persistent_workers: bool | None,
    in_order: bool,
    seed: int,
) -> None:
    """Refuses arguments the loader cannot honour exactly.

    Batching arguments are checked by the batching stage (``datasets/batch.py``).

    Raises:
        ConfigError: An argument is invalid or its position cannot be saved; the
            message says why and what to pass instead.
    """
    if sampler is not None or batch_sampler is not None:
        raise ConfigError(
            "sampler and batch_sampler are not supported: their position cannot be saved "
            "exactly; use shuffle=True (map-style datasets) or a savable pipeline"
        )
    if not in_order:
        raise ConfigError(
            "in_order=False delivers batches in the order workers finish them, which a "
            "restore cannot reproduce; use in_order=True"
        )
    if generator is not None:
        raise ConfigError(
            "generator is not supported: the loader's random choices derive from seed=..., "
            "so that a restored loader reproduces them"
        )
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"num_workers must be a non-negative int, got {num_workers!r}")
    if num_workers == 0 and prefetch_factor is not None:
        raise ConfigError("prefetch_factor applies to worker processes; num_workers is 0")
    if prefetch_factor is not None and (
        not isinstance(prefetch_factor, int) or prefetch_factor < 1
    ):
        raise ConfigError(f"prefetch_factor must be a positive int, got {prefetch_factor!r}")
    if num_workers > 0 and persistent_workers is False:
        raise ConfigError(
            "persistent_workers=False is not supported: worker processes keep the pipeline's "
            "position between epochs; leave it None or True"
        )
    if not isinstance(seed, int):
        raise ConfigError(f"seed must be an int, got {seed!r}")
