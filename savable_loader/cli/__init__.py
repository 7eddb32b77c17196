"""The ``savable-loader`` command: ``demo``, ``inspect``, ``verify`` and ``counts``.

``savable-loader demo`` trains a small model over a synthetic pipeline with worker
processes, kills the run with SIGKILL part way, resumes it in a new process from the last
saved state, and checks that the resumed stream of batches is the uninterrupted one
(NOTE [ Demo ] in ``demo_child.py``). ``savable-loader inspect URL`` prints what a state file
holds. ``savable-loader verify MODULE:FACTORY`` runs the resume-equivalence check
(:func:`savable_loader.testing.verify`) on a user's pipeline. ``savable-loader counts
{tar,jsonl} URL... --out URL`` writes a counts file. Reports go to stdout, errors
to stderr as one line; exit codes: 0 success, 1 the demo or the check found a difference
(or a demo process failed), 2 bad usage, an unreadable state or a factory that cannot be
loaded.

The package holds one module per command (``inspect.py``, ``verify.py``, ``counts.py``,
``demo.py``; the demo's pipeline and child processes in ``demo_child.py``); this one
parses the arguments and dispatches.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .._version import __version__
from .counts import _counts, _counts_parser
from .demo import _demo, _demo_settings
from .demo_child import DemoPaths, run_child
from .inspect import _inspect
from .output import _PROG, _err
from .verify import _verify, _verify_parser

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Save and restore a DataLoader's position exactly: demo and tools.",
    )
    parser.add_argument("--version", action="version", version=f"{_PROG} {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    commands = parser.add_subparsers(
        dest="command", metavar="{demo,inspect,verify,counts}", required=True
    )

    demo = commands.add_parser(
        "demo",
        help="kill a training run, resume it, and check the batches are the same",
        description=(
            "Train over a synthetic pipeline three times, each in its own process: "
            "uninterrupted; saving the loader's state every few steps and killed with "
            "SIGKILL; resumed from the last saved state. Exit 0 when the interrupted "
            "and resumed runs together yield exactly the uninterrupted run's batches."
        ),
    )
    _demo_options(demo)
    demo.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep the demo's files here (default: a temporary folder, removed at the end)",
    )

    inspect = commands.add_parser(
        "inspect",
        help="print what a saved loader state holds",
        description="Print a summary of a state file written by savable_loader.save_state.",
    )
    inspect.add_argument("url", help="a local path or an fsspec URL (s3://..., memory://...)")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")

    _verify_parser(commands)
    _counts_parser(commands)

    child = commands.add_parser("demo-child")  # internal: one process of the demo
    child.add_argument("mode", choices=("reference", "interrupted", "resumed"))
    _demo_options(child)
    child.add_argument("--workdir", type=Path, required=True)
    return parser


def _demo_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument(
        "--steps", type=int, default=40, help="batches per epoch; 2 epochs (default 40)"
    )
    parser.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="step at which the run is killed (default: two thirds of the way, off a save)",
    )
    parser.add_argument(
        "--save-every", type=int, default=10, help="save the state every N steps (default 10)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``savable-loader`` command; returns its exit code.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 1 when the demo or the check fails, 2 on bad usage, an unreadable
        state or a factory that cannot be loaded.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version and usage errors
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.command == "verify":
        return _verify(args)
    if args.command == "counts":
        return _counts(args)
    if args.command == "inspect":
        try:
            return _inspect(args.url, as_json=args.json)
        except BrokenPipeError:
            # The reader left (``| head``): stop quietly, as Unix tools do.
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - replaces the closed stream
            return 0
    try:
        settings = _demo_settings(args)
    except ValueError as error:
        _err(f"{_PROG} {args.command}: error: {error}")
        return 2
    if args.command == "demo-child":
        return run_child(args.mode, settings, DemoPaths(args.workdir))
    return _demo(settings, args.workdir)
