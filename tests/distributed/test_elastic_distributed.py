"""Elastic resume over real process groups (gloo): a save made on R ranks x W workers is
restored onto R' ranks x W' workers (NOTE [ Elastic resume ] in
``savable_loader/datasets/protocol/elastic.py``).

Four gloo jobs serve every test: a save on 2 ranks, a save on 3 ranks, a restore on 2
ranks and a restore on 3 ranks, each covering several scenarios; the one-rank side of a
layout change runs in the test process without ``torch.distributed``. States travel
between the jobs as files (``save_state`` / ``load_state``), so each layout is its own
process group. Items are ids (a dataset index + 1000, after a filter), which lets the
tests account for every item: what the old ranks consumed of the interrupted epoch plus
what the new ranks deliver for its rest is the epoch, each item exactly once; the next
epoch on each new rank is what a fresh run on the new layout delivers there.

The helpers live at module level so that the ranks can import them (pytest puts ``tests/``
on ``sys.path`` and multiprocessing hands ``sys.path`` to the children).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gloo import COMMAND_TIMEOUT, in_rank_order, outcome, run_ranks

pytestmark = pytest.mark.slow

N = 101
BATCH = 4
SEED = 0
JOB_TIMEOUT = 150.0  # a hang is still caught; a loaded 2-core CI machine is slow
#: Epochs of a fresh run: the latest epoch a test compares with is 2.
FRESH_EPOCHS = 3
#: Items per stream and epoch of the "limit" pipeline.
LIMIT = 9


def _keep(index: int) -> bool:
    return index % 5 != 2


def _tag(index: int) -> int:
    return 1000 + index


#: Every epoch of the elastic pipeline on one rank, as ids.
EPOCH = Counter(_tag(index) for index in range(N) if _keep(index))


def _order(epoch: int) -> list[int]:
    """Epoch ``epoch``'s order of the indexed source (what one rank reads)."""
    from savable_loader import WorkerContext
    from savable_loader.datasets import IndexedDataset

    cursor = IndexedDataset(range(N), shuffle=True).cursor(WorkerContext(0, 1, 0, 0, 0, None))
    cursor.restore({"epoch": epoch, "pos": 0, "order": 2})
    return list(cursor)


def _unaccounted(delivered: Counter[int], epoch: int, old_ranks: int, hops: list[int]) -> str:
    """What is wrong with ``delivered``, or "" (NOTE [ Elastic indexed order ]): every
    position of the old layout's epoch (N padded to a multiple of its ranks, the order's
    first items again) once, and beyond it only the next positions of the cyclic order,
    fewer than the new ranks of each hop."""
    order, length = _order(epoch), -(-N // old_ranks) * old_ranks
    base = Counter(_tag(x) for p in range(length) if _keep(x := order[p % N]))
    allowed = Counter(
        _tag(x) for i in range(sum(r - 1 for r in hops)) if _keep(x := order[(length + i) % N])
    )
    missing, extra = base - delivered, (delivered - base) - allowed
    if not missing and not extra:
        return ""
    return f"missing {sorted(missing.elements())}, extra {sorted(extra.elements())}"


def _pipeline(kind: str) -> Any:
    from savable_loader.datasets import IndexedDataset

    source = IndexedDataset(range(N), shuffle=True)
    if kind == "elastic":
        return source.filter(_keep).map(_tag)
    if kind == "limit":
        return source.filter(_keep).map(_tag).limit(LIMIT)
    if kind == "shuffle":  # not elastic, and not the outermost stage
        return source.filter(_keep).shuffle(buffer_size=8, seed=0).map(_tag)
    raise AssertionError(kind)


def _loader(kind: str, workers: int) -> Any:
    """This rank's loader: the rank and world size come from torch.distributed, or are
    0 of 1 without it."""
    from savable_loader import SavableDataLoader, WorkerConfig

    config = WorkerConfig(command_timeout=COMMAND_TIMEOUT)
    return SavableDataLoader(
        _pipeline(kind), batch_size=BATCH, num_workers=workers, seed=SEED, worker_config=config
    )


def _epoch(loader: Any) -> list[list[int]]:
    """The rest of the loader's current epoch (a whole one when it stands between epochs)."""
    return [batch.tolist() for batch in loader]


def _items(batches: Iterable[list[int]]) -> list[int]:
    return [item for batch in batches for item in batch]


def _fresh(kind: str, workers: int, epochs: int) -> list[list[list[int]]]:
    """A fresh run's first ``epochs`` epochs on this rank."""
    loader = _loader(kind, workers)
    try:
        return [_epoch(loader) for _ in range(epochs)]
    finally:
        loader.close()


# -- the scenarios -------------------------------------------------------------------------


@dataclass(frozen=True)
class Save:
    """A save on ``ranks`` x ``workers`` after ``epoch`` whole epochs, with rank r then
    ``batches[r]`` batches into epoch ``epoch`` (None: all of it, so that rank stands
    between epochs; -1: all of it but one batch)."""

    ranks: int
    workers: int
    kind: str
    epoch: int
    batches: tuple[int | None, ...]

    @property
    def resumed(self) -> int:
        """The epoch a restore continues: the next one when every rank finished this one."""
        return self.epoch + 1 if all(b is None for b in self.batches) else self.epoch


SAVES = {
    "1x2-mid": Save(1, 2, "elastic", 0, (5,)),
    "1x3-end": Save(1, 3, "elastic", 0, (None,)),
    "2x2-mid": Save(2, 2, "elastic", 0, (4, 3)),  # rank 0 one batch ahead
    "2x3-end": Save(2, 3, "elastic", 0, (None, None)),
    # Epoch 1: rank 0 finished it, rank 1 has one batch left.
    "2x2-edge": Save(2, 2, "elastic", 1, (None, -1)),
    "2x2-e1": Save(2, 2, "elastic", 1, (2, 3)),  # rank 1 one batch ahead
    "2x2-shuffle": Save(2, 2, "shuffle", 0, (3, 3)),
    "3x3-mid": Save(3, 3, "elastic", 0, (3, 2, 3)),  # rank 1 one batch behind
    "3x2-end": Save(3, 2, "elastic", 0, (None, None, None)),
    "3x2-limit": Save(3, 2, "limit", 0, (2, 1, 1)),
}


@dataclass(frozen=True)
class Restore:
    """``save`` restored on ``ranks`` x ``workers``. ``src`` None: every rank passes the
    full list (on one rank: ``restore_state_rank(list)``); otherwise rank ``src`` alone
    holds it and scatters (on one rank: ``restore_state_global(list, src_rank=0)``)."""

    save: str
    ranks: int
    workers: int
    src: int | None


RESTORES = {
    # Grow.
    "1x2-mid -> 2x3": Restore("1x2-mid", 2, 3, None),
    "1x3-end -> 2x2": Restore("1x3-end", 2, 2, 1),
    "2x2-mid -> 3x3": Restore("2x2-mid", 3, 3, None),
    "2x3-end -> 3x2": Restore("2x3-end", 3, 2, 2),
    "2x2-edge -> 3x3": Restore("2x2-edge", 3, 3, 0),
    # Shrink.
    "3x3-mid -> 2x2": Restore("3x3-mid", 2, 2, 1),
    "3x2-end -> 2x3": Restore("3x2-end", 2, 3, None),
    "3x2-limit -> 2x2": Restore("3x2-limit", 2, 2, 0),
    "2x2-mid -> 1x2": Restore("2x2-mid", 1, 2, None),
    "3x3-mid -> 1x2": Restore("3x3-mid", 1, 2, 0),
    "3x2-end -> 1x3": Restore("3x2-end", 1, 3, None),
    # The second hop of 2x2 -> 3x2 -> 1x3 (the first is _hop, on 3 ranks).
    "hop -> 1x3": Restore("hop", 1, 3, None),
}

#: 2x2 -> 3x2 -> 1x3 within epoch 1: the 3x2 ranks read these batches, then save again.
HOP_FROM = "2x2-e1"
HOP_WORKERS = 2
HOP_BATCHES = (2, 1, 1)


def _kind(save: str) -> str:
    return "elastic" if save == "hop" else SAVES[save].kind


# -- what runs in each rank ----------------------------------------------------------------


def _job_save(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    """Every save on ``world_size`` ranks; reports the items each epoch gave this rank."""
    from savable_loader import save_state

    reports: dict[str, Any] = {}
    for name, save in SAVES.items():
        if save.ranks != world_size:
            continue
        report: dict[str, Any] = {}
        want = save.batches[rank]
        if save.kind == "limit" or (want is not None and want < 0):
            reference = _fresh(save.kind, save.workers, save.resumed + 1)
            report["ref_items"] = len(_items(reference[save.resumed]))
            if want is not None and want < 0:
                want += len(reference[save.epoch])
        loader = _loader(save.kind, save.workers)
        try:
            epochs = {epoch: _items(_epoch(loader)) for epoch in range(save.epoch)}
            if want is None:
                epochs[save.epoch] = _items(_epoch(loader))
            else:
                stream = iter(loader)
                epochs[save.epoch] = _items(next(stream).tolist() for _ in range(want))
            states = loader.save_state_global(global_dst_rank=0)
        finally:
            loader.close()
        if states is not None:
            save_state(states, tmp / f"{name}.msgpack")
        report["epochs"] = epochs
        reports[name] = report
    return reports


def _restore(
    loader: Any, path: Path, src: int | None, rank: int, world_size: int, **kwargs: Any
) -> None:
    from savable_loader import load_state

    if world_size == 1 and src is None:
        loader.restore_state_rank(load_state(path), **kwargs)
        return
    states = load_state(path) if src is None or rank == src else None
    loader.restore_state_global(states, src_rank=src, **kwargs)


def _hop(rank: int, tmp: Path) -> list[int]:
    """2x2 -> 3x2: restores, reads a few batches, saves again; returns what it read."""
    from savable_loader import save_state

    loader = _loader("elastic", HOP_WORKERS)
    try:
        _restore(loader, tmp / f"{HOP_FROM}.msgpack", 0, rank, 3)
        stream = iter(loader)
        consumed = _items(next(stream).tolist() for _ in range(HOP_BATCHES[rank]))
        states = loader.save_state_global(global_dst_rank=0)
    finally:
        loader.close()
    if states is not None:
        save_state(states, tmp / "hop.msgpack")
    return consumed


def _not_elastic(rank: int, tmp: Path) -> dict[str, Any]:
    """The 2x2 shuffle save into 3x2: refused both ways, then restored approximately."""
    from savable_loader import ApproximateResumeWarning

    path = tmp / "2x2-shuffle.msgpack"
    report: dict[str, Any] = {}
    for mode, src in (("full", None), ("src", 0)):
        loader = _loader("shuffle", 2)
        try:
            report[mode] = outcome(lambda: _restore(loader, path, src, rank, 3))  # noqa: B023
        finally:
            loader.close()
    for suffix, src in (("", None), ("_src", 0)):
        loader = _loader("shuffle", 2)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _restore(loader, path, src, rank, 3, approximate=True)
            report[f"warnings{suffix}"] = [
                str(warning.message)
                for warning in caught
                if issubclass(warning.category, ApproximateResumeWarning)
            ]
            report[f"rest{suffix}"] = _epoch(loader)
            report[f"next{suffix}"] = _epoch(loader)
        finally:
            loader.close()
    return report


def _job_restore(rank: int, world_size: int, tmp: Path) -> dict[Any, Any]:
    """Every restore onto ``world_size`` ranks, and the fresh runs they compare with."""
    report: dict[Any, Any] = {}
    fresh: set[tuple[str, int]] = set()
    for name, restore in RESTORES.items():
        if restore.ranks != world_size:
            continue
        kind = _kind(restore.save)
        fresh.add((kind, restore.workers))
        loader = _loader(kind, restore.workers)
        try:
            path = tmp / f"{restore.save}.msgpack"
            _restore(loader, path, restore.src, rank, world_size)
            report[name] = {"rest": _epoch(loader), "next": _epoch(loader)}
        finally:
            loader.close()
    if world_size == 3:
        report["hop"] = _hop(rank, tmp)
        report["not_elastic"] = _not_elastic(rank, tmp)
        fresh.add(("shuffle", 2))
    for kind, workers in sorted(fresh):
        report["fresh", kind, workers] = _fresh(kind, workers, FRESH_EPOCHS)
    return report


# -- running the jobs once per module ------------------------------------------------------


def _in_process(job: Callable[[int, int, Path], Any]) -> Callable[[Path], list[Any]]:
    """The one-rank side: runs ``job`` in the test process, without torch.distributed."""
    return lambda tmp: [job(0, 1, tmp)]


def _gloo(job: Callable[[int, int, Path], Any], world_size: int) -> Callable[[Path], list[Any]]:
    def run(tmp: Path) -> list[Any]:
        reports = run_ranks(job, world_size, tmp, timeout=JOB_TIMEOUT)
        return in_rank_order(reports, world_size, job.__name__)

    return run


_RUNNERS = {
    "save1": _in_process(_job_save),
    "save2": _gloo(_job_save, 2),
    "save3": _gloo(_job_save, 3),
    "restore2": _gloo(_job_restore, 2),
    "restore3": _gloo(_job_restore, 3),
    "restore1": _in_process(_job_restore),
}
_DEPENDS = {
    "save1": (),
    "save2": (),
    "save3": (),
    "restore2": ("save1", "save3"),
    "restore3": ("save2",),
    "restore1": ("save2", "save3", "restore3"),
}
_RESULTS: dict[str, Any] = {}


def _result(job: str, tmp: Path) -> list[Any]:
    """The job's per-rank reports; each job runs once per module (a failure is kept)."""
    if job not in _RESULTS:
        for dependency in _DEPENDS[job]:
            _result(dependency, tmp)
        try:
            _RESULTS[job] = _RUNNERS[job](tmp)
        except Exception as error:
            _RESULTS[job] = error
            raise
    result = _RESULTS[job]
    if isinstance(result, Exception):
        pytest.fail(f"job {job} failed earlier: {result}")
    return result  # type: ignore[no-any-return]


def _saved(save: str, tmp: Path) -> list[dict[str, Any]]:
    """The save's per-rank reports (old ranks)."""
    return [report[save] for report in _result(f"save{SAVES[save].ranks}", tmp)]


def _fresh_epochs(ranks: int, kind: str, workers: int, tmp: Path) -> list[Any]:
    """Per new rank: a fresh run's epochs on that layout."""
    return [report["fresh", kind, workers] for report in _result(f"restore{ranks}", tmp)]


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("elastic")


# -- the tests -----------------------------------------------------------------------------


def test_the_saves_stand_where_the_scenarios_say(state_dir: Path) -> None:
    from savable_loader import load_state

    for name, save in SAVES.items():
        _saved(name, state_dir)
        states = load_state(state_dir / f"{name}.msgpack")
        assert isinstance(states, list)
        assert [(s.rank, s.world_size, s.num_workers) for s in states] == [
            (rank, save.ranks, save.workers) for rank in range(save.ranks)
        ], name
        assert [s.between_epochs for s in states] == [b is None for b in save.batches], name
        assert {s.epoch for s in states} == {save.epoch}, name


@pytest.mark.parametrize("name", [name for name in RESTORES if name != "hop -> 1x3"])
def test_the_rest_of_the_epoch_comes_once_and_the_next_epoch_is_a_fresh_runs(
    name: str, state_dir: Path
) -> None:
    restore = RESTORES[name]
    save = SAVES[restore.save]
    resumed = save.resumed
    saved = _saved(restore.save, state_dir)
    restored = [report[name] for report in _result(f"restore{restore.ranks}", state_dir)]
    fresh = _fresh_epochs(restore.ranks, save.kind, restore.workers, state_dir)
    before = [item for report in saved for item in report["epochs"].get(resumed, [])]
    rest = [item for report in restored for item in _items(report["rest"])]
    delivered = Counter(before + rest)
    if save.kind == "limit":
        # NOTE [ Elastic limit ]: as many items as the saved layout's epoch, none twice.
        assert max(delivered.values()) == 1, f"{name}: items came twice"
        assert set(delivered) <= set(EPOCH)
        assert len(before) < sum(report["ref_items"] for report in saved)
        assert delivered.total() == sum(report["ref_items"] for report in saved), name
    elif before:  # nothing read of the epoch: a fresh run's on the new layout, checked below
        wrong = _unaccounted(delivered, resumed, save.ranks, [restore.ranks])
        assert not wrong, (
            f"{name}: epoch {resumed}: {len(before)} items before the save, {len(rest)} "
            f"after; {wrong}"
        )
    for rank, report in enumerate(restored):
        assert report["next"] == fresh[rank][resumed + 1], (
            f"{name}: rank {rank}: epoch {resumed + 1} is not a fresh run's"
        )
        if not before:  # saved between epochs: the whole resumed epoch is a fresh run's
            assert report["rest"] == fresh[rank][resumed], f"{name}: rank {rank}"


def test_a_second_elastic_resume_in_the_same_epoch_keeps_exact_accounting(
    state_dir: Path,
) -> None:
    """2x2 -> 3x2 -> 1x3, all within epoch 1."""
    resumed = SAVES[HOP_FROM].resumed
    first = [report["epochs"][resumed] for report in _saved(HOP_FROM, state_dir)]
    second = [report["hop"] for report in _result("restore3", state_dir)]
    assert [len(items) for items in second] == [BATCH * b for b in HOP_BATCHES]
    (last,) = [report["hop -> 1x3"] for report in _result("restore1", state_dir)]
    (fresh,) = _fresh_epochs(1, "elastic", 3, state_dir)
    delivered = Counter(_items(first) + _items(second) + _items(last["rest"]))
    wrong = _unaccounted(delivered, resumed, 2, [3, 1])
    assert not wrong, wrong
    assert last["next"] == fresh[resumed + 1]


@pytest.mark.parametrize("mode", ["full", "src"])
def test_a_non_elastic_pipeline_raises_on_every_rank_naming_the_shuffle(
    mode: str, state_dir: Path
) -> None:
    reports = [report["not_elastic"] for report in _result("restore3", state_dir)]
    for rank, report in enumerate(reports):
        name, text, elapsed = report[mode]
        assert name == "StateMismatchError", f"rank {rank}: {name}: {text}"
        assert "world_size was 2 when the state was saved and is 3 now" in text, text
        assert "num_workers was" not in text, text
        # The stage named is the shuffle (the pipeline up to it), not the map after it.
        assert ".filter(_keep).shuffle(buffer_size=8, seed=0): its buffer" in text, text
        assert "approximate=True" in text
        assert elapsed < 20, f"rank {rank} took {elapsed:.1f} s"


def test_a_non_elastic_pipeline_resumed_approximately_warns_and_restarts_the_epoch(
    state_dir: Path,
) -> None:
    reports = [report["not_elastic"] for report in _result("restore3", state_dir)]
    fresh = _fresh_epochs(3, "shuffle", 2, state_dir)
    for rank, report in enumerate(reports):
        for suffix in ("", "_src"):  # every rank says so, also when src_rank computed it
            warned = report[f"warnings{suffix}"]
            assert len(warned) == 1, f"rank {rank}{suffix}: {warned}"
            (message,) = warned
            assert "shuffle(buffer_size=8, seed=0)" in message
            assert "restarts epoch 0" in message
            assert report[f"rest{suffix}"] == fresh[rank][0], f"rank {rank}{suffix}: restart"
            assert report[f"next{suffix}"] == fresh[rank][1], f"rank {rank}{suffix}: epoch 1"


def test_a_save_with_one_rank_already_in_the_next_epoch_reshards_from_its_start() -> None:
    """A rank that finished epoch 0 and has not begun epoch 1 stands where a rank that
    began epoch 1 started from: with rank 0 one batch into epoch 1 and rank 1 between
    epochs, the save reshards onto 3 ranks, and restores on its own layout too."""
    from savable_loader import SavableDataLoader, WorkerConfig

    def make(rank: int, world_size: int, workers: int = 2) -> Any:
        config = WorkerConfig(rank=rank, world_size=world_size)
        pipeline = _pipeline("elastic")
        return SavableDataLoader(
            pipeline, batch_size=BATCH, num_workers=workers, seed=SEED, worker_config=config
        )

    states = []
    head: list[int] = []
    for rank in range(2):
        loader = make(rank, 2)
        try:
            _epoch(loader)
            if rank == 0:
                head += next(iter(loader)).tolist()
            states.append(loader.save_state_rank())
        finally:
            loader.close()
    assert [(s.epoch, s.between_epochs) for s in states] == [(1, False), (0, True)]
    rest: list[int] = []
    for rank in range(3):
        loader = make(rank, 3, workers=3)
        try:
            loader.restore_state_rank(states)
            rest += _items(_epoch(loader))
        finally:
            loader.close()
    # Epoch 1 of the 2-rank layout once (padded to an even count), plus what padding the
    # rest for 3 ranks adds.
    wrong = _unaccounted(Counter(head + rest), 1, 2, [3])
    assert not wrong, wrong
    fresh = make(1, 2)
    try:
        epoch_1 = [_epoch(fresh) for _ in range(2)][1]
    finally:
        fresh.close()
    loader = make(1, 2)
    try:
        loader.restore_state_rank(states)
        assert _epoch(loader) == epoch_1
    finally:
        loader.close()
