"""Which source serves each position of a ``Blend`` epoch read by position.

NOTE [ Blend by position ]
Read by position (NOTE [ Pipelines read by position ] in ``datasets/global_view.py``), a Blend's
epoch is laid out before it is read, as a function of the seed, the epoch, the sources'
lengths and the weights alone; no rank or worker enters it.

*How many items of each source.* The epoch is a few *segments*. In a segment the
sources still in play (a positive weight, items left) are mixed in proportion to their
weights until the first of them runs out: that source ``j`` is the one with the fewest
items left per unit of weight, all its ``r_j`` items go into the segment, and every other
source ``i`` gives ``round(w_i r_j / w_j)`` items (never more than it has left). With
``stop="first_exhausted"`` the epoch is that one segment; with ``"all_exhausted"``
segments follow one another, without the sources that ran out, until none is left, so
every item of every source of positive weight comes once per epoch. A segment holds the
sources' items in the proportion of the weights exactly (to one item), where draws made
one by one would hold it on average.

*Where they go.* Within a segment the sources are in a uniformly random order, drawn
without walking the positions: a run of positions with counts ``c`` (one per source) is
cut in two, the left part's counts drawn from the multivariate hypergeometric law of
``c`` (what a uniform order would put there), keyed by (seed, epoch, segment, run); each
part is cut again, down to leaves of :data:`LEAF` positions, whose order is a keyed
shuffle of their counts. The source of any position, and how many items of that source
come before it, take one walk down: ``O(log n)`` draws, independent of where other
positions were read. The ``k``-th item of source ``i`` in the epoch is position ``k`` of
that source's same epoch, read through its own access; the key of a position's item is
``(i, *that item's key)``, as in a Blend read stream by stream.

NOTE [ Endless blends by position ]
A blend with ``stop="never"`` has one endless epoch (under a ``Limit``, which cuts it
into epochs of ``n`` positions, NOTE [ Limit by position ] in ``datasets/transforms/limit.py``). It
is laid out in blocks of :data:`BLOCK` positions, each holding the same number of items of every
source, the weights' shares of the block to one item (largest remainders, ties to the
lower index), in the order of a split tree keyed by the block's index. The ``k``-th item
drawn from a source of ``L`` items per epoch is its position ``k mod L`` of its epoch
``k // L``: a source restarts as it ends, as a Blend read stream by stream restarts it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...rng import Purpose, generator_for

__all__ = ["BLOCK", "LEAF", "BlendOrder", "Segment", "block_counts", "segments"]

#: Positions of a leaf of the split tree: the unit read and cached at once.
LEAF = 1024
#: Positions of a block of an endless blend (NOTE [ Endless blends by position ]).
BLOCK = 4 * LEAF
_KEPT_LEAVES = 8
_EXACT = 10**9


@dataclass(frozen=True)
class Segment:
    """A run of an epoch's positions over which the sources' counts are fixed."""

    start: int
    counts: tuple[int, ...]
    before: tuple[int, ...]

    @property
    def size(self) -> int:
        return sum(self.counts)


def segments(lengths: Sequence[int], weights: Sequence[float], stop: str) -> list[Segment]:
    """An epoch's segments (NOTE [ Blend by position ]) for sources of ``lengths``."""
    left = list(lengths)
    before = [0] * len(left)
    found: list[Segment] = []
    start = 0
    playing = [i for i, weight in enumerate(weights) if weight > 0]
    while playing:
        # The source with the fewest items left per unit of weight runs out first.
        first = min(playing, key=lambda i: (left[i] / weights[i], i))
        counts = [0] * len(left)
        for i in playing:
            share = int(weights[i] * left[first] / weights[first] + 0.5)
            counts[i] = left[i] if i == first else min(left[i], share)
        if any(counts):
            found.append(Segment(start, tuple(counts), tuple(before)))
        start += sum(counts)
        for i, count in enumerate(counts):
            left[i] -= count
            before[i] += count
        if stop == "first_exhausted":
            break
        playing = [i for i in playing if left[i] > 0]
    return found


def block_counts(weights: Sequence[float]) -> tuple[int, ...]:
    """Each source's items in a block of an endless blend: the weights' shares of
    :data:`BLOCK`, to one item (NOTE [ Endless blends by position ])."""
    total = sum(weights)
    shares = [BLOCK * weight / total for weight in weights]
    counts = [int(share) for share in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: (counts[i] - shares[i], i))
    for i in by_remainder[: BLOCK - sum(counts)]:
        counts[i] += 1
    return tuple(counts)


class BlendOrder:
    """The source and the source position of each position of a blend's epochs."""

    def __init__(self, seed: int, layout: list[Segment]) -> None:
        self.seed = seed
        self.layout = layout
        self.starts = [segment.start for segment in layout]
        self.length = sum(segment.size for segment in layout)
        self._leaves: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}

    def locate(self, epoch: int, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Each position's source and its place in that source's epoch."""
        sources = np.empty(len(positions), dtype=np.int64)
        places = np.empty(len(positions), dtype=np.int64)
        for n, position in enumerate(positions):
            index = bisect.bisect_right(self.starts, position) - 1
            offset = position - self.starts[index]
            leaf_start = offset - offset % LEAF
            leaf_sources, leaf_places = self._leaf(epoch, index, leaf_start)
            sources[n] = leaf_sources[offset - leaf_start]
            places[n] = leaf_places[offset - leaf_start]
        return sources, places

    def _leaf(self, epoch: int, index: int, leaf_start: int) -> tuple[np.ndarray, np.ndarray]:
        key = (epoch, index, leaf_start)
        leaf = self._leaves.get(key)
        if leaf is None:
            if len(self._leaves) >= _KEPT_LEAVES:
                del self._leaves[next(iter(self._leaves))]
            leaf = self._leaves[key] = self._compute_leaf(epoch, index, leaf_start)
        return leaf

    def _compute_leaf(
        self, epoch: int, index: int, leaf_start: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Walks the split tree of segment ``index`` down to the leaf at ``leaf_start``."""
        segment = self.layout[index]
        counts = np.asarray(segment.counts, dtype=np.int64)
        earlier = np.asarray(segment.before, dtype=np.int64)  # each source's items before
        low, size = 0, segment.size
        while size > LEAF:
            leaves = -(-size // LEAF)
            left_size = (leaves // 2) * LEAF
            generator = generator_for(Purpose.BLEND_SPLIT, self.seed, epoch, index, low, size)
            left = _split(generator, counts, left_size)
            if leaf_start < low + left_size:
                counts, size = left, left_size
            else:
                earlier = earlier + left
                counts, low, size = counts - left, low + left_size, size - left_size
        generator = generator_for(Purpose.BLEND_LEAF, self.seed, epoch, index, low)
        order = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        generator.shuffle(order)
        places = np.empty(len(order), dtype=np.int64)
        for source in np.flatnonzero(counts):
            where = order == source
            places[where] = earlier[source] + np.arange(int(counts[source]), dtype=np.int64)
        return order, places


def _split(generator: np.random.Generator, counts: np.ndarray, size: int) -> np.ndarray:
    """How many of each source's ``counts`` fall in the first ``size`` positions of a
    uniformly random order of them: one hypergeometric draw per source against the
    sources after it (NumPy's law takes fewer than 10^9 of each kind; past that a
    binomial draw of the same mean, kept in the possible range, stands in)."""
    left = np.zeros_like(counts)
    rest, wanted = int(counts.sum()), size
    for source in np.flatnonzero(counts):
        count = int(counts[source])
        rest -= count
        if wanted == 0:
            break
        if rest == 0:
            drawn = wanted
        elif count < _EXACT and rest < _EXACT:
            drawn = int(generator.hypergeometric(count, rest, wanted))
        else:
            drawn = int(generator.binomial(wanted, count / (count + rest)))
            drawn = min(max(drawn, wanted - rest), count, wanted)
        left[source] = drawn
        wanted -= drawn
    return left
