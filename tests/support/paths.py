"""Where the repository's parts are, for the tests that read its files or start Python
processes importing the shared helpers of this folder (NOTE [ Test folders ] in
tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

#: This folder: the shared helpers, imported under their own names (``import gloo``).
SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
ROOT = TESTS.parent
#: State files written by an earlier version (``golden/make_golden.py``).
GOLDEN = SUPPORT / "golden"


def pythonpath(*folders: Path) -> str:
    """A ``PYTHONPATH`` for a child process: the repository (the package), this folder (the
    helpers), then ``folders`` (a test file's own folder, to import the file by its name),
    then the ``PYTHONPATH`` of this process."""
    paths = [str(path) for path in (ROOT, SUPPORT, *folders)]
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join([*paths, inherited] if inherited else paths)
