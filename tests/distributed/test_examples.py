"""The examples under torchrun: a crashed and resumed run trains on the same batches.

examples/train_torchrun.py (a savable dataset) and examples/train_ddp_sampler.py (a
map-style dataset with ``DistributedSampler``). The crashed run and its resumption are
real ``python -m torch.distributed.run --standalone --nproc-per-node 2`` jobs (two gloo
ranks, two loader workers each) in a subprocess with a deadline. The uninterrupted
reference run, which only gives the batches to compare with, is the same script on two
ranks forked from a zygote with torchrun's variables (NOTE [ Jobs from a zygote ] in
``tests/support/zygote.py``): three interpreters fewer a test (torchrun's agent and two
ranks, each importing torch: about 8 s of CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from paths import ROOT
from trainer_jobs import Job
from zygote import Zygote

EXAMPLES = ROOT / "examples"
SCRIPT = EXAMPLES / "train_torchrun.py"
RANKS = 2
STEPS = 20  # 8 batches per rank per epoch: the runs cross two epoch boundaries
SAVE_EVERY = 5
STOP_AT = 13  # after the save at step 10: steps 11 to 13 are trained twice
RUN_TIMEOUT = 120.0


def _start(
    ckpt: Path, *extra: str, script: Path = SCRIPT, steps: bool = True
) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={RANKS}",
        str(script),
        f"--ckpt={ckpt}",
        *([f"--steps={STEPS}", f"--save-every={SAVE_EVERY}"] if steps else []),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _finish(process: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        stdout, stderr = process.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        # torchrun ends its ranks (each in its own session) when it gets SIGTERM.
        process.terminate()
        try:
            stdout, stderr = process.communicate(timeout=30.0)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        pytest.fail(
            f"torchrun {process.args} did not finish in {RUN_TIMEOUT:.0f} s:\n{stderr[-3000:]}"
        )
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _torchrun(
    ckpt: Path, *extra: str, script: Path = SCRIPT, steps: bool = True
) -> subprocess.CompletedProcess[str]:
    return _finish(_start(ckpt, *extra, script=script, steps=steps))


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    with Zygote("torch", "torch.distributed", "savable_loader") as started:
        yield started


def _reference(
    zygote: Zygote, ckpt: Path, *extra: str, script: Path = SCRIPT, steps: bool = True
) -> Job:
    """The uninterrupted run, on two ranks forked from ``zygote``; it goes beside the
    crashed run and its resumption (the jobs are independent). Leaving the ``with`` block
    kills it if it still runs."""
    command = [
        sys.executable,
        str(script),
        f"--ckpt={ckpt}",
        *([f"--steps={STEPS}", f"--save-every={SAVE_EVERY}"] if steps else []),
        *extra,
    ]
    return Job(command, "none", RUN_TIMEOUT, zygote=zygote, ranks=RANKS)


def _log(ckpt: Path, rank: int) -> list[tuple[int, str]]:
    lines = (ckpt / f"batches_rank{rank}.jsonl").read_text().splitlines()
    return [(entry["step"], entry["digest"]) for entry in map(json.loads, lines)]


def _last_per_step(log: list[tuple[int, str]]) -> list[tuple[int, str]]:
    return sorted(dict(log).items())


def _assert_resumed(
    reference: Path,
    crashed: Path,
    before: list[list[tuple[int, str]]],
    *,
    steps: int,
    last_save: int,
) -> None:
    """Every rank of the crashed-and-resumed run trained on the reference's batches: its
    log up to the crash is kept, the resumed run starts right after the last save (the
    steps after it are trained twice, on the same batches), and ranks read different data."""
    for rank in range(RANKS):
        expected = _log(reference, rank)
        assert [step for step, _ in expected] == list(range(1, steps + 1))
        resumed = _log(crashed, rank)
        assert _last_per_step(resumed) == expected, f"rank {rank} diverged"
        done = len(before[rank])
        assert resumed[:done] == before[rank]
        assert [step for step, _ in resumed[done:]] == list(range(last_save + 1, steps + 1))
        assert set(resumed[last_save:done]) <= set(resumed[done:])
    assert _log(reference, 0) != _log(reference, 1)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_torchrun_example_resumes_after_a_crash_on_the_same_batches(
    tmp_path: Path, zygote: Zygote
) -> None:
    assert STOP_AT % SAVE_EVERY != 0
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"

    with _reference(zygote, reference) as uninterrupted:
        run = _torchrun(crashed, f"--stop-at={STOP_AT}")
        assert run.returncode != 0, "the run with --stop-at should end as a crash does"
        assert "exitcode  : 17" in run.stderr
        # A rank logs a step before the next step's gradient all-reduce, so every rank got
        # at least to STOP_AT - 1; whether the other rank logged STOP_AT before torchrun
        # stopped it is a race.
        before = [_log(crashed, rank) for rank in range(RANKS)]
        for log in before:
            assert STOP_AT - 1 <= len(log) <= STOP_AT
            assert [step for step, _ in log] == list(range(1, len(log) + 1))
        run = _torchrun(crashed)
        assert run.returncode == 0, run.stderr[-3000:]
        assert uninterrupted.wait() == 0

    _assert_resumed(
        reference, crashed, before, steps=STEPS, last_save=STOP_AT - STOP_AT % SAVE_EVERY
    )

    # Same batches and a restored optimizer: the final models are equal bit for bit.
    want = torch.load(reference / "model.pt", weights_only=True)
    got = torch.load(crashed / "model.pt", weights_only=True)
    assert got["step"] == want["step"] == STEPS
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name


SAMPLER_SCRIPT = EXAMPLES / "train_ddp_sampler.py"
SAMPLER_STEPS = 15  # 50 points, 2 ranks, batches of 5: 5 steps per epoch, 3 epochs
SAMPLER_SAVE_EVERY = 4
SAMPLER_STOP_AT = 10  # the last save was at step 8, in epoch 1


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sampler_example_resumes_after_a_crash_on_the_same_batches(
    tmp_path: Path, zygote: Zygote
) -> None:
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"
    options = (f"--save-every={SAMPLER_SAVE_EVERY}", "--epochs=3")

    first = _reference(zygote, reference, *options, script=SAMPLER_SCRIPT, steps=False)
    with first as uninterrupted:
        stop = f"--stop-at={SAMPLER_STOP_AT}"
        run = _torchrun(crashed, *options, stop, script=SAMPLER_SCRIPT, steps=False)
        assert run.returncode != 0, "the run with --stop-at should end as a crash does"
        assert "exitcode  : 17" in run.stderr
        before = [_log(crashed, rank) for rank in range(RANKS)]
        run = _torchrun(crashed, *options, script=SAMPLER_SCRIPT, steps=False)
        assert run.returncode == 0, run.stderr[-3000:]
        assert uninterrupted.wait() == 0

    for log in before:
        assert SAMPLER_STOP_AT - 1 <= len(log) <= SAMPLER_STOP_AT
    last_save = SAMPLER_STOP_AT - SAMPLER_STOP_AT % SAMPLER_SAVE_EVERY
    _assert_resumed(reference, crashed, before, steps=SAMPLER_STEPS, last_save=last_save)
    want = torch.load(reference / "final.pt", weights_only=True)
    got = torch.load(crashed / "final.pt", weights_only=True)
    assert got["step"] == want["step"] == SAMPLER_STEPS
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
