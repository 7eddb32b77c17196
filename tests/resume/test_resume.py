"""The resume-equivalence harness over the loader's configuration space (issue 2)."""

from __future__ import annotations

import multiprocessing
import warnings

import numpy as np
import pytest
from pipelines import RandomCounter, SkippingCounter, Squares, StatefulCounter

from savable_loader import SavableDataLoader, WorkerConfig
from savable_loader.testing import ResumeMismatch, assert_resumes_exactly

slow = pytest.mark.slow


def _build(dataset_factory, **kwargs):
    return lambda: SavableDataLoader(dataset_factory(), **kwargs)


def _chains(num_workers):
    """Chain lengths: with three or more workers one chain of 2 items, whose save holds
    fresh checkpoints of the workers that delivered since the restore and the restored
    checkpoints of the others, does for the harness's chains of 1 and 3 items."""
    return (2,) if num_workers >= 3 else (1, 3)


def _check(build, **options):
    """The harness with its chains saved inline (from the resumed loader, which goes on to
    the end): the same saves and restores with one fresh loader fewer a chain. Chains from
    loaders of their own, the harness's default, are checked where chains are the point:
    test_cheap_items_spaced_checkpoints_chain_before_every_worker_delivered.

    Unless a test says otherwise, three random save points rather than six, and the last
    item of every epoch besides its first: with the boundaries (before and after
    ``iter()``, after StopIteration) every kind of position is saved at in every case."""
    options.setdefault("num_points", 3)
    options.setdefault("last_items", True)
    return assert_resumes_exactly(build, inline_chains=True, **options)


@pytest.mark.parametrize("batch_size", [None, 1, 3])
def test_no_workers(batch_size):
    report = assert_resumes_exactly(
        _build(lambda: RandomCounter(17, uneven=True), batch_size=batch_size, num_workers=0),
        epochs=3,
        num_points=10,
    )
    assert len(report.items_per_epoch) == 3
    assert report.items_per_epoch[0] > 0


@pytest.mark.parametrize(
    ("num_workers", "batch_size"),
    [
        (1, 2),
        (2, None),
        (2, 3),
        # One worker, batch sizes 1 and None, and 4 workers with batches of 3 added
        # nothing the kept cases do not cover, for about a minute of the suite. Four
        # workers: test_three_epochs_with_four_workers_and_many_points; batches of one item
        # from workers: test_cheap_items_spaced_checkpoints_chain_before_every_worker_delivered.
        pytest.param(3, 3, marks=slow),
    ],
)
def test_workers_uneven_shards(num_workers, batch_size):
    """Worker w's shard is longer than worker w-1's: workers end their epochs apart. With
    three workers the batches are pinned (pin_memory: a thread of the main process between
    the workers and the loader, which a restore starts anew)."""
    options = {"pin_memory": True} if num_workers == 3 else {}
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*pin_memory.*no accelerator", category=UserWarning
        )
        _check(
            _build(
                lambda: RandomCounter(11, uneven=True),
                batch_size=batch_size,
                num_workers=num_workers,
                **options,
            ),
            chain_items=_chains(num_workers),
        )


@pytest.mark.parametrize("num_workers", [0, pytest.param(3, marks=slow)])
def test_drop_last(num_workers):
    # With workers, each holds one batch in flight (prefetch_factor=1, the least torch
    # takes; the default is 2, and 4 is test_map_style_dataset's).
    options = {"prefetch_factor": 1} if num_workers else {}
    report = _check(
        _build(
            lambda: RandomCounter(14, uneven=True),
            batch_size=3,
            num_workers=num_workers,
            drop_last=True,
            **options,
        ),
        chain_items=_chains(num_workers),
    )
    assert all(count > 0 for count in report.items_per_epoch)


@slow
def test_three_epochs_with_four_workers_and_many_points():
    """Later epochs after a mid-epoch restore equal an uninterrupted run's."""
    # Shards of 3, 6, 9 and 12 items: batches of 2 end the workers' epochs apart, some on a
    # short batch, and an epoch of 16 batches still holds the 5-item chains. The four
    # workers, not the items, are what costs: longer shards only made each epoch longer.
    # Workers 0 to 3 deliver 2, 3, 5 and 6 batches an epoch, in rounds of 4, 4, 3, 2, 2
    # and 1 batches. Mid-epoch saves in every epoch: in the first round (worker 3 next),
    # right after worker 1's last batch and after worker 2's short last one (workers done
    # at the save), in rounds 2 and 4 of epoch 1 and round 3 of epoch 2. The boundaries
    # (around iter() and StopIteration), and the peek and the break after the last epoch,
    # are checked with three workers (test_workers_uneven_shards, test_drop_last,
    # test_map_style_dataset): 21 restores more here, each starting four workers an epoch.
    report = _check(
        _build(lambda: RandomCounter(3, uneven=True), batch_size=2, num_workers=4),
        epochs=3,
        points=[3, 9, 14, 22, 28, 42],
        chain_items=(1, 5),
        boundaries=False,
        interruptions=False,
    )
    assert report.items_per_epoch == [16, 16, 16]
    # A chain of 5 items needs 5 left in the epoch: none after 14 or 28.
    assert report.chains == 10


def test_dataset_with_skip_fast_path():
    # Cheap items are checkpointed at the start and end of an epoch only (NOTE [ Checkpoint
    # policy ]), so every mid-epoch restore skips, whatever the epoch's length: 8 items a
    # worker do.
    _check(_build(lambda: SkippingCounter(16), batch_size=2, num_workers=2))


@pytest.mark.parametrize(
    ("num_workers", "shuffle"),
    [(0, True), (0, False), (2, True), pytest.param(3, False, marks=slow)],
)
def test_map_style_dataset(num_workers, shuffle):
    # Three workers with four batches each in flight (prefetch_factor=4; 1 is
    # test_drop_last's).
    options = {"prefetch_factor": 4} if num_workers == 3 else {}
    _check(
        _build(
            lambda: Squares(37),
            batch_size=4,
            num_workers=num_workers,
            shuffle=shuffle,
            **options,
        ),
        chain_items=_chains(num_workers),
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_object(num_workers):
    _check(_build(lambda: StatefulCounter(15), batch_size=2, num_workers=num_workers))


@slow
@pytest.mark.parametrize("method", ["forkserver", "spawn"])  # fork: every other test
def test_start_methods(method):
    """Workers that start in a fresh interpreter (nothing inherited from the parent)."""
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        # The server imports torch, savable_loader and the pipeline once and forks every
        # worker from there: nothing of the test's process is inherited, and each worker
        # gets its state by pickling. Workers start anew every epoch, from the end-of-epoch
        # checkpoint. (Importing savable_loader and the pipeline in every worker, as
        # before, cost about a second of CPU a worker, for some 30 workers.)
        context.set_forkserver_preload(["torch", "savable_loader", "pipelines"])
        options, points = {}, [4, 13]
    else:
        # Spawn imports torch in every worker (seconds each), so the workers persist and one
        # mid-epoch save is restored into spawned workers that go on into the next epoch.
        # Workers started anew per epoch in a fresh interpreter: the forkserver case; with
        # spawn, tests/loader/test_conformance.py::test_spawned_workers_resume_exactly.
        options, points = {"persistent_workers": True}, [4]
    # The chain (a state saved by restored workers, restored again) only repeats a restore
    # into spawned workers (four more interpreters); its state is made as with fork.
    chain_items = (1,) if method == "forkserver" else ()
    _check(
        _build(
            lambda: RandomCounter(9, uneven=True),
            batch_size=2,
            num_workers=2,
            multiprocessing_context=context,
            **options,
        ),
        points=points,
        chain_items=chain_items,
        boundaries=False,
        # A peek and a break after the last epoch (two reference epochs and two restores
        # more, in workers that take seconds to start here) are the loader's: every other
        # test of this file checks them with forked workers.
        interruptions=False,
    )


@slow
def test_cheap_items_spaced_checkpoints_chain_before_every_worker_delivered():
    """Cheap items: the ring's checkpoints are spaced, so restores replay; a second save
    after one item (before the other workers delivered anything) must keep the replay
    offsets of the workers that did not deliver."""

    # A tiny checkpoint share spaces checkpoints whatever the machine's timing: only the
    # start-up and end-of-epoch checkpoints are taken, so every restore replays.
    sparse = WorkerConfig(checkpoint_share=1e-9)

    def build():
        return SavableDataLoader(
            RandomCounter(60), batch_size=1, num_workers=3, prefetch_factor=4, worker_config=sparse
        )

    # Early in the first epoch (before every worker delivered, in the chains too), mid-way
    # through each epoch. The last item of an epoch and the first of the next, with spaced
    # checkpoints, are every other test's: cheap items are checkpointed sparsely by default.
    # The peek and the break after the last epoch are every other test's too.
    report = assert_resumes_exactly(
        build,
        epochs=2,
        points=[1, 2, 20, 88],
        chain_items=(1, 2),
        boundaries=False,
        interruptions=False,
    )
    assert report.chains >= 6
    loader = build()
    try:
        iterator = iter(loader)
        for _ in range(20):
            next(iterator)
        state = loader.save_state_rank()
    finally:
        loader.close()
    # At the mid-epoch save point (20), every worker's checkpoint lies behind it: a
    # restore replays in all three, the two a one-item chain saves before included.
    assert all(worker.replay > 0 for worker in state.workers), "checkpoints were not spaced"


class ForgetsItsPosition(RandomCounter):
    """A broken dataset: its state leaves out where it stands in the epoch."""

    def save_state(self):
        return {"pos": 0, "epoch": self.epoch}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_harness_catches_a_dataset_that_forgets_its_position(num_workers):
    # Every event checkpointed, so restores use the dataset's own (broken) state rather
    # than replaying from a start-of-epoch checkpoint, where position 0 happens to be right.
    every_event = WorkerConfig(checkpoint_share=1.0)
    with pytest.raises(ResumeMismatch, match=r"differs at item|items, expected"):
        assert_resumes_exactly(
            _build(
                lambda: ForgetsItsPosition(12, cost=0.002),
                batch_size=2,
                num_workers=num_workers,
                worker_config=every_event,
            ),
            points=[3],
            chain_items=(),
            boundaries=False,
        )


class OwnGeneratorNotSaved(RandomCounter):
    """A broken dataset: it draws from its own generator and leaves it out of its state."""

    def __init__(self, n):
        super().__init__(n)
        self.generator = np.random.default_rng(5)

    def __iter__(self):
        for item in super().__iter__():
            yield {**item, "own": float(self.generator.random())}


def test_harness_catches_a_generator_left_out_of_the_state():
    with pytest.raises(ResumeMismatch):
        assert_resumes_exactly(
            _build(lambda: OwnGeneratorNotSaved(12), batch_size=2, num_workers=0),
            points=[3],
            chain_items=(),
            boundaries=False,
        )


class SavesAheadOnceRestored(RandomCounter):
    """A broken dataset: once restored, the states it saves are one item ahead."""

    restored = False

    def restore_state(self, state):
        super().restore_state(state)
        self.restored = state is not None

    def save_state(self):
        state = super().save_state()
        return {**state, "pos": state["pos"] + 1} if self.restored else state


@pytest.mark.parametrize("inline_chains", [False, True])
def test_harness_chains_catch_a_state_saved_wrongly_after_a_restore(inline_chains):
    """Only a chain saves from a restored dataset: both ways of chaining catch it."""
    build = _build(
        lambda: SavesAheadOnceRestored(12),
        batch_size=2,
        num_workers=0,
        worker_config=WorkerConfig(checkpoint_share=1.0),
    )
    options = {"points": [3], "boundaries": False, "inline_chains": inline_chains}
    assert_resumes_exactly(build, chain_items=(), **options)
    with pytest.raises(ResumeMismatch, match="saved and restored again"):
        assert_resumes_exactly(build, chain_items=(1,), **options)


class NumbersItsNextEpochWrongOnceRestored(RandomCounter):
    """A broken dataset: restored mid-epoch, it numbers the epoch after that one too far."""

    jump = False

    def restore_state(self, state):
        super().restore_state(state)
        self.jump = state is not None and state["pos"] > 0

    def __iter__(self):
        yield from super().__iter__()
        if self.jump:
            self.epoch += 1
            self.jump = False


def test_harness_with_later_epochs_still_compares_the_next_epoch():
    build = _build(
        lambda: NumbersItsNextEpochWrongOnceRestored(12),
        batch_size=2,
        num_workers=0,
        worker_config=WorkerConfig(checkpoint_share=1.0),
    )
    with pytest.raises(ValueError, match="later_epochs must be at least 1"):
        assert_resumes_exactly(build, later_epochs=0)
    options = {"epochs": 3, "points": [3], "chain_items": (), "boundaries": False}
    with pytest.raises(ResumeMismatch, match="resumed epoch 1 differs"):
        assert_resumes_exactly(build, later_epochs=1, **options)
