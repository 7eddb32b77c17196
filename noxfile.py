"""Nox sessions for savable_loader.

CI runs ``.ci/run`` (``nox -s tests``, every test); a quick local run is
``nox -s tests -- -m "not slow"``.

Torch is installed first from ``SAVABLE_LOADER_TORCH`` (default ``torch==2.13.0``,
the CPU build available locally) so that ``pip install -e .`` finds ``torch>=2.4``
already satisfied and does not pull a multi-GB CUDA build. Set it to ``torch`` to
take the registry's default build, or to an empty string to skip the step.

``tests_lowest`` runs the quick suite against the lowest versions ``pyproject.toml``
declares (:data:`LOWEST`), so that the declared ranges are true; CI runs it too. Torch
2.4 comes from the registry as a CUDA build (about 3 GB, a minute or two here); it runs
on the CPU.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "typing", "tests", "tests_lowest"]

DEFAULT_TORCH = "torch==2.13.0"
#: The lowest version of every dependency pyproject.toml declares; keep them in step.
LOWEST = (
    "torch==2.4.0",
    "numpy==1.24.0",
    "msgpack==1.0.0",
    "fsspec==2024.6.0",
    "pydantic==2.5.0",
    "tqdm==4.66.3",
)
#: The test extra's versions beside :data:`LOWEST`, pinned so that pip resolves at once:
#: ``s3fs`` must equal ``fsspec``'s version, and its aiobotocore pins botocore to a narrow
#: range that boto3 must match (left open, pip backtracked through boto3 releases for over
#: 25 minutes). The ``hf`` extra (Hugging Face ``datasets``) is left out: the versions its
#: tests pass with need NumPy 2, so those tests skip here.
LOWEST_TEST = (
    "s3fs==2024.6.0",
    "aiobotocore==2.26.0",
    "boto3==1.41.5",
    "botocore==1.41.5",
    # The parquet extra's lowest: its cp311 wheels are built against NumPy 1, as LOWEST's.
    "pyarrow==14.0.1",
    # The lightning extra's lowest; it resolves beside torch 2.4 and NumPy 1.24.
    "lightning==2.4.0",
    # The obstore extra's lowest.
    "obstore==0.12.1",
)
LINT_PATHS = ("savable_loader", "tests", "benchmarks", "examples", "noxfile.py")
# NOTE [ Four test processes ]
# Most of the suite's time is spent starting loaders, workers and training jobs, and a
# single pytest process kept 1.47 of this machine's 2 cores busy (20 min 39 s). Two
# pytest-xdist processes, each taking whole files (module fixtures such as the S3 server
# and the trainer tests' shared reference runs stay in one process), kept 1.58 to 1.82
# busy; a test waiting on its ranks, a timeout or a server leaves its core to the others.
# Three processes kept 1.71 busy: the whole suite took 14 min 50 s where two had taken
# 17 min 49 s (2,391 tests, 2026-11-29, quiet machine; the later commit was also about 10%
# cheaper in CPU). Four, on the same commit: 14 min 16 s against three's 15 min 10 s
# (1.74 cores busy against 1.68; 2,394 tests, 2026-11-29); each holds 0.3 to 0.5 GB.
# The files go out in collection order (``--no-loadscope-reorder``; by default
# pytest-xdist sends the files with the most tests first, which left the trainer tests,
# few and long, for the end: NOTE [ Longest files first ] in tests/conftest.py). A test
# that checks something machine-wide (tests/processes/test_hygiene.py: /dev/shm) must
# tell its own entries from the other processes'. ``-n 0`` in the session's arguments
# runs the tests in one process again.
PYTEST_PROCESSES = ("-n", "4", "--dist", "loadfile", "--no-loadscope-reorder")


def install_project(session: nox.Session, *extras: str) -> None:
    """Install the torch spec from the environment, then the project in editable mode."""
    torch_spec = os.environ.get("SAVABLE_LOADER_TORCH", DEFAULT_TORCH).strip()
    if torch_spec:
        session.install(torch_spec)
    target = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", target)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (pytest exit code 5, no tests collected, fails the session)."""
    install_project(session, "test", "hf", "accelerate", "transformers")
    session.run("pytest", *PYTEST_PROCESSES, *session.posargs)


@nox.session
def tests_lowest(session: nox.Session) -> None:
    """The quick suite against the lowest declared versions (:data:`LOWEST`)."""
    session.install(*LOWEST)
    session.install("-e", ".[test]", *LOWEST, *LOWEST_TEST)
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("pytest", *PYTEST_PROCESSES, "-m", "not slow", *session.posargs)


def dev_pin(name: str) -> str:
    """The pin of tool ``name`` (ruff, mypy) in pyproject.toml's ``dev`` extra."""
    with open("pyproject.toml", "rb") as file:
        dev = tomllib.load(file)["project"]["optional-dependencies"]["dev"]
    (pin,) = [spec for spec in dev if spec.partition("==")[0] == name]
    return str(pin)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff lint and format check."""
    session.install(dev_pin("ruff"))
    paths = [path for path in LINT_PATHS if Path(path).exists()]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session
def typing(session: nox.Session) -> None:
    """Mypy (strict) on the package, beside the optional libraries it imports and that ship
    types (Lightning, obstore, transformers; the rest are ignored where missing: pyproject's
    mypy overrides). The whole ``dev`` extra took CI 10 minutes to install; these take one."""
    install_project(session, "lightning", "obstore", "transformers")
    session.install(dev_pin("mypy"))
    session.run("mypy")


@nox.session
def demo(session: nox.Session) -> None:
    """Run ``savable-loader demo``; extra arguments go to the demo."""
    install_project(session)
    session.run("savable-loader", "demo", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Run every ``benchmarks/bench_*.py`` in name order; extra arguments go to each."""
    install_project(session)
    # bench_peers.py: plots (matplotlib), generated JPEGs (pillow) and the peer loaders.
    # The project's torch is installed first, so Energon does not pull another build.
    session.install("matplotlib", "pillow", "torchdata>=0.10", "megatron-energon")
    # bench_fair.py's S3 server and peers (Mosaic Streaming, LitData). Both require
    # torchvision; naming the project's torch again makes pip take the torchvision built
    # for it rather than upgrade torch for a newer one.
    torch_spec = os.environ.get("SAVABLE_LOADER_TORCH", DEFAULT_TORCH).strip()
    session.install("-e", ".[bench]", *([torch_spec] if torch_spec else []))
    scripts = sorted(Path("benchmarks").glob("bench_*.py"))
    if not scripts:
        session.error("no benchmarks/bench_*.py scripts found")
    for script in scripts:
        session.run("python", str(script), *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation, warnings as errors."""
    install_project(session, "docs")
    session.run("mkdocs", "build", "--strict")
