"""The package's structure: no import circle, layers that import only downward, small
modules, a loader class that reads in one sitting, NOTE references that resolve."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest
from paths import ROOT

PACKAGE = ROOT / "savable_loader"
#: Lines of code a module may have: docstrings, comments and blank lines not counted.
MAX_MODULE_CODE_LINES = 400
MAX_LOADER_CLASS_LINES = 450
#: What the pipeline layer (``savable_loader.datasets``) may import from the package: the
#: layers below it, never the loader and its runtime above.
DATASETS_MAY_IMPORT = (
    "config",
    "errors",
    "plain",
    "rng",
    "state",
    "storage",
    "datasets",
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> Iterator[str]:
    """The package modules ``name`` imports, wherever the import statement sits."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("savable_loader"):
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            elif node.module and node.module.startswith("savable_loader"):
                module = node.module
            else:
                continue
            for alias in node.names:
                candidate = f"{module}.{alias.name}"
                yield candidate if candidate in MODULES else module


GRAPH = {
    name: sorted({target for target in _imports(name, path) if target != name})
    for name, path in MODULES.items()
}


def test_every_import_names_a_module_of_the_package() -> None:
    unknown = {(name, target) for name, targets in GRAPH.items() for target in targets}
    unknown = {(name, target) for name, target in unknown if target not in MODULES}
    assert not unknown


def test_the_import_graph_has_no_circle() -> None:
    circles: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in GRAPH.get(module, []):
            if state.get(target) == "open":
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in MODULES:
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_pipeline_layer_never_imports_the_loader() -> None:
    allowed = tuple(f"savable_loader.{layer}" for layer in DATASETS_MAY_IMPORT)
    upward = [
        (name, target)
        for name, targets in GRAPH.items()
        if name.startswith("savable_loader.datasets")
        for target in targets
        if not target.startswith(allowed)
    ]
    assert not upward


def code_lines(source: str) -> int:
    """The lines that hold code: not blank, not only a comment, not in a docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(body[0].lineno, (body[0].end_lineno or 0) + 1))
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in skip or token.type == tokenize.ENDMARKER:
            continue
        lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def test_code_lines_leave_out_docstrings_comments_and_blank_lines() -> None:
    source = '"""Doc\n\nmore."""\n\n# note\nx = 1  # one\n\n\ndef f():\n    """Doc."""\n    return (\n        2\n    )\n'
    assert code_lines(source) == 5


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_are_small(name: str) -> None:
    lines = code_lines(MODULES[name].read_text())
    assert lines <= MAX_MODULE_CODE_LINES, f"{name} has {lines} lines of code"


def test_the_loader_class_reads_in_one_sitting() -> None:
    tree = ast.parse(MODULES["savable_loader.loader"].read_text())
    (loader,) = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "SavableDataLoader"
    ]
    assert loader.end_lineno is not None
    length = loader.end_lineno - loader.lineno + 1
    assert length <= MAX_LOADER_CLASS_LINES, f"SavableDataLoader has {length} lines"


_NOTE = re.compile(r"NOTE \[ ([^\]]+?) \]", re.DOTALL)


def test_every_note_reference_names_a_note() -> None:
    """``NOTE [ X ]`` in prose must name a note defined somewhere (a line of its own)."""
    defined: set[str] = set()
    mentioned: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        text = path.read_text()
        defined.update(m.group(1) for m in re.finditer(r"^\s*NOTE \[ ([^\]]+?) \]\s*$", text, re.M))
        for match in _NOTE.finditer(text):
            mentioned.setdefault(" ".join(match.group(1).split()), set()).add(name)
    dangling = {note: sorted(where) for note, where in mentioned.items() if note not in defined}
    assert not dangling


_NOTE_IN = re.compile(r"NOTE \[ ([^\]]+?) \]\)?,?\s+in\s+``?([\w/]+\.py)``?", re.DOTALL)
_DOCS = [*sorted((PACKAGE.parent / "docs").rglob("*.md")), PACKAGE.parent / "README.md"]


def _note_homes() -> dict[str, set[Path]]:
    homes: dict[str, set[Path]] = {}
    for path in MODULES.values():
        for match in re.finditer(r"^\s*NOTE \[ ([^\]]+?) \]\s*$", path.read_text(), re.M):
            homes.setdefault(match.group(1), set()).add(path)
    return homes


def test_a_note_reference_that_names_a_file_names_the_file_of_the_note() -> None:
    """``NOTE [ X ] in ``path.py``: the path (from the package root, or beside the file
    that mentions it) is where the note is written, so that a reader lands on it."""
    homes = _note_homes()
    wrong = []
    for path in [*MODULES.values(), *_DOCS]:
        for match in _NOTE_IN.finditer(path.read_text()):
            note, named = " ".join(match.group(1).split()), match.group(2)
            named = named.removeprefix("savable_loader/")
            candidates = {PACKAGE / named, path.parent / named}
            if (PACKAGE.parent / named).exists() or (
                PACKAGE.parent / "benchmarks" / named
            ).exists():
                continue  # a note of the benchmarks or the tests
            if not candidates & homes.get(note, set()):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}: NOTE [ {note} ] in {named}")
    assert not wrong, "\n".join(wrong)


MAX_FOLDER_MODULES = 15
MAX_ROOT_MODULES = 12


def _folders() -> dict[Path, list[Path]]:
    found: dict[Path, list[Path]] = {}
    for path in MODULES.values():
        found.setdefault(path.parent, []).append(path)
    return found


@pytest.mark.parametrize("folder", sorted(_folders()), ids=lambda p: p.name)
def test_folders_are_small(folder: Path) -> None:
    most = MAX_ROOT_MODULES if folder == PACKAGE else MAX_FOLDER_MODULES
    modules = sorted(path.name for path in _folders()[folder])
    assert len(modules) <= most, f"{folder.name} holds {len(modules)} modules: {modules}"


@pytest.mark.parametrize("folder", sorted(_folders()), ids=lambda p: p.name)
def test_every_package_says_what_lives_there(folder: Path) -> None:
    docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
    assert docstring, f"{folder.name}/__init__.py has no docstring"
    assert len(docstring.split()) >= 8, f"{folder.name}/__init__.py: {docstring!r}"


#: Where code runs, bottom to top: what crosses the command channel, what runs the
#: pipeline (in a worker), what meets a saved state, the main process's loader. A layer
#: imports only the layers below it.
PROCESS_LAYERS = ("_channel", "_worker", "_resume", "_main")


@pytest.mark.parametrize("layer", PROCESS_LAYERS)
def test_a_process_layer_imports_only_the_layers_below_it(layer: str) -> None:
    above = PROCESS_LAYERS[PROCESS_LAYERS.index(layer) + 1 :]
    forbidden = tuple(f"savable_loader.{name}" for name in (*above, "loader"))
    upward = [
        (name, target)
        for name, targets in GRAPH.items()
        if name.startswith(f"savable_loader.{layer}")
        for target in targets
        if target.startswith(forbidden)
    ]
    assert not upward
