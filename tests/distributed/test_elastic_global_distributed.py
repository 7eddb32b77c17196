"""The global stream over real process groups (gloo): a job saved with
``save_state_global`` and killed mid-epoch restarts on another number of ranks with
``restore_state_global`` (docs/how-to/torchrun.md, "Restart on another number of GPUs").

Two restarts, each a killed job and the job that resumes it, both run on real ranks
(``gloo.run_ranks``: processes on loopback, every wait bounded):

- **4 ranks x batch 2 -> 2 ranks x batch 4** (one global batch of 8): after the restore,
  every global batch (every rank's batch of a step together, as a multiset of items with
  their seeded-map draws) equals, step for step, the global batch an uninterrupted run on
  4 ranks gives at that step, through the end of epoch 1.
- **2 ranks x batch 4 -> 3 ranks x batch 4** (the global batch grows from 8 to 12): the
  rest of the interrupted epoch delivers every item the killed job had not consumed
  exactly once, with the draws an uninterrupted run gave it; epoch 1 on each new rank is
  what a fresh 3-rank run delivers there, batch for batch.

In a killed job each rank (one loader worker) first runs its layout uninterrupted for two
epochs, in a loader of its own: the reference. Then it writes every step it trains on to
a file of its own, saves at a mid-epoch step with the other ranks, trains two steps more
and SIGKILLs its process group (the rank and its worker: the rank made a group of its
own): the steps after the save are lost, as in a crash, and no rank reports. The job that
resumes also runs its own layout fresh, for the epoch after the restored one.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from gloo import COMMAND_TIMEOUT, in_rank_order, run_ranks

pytestmark = pytest.mark.slow  # multi-process (pyproject's markers); about 11 s in all

N = 96  # every global batch here (8 or 12) divides it: no layout pads its epoch
SEED = 0
ORDER_SEED = 3
MAP_SEED = 5
WORKERS = 1
JOB_TIMEOUT = 120.0  # a hang is still caught; a loaded 2-core machine is slow
#: Steps the killed jobs train on after their save before they are killed (lost).
LOST_STEPS = 2

#: An item: its index and its seeded map's draw (the draw as a float, exact in JSON).
Item = tuple[int, float]
#: A run's global batches: per epoch, per step, the sorted items of every rank's batch.
Steps = list[list[list[Item]]]


def _draw(index: int, rng: Any) -> tuple[int, float]:
    """The seeded map: its generator is keyed by the item's place in the global stream."""
    return index, float(rng.random())


def _loader(batch_size: int) -> Any:
    """This rank's loader; the rank and world size come from torch.distributed."""
    from savable_loader import SavableDataLoader, WorkerConfig
    from savable_loader.datasets import IndexedDataset

    pipeline = IndexedDataset(range(N), shuffle=True, seed=ORDER_SEED).map(_draw, seed=MAP_SEED)
    return SavableDataLoader(
        pipeline,
        batch_size=batch_size,
        num_workers=WORKERS,
        seed=SEED,
        worker_config=WorkerConfig(command_timeout=COMMAND_TIMEOUT),
    )


def _items(batch: Any) -> list[Item]:
    """A default-collated batch of (index, draw) items: two tensors."""
    indices, draws = batch
    return list(zip(indices.tolist(), draws.tolist(), strict=True))


def _epoch(loader: Any) -> list[list[Item]]:
    """The rest of the loader's current epoch (a whole one between epochs), per batch."""
    return [_items(batch) for batch in loader]


def _epochs(loader: Any, count: int) -> list[list[list[Item]]]:
    return [_epoch(loader) for _ in range(count)]


# -- what runs in each rank ----------------------------------------------------------------


def _write(path: Path, record: dict[str, Any]) -> None:
    """Appends one line; a killed rank keeps what it wrote (flushed, in the page cache)."""
    with path.open("a") as file:
        file.write(json.dumps(record) + "\n")


def _killed_job(rank: int, world_size: int, tmp: Path) -> None:
    """Runs its layout uninterrupted (the reference), then trains mid-epoch, saves, trains
    ``LOST_STEPS`` steps more and is killed: per rank, ``tmp/killed-<world_size>/`` gets
    ``reference<rank>.json`` and ``rank<rank>.jsonl`` (one line per step, then "kill")."""
    from savable_loader import save_state

    os.setpgrp()  # before the loader forks its worker: the kill takes the rank and it
    batch_size, save_after = _SAVES[world_size]
    out = tmp / f"killed-{world_size}"
    out.mkdir(exist_ok=True)
    loader = _loader(batch_size)
    try:
        reference = _epochs(loader, 2)
    finally:
        loader.close()
    (out / f"reference{rank}.json").write_text(json.dumps(reference))

    steps = out / f"rank{rank}.jsonl"
    loader = _loader(batch_size)
    try:
        stream = iter(loader)
        for step in range(save_after + LOST_STEPS):
            if step == save_after:
                states = loader.save_state_global(global_dst_rank=0)  # every rank calls it
                if rank == 0:
                    save_state(states, out / "loader.msgpack")
                _write(steps, {"saved": step})
            _write(steps, {"step": step, "items": _items(next(stream))})
    except BaseException:
        loader.close()  # a failure is reported, not killed: leave no worker behind
        raise
    _write(steps, {"kill": True})
    assert os.getpgrp() == os.getpid()
    os.killpg(os.getpid(), signal.SIGKILL)  # the rank and its worker, mid-epoch


def _restored_job(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    """Restores the killed job's save onto ``world_size`` ranks and reads the rest of
    epoch 0 and epoch 1; then a fresh run's two epochs on this layout."""
    from savable_loader import load_state

    saved_on, batch_size, src_rank = _RESTORES[world_size]
    path = tmp / f"killed-{saved_on}" / "loader.msgpack"
    loader = _loader(batch_size)
    try:
        if src_rank is None:  # every rank passes the full list
            loader.restore_state_global(load_state(path))
        else:  # src_rank alone reads the file and scatters the states
            states = load_state(path) if rank == src_rank else None
            loader.restore_state_global(states, src_rank=src_rank)
        restored = _epochs(loader, 2)
    finally:
        loader.close()
    loader = _loader(batch_size)
    try:
        fresh = _epochs(loader, 2)
    finally:
        loader.close()
    return {"restored": restored, "fresh": fresh}


#: Killed jobs by ranks: (per-rank batch size, steps before the save).
_SAVES = {4: (2, 5), 2: (4, 3)}
#: Restored jobs by ranks: (ranks of the killed job, per-rank batch size, src_rank).
_RESTORES = {2: (4, 4, 0), 3: (2, 4, None)}


# -- running the jobs ----------------------------------------------------------------------


def _kill_and_restore(
    tmp: Path, saved_on: int, restored_on: int
) -> tuple[list[Any], list[Any], list[Any]]:
    """Runs the killed job and the job that resumes it; returns per old rank its reference
    epochs and its steps (a save marker among them), and per new rank its report."""
    killed = run_ranks(_killed_job, saved_on, tmp, timeout=JOB_TIMEOUT)
    assert not killed, f"the killed job's ranks should have died without a report: {killed}"
    out = tmp / f"killed-{saved_on}"
    references, steps = [], []
    for rank in range(saved_on):
        references.append(json.loads((out / f"reference{rank}.json").read_text()))
        lines = [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]
        assert lines[-1] == {"kill": True}, f"rank {rank} did not reach its kill: {lines[-1]}"
        steps.append(lines[:-1])
    reports = run_ranks(_restored_job, restored_on, tmp, timeout=JOB_TIMEOUT)
    restored = in_rank_order(reports, restored_on, "_restored_job")
    return references, steps, restored


def _as_items(batch: Iterable[Iterable[Any]]) -> list[Item]:
    return [(int(index), float(draw)) for index, draw in batch]


def _global(per_rank: list[list[list[Any]]]) -> list[list[Item]]:
    """The global batches of one epoch's steps: every rank's batch of a step, sorted."""
    assert len({len(batches) for batches in per_rank}) == 1, "ranks yield unequal epochs"
    return [
        sorted(item for batch in step for item in _as_items(batch))
        for step in zip(*per_rank, strict=True)
    ]


def _global_epochs(per_rank: list[list[list[list[Any]]]]) -> Steps:
    """Per epoch, the global batches of ranks' epochs (``per_rank[rank][epoch]``)."""
    return [_global([epochs[e] for epochs in per_rank]) for e in range(len(per_rank[0]))]


def _trained(steps: list[dict[str, Any]]) -> tuple[int, list[list[Any]], list[list[Any]]]:
    """A killed rank's save step, its batches before the save and those after it."""
    (saved,) = [line["saved"] for line in steps if "saved" in line]
    batches = [line["items"] for line in steps if "step" in line]
    assert [line["step"] for line in steps if "step" in line] == list(range(len(batches)))
    return saved, batches[:saved], batches[saved:]


def _check_saved_file(tmp: Path, ranks: int, batch_size: int) -> None:
    from savable_loader import load_state

    states = load_state(tmp / f"killed-{ranks}" / "loader.msgpack")
    assert isinstance(states, list)
    assert [(s.rank, s.world_size, s.num_workers, s.batch_size) for s in states] == [
        (rank, ranks, WORKERS, batch_size) for rank in range(ranks)
    ]
    assert {(s.epoch, s.between_epochs) for s in states} == {(0, False)}


# -- the tests -----------------------------------------------------------------------------


def test_four_ranks_killed_mid_epoch_go_on_with_the_same_global_batches_on_two(
    tmp_path: Path,
) -> None:
    """4 ranks x batch 2, saved after step 5 of 12 and killed two steps later; restored
    on 2 ranks x batch 4 (src_rank 0 reads the file): steps 5 to 11 of epoch 0 and all of
    epoch 1 are the uninterrupted 4-rank run's global batches, draws included."""
    references, steps, restored = _kill_and_restore(tmp_path, saved_on=4, restored_on=2)
    _check_saved_file(tmp_path, 4, 2)
    reference = _global_epochs(references)
    assert [len(epoch) for epoch in reference] == [12, 12]
    assert reference[0] != reference[1]

    trained = [_trained(lines) for lines in steps]
    (saved,) = {save for save, _, _ in trained}
    assert saved == 5
    # The killed run is the uninterrupted one until it dies, lost steps included.
    assert _global([before for _, before, _ in trained]) == reference[0][:saved]
    assert _global([after for _, _, after in trained]) == reference[0][saved : saved + LOST_STEPS]

    after = _global_epochs([report["restored"] for report in restored])
    assert [len(epoch) for epoch in after] == [12 - saved, 12]
    for step, (mine, theirs) in enumerate(zip(after[0], reference[0][saved:], strict=True)):
        assert mine == theirs, f"epoch 0 step {saved + step} differs from the 4-rank run's"
    for step, (mine, theirs) in enumerate(zip(after[1], reference[1], strict=True)):
        assert mine == theirs, f"epoch 1 step {step} differs from the 4-rank run's"
    # And a fresh 2 x 4 run gives those global batches too (one stream on both layouts).
    assert _global_epochs([report["fresh"] for report in restored]) == reference


def test_two_ranks_killed_mid_epoch_restored_on_three_deliver_the_rest_once(
    tmp_path: Path,
) -> None:
    """2 ranks x batch 4, saved after step 3 of 12 and killed two steps later; restored
    on 3 ranks x batch 4 (every rank passes the full list): the 72 items not consumed,
    each once with its draw, in 6 steps of 12; then epoch 1 as a fresh 3-rank run's."""
    references, steps, restored = _kill_and_restore(tmp_path, saved_on=2, restored_on=3)
    _check_saved_file(tmp_path, 2, 4)
    reference = _global_epochs(references)
    uninterrupted = Counter(item for step in reference[0] for item in step)
    assert sorted(index for index, _ in uninterrupted) == list(range(N))

    trained = [_trained(lines) for lines in steps]
    (saved,) = {save for save, _, _ in trained}
    assert saved == 3
    consumed = Counter(item for step in _global([b for _, b, _ in trained]) for item in step)
    assert len(consumed) == 8 * saved

    rest = _global([report["restored"][0] for report in restored])
    assert [len(step) for step in rest] == [12] * 6
    delivered = Counter(item for step in rest for item in step)
    assert max(delivered.values()) == 1, "an item came twice in the rest of the epoch"
    assert not delivered & consumed, "an item consumed before the save came again"
    # Every item not consumed, once, with the draw the uninterrupted run gave it.
    assert delivered == uninterrupted - consumed

    for rank, report in enumerate(restored):
        assert report["restored"][1] == report["fresh"][1], (
            f"rank {rank}: epoch 1 is not a fresh 3-rank run's"
        )
    fresh = _global([report["fresh"][1] for report in restored])
    assert sorted(index for step in fresh for index, _ in step) == list(range(N))
