"""The resume-equivalence check every building block passes (STYLE point 11).

``check_stage(build)`` runs ``assert_resumes_exactly`` on a loader over the stage that
``build()`` returns, over two epochs at many save points, with dense checkpoints (every
item checkpointed, so a stage that forgets part of its position cannot hide behind a
replay from an older checkpoint) and with the default adaptive policy. Besides the
boundaries (before and right after ``iter()``, after StopIteration) and the first and last
item of every epoch, three random save points fall mid-epoch: with every restore starting
fresh workers for each epoch left, these are most of the check's cost.

Every restore is also chained (restored, a few items read, saved, restored again). With
three or more workers one chain of two items does for the harness's two (1 and 3 items):
its save holds fresh checkpoints of the two workers that delivered since the restore and
the restored checkpoint of the one that did not, and it comes after more than one item.
With two workers one chain of one item (a batch, several of the stage's items): its save
holds a fresh checkpoint of the restored stage in the worker that delivered and the
restored checkpoint of the other; a save once every worker delivered again is the
loader's business, which ``tests/resume/test_resume.py`` chains over 1 and 3 items for 1 to 4
workers. Without workers (or with one) the harness's chains of 1 and 3 items stay. The
chains' saves are taken inline, from the resumed loader, which goes on after them
(``inline_chains``): the same saves and restores with one fresh loader fewer a chain.

With workers the harness leaves out the peek and the break after the last epoch
(``interruptions``): what a stage saves there is the start of an epoch, as at every
epoch boundary the harness saves at, and the same check runs for every stage without
workers; the loader's peek and break with workers are ``tests/resume/test_resume.py``'s. They
cost an epoch more in both reference runs and two restores more (about 15% of a check).

The stages' own tests run two workers, not three: a stage's shards differ in length
with two workers as well, and round-robin over three or more workers (placeholders for
two workers before the one next in turn) is the loader's, checked in ``test_resume.py``.

NOTE [ Stages in process ]
A stage that holds nothing but its items and its position (the transforms: Map, Filter,
Shuffle, Limit, Repeat, Blend, and their compositions) shows nothing more in a worker
process than in the main process: the worker only runs its cursor, and what workers add
(starting, restoring and replaying each worker, the ring of checkpoints, the round-robin
of uneven shards, the workers' generators) is the loader's, which
``tests/resume/test_resume.py`` checks over the loader's configurations. What a stage does
with a shard of the data is checked in process too: ``sharded=True`` reads stream 1 of 2
(``WorkerConfig(rank=1, world_size=2)``, no worker process), and
``tests/resume/test_cursor_resume.py`` resumes every stage at every position as worker 1 of
2 of rank 1 of 2. So those stages run their check in process, alone and sharded, at a
seventh of the cost of two workers (whose every restore starts them again, each epoch).
A stage that holds what a fork could break keeps a case with worker processes: the file
sources (open files, memory maps, S3 clients, download threads) and the adapters of
objects that read ``get_worker_info()`` themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from savable_loader import SavableDataLoader, WorkerConfig
from savable_loader.testing import ResumeReport, assert_resumes_exactly

DENSE = WorkerConfig(checkpoint_share=1.0)


def check_stage(
    build: Callable[[], Any],
    *,
    num_workers: int,
    batch_size: int | None = 2,
    dense: bool = True,
    epochs: int = 2,
    num_points: int = 3,
    chain_items: Sequence[int] | None = None,
    interruptions: bool | None = None,
    sharded: bool = False,
    **loader_kwargs: Any,
) -> ResumeReport:
    """Asserts that a loader over ``build()`` resumes exactly; returns the report.

    ``sharded``: the loader reads stream 1 of 2 (rank 1 of 2, simulated in this process;
    NOTE [ Stages in process ]) instead of the whole data."""
    config = DENSE if dense else None
    if sharded:
        config = dataclasses.replace(config or WorkerConfig(), rank=1, world_size=2)

    def loader() -> SavableDataLoader:
        return SavableDataLoader(
            build(),
            batch_size=batch_size,
            num_workers=num_workers,
            worker_config=config,
            **loader_kwargs,
        )

    if chain_items is None:
        chain_items = (2,) if num_workers >= 3 else (1,) if num_workers == 2 else (1, 3)
    report = assert_resumes_exactly(
        loader,
        epochs=epochs,
        num_points=num_points,
        chain_items=chain_items,
        last_items=True,
        inline_chains=True,
        interruptions=num_workers == 0 if interruptions is None else interruptions,
    )
    assert sum(report.items_per_epoch) > 0, "the pipeline produced nothing"
    return report
