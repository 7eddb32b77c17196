"""Tests of the test and packaging scaffolding itself (no savable_loader import)."""

from __future__ import annotations

import multiprocessing
import sys
import time
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli before Python 3.11
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_joined_child_process_does_not_trip_leak_check() -> None:
    # spawn: forking a multi-threaded pytest process warns on Python >= 3.12.
    process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0.01,))
    process.start()
    process.join(timeout=60)
    assert process.exitcode == 0


def test_pyproject_declares_console_script() -> None:
    with PYPROJECT.open("rb") as file:
        pyproject = tomllib.load(file)
    assert pyproject["project"]["scripts"]["savable-loader"] == "savable_loader.cli:main"
