"""The loader's arguments checked before anything is built (STYLE point 7).

NOTE [ Arguments the state must carry ]
The loader's ``seed`` and ``num_workers`` are saved in every state, as strict ints in
msgpack (``state/models.py``, ``serialization.py``). An argument the state cannot carry
would let the loader run until its first save and fail there, so it is refused here:
a bool (torch takes ``num_workers=True`` for 1 worker; ``seed=True`` is a slip), more
workers than a state holds (4096), and a seed outside msgpack's integer range, -2**63
to 2**64-1 (the range ``torch.Generator.manual_seed`` takes as well). A bool
``batch_size`` is refused with torch's message (``_main/pipeline.py``), a bool ``rank`` or
``world_size`` by ``WorkerConfig``.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..state.models import _MAX_WORKERS as MAX_WORKERS

__all__ = ["SEED_RANGE", "check_arguments"]

#: The seeds a state can carry: msgpack's integers (NOTE [ Arguments the state must carry ]).
SEED_RANGE = range(-(2**63), 2**64)


def check_arguments(
    num_workers: int,
    timeout: float,
    prefetch_factor: int | None,
    persistent_workers: bool | None,
    in_order: bool,
    seed: int,
) -> None:
    """Refuses arguments the loader cannot honour exactly.

    Batching arguments are checked by the batching stage (``datasets/transforms/batch.py``); the
    sampling arguments by torch itself (``_main/pipeline.py``). What the saved state must carry
    is refused here rather than at the first save (NOTE [ Arguments the state must
    carry ]). What torch's ``DataLoader`` refuses is refused with torch's message, in
    torch's order, before the pipeline is built.

    Raises:
        ConfigError: An argument is invalid or its position cannot be saved; the
            message says why and what to pass instead.
    """
    if isinstance(num_workers, bool):
        raise ConfigError(
            f"num_workers must be a non-negative int, not a bool ({num_workers}): the saved "
            f"state records the number of workers; pass num_workers={int(num_workers)}"
        )
    if not isinstance(num_workers, int):
        raise ConfigError(f"num_workers must be a non-negative int, got {num_workers!r}")
    if num_workers < 0:
        raise ConfigError(
            "num_workers option should be non-negative; use num_workers=0 to disable "
            "multiprocessing."
        )
    if num_workers > MAX_WORKERS:
        raise ConfigError(
            f"num_workers={num_workers} is more than the {MAX_WORKERS} workers a saved state "
            "holds; use fewer workers per rank"
        )
    if not in_order and num_workers > 0:
        # Without workers torch delivers in order whatever in_order says; so does this loader.
        raise ConfigError(
            "in_order=False delivers batches in the order workers finish them, which a "
            "restore cannot reproduce; use in_order=True"
        )
    if timeout < 0:
        raise ConfigError("timeout option should be non-negative")
    if num_workers == 0 and prefetch_factor is not None:
        raise ConfigError(
            "prefetch_factor option could only be specified in multiprocessing."
            "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
        )
    if isinstance(prefetch_factor, int) and prefetch_factor < 0:
        raise ConfigError("prefetch_factor option should be non-negative")
    if prefetch_factor is not None and (
        not isinstance(prefetch_factor, int) or prefetch_factor < 1
    ):
        # Torch takes 0 here and raises an AssertionError when it starts the workers.
        raise ConfigError(f"prefetch_factor must be a positive int, got {prefetch_factor!r}")
    if persistent_workers and num_workers == 0:
        raise ConfigError("persistent_workers option needs num_workers > 0")
    if isinstance(seed, bool):
        raise ConfigError(
            f"seed must be an int, not a bool ({seed}): the saved state records the seed; "
            f"pass seed={int(seed)}"
        )
    if not isinstance(seed, int):
        raise ConfigError(f"seed must be an int, got {seed!r}")
    if seed not in SEED_RANGE:
        raise ConfigError(
            f"seed={seed} is outside -2**63..2**64-1, the integers a saved state (msgpack) "
            "can hold and torch.Generator.manual_seed takes; pass a seed in that range "
            "(for example seed % 2**64)"
        )
