"""The trainer how-to pages' complete examples run as written, on one process and on two.

docs/how-to/lightning.md, accelerate.md and hf-trainer.md each show a complete example:
a run crashed mid-epoch (an exception standing for a killed job), resumed from the
trainer's last checkpoint by a new trainer, and an ``assert`` that every step's item ids,
augmented values and losses are an uninterrupted run's. The example is a script under
examples/, shown on its page verbatim (a test here fails when they drift). test_docs.py
runs each page's example on one process; the tests here run each script as a job on two
gloo ranks with torchrun's environment variables, forked from a process that imported the
library once (tests/support/zygote.py), as each page says to (the Lightning page: with its several-ranks ``Trainer`` in place of
the example's). A job's script checks itself: its ``assert`` fails the job. The same
integrations killed with SIGKILL and resumed in new processes are test_lightning.py's,
test_accelerate.py's and test_hf_trainer.py's.
"""

from __future__ import annotations

import sys
import textwrap
from importlib.util import find_spec
from pathlib import Path

import pytest
from test_docs import ROOT, Block, parse
from trainer_jobs import run_job
from zygote import Zygote

TIMEOUT = 150  # a hang is still caught; a loaded 2-core CI machine is slow

#: Page, example script, the packages it needs.
PAGES = {
    "lightning": ("docs/how-to/lightning.md", "examples/resume_lightning.py", ("lightning",)),
    "accelerate": ("docs/how-to/accelerate.md", "examples/resume_accelerate.py", ("accelerate",)),
    "hf-trainer": (
        "docs/how-to/hf-trainer.md",
        "examples/resume_hf_trainer.py",
        ("transformers", "accelerate"),
    ),
}


#: What each example imports, imported once for both ranks.
PRELOAD = {
    "lightning": ("lightning.pytorch", "savable_loader.integrations.lightning"),
    "accelerate": ("accelerate", "savable_loader.integrations.accelerate"),
    "hf-trainer": ("transformers.trainer", "savable_loader.integrations.hf_trainer"),
}


def _blocks(page: str) -> list[Block]:
    return parse(ROOT / page)


def _trainer_call(code: str) -> tuple[int, int]:
    """The lines (start, end) of the example's ``trainer = pl.Trainer(...)`` statement."""
    lines = code.splitlines()
    start = lines.index("    trainer = pl.Trainer(")
    return start, lines.index("    )", start) + 1


def _several_ranks(example: str, trainer: str) -> str:
    """The Lightning example with the page's several-ranks ``Trainer`` in place of its own."""
    lines = example.splitlines()
    start, end = _trainer_call(example)
    call = textwrap.indent(trainer, "    ").splitlines()
    return "\n".join([*lines[:start], *call, *lines[end:]]) + "\n"


@pytest.mark.parametrize("name", PAGES)
def test_the_page_shows_its_example_script(name: str) -> None:
    """The page's first Python block is the script under examples/, character for
    character; test_docs.py runs it (the page does not skip it)."""
    page, script, _ = PAGES[name]
    first = _blocks(page)[0]
    assert first.skip is None, page
    assert first.code + "\n" == (ROOT / script).read_text(), f"{page} and {script} differ"


def test_the_lightning_page_changes_only_the_trainer_for_several_ranks() -> None:
    """The several-ranks block is the example's ``Trainer`` call with ``devices=2`` and
    ``strategy="ddp"``: nothing else changes."""
    example, trainer = (block.code for block in _blocks(PAGES["lightning"][0])[:2])
    start, end = _trainer_call(example)
    own = textwrap.dedent("\n".join(example.splitlines()[start:end]))
    expected = own.replace("devices=1,\n", 'devices=2,\n    strategy="ddp",\n')
    assert expected != own
    assert trainer == expected


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", PAGES)
def test_the_example_runs_on_two_ranks(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page's example on two gloo ranks: each rank's run crashed at step 13 and
    resumed from step 10 trains on the uninterrupted run's items, augmented values and
    losses (the script's ``assert``), with every rank training one model over its share."""
    page, script, needs = PAGES[name]
    for package in needs:
        if find_spec(package) is None:
            pytest.skip(f"{package} is not installed")
    path = ROOT / script
    if name == "lightning":
        example, trainer = (block.code for block in _blocks(page)[:2])
        path = tmp_path / "resume_lightning_ddp.py"
        path.write_text(_several_ranks(example, trainer))
    # The script writes its runs' checkpoints under the working directory, which the
    # job's processes take from this one.
    monkeypatch.chdir(tmp_path)
    # Both ranks forked from a process that imported the library once (NOTE [ Jobs from a
    # zygote ] in zygote.py), with torchrun's environment variables.
    command = [sys.executable, str(path), "job", str(tmp_path), "none"]
    with Zygote(*PRELOAD[name]) as zygote:
        assert run_job(command, "none", TIMEOUT, zygote=zygote, ranks=2) == 0
