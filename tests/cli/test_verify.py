"""``savable-loader verify`` and ``savable_loader.testing.verify``: the check catches
datasets that forget part of their state and says where and what differs."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from paths import pythonpath
from pipelines import RandomCounter
from torch.utils.data import DataLoader

from savable_loader import SavableDataLoader, WorkerConfig
from savable_loader.cli import main
from savable_loader.testing import ResumeMismatch, VerifyReport, assert_resumes_exactly, verify
from savable_loader.testing.divergence import _differences

HERE = Path(__file__).resolve()
MODULE = HERE.stem  # pytest imports this file under its base name (rootdir/prepend mode)


class ForgetsPosition(RandomCounter):
    """Saves its epoch but not its position: a restore starts the epoch over."""

    def save_state(self) -> dict[str, int]:
        return {"epoch": self.epoch}

    def restore_state(self, state: Any) -> None:
        self.pos, self.epoch = 0, (state or {"epoch": 0})["epoch"]


class ForgetsGenerator(RandomCounter):
    """Draws noise from a generator of its own, which its state leaves out."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.rng = np.random.default_rng(7)

    def __iter__(self) -> Any:
        for item in super().__iter__():
            yield {**item, "own": float(self.rng.random())}

    def restore_state(self, state: Any) -> None:
        super().restore_state(state)
        self.rng = np.random.default_rng(7)


def good() -> RandomCounter:
    return RandomCounter(10)


def forgets_position() -> ForgetsPosition:
    return ForgetsPosition(10)


def forgets_generator() -> ForgetsGenerator:
    return ForgetsGenerator(10)


def good_loader() -> SavableDataLoader:
    return SavableDataLoader(
        RandomCounter(10), batch_size=2, worker_config=WorkerConfig(checkpoint_share=1.0)
    )


def sparse_loader() -> SavableDataLoader:
    return SavableDataLoader(RandomCounter(6), batch_size=None)


def broken() -> Any:
    raise ValueError("boom: no data here")


def torch_loader() -> DataLoader[Any]:
    return DataLoader(RandomCounter(4))


SHARED = RandomCounter(4)


def shared() -> RandomCounter:
    return SHARED


NOT_CALLABLE = 3


def _crop(index: int, rng: Any) -> tuple[int, int]:
    return index, int(rng.integers(100))


def _every_third(index: int) -> bool:
    return index % 3 == 0


def shuffled_map_style() -> Any:
    """Read by position: one global stream on every layout."""
    from savable_loader.datasets import IndexedDataset

    source = IndexedDataset(list(range(48)), shuffle=True, seed=1).map(_crop, seed=2)
    return source.shuffle(buffer_size=8, seed=3)


def filtered() -> Any:
    """A filter's streams pass as many items as they read: the ranks do not keep step."""
    from savable_loader.datasets import IndexedDataset

    return IndexedDataset(list(range(48)), shuffle=True, seed=1).filter(_every_third)


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["verify", "--no-progress", *args])
    out, err = capsys.readouterr()
    return code, out, err


# -- the Python API ---------------------------------------------------------------------


def test_verify_returns_a_report() -> None:
    calls: list[tuple[int, int]] = []

    report = verify(good, num_workers=0, points=4, progress=lambda d, t: calls.append((d, t)))

    assert isinstance(report, VerifyReport)
    assert report.items_per_epoch == [10, 10]
    assert (report.num_workers, report.batch_size, report.checkpoint_share) == (0, None, 1.0)
    assert report.pipeline == "RandomCounter"
    assert not report.from_loader
    labels = report.save_points
    assert report.boundary_points == 5  # before iter(), 2 x after iter(), 2 x StopIteration
    for label in ("epoch 0, after item 1 ", "epoch 0, after item 10 ", "epoch 1, after item 10 "):
        assert any(point.startswith(label) for point in labels), label
    assert report.chains > 0
    assert report.restores == len(labels) + 1 + 2 * report.chains
    done = [d for d, _ in calls]
    assert done == list(range(1, len(calls) + 1))
    assert calls[-1][0] == calls[-1][1]


def test_verify_names_the_forgotten_position() -> None:
    with pytest.raises(ResumeMismatch) as caught:
        verify(forgets_position, num_workers=0, points=2)

    mismatch = caught.value
    # The first check that catches it: restore the state saved before iter(), read one
    # item, save (the position is forgotten), restore, and item 2 is item 1 again.
    assert mismatch.point == "before iter(), then 1 item, saved and restored again"
    assert (mismatch.epoch, mismatch.position, mismatch.after_restore) == (0, 1, 0)
    assert mismatch.worker is None  # no workers
    assert mismatch.fields == ["index"]  # generator states are restored: draws agree
    assert (mismatch.expected["index"], mismatch.got["index"]) == (1, 0)
    assert mismatch.differences == ["index: 0, expected 1"]
    message = str(mismatch)
    assert message.startswith(f'at save point "{mismatch.point}": ')
    assert (
        "resumed epoch 0 differs at item 2 (its 1st item after the restore; main process) "
        "in fields ['index']"
    ) in message
    assert "expected: {'index': 1, " in message


def test_verify_names_a_forgotten_generator() -> None:
    with pytest.raises(ResumeMismatch) as caught:
        verify(forgets_generator, num_workers=0, points=0)

    assert caught.value.fields == ["own"]
    assert caught.value.point == "before iter(), then 1 item, saved and restored again"


@pytest.mark.slow
def test_verify_with_workers_names_the_worker() -> None:
    report = verify(good, num_workers=2, batch_size=2, points=2, chain_items=(1,))
    assert report.items_per_epoch == [6, 6]  # 5 items per worker: batches of 2, 2, 1

    with pytest.raises(ResumeMismatch) as caught:
        verify(forgets_position, num_workers=2, batch_size=2, points=0, chain_items=())
    mismatch = caught.value  # the chains are off: this is the first restore that diverges
    # After item 1 (worker 0's first batch) comes worker 1's first batch, which its
    # restored copy produces right; worker 0's next batch starts over at index 0.
    assert mismatch.point == "epoch 0, after item 1 (item 1 overall)"
    assert (mismatch.epoch, mismatch.position, mismatch.after_restore) == (0, 2, 1)
    assert mismatch.worker == mismatch.expected_worker == 0
    assert mismatch.fields == ["index"]
    assert mismatch.expected["index"].tolist() == [4, 6]
    assert mismatch.got["index"].tolist() == [0, 2]
    assert "(its 2nd item after the restore; worker 0)" in str(mismatch)
    assert "index: 2 of 2 values differ; first at [0]: 0, expected 4" in str(mismatch)


def test_verify_takes_a_loader_as_given(caplog: pytest.LogCaptureFixture) -> None:
    report = verify(good_loader, points=1)
    assert report.from_loader
    assert (report.batch_size, report.checkpoint_share) == (2, 1.0)
    assert report.items_per_epoch == [5, 5]

    with caplog.at_level(logging.WARNING, logger="savable_loader.testing"):
        verify(sparse_loader, points=0, chain_items=())
    assert "checkpoint_share=0.01" in caplog.text


def test_differences_are_structural() -> None:
    want = {"a": 1, "b": (torch.zeros(2, 3), "x"), "c": np.arange(3), "d": 1.0}
    got = {"a": 1, "b": (torch.ones(2, 3), "y"), "c": np.arange(3.0), "e": 2}
    assert _differences(want, got, "") == [
        ("b[0]", "6 of 6 values differ; first at [0, 0]: 1, expected 0"),
        ("b[1]", "'y', expected 'x'"),
        ("c", "dtype float64, expected int64"),
        ("d", "missing from the resumed item"),
        ("e", "not in the expected item"),
    ]
    assert _differences(torch.zeros(2, 3), torch.zeros(3, 2), "") == [
        ("<item>", "shape (3, 2), expected (2, 3)")
    ]
    assert _differences([1, 2], [1, 2, 3], "") == [("<item>", "length 3, expected 2")]


# -- the command ------------------------------------------------------------------------


def test_cli_passes_a_good_dataset(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, f"{MODULE}:good", "--num-workers", "0", "--points", "3")

    assert code == 0, out + err
    assert err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"savable-loader verify {MODULE}:good: 2 epochs, 3 random")
    assert "OK: every restored loader continued the uninterrupted stream exactly" in lines
    assert "  items per epoch:   10, 10 (2 epochs)" in lines
    assert any(
        line.startswith("  save points:       ") and "5 boundaries" in line for line in lines
    )
    assert any(line.startswith("  chains:            ") for line in lines)
    assert any(line.startswith("  time:              ") for line in lines)


def test_cli_reports_the_first_divergence(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, f"{MODULE}:forgets_position", "--num-workers", "0")

    assert code == 1
    assert (
        'DIVERGED at save point "before iter(), then 1 item, saved and restored again": '
        "resumed epoch 0 differs at item 2 (its 1st item after the restore; main process) in fields ['index']"
    ) in out
    assert "  index: 0, expected 1" in out
    assert "  got:      {'index': 0, " in out


def test_cli_takes_a_py_path_and_a_loader(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, f"{HERE}:good_loader", "--points", "1")
    assert code == 0, out + err
    assert "  batches per epoch: 5, 5 (2 epochs)" in out
    assert "batch size 2, every item checkpointed" in out


@pytest.mark.parametrize(
    ("target", "options", "message"),
    [
        ("no_colon", [], "'no_colon' is not MODULE:FACTORY"),
        (":good", [], "':good' is not MODULE:FACTORY"),
        (f"{MODULE}:", [], f"'{MODULE}:' is not MODULE:FACTORY"),
        ("no_such_module_xyz:f", [], "cannot import 'no_such_module_xyz': No module named"),
        (f"{MODULE}:missing", [], f"{MODULE} has no attribute 'missing'"),
        (f"{MODULE}:NOT_CALLABLE", [], f"{MODULE}:NOT_CALLABLE is a int, not a callable"),
        ("/no/such/file.py:f", [], "/no/such/file.py: no such file"),
        (f"{MODULE}:broken", [], f"{MODULE}:broken raised ValueError: boom: no data here"),
        (f"{MODULE}:torch_loader", [], "the factory returned a torch DataLoader"),
        (f"{MODULE}:shared", [], "returned the same RandomCounter object twice"),
        (
            f"{MODULE}:good_loader",
            ["--num-workers", "2", "--batch-size", "4"],
            "num_workers and batch_size cannot be given when the factory returns a "
            "SavableDataLoader",
        ),
        (f"{MODULE}:good", ["--epochs", "0"], "epochs must be at least 1, got 0"),
    ],
)
def test_cli_usage_errors_exit_2(capsys, target, options, message) -> None:
    code, out, err = _run(capsys, target, *options)

    assert code == 2
    (line,) = err.splitlines()
    assert line.startswith("savable-loader verify: error: ")
    assert message in line
    assert "Traceback" not in out + err


def test_cli_import_errors_exit_2(tmp_path, capsys) -> None:
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('no GPU here')\n")
    (tmp_path / "bad_syntax.py").write_text("def f(:\n")

    code, _, err = _run(capsys, f"{tmp_path / 'raises_on_import.py'}:f")
    assert code == 2
    assert err.strip().endswith("raised RuntimeError: no GPU here")

    code, _, err = _run(capsys, f"{tmp_path / 'bad_syntax.py'}:f")
    assert code == 2
    assert "raised SyntaxError" in err
    assert len(err.splitlines()) == 1


@pytest.mark.slow
def test_cli_end_to_end_in_a_new_process(tmp_path) -> None:
    pipeline = tmp_path / "my_pipeline.py"
    pipeline.write_text(
        "from pipelines import RandomCounter\n\n"
        "def build():\n"
        "    return RandomCounter(8, uneven=True)\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "savable_loader.cli",
            "verify",
            f"{pipeline}:build",
            "--points",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**__import__("os").environ, "PYTHONPATH": pythonpath()},
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK: every restored loader continued" in done.stdout
    assert "2 workers, items one by one, every item checkpointed" in done.stdout
    assert "  items per epoch:   19, 19 (2 epochs)" in done.stdout  # 8 + 11
    assert done.stderr == ""  # no bar: stderr is not a terminal


class JumpsToEnd(RandomCounter):
    """Restores to the end of the epoch, whatever the state says."""

    def restore_state(self, state: Any) -> None:
        super().restore_state(state)
        if state is not None:
            self.pos = self.n


def _dense(dataset: Any) -> Any:
    config = WorkerConfig(checkpoint_share=1.0)
    return lambda: SavableDataLoader(dataset(), batch_size=None, worker_config=config)


def test_harness_reports_a_short_and_a_long_epoch() -> None:
    with pytest.raises(ResumeMismatch) as short:
        assert_resumes_exactly(
            _dense(lambda: JumpsToEnd(10)), points=[3], boundaries=False, chain_items=()
        )
    assert str(short.value).startswith(
        'at save point "epoch 0, after item 3 (item 3 overall)": resumed epoch 0 ended early: '
        "3 items, expected 10 (item 4, its 1st after the restore, is missing)"
    )
    assert (short.value.got, short.value.expected["index"]) == (None, 3)

    with pytest.raises(ResumeMismatch) as long:
        assert_resumes_exactly(
            _dense(forgets_position), points=[10], boundaries=False, chain_items=()
        )
    assert str(long.value).startswith(
        'at save point "epoch 0, after item 10 (item 10 overall)": resumed epoch 0 goes on '
        "past its end: more than 10 items, expected 10 (item 11, its 1st after the restore, "
        "from main process)"
    )
    assert (long.value.expected, long.value.got["index"]) == (None, 0)


# -- --elastic ----------------------------------------------------------------------------


def test_cli_elastic_passes_a_pipeline_read_by_position(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, f"{MODULE}:shuffled_map_style", "--elastic", "2x1x4,1x0x8,4x0x2")
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].endswith(
        "2 ranks x 1 worker x batch 4, 1 rank x 0 workers x batch 8, 4 ranks x 0 workers x batch 2"
    )
    assert (
        "OK: every layout gave the same global batches, and every restore went on with them"
        in lines
    )
    assert "  global steps:      6, 6 (2 epochs)" in lines
    assert "  restores:          12 onto another layout" in lines


def test_cli_elastic_reports_a_pipeline_whose_batches_follow_the_layout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = _run(capsys, f"{MODULE}:filtered", "--elastic", "2x0x4,1x0x8")
    assert code == 1
    assert out.splitlines()[-1].startswith("DIVERGED ")


@pytest.mark.parametrize(
    ("layouts", "message"),
    [
        ("2x1x4,1x0x6", "of one global batch size"),
        ("2x1x4", "at least two layouts"),
        ("2x1,1x0x8", "RANKSxWORKERSxBATCH"),
        ("0x1x4,0x0x4", "at least 1 rank"),
    ],
)
def test_cli_elastic_usage_errors_exit_2(capsys, layouts, message) -> None:
    code, _, err = _run(capsys, f"{MODULE}:shuffled_map_style", "--elastic", layouts)
    assert code == 2
    assert message in err


def test_cli_elastic_refuses_a_factory_of_loaders(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, f"{MODULE}:good_loader", "--elastic", "2x0x4,1x0x8")
    assert code == 2
    assert "returns a dataset, not a loader" in err
