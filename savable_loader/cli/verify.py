"""``savable-loader verify MODULE:FACTORY``: its arguments, the import of the factory, a
progress bar, and a report of :func:`savable_loader.testing.verify` run on the factory.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

from tqdm import tqdm

from ..errors import ConfigError
from ..testing import ResumeMismatch, Shape, VerifyReport, assert_elastic, elastic_builder, verify
from .output import _PROG, _err, _out, _plural

logger = logging.getLogger(__name__)


def _verify_parser(commands: Any) -> None:
    verify_ = commands.add_parser(
        "verify",
        help="check that your pipeline resumes exactly from any save point",
        description=(
            "Import FACTORY from MODULE (a module name or a path to a .py file), build "
            "loaders over what it returns (a dataset, or a SavableDataLoader used as "
            "given), save at many points of an uninterrupted run, restore each state into "
            "a fresh loader and check that it yields exactly the rest of the stream. Exit 0 "
            "when every restore does, 1 with the first divergence, 2 on bad usage."
        ),
    )
    verify_.add_argument(
        "target",
        metavar="MODULE:FACTORY",
        help="e.g. my_project.data:build_dataset or path/to/pipeline.py:build",
    )
    verify_.add_argument(
        "--num-workers",
        type=int,
        default=None,
        metavar="N",
        help="worker processes (default 2); not with a factory that returns a loader",
    )
    verify_.add_argument(
        "--batch-size",
        type=int,
        default=None,
        metavar="B",
        help="items per batch (default: items one by one); not with a factory that returns "
        "a loader",
    )
    verify_.add_argument(
        "--points",
        type=int,
        default=6,
        metavar="K",
        help="random save points, besides the first and last item of every epoch and the "
        "epoch boundaries (default 6)",
    )
    verify_.add_argument(
        "--epochs", type=int, default=2, metavar="E", help="epochs of the reference run (default 2)"
    )
    verify_.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="seed of the choice of save points (default 0)",
    )
    verify_.add_argument("--no-progress", action="store_true", help="no progress bar")
    verify_.add_argument(
        "--elastic",
        metavar="RxWxB,...",
        default=None,
        help="instead, check one global stream (savable_loader.testing.assert_elastic) on "
        "these layouts of one global batch size, e.g. 2x1x4,1x0x8,4x0x2 (ranks x workers x "
        "per-rank batch size); the factory returns a dataset",
    )


class _UsageError(Exception):
    """MODULE:FACTORY cannot be loaded; the message says why, in one line."""


class _FactoryFailed(Exception):
    """The user's factory raised ``error``."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _load_factory(target: str) -> Callable[[], Any]:
    """Imports ``MODULE:FACTORY``; MODULE is a module name or a path to a .py file."""
    module_name, colon, attribute = target.rpartition(":")
    if not colon or not module_name or not attribute:
        raise _UsageError(
            f"{target!r} is not MODULE:FACTORY (for example my_project.data:build_dataset "
            "or path/to/pipeline.py:build)"
        )
    module = _import(module_name)
    factory: Any = module
    for part in attribute.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError:
            raise _UsageError(f"{module_name} has no attribute {attribute!r}") from None
    if not callable(factory):
        raise _UsageError(f"{target} is a {type(factory).__name__}, not a callable")
    return cast("Callable[[], Any]", factory)


def _import(name: str) -> Any:
    if name.endswith(".py") or "/" in name or os.sep in name:
        return _import_file(Path(name))
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as ``python -m`` does
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        logger.debug("importing %s failed", name, exc_info=True)
        raise _UsageError(f"cannot import {name!r}: {error}") from None
    except Exception as error:
        logger.debug("importing %s failed", name, exc_info=True)
        raise _UsageError(
            f"importing {name!r} raised {type(error).__name__}: {_brief(error)}"
        ) from None


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise _UsageError(f"{path}: no such file")
    path = path.resolve()
    # Its folder goes on sys.path so that worker processes started with spawn or
    # forkserver import the module (and the classes pickled from it) by its name.
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    if loaded is not None or not name.isidentifier():
        name = f"_savable_loader_verify_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise _UsageError(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        logger.debug("importing %s failed", path, exc_info=True)
        raise _UsageError(
            f"importing {path} raised {type(error).__name__}: {_brief(error)}"
        ) from None
    return module


def _brief(error: BaseException) -> str:
    """One line for an error; a worker's error keeps its first and last line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) > 2 and any(line.startswith("Original Traceback") for line in lines):
        return f"{lines[0]} {lines[-1]}"
    return "; ".join(lines)


class _Bar:
    """A tqdm progress bar on stderr, made on the first update."""

    def __init__(self) -> None:
        self._bar: Any = None

    def update(self, done: int, total: int) -> None:
        if self._bar is None:
            self._bar = tqdm(
                total=total,
                desc="verify",
                unit="run",
                file=sys.stderr,
                leave=False,
                ncols=min(shutil.get_terminal_size().columns, 100),  # 80 if it reports 0
            )
        self._bar.total = total
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _verify(args: argparse.Namespace) -> int:
    prefix = f"{_PROG} verify"
    try:
        factory = _load_factory(args.target)
    except _UsageError as error:
        _err(f"{prefix}: error: {error}")
        return 2

    def guarded() -> Any:
        try:
            return factory()
        except Exception as error:
            raise _FactoryFailed(error) from error

    if args.elastic is not None:
        return _verify_elastic(args, guarded)
    _out(
        f"{prefix} {args.target}: {_epochs(args.epochs)}, "
        f"{_plural(args.points, 'random save point')} (seed {args.seed}) and the fixed ones"
    )
    bar = _Bar()
    show = not args.no_progress and sys.stderr.isatty()
    try:
        report = verify(
            guarded,
            num_workers=args.num_workers,
            batch_size=args.batch_size,
            points=args.points,
            epochs=args.epochs,
            seed=args.seed,
            progress=bar.update if show else None,
        )
    except ResumeMismatch as mismatch:
        _out(f"DIVERGED {mismatch}" if mismatch.point else f"FAILED: {mismatch}")
        return 1
    except Exception as error:
        return _failed(args, error)
    finally:
        bar.close()
    for line in _verify_summary(report):
        _out(line)
    return 0 if sum(report.items_per_epoch) else 1


def _failed(args: argparse.Namespace, error: Exception) -> int:
    """Reports a check that could not run (the factory or an argument: exit 2) or that
    raised (exit 1)."""
    prefix = f"{_PROG} verify"
    if isinstance(error, _FactoryFailed):
        logger.debug("the factory raised", exc_info=error.error)
        cause = error.error
        _err(f"{prefix}: error: {args.target} raised {type(cause).__name__}: {_brief(cause)}")
        return 2
    if isinstance(error, ConfigError):
        _err(f"{prefix}: error: {_brief(error)}")
        return 2
    logger.debug("the check raised", exc_info=True)
    _out(f"FAILED: the check raised {type(error).__name__}: {_brief(error)}")
    return 1


def _layouts(text: str) -> list[Shape]:
    """``RxWxB,...`` as layouts."""
    layouts = []
    for part in text.split(","):
        numbers = part.strip().lower().split("x")
        if len(numbers) != 3 or not all(number.isdigit() for number in numbers):
            raise _UsageError(
                f"--elastic takes layouts RANKSxWORKERSxBATCH separated by commas, e.g. "
                f"2x1x4,1x0x8; got {part.strip()!r}"
            )
        ranks, workers, batch = (int(number) for number in numbers)
        if ranks < 1 or batch < 1:
            raise _UsageError(f"--elastic: {part.strip()!r} needs at least 1 rank and batch 1")
        layouts.append(Shape(ranks, workers, batch))
    if len(layouts) < 2 or len({layout.global_batch for layout in layouts}) != 1:
        raise _UsageError(
            "--elastic compares at least two layouts of one global batch size (ranks x "
            f"batch); got {text!r}"
        )
    return layouts


def _verify_elastic(args: argparse.Namespace, factory: Callable[[], Any]) -> int:
    """``--elastic``: :func:`assert_elastic` on loaders over what ``factory`` returns."""
    prefix = f"{_PROG} verify"
    try:
        layouts = _layouts(args.elastic)
    except _UsageError as error:
        _err(f"{prefix}: error: {error}")
        return 2

    build = elastic_builder(factory, seed=args.seed)

    shown = ", ".join(str(layout) for layout in layouts)
    _out(f"{prefix} {args.target} --elastic: {_epochs(args.epochs)} on {shown}")
    try:
        report = assert_elastic(build, layouts, epochs=args.epochs)
    except AssertionError as mismatch:  # an ElasticMismatch, or ranks of unequal epochs
        _out(f"DIVERGED {mismatch}")
        return 1
    except Exception as error:
        return _failed(args, error)
    _out("OK: every layout gave the same global batches, and every restore went on with them")
    steps = ", ".join(str(count) for count in report.steps)
    _out(_field("global steps", f"{steps} ({_epochs(args.epochs)})"))
    _out(_field("restores", f"{report.restores} onto another layout"))
    return 0


def _verify_summary(report: VerifyReport) -> Iterator[str]:
    items = sum(report.items_per_epoch)
    if not items:
        yield f"FAILED: nothing to check, the pipeline yielded no items in {report.epochs} epochs"
    else:
        yield "OK: every restored loader continued the uninterrupted stream exactly"
    where = _plural(report.num_workers, "worker") if report.num_workers else "no workers"
    batch = "items one by one" if report.batch_size is None else f"batch size {report.batch_size}"
    if report.checkpoint_share >= 1:
        checkpoints = "every item checkpointed"
    else:
        checkpoints = f"checkpoint_share={report.checkpoint_share:g}, replays may hide bugs"
    yield _field("pipeline", f"{report.pipeline}; {where}, {batch}, {checkpoints}")
    unit = "items" if report.batch_size is None and not report.from_loader else "batches"
    per_epoch = ", ".join(str(n) for n in report.items_per_epoch)
    yield _field(f"{unit} per epoch", f"{per_epoch} ({_epochs(report.epochs)})")
    after_items = len(report.save_points) - report.boundary_points
    yield _field(
        "save points",
        f"{len(report.save_points)} checked ({after_items} after items: random, first and "
        f"last of each epoch; {report.boundary_points} boundaries: before iter(), after "
        "iter(), after StopIteration)",
    )
    yield _field("chains", f"{report.chains} (restore, consume, save, restore again)")
    yield _field("restores", str(report.restores))
    yield _field("time", f"{report.seconds:.1f} s")


def _epochs(count: int) -> str:
    return "1 epoch" if count == 1 else f"{count} epochs"


def _field(name: str, value: str) -> str:
    return f"  {name + ':':<18} {value}"
