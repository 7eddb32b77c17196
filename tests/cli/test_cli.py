"""The ``savable-loader`` command: ``inspect``, ``demo`` and ``--version``."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from savable_loader import (
    SavableDataLoader,
    SavableDataset,
    WorkerConfig,
    __version__,
    save_state,
    serialization,
)
from savable_loader.cli import main
from savable_loader.cli.demo import compare
from savable_loader.cli.demo_child import AugmentedImages
from savable_loader.state.models import FORMAT_VERSION

OK_LINE = "OK: resumed stream identical to uninterrupted run"


def _save_after(tmp_path, loader, batches, name="loader.msgpack"):
    with loader:
        iterator = iter(loader)
        for _ in range(batches):
            next(iterator)
        state = loader.save_state_rank()
    path = tmp_path / name
    save_state(state, path)
    return state, path


def _images_loader(num_workers):
    return SavableDataLoader(AugmentedImages(40, block=4), batch_size=4, num_workers=num_workers)


class BytesCounter(SavableDataset[int]):
    """Counts to 10; its state holds bytes, which inspect shows as their length."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self) -> Iterator[int]:
        while self.pos < 10:
            self.pos += 1
            yield self.pos - 1
        self.pos = 0

    def save_state(self) -> dict[str, Any]:
        return {"pos": self.pos, "blob": b"\x00" * 7}

    def restore_state(self, state: Any) -> None:
        self.pos = state["pos"] if state else 0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_inspect_prints_a_summary(tmp_path, capsys, num_workers):
    state, path = _save_after(tmp_path, _images_loader(num_workers), batches=3)

    assert main(["inspect", str(path)]) == 0

    out, err = capsys.readouterr()
    assert err == ""
    assert f"{path.stat().st_size:,} bytes" in out
    assert "file format version:  1" in out
    assert f"state format version: {FORMAT_VERSION}" in out
    assert f"library version:      {__version__}" in out
    workers = f"{num_workers} workers" if num_workers else "no workers"
    assert f"rank 0 of 1: {workers}, batch size 4, seed 0" in out
    assert f"fingerprint {state.fingerprint}" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == len(state.workers)
    for row, worker in zip(rows, state.workers, strict=True):
        assert row[:3] == [str(worker.worker_id), str(worker.delivered), "no"]
        assert row[3:5] == [str(worker.checkpoint.seq), str(worker.replay)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_inspect_json_matches_the_state(tmp_path, capsys, num_workers):
    state, path = _save_after(tmp_path, _images_loader(num_workers), batches=4)

    assert main(["inspect", "--json", str(path)]) == 0

    summary = json.loads(capsys.readouterr().out)
    assert summary["file_size"] == path.stat().st_size
    assert summary["file_format_version"] == 1
    assert summary["body_length"] == path.stat().st_size - 52
    assert summary["kind"] == "rank"
    (rank,) = summary["ranks"]
    assert rank["state_format_version"] == FORMAT_VERSION
    assert rank["library_version"] == __version__
    expected = {
        "rank": 0,
        "world_size": 1,
        "num_workers": num_workers,
        "batch_size": 4,
        "seed": 0,
        "epoch": state.epoch,
        "between_epochs": False,
        "fingerprint": state.fingerprint,
        "next_worker": state.next_worker,
    }
    assert {key: rank[key] for key in expected} == expected
    for shown, worker in zip(rank["workers"], state.workers, strict=True):
        checkpoint = worker.checkpoint
        assert shown == {
            "worker_id": worker.worker_id,
            "delivered": worker.delivered,
            "ended": worker.ended,
            "checkpoint_seq": checkpoint.seq,
            "replay": worker.replay,
            "exhausted": checkpoint.state["exhausted"],
            "dataset_state": checkpoint.state["parent"],
            "dataset_state_bytes": len(msgpack.packb(checkpoint.state["parent"])),
        }


def test_inspect_state_saved_before_iteration(tmp_path, capsys):
    path = tmp_path / "fresh.msgpack"
    with _images_loader(2) as loader:
        save_state(loader.save_state_rank(), path)

    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("(none: starts from the dataset's initial state)") == 2

    assert main(["inspect", "--json", str(path)]) == 0
    workers = json.loads(capsys.readouterr().out)["ranks"][0]["workers"]
    assert [w["checkpoint_seq"] for w in workers] == [None, None]
    assert [w["replay"] for w in workers] == [0, 0]


def test_inspect_global_state_and_bytes_in_dataset_state(tmp_path, capsys):
    state, _ = _save_after(tmp_path, SavableDataLoader(BytesCounter(), batch_size=3), batches=2)
    path = tmp_path / "global.msgpack"
    save_state([state], path)

    assert main(["inspect", "--json", str(path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kind"] == "global"
    assert summary["ranks"][0]["workers"][0]["dataset_state"] == {"pos": 6, "blob": "<7 bytes>"}

    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "holds:                1 rank states (save_state_global)" in out
    assert '{"pos":6,"blob":"<7 bytes>"}' in out


def test_inspect_between_epochs(tmp_path, capsys):
    path = tmp_path / "ended.msgpack"
    with SavableDataLoader(BytesCounter(), batch_size=4) as loader:
        assert len(list(loader)) == 3
        save_state(loader.save_state_rank(), path)

    assert main(["inspect", str(path)]) == 0
    assert "epoch 0 ended (the next iter() starts epoch 1)" in capsys.readouterr().out


def _corrupt(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_corrupt, "checksum"),
        (lambda data: data[:-10], "truncated"),
        (lambda data: b"", "empty"),
        (lambda data: pickle.dumps({"a": 1}), "pickle"),
    ],
    ids=["flipped-byte", "truncated", "empty", "pickle"],
)
def test_inspect_refuses_a_bad_file(tmp_path, capsys, damage, message):
    _, path = _save_after(tmp_path, _images_loader(0), batches=1)
    path.write_bytes(damage(path.read_bytes()))

    assert main(["inspect", str(path)]) == 2

    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"savable-loader inspect: {path}: ")
    assert message in err
    assert err.count("\n") == 1


def test_inspect_missing_file(tmp_path, capsys):
    assert main(["inspect", "--json", str(tmp_path / "nowhere.msgpack")]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "not found" in err
    assert err.count("\n") == 1


def test_inspect_invalid_state_is_one_line(tmp_path, capsys):
    state, path = _save_after(tmp_path, _images_loader(0), batches=1)
    plain = state.to_plain()
    plain["workers"][0]["delivered"] = "many"
    path.write_bytes(serialization.dumps({"kind": "rank", "state": plain}))

    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert "invalid loader state" in err
    assert "delivered" in err
    assert err.count("\n") == 1


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"savable-loader {__version__}\n"


def test_help_hides_the_internal_subcommand(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "inspect" in out
    assert "demo-child" not in out


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    assert main(["inspect"]) == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--kill-at", "5"], "--kill-at must be between --save-every (10"),
        (["--kill-at", "80"], "the run has 80 steps"),
        (["--save-every", "0"], "--save-every must be between 1 and 79"),
        (["--workers", "-1"], "--workers must be 0 or more"),
    ],
)
def test_demo_refuses_bad_arguments(capsys, arguments, message):
    assert main(["demo", *arguments]) == 2
    out, err = capsys.readouterr()
    assert message in err
    assert out == ""


def test_compare_names_the_first_divergence():
    reference = ["a", "b", "c", "d"]
    assert compare(reference, ["a", "b", "c", "d"], resumed_from=2) == (
        f"{OK_LINE} (4 batches compared)",
        True,
    )
    line, ok = compare(reference, ["a", "b", "x", "d"], resumed_from=2)
    assert not ok
    assert line.startswith("FAIL: first divergence at step 3 (resumed run)")
    line, ok = compare(reference, ["a", "x", "c", "d"], resumed_from=2)
    assert "step 2 (interrupted run)" in line
    line, ok = compare(reference, ["a", "b", "c"], resumed_from=2)
    assert not ok
    assert "yielded 3 batches together, the uninterrupted run 4" in line


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arguments", "batches"),
    [
        ([], 80),
        (["--workers", "0", "--steps", "6", "--save-every", "4", "--kill-at", "9"], 12),
    ],
    ids=["defaults", "no-workers"],
)
def test_demo_end_to_end(tmp_path, capsys, arguments, batches):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "savable_loader.cli",
            "demo",
            "--workdir",
            str(tmp_path),
            *arguments,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{OK_LINE} ({batches} batches compared)" in done.stdout
    assert "killed with SIGKILL at step" in done.stdout
    saved = sorted((tmp_path / "checkpoints").glob("loader-step*.msgpack"))
    assert saved

    assert main(["inspect", str(saved[-1])]) == 0
    assert "rank 0 of 1" in capsys.readouterr().out


def test_inspect_into_a_closed_pipe_stops_quietly(tmp_path):
    # More output than a pipe buffers (64 KiB), so the writer meets the closed pipe.
    ranks = 400
    states = [
        SavableDataLoader(
            BytesCounter(), batch_size=3, worker_config=WorkerConfig(rank=r, world_size=ranks)
        ).save_state_rank()
        for r in range(ranks)
    ]
    path = tmp_path / "many.msgpack"
    save_state(states, path)
    command = [sys.executable, "-m", "savable_loader.cli", "inspect", str(path)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
        assert child.stdout is not None
        child.stdout.readline()
        child.stdout.close()
        _, err = child.communicate(timeout=60)
    assert b"Traceback" not in err, err.decode()
    assert child.returncode == 0


def test_inspect_shows_how_a_samplers_order_was_drawn(tmp_path, capsys):
    import torch
    from torch.utils.data import DistributedSampler

    data = list(range(20))
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=3)
    sampler.set_epoch(4)
    loader = SavableDataLoader(
        data, batch_size=2, sampler=sampler, generator=torch.Generator().manual_seed(1)
    )
    _, path = _save_after(tmp_path, loader, batches=1)

    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "order of epoch 0 drawn in the main process: 1 generator state(s)" in out
    assert "sampler epoch 4" in out
    assert main(["inspect", "--json", str(path)]) == 0
    (rank,) = json.loads(capsys.readouterr().out)["ranks"]
    assert rank["order"] == {
        "epoch": 0,
        "generators": 1,
        "sampler_state": False,
        "sampler_epoch": 4,
    }
