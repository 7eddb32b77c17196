"""Tests of the test and packaging scaffolding itself (no savable_loader import)."""

from __future__ import annotations

import ast
import multiprocessing
import time
import tomllib
from collections import Counter

from packaging.version import Version
from paths import ROOT, TESTS

PYPROJECT = ROOT / "pyproject.toml"


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


def test_the_lowest_session_installs_every_declared_minimum() -> None:
    """``nox -s tests_lowest`` (run by CI) tests what pyproject.toml declares."""
    with PYPROJECT.open("rb") as file:
        declared = tomllib.load(file)["project"]["dependencies"]
    minimums = {}
    for requirement in declared:
        name, _, version = requirement.partition(">=")
        minimums[name.strip()] = version.strip()
    noxfile = ast.parse((PYPROJECT.parent / "noxfile.py").read_text())
    (lowest,) = [
        node.value
        for node in noxfile.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "LOWEST"
    ]
    pinned = dict(pin.split("==") for pin in ast.literal_eval(lowest))
    assert {name: Version(version) for name, version in pinned.items()} == {
        name: Version(version) for name, version in minimums.items()
    }


def test_test_folders_hold_at_most_15_files_of_unique_names() -> None:
    """NOTE [ Test folders ] in tests/conftest.py: pytest imports a test file under its base
    name, so two files of one name would collide."""
    files = sorted(TESTS.rglob("test_*.py"))
    folders = Counter(path.parent.relative_to(TESTS).as_posix() for path in files)
    assert {folder: count for folder, count in folders.items() if count > 15} == {}
    names = Counter(path.name for path in files)
    assert {name: count for name, count in names.items() if count > 1} == {}
    assert not list(TESTS.glob("test_*.py")), "a test file belongs in a folder"


def test_the_ordering_tables_name_test_files_that_exist() -> None:
    """NOTE [ Heavy imports last ] and NOTE [ Longest files first ] in tests/conftest.py."""
    import conftest

    named = {*conftest._HEAVY_TIERS, *conftest._LONGEST_MODULES}
    assert {name for name in named if not (TESTS / name).is_file()} == set()


def _top_level_imports(source: str) -> set[str]:
    """The top-level names a Python source imports, ``importorskip`` calls included."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.partition(".")[0])
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "importorskip"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(str(node.args[0].value).partition(".")[0])
    return names


def test_no_test_folder_shadows_an_imported_library() -> None:
    """NOTE [ Test folders ] in tests/conftest.py: ``tests/datasets/`` once stood in for
    Hugging Face ``datasets`` wherever that extra was not installed (``nox -s tests_lowest``),
    so ``pytest.importorskip("datasets")`` returned the folder and its tests failed."""
    imported: set[str] = set()
    for path in TESTS.rglob("*.py"):
        imported |= _top_level_imports(path.read_text())
    # A module of support/ always wins over a folder (a namespace package is the last resort
    # of an import), so a folder may share a name with one (processes/, processes.py).
    imported -= {path.stem for path in (TESTS / "support").glob("*.py")}
    folders = {path.name for path in TESTS.rglob("*") if path.is_dir() and path.name[0] not in "._"}
    assert "datasets" in imported  # the check sees the imports it guards against
    assert folders & imported == set()


def test_the_long_cases_name_tests_that_exist() -> None:
    """NOTE [ Long cases are slow ] in tests/conftest.py: a renamed test would silently
    join the quick suite again."""
    import conftest

    missing = []
    for case in conftest._LONG_CASES:
        path, _, test = case.partition("::")
        function = test.partition("[")[0]
        if not (TESTS / path).is_file() or f"def {function}(" not in (TESTS / path).read_text():
            missing.append(case)
    assert missing == []
