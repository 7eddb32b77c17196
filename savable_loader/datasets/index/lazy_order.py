"""An epoch's order read lazily from the sampler, from the generators at the epoch's start
(NOTE [ Endless samplers ] in ``_main/sampling.py``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch

from ... import rng
from ...errors import ConfigError, StateError
from ...state.models import OrderSnapshot

__all__ = ["LazyOrder", "apply_snapshot", "find_generators", "stateful_inner"]

#: How deep samplers are searched for generators: torch nests two (a batch sampler's
#: sampler's generator); wrappers of those add a few.
_MAX_NESTING = 8

#: Groups read from a sampler at a time, under one swap of the global generators.
_AHEAD = 256

#: Groups a lazily read sampler must give again, read anew from the epoch's start, before
#: its copies are trusted to be the stream the main process read.
_CHECKED = 64


def find_generators(*objects: Any) -> list[torch.Generator]:
    """The distinct torch generators of the loader and its sampler (and the sampler a
    batch sampler wraps), in a fixed order."""
    found: list[torch.Generator] = []
    seen: dict[int, Any] = {}  # by id, holding each object so that no id is reused
    # Breadth first, a few levels down: a sampler that holds itself (a cycle) or makes a
    # new object on every read (a Mock) must not keep this walking.
    pending = [(obj, 0) for obj in objects]
    while pending:
        obj, depth = pending.pop(0)
        if obj is None or id(obj) in seen or depth > _MAX_NESTING:
            continue
        seen[id(obj)] = obj
        if isinstance(obj, torch.Generator):
            found.append(obj)
            continue
        pending.append((getattr(obj, "generator", None), depth + 1))
        pending.append((getattr(obj, "sampler", None), depth + 1))
    return found


def apply_snapshot(
    generators: list[torch.Generator], sampler: Any, snapshot: OrderSnapshot
) -> None:
    """Puts ``generators`` and ``sampler``'s own state as ``snapshot`` holds them (the
    global generators' part is swapped in apart).

    Raises:
        StateError: A saved generator state does not fit its generator.
    """
    for generator, data in zip(generators, snapshot.generators, strict=True):
        try:
            generator.set_state(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        except RuntimeError as error:
            raise StateError(f"a saved generator state does not fit: {error}") from None
    load = getattr(sampler, "load_state_dict", None)
    if snapshot.sampler is not None and callable(load):
        load(snapshot.sampler)


def stateful_inner(index_sampler: Any) -> Any:
    """The sampler the loader saves ``state_dict``/``epoch`` of (the one a batch sampler
    wraps, else ``index_sampler``)."""
    inner = getattr(index_sampler, "sampler", None)
    return inner if inner is not None else index_sampler


class LazyOrder:
    """An epoch's order as the groups the sampler gives from ``start`` on, read as they
    are needed (NOTE [ Endless samplers ] in ``_main/sampling.py``).

    Args:
        generator: The loader's ``generator`` argument (None: none).
        sampler: What the loader reads indices from (the batch sampler with automatic
            batching, else the sampler).
        start: The generators just before the epoch's first read of the sampler.
        name: What names the sampler in errors.
    """

    def __init__(
        self, generator: torch.Generator | None, sampler: Any, start: OrderSnapshot, name: str
    ) -> None:
        self.generator = generator
        self.sampler = sampler
        self.start = start
        self.name = name

    def groups(self) -> Iterator[Any]:
        """Every group of the epoch from its start, as the sampler gives it; the sampler
        draws from ``start``'s global generators, swapped in around each read."""
        own = rng.OwnGenerators.of(self.start.rng)
        with own:
            apply_snapshot(
                find_generators(self.generator, self.sampler),
                stateful_inner(self.sampler),
                self.start,
            )
            reading = iter(self.sampler)
        while True:
            with own:
                chunk = list(itertools.islice(reading, _AHEAD))
            yield from chunk
            if len(chunk) < _AHEAD:
                return

    def share(self, worker_id: int, workers: int, skip: int) -> Iterator[Any]:
        """The groups of worker ``worker_id`` of ``workers`` (group ``g`` goes to worker
        ``g % workers``) after its first ``skip`` ones."""
        start = worker_id + skip * workers
        return itertools.islice(self.groups(), start, None, workers)

    def check_restarts(self, first: list[Any]) -> None:
        """Checks that the sampler, read anew from ``start``, gives ``first`` again.

        Raises:
            ConfigError: It gives other groups: its ``__iter__`` goes on with a stream
                that an earlier read moved on (mmengine's ``InfiniteSampler`` keeps one
                generator made in ``__init__``), so no copy of it restarts the epoch.
        """
        expected = first[:_CHECKED]
        again = list(itertools.islice(self.groups(), len(expected)))
        if not _same(again, expected):
            raise ConfigError(
                f"the sampler {self.name} gives more indices than are read at an epoch's "
                "start (NOTE [ Endless samplers ]), so each worker reads its own copy of it "
                "from the epoch's start; but iter() on it again gives other indices than the "
                "first iter() gave: it goes on with one stream kept across calls (a "
                "generator object passed as the sampler, or one made in __init__ as "
                "mmengine's InfiniteSampler makes it). Make __iter__ start the stream anew "
                "from the sampler's seed and generators on every call, as detectron2's "
                "TrainingSampler does, or give the sampler an end"
            )


def _same(a: list[Any], b: list[Any]) -> bool:
    """Whether two lists of groups are equal (groups of tensors compared by value)."""
    try:
        return bool(a == b)
    except (RuntimeError, ValueError):  # tensors or arrays of several values
        return len(a) == len(b) and all(
            torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(a, b, strict=True)
        )
