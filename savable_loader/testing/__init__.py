"""Check that a pipeline resumes exactly: the resume-equivalence harness and ``verify``.

:func:`assert_resumes_exactly` runs a loader uninterrupted over several epochs and saves
its state at many points on the way: before ``iter()``, right after ``iter()`` before any
item, after chosen items (optionally after the last item of every epoch) and after each
StopIteration. Each state goes through the state file encoding (msgpack with header and
checksum) and into a fresh loader, which must then yield exactly what the uninterrupted
run yielded from that point on, later epochs included. Optionally each resumed run
consumes a few items, saves again and is restored into yet another loader (a chain), and
the first state is restored twice to check that restoring neither changes the state nor
depends on the loader it goes into. After its epochs it also checks one more as a
training loop may leave it: states saved right after a peek (``next(iter(loader))``) and
after a ``break`` restore to that mid-epoch position.

:func:`verify` is the same check for a user's factory (of a dataset or of a loader) with
dense checkpoints, behind ``savable-loader verify MODULE:FACTORY``.

:func:`assert_elastic` checks elastic determinism: the same global batches on every
layout (ranks x workers x per-rank batch size) of one global batch size, and a state
saved on one layout continuing that stream on the others.

:func:`assert_cursor_resumes_exactly` is the same check one level down, for a stage and
its cursors in one process, at every position of a few epochs: what a stage's author
runs while writing it.

Use it on your own pipeline::

    from savable_loader.testing import assert_resumes_exactly, verify
    assert_resumes_exactly(lambda: SavableDataLoader(MyDataset(), batch_size=8, num_workers=2))
    verify(MyDataset, num_workers=2)

:class:`FaultProxy` stands between a pipeline and an S3 endpoint on loopback and makes
the store look distant or flaky (first-byte latency, ``503 SlowDown``, answers cut
mid-body, denied keys), counting what it did in :class:`ProxyStats`.
"""

from __future__ import annotations

from .cursors import CursorReport, assert_cursor_resumes_exactly
from .digests import digest
from .divergence import ResumeMismatch
from .elastic import (
    ElasticMismatch,
    ElasticReport,
    Shape,
    assert_elastic,
    elastic_builder,
    split_batch,
)
from .files import roundtrip
from .harness import Progress, ResumeReport, assert_resumes_exactly
from .proxy import FaultProxy, ProxyStats
from .verification import VerifyReport, verify

__all__ = [
    "CursorReport",
    "ElasticMismatch",
    "ElasticReport",
    "FaultProxy",
    "Progress",
    "ProxyStats",
    "ResumeMismatch",
    "ResumeReport",
    "Shape",
    "VerifyReport",
    "assert_cursor_resumes_exactly",
    "assert_elastic",
    "assert_resumes_exactly",
    "digest",
    "elastic_builder",
    "roundtrip",
    "split_batch",
    "verify",
]
