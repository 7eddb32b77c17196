"""The random streams a pipeline draws from: captured, restored and derived.

Runs in every process that runs a pipeline (a worker, or the main process without
workers or in an elastic restore). ``generators`` captures and restores the global
generators (``random``, ``numpy.random``, torch); ``keys`` derives every keyed seed and
generator from one registry of purposes (NOTE [ Seeds ] in ``keys.py``).
"""

from .generators import (
    OwnGenerators,
    RngSnapshot,
    Scope,
    Seeded,
    Seedings,
    apply,
    capture,
    seed_globals,
    seeded_epoch_of,
    seeded_for,
)
from .keys import Purpose, derive_seed, generator_for, seed_for, seed_item

__all__ = [
    "OwnGenerators",
    "Purpose",
    "RngSnapshot",
    "Scope",
    "Seeded",
    "Seedings",
    "apply",
    "capture",
    "derive_seed",
    "generator_for",
    "seed_for",
    "seed_globals",
    "seed_item",
    "seeded_epoch_of",
    "seeded_for",
]
