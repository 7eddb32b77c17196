"""A DDP training job over gloo (2 and 3 ranks) saves its data stream mid-run, dies with
``os._exit`` a few steps later and resumes in fresh rank processes on the same batches.

Every case trains a ``DistributedDataParallel`` linear model (one gradient all-reduce per
step) for several epochs over one source: a map-style dataset with ``DistributedSampler``
(``set_epoch`` every epoch), a map-style dataset the loader shards itself (with two
workers), JSON lines files and tar shards of uneven sizes, and ``TokenSource``. A first launch runs the job uninterrupted (the
reference), then again with ``save_state_global`` at step ``SAVE`` and ``os._exit`` after
step ``KILL``; a second launch restores the saved state file and trains to the end. Each
rank logs every step's batch digest to a line-buffered file, read back here.

NOTE [ Uneven files in a DDP job ]
A rank that yields more batches than another hangs a DDP job in the gradient all-reduce
that the other rank never joins. ``JsonLinesSource`` and ``TarSource`` share an epoch's
samples out so that every rank reads as many (NOTE [ Splitting files by samples ] in
``datasets/files/sample_split.py``): the files here have uneven sizes on purpose, and the job
checks every rank took as many steps. ``test_uneven_files_give_every_rank_as_many_steps``
checks the counts directly, and that ``split="files"`` (whole files per stream) does not
give that guarantee.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gloo import COMMAND_TIMEOUT, in_rank_order, run_ranks

pytestmark = pytest.mark.slow

EPOCHS = 3
SAVE = 5  # the save, mid-epoch 1 in every case
KILL = 8  # os._exit right after this step: steps SAVE + 1 to KILL are trained twice
JOB_TIMEOUT = 150.0  # a hang is still caught; a loaded 2-core CI machine is slow
#: Sizes of the JSON lines files: dealt round-robin, streams get uneven line counts.
JSONL_SIZES = (7, 3, 9, 5, 8, 4)
TOKEN_SIZES = (40, 27)  # tokens per file: 10 + 6 windows of 4
CASES = ["sampler", "sharded", "jsonl", "tokens", "tar"]
TAR_SIZES = (3, 1, 2, 4, 1, 2)  # samples per shard: uneven, 13 in all


# -- the data ------------------------------------------------------------------------------


class Augmented:
    """Item ``i`` is ``(i, noise)`` with noise from the global torch generator: a random
    augmentation, so the workers' generators show in the stream."""

    def __len__(self) -> int:
        return 22

    def __getitem__(self, index: int) -> tuple[int, Any]:
        import torch

        return index, torch.rand(())


def _write_data(tmp: Path) -> None:
    (tmp / "jsonl").mkdir()
    first = 0
    for number, size in enumerate(JSONL_SIZES):
        lines = [json.dumps({"id": first + i}) for i in range(size)]
        with gzip.open(tmp / "jsonl" / f"part-{number}.jsonl.gz", "wt") as file:
            file.write("\n".join(lines) + "\n")
        first += size
    (tmp / "tokens").mkdir()
    first = 0
    for number, size in enumerate(TOKEN_SIZES):
        np.arange(first, first + size, dtype=np.uint16).tofile(tmp / "tokens" / f"{number}.bin")
        first += size
    (tmp / "tar").mkdir()
    first = 0
    for shard, size in enumerate(TAR_SIZES):
        with tarfile.open(tmp / "tar" / f"shard-{shard}.tar", "w") as tar:
            for sample in range(size):
                data = str(first + sample).encode()
                member = tarfile.TarInfo(f"{shard:02d}{sample:02d}.id")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
        first += size


# -- what runs in each rank ----------------------------------------------------------------


def _build(case: str, tmp: Path) -> tuple[Any, Any]:
    """The case's loader and the sampler the loop calls ``set_epoch`` on (or None)."""
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    from savable_loader import SavableDataLoader, WorkerConfig
    from savable_loader.datasets import JsonLinesSource, TarSource, TokenSource

    config = WorkerConfig(command_timeout=COMMAND_TIMEOUT)
    if case == "sampler":
        dataset = Augmented()
        sampler = DistributedSampler(dataset, shuffle=True, seed=3)
        assert sampler.num_replicas == dist.get_world_size()
        loader = SavableDataLoader(
            dataset, batch_size=3, sampler=sampler, num_workers=1, worker_config=config
        )
        return loader, sampler
    if case == "sharded":
        loader = SavableDataLoader(
            Augmented(), batch_size=2, shuffle=True, num_workers=2, seed=1, worker_config=config
        )
        return loader, None
    if case == "jsonl":
        source = JsonLinesSource(str(tmp / "jsonl" / "*.jsonl.gz"), shuffle_shards=True, seed=2)
        return SavableDataLoader(source, batch_size=5, num_workers=1, worker_config=config), None
    if case == "tokens":
        source = TokenSource(str(tmp / "tokens" / "*.bin"), seq_len=4, shuffle=True, seed=4)
        return SavableDataLoader(source, batch_size=2), None
    if case == "tar":
        source = TarSource(str(tmp / "tar" / "*.tar"), shuffle_shards=True, seed=5)
        return SavableDataLoader(source, batch_size=2), None
    raise ValueError(case)


def _inputs(case: str, batch: Any) -> Any:
    """The batch as the model's input: its items' ids, one per row."""
    import torch

    if case in ("sampler", "sharded"):
        ids = batch[0]
    elif case == "jsonl":
        ids = batch["id"]
    elif case == "tokens":
        ids = batch[:, 0].long() // 4
    else:
        ids = torch.tensor([int(data) for data in batch["id"]])
    return ids.float().unsqueeze(1)


def _train(
    case: str,
    tmp: Path,
    log: Path,
    *,
    save: int | None = None,
    stop: int | None = None,
    resume: bool = False,
) -> Any:
    """Trains EPOCHS epochs (the rest of them with ``resume``, after restoring the saved
    state) and logs every step; returns None.

    With ``save``, saves the loader after that step (every rank) and rank 0 writes the
    state file and the loop's position. With ``stop``, returns the loader as it stands
    after that step, open, its workers running: the caller ends the process.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from savable_loader import load_state, save_state
    from savable_loader.testing import digest

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    loader, sampler = _build(case, tmp)
    step, first_epoch = 0, 0
    position = tmp / f"{case}-position.json"
    if resume:
        saved = json.loads(position.read_text())
        step, first_epoch = saved["step"], saved["epoch"]
        states = load_state(tmp / f"{case}-loader.msgpack") if rank == 0 else None
        loader.restore_state_global(states, src_rank=0)
    with open(log, "a", buffering=1) as out:
        for epoch in range(first_epoch, EPOCHS):
            if sampler is not None:
                sampler.set_epoch(epoch)
            for batch in loader:
                step += 1
                optimizer.zero_grad()
                model(_inputs(case, batch)).pow(2).mean().backward()  # all-reduce
                optimizer.step()
                pids = [stats["pid"] for stats in loader.worker_stats()]
                entry = {"step": step, "epoch": epoch, "digest": digest(batch), "pids": pids}
                out.write(json.dumps(entry) + "\n")
                if step == save:
                    states = loader.save_state_global(global_dst_rank=0)
                    if rank == 0:
                        save_state(states, tmp / f"{case}-loader.msgpack")
                        written = position.with_suffix(".tmp")
                        written.write_text(json.dumps({"step": step, "epoch": epoch}))
                        os.replace(written, position)
                if step == stop:
                    return loader
    loader.close()
    return None


def _job_run(rank: int, world_size: int, tmp: Path) -> None:
    """Every case's reference run, then every case's run that saves and stops at KILL,
    each leaving its loader open; then the rank dies with all of them running."""
    stopped = []
    for case in CASES:
        _train(case, tmp, tmp / f"{case}-reference-{rank}.jsonl")
        stopped.append(_train(case, tmp, tmp / f"{case}-run-{rank}.jsonl", save=SAVE, stop=KILL))
    assert all(loader is not None for loader in stopped)
    os._exit(17)  # no cleanup at all, as in a crash


def _job_resume(rank: int, world_size: int, tmp: Path) -> None:
    for case in CASES:
        _train(case, tmp, tmp / f"{case}-run-{rank}.jsonl", resume=True)


# -- the tests -----------------------------------------------------------------------------


def _log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _running(pids: set[int], timeout: float) -> set[int]:
    """The pids still running after up to ``timeout`` seconds (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = set()
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                alive.add(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("ddp-data")
    _write_data(tmp)
    return tmp


@dataclass
class Job:
    """One world size's two launches: where their logs are and how long they took."""

    tmp: Path
    seconds: tuple[float, float]
    orphans: set[int]


_JOBS: dict[int, Job] = {}


def _job(world_size: int, data_dir: Path) -> Job:
    """Runs the killed job and its resumption on ``world_size`` ranks, once per module."""
    if world_size in _JOBS:
        return _JOBS[world_size]
    tmp = data_dir / f"ranks{world_size}"
    tmp.mkdir()
    for name in ("jsonl", "tokens", "tar"):
        (tmp / name).symlink_to(data_dir / name)
    began = time.monotonic()
    reports = run_ranks(_job_run, world_size, tmp, timeout=JOB_TIMEOUT)
    # Every rank died in os._exit: none reported, none ran into the launcher's timeout.
    assert not reports, reports
    killed = time.monotonic() - began
    assert killed < JOB_TIMEOUT, f"the killed run took {killed:.0f} s: a rank hung"
    workers = set()
    for case in CASES:
        for rank in range(world_size):
            workers.update(_log(tmp / f"{case}-run-{rank}.jsonl")[-1]["pids"])
    began = time.monotonic()
    reports = run_ranks(_job_resume, world_size, tmp, timeout=JOB_TIMEOUT)
    in_rank_order(reports, world_size, "the resumed run")
    resumed = time.monotonic() - began
    # Orphaned by the kill, the loader workers notice and end by themselves.
    _JOBS[world_size] = Job(tmp, (killed, resumed), _running(workers, timeout=15.0))
    return _JOBS[world_size]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", CASES)
def test_a_ddp_job_killed_after_a_save_resumes_on_the_same_batches(
    case: str, world_size: int, data_dir: Path
) -> None:
    job = _job(world_size, data_dir)
    references = [_log(job.tmp / f"{case}-reference-{rank}.jsonl") for rank in range(world_size)]
    steps = [len(reference) for reference in references]
    assert steps == [steps[0]] * world_size, f"ranks took different step counts: {steps}"
    assert steps[0] > KILL
    for reference in references:
        assert [entry["step"] for entry in reference] == list(range(1, steps[0] + 1))
        assert [entry["epoch"] for entry in reference][-1] == EPOCHS - 1
    streams = []
    for rank in range(world_size):
        want = [(entry["step"], entry["digest"]) for entry in references[rank]]
        log = _log(job.tmp / f"{case}-run-{rank}.jsonl")
        run = [(entry["step"], entry["digest"]) for entry in log]
        assert run[:KILL] == want[:KILL], f"rank {rank}: the run before the kill"
        # The resumed run starts after the save and trains the steps after it again.
        assert run[KILL:] == want[SAVE:], f"rank {rank}: the resumed run"
        streams.append(tuple(digest for _, digest in want))
    assert len(set(streams)) == world_size, "two ranks read the same batches"
    assert not job.orphans, "workers of the killed ranks are still running"


def test_uneven_files_give_every_rank_as_many_steps(data_dir: Path) -> None:
    """NOTE [ Uneven files in a DDP job ]: 36 lines in files of 3 to 9 lines."""
    from savable_loader import SavableDataLoader, WorkerConfig
    from savable_loader.datasets import JsonLinesSource

    pattern = str(data_dir / "jsonl" / "*.jsonl.gz")
    for split, world_size, want in (
        ("samples", 2, [6, 6]),
        ("samples", 3, [4, 4, 4]),
        ("files", 2, [8, 4]),
        ("files", 3, [4, 4, 5]),
    ):
        counts = []
        for rank in range(world_size):
            config = WorkerConfig(rank=rank, world_size=world_size)
            source = JsonLinesSource(pattern, split=split)  # type: ignore[arg-type]
            with SavableDataLoader(source, batch_size=3, worker_config=config) as loader:
                counts.append(sum(1 for _ in loader))
        assert counts == want, (split, world_size)
