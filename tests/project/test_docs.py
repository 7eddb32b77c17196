"""Every ```python block of the documentation runs: docs/**/*.md and README.md.

NOTE [ Runnable documentation ]
The blocks of one page run in order, in one namespace (a module registered in
``sys.modules`` for the page's run, so later blocks use what earlier ones defined and
functions pickle by reference), in a fresh temporary working directory. Blocks are
compiled with the page's path and line numbers, so a traceback points into the page.

An HTML comment right before a block (blank lines between are allowed) changes how it
runs; the published page does not show it:

- ``<!-- test-setup: CODE -->`` runs CODE (one or several lines, Python) in the page's
  namespace before the block. Use it to define what a fragment takes from its context
  (a ``dataset``, a ``train_step``) with small real stand-ins. Setup code can use
  ``docs_test`` (:class:`_Helpers`): ``docs_test.s3_server(url, bucket)`` starts a
  loopback S3 server, ``docs_test.process_group()`` a one-rank gloo process group,
  ``docs_test.setenv(name, value)`` sets a variable for the page's run,
  ``docs_test.allow_in_weights_only_load(*objects)`` extends torch's weights-only
  allowlist for the page's run.
- ``<!-- test: skip (REASON) -->`` leaves the block out; the reason is required. Keep
  these rare: a block that cannot run in one process (several ranks) or against a
  loopback server.

README.md, and pages written by others, are not edited for tests: their setups and skips
live in ``EXTERNAL_SETUP`` and ``EXTERNAL_SKIP`` below, keyed by page and by the start of
a line of the block.

Every ``SavableDataLoader`` a page builds is closed after the page, so that a snippet that
leaves one open (as a short example may) does not leak worker processes.
"""

from __future__ import annotations

import contextlib
import functools
import re
import socket
import sys
import textwrap
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from savable_loader import SavableDataLoader

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

# Pages whose blocks start worker processes and take more than ~5 s.
SLOW_PAGES = {
    "docs/stages/index.md",  # assert_resumes_exactly with 2 workers: about 6 s
}

# Pages this suite does not edit (README.md; pages other people are writing): hidden
# setups and skips by page and by the start of a line that only that block has. README.md's
# example runs as it is; the blocks it had before, with their setups and the skip of the
# several-ranks block, moved to docs/usage.md, where they are the page's own directives.
EXTERNAL_SETUP: dict[tuple[str, str], str] = {}
EXTERNAL_SKIP: dict[tuple[str, str], str] = {}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^`]*$")
_SETUP = re.compile(r"^test-setup:(?P<code>.*)$", re.DOTALL)
_SKIP = re.compile(r"^test:\s*skip\s*\((?P<reason>[^)]*\S[^)]*)\)$", re.DOTALL)


@dataclass(frozen=True)
class Block:
    """A ```python block: its code, where it starts, and the comment before it."""

    page: str
    line: int  # 1-based line of the block's first code line
    code: str
    setup: str | None = None
    setup_line: int = 0
    skip: str | None = None


def _comment_before(lines: list[str], fence: int) -> tuple[str, int] | None:
    """The HTML comment ending right before line ``fence`` (0-based), and its first line."""
    end = fence - 1
    while end >= 0 and not lines[end].strip():
        end -= 1
    if end < 0 or not lines[end].rstrip().endswith("-->"):
        return None
    start = end
    while start >= 0 and "<!--" not in lines[start]:
        start -= 1
    if start < 0:
        return None
    text = "\n".join(lines[start : end + 1]).strip()
    return text[text.index("<!--") + 4 : -3].strip(), start


def parse(path: Path, text: str | None = None) -> list[Block]:
    """The ```python blocks of a page (or of ``text`` as that page), with their directives."""
    page = path.relative_to(ROOT).as_posix()
    lines = (path.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence or not fence["lang"]:
            i += 1
            continue
        indent = fence["indent"]
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if fence["lang"] == "python":
            code = textwrap.dedent("\n".join(lines[i + 1 : end]))
            assert all(not line.strip() or line.startswith(indent) for line in lines[i + 1 : end])
            block = Block(page, i + 2, code)
            comment = _comment_before(lines, i)
            if comment is not None and comment[0].startswith("test"):
                text, first = comment
                if setup := _SETUP.match(text):
                    # Keep line numbers: the setup's first line is the comment's line.
                    body = textwrap.dedent(setup["code"].lstrip(" ").rstrip())
                    block = Block(page, i + 2, code, setup=body, setup_line=first + 1)
                elif skip := _SKIP.match(text):
                    block = Block(page, i + 2, code, skip=skip["reason"].strip())
                else:
                    raise ValueError(f"{page}:{first + 1}: unknown test directive {text!r}")
            blocks.append(block)
        i = end + 1
    return [_external(block) for block in blocks]
    return blocks


def _has_line(block: Block, start: str) -> bool:
    return any(line.strip().startswith(start) for line in block.code.splitlines())


def _external(block: Block) -> Block:
    for (page, start), reason in EXTERNAL_SKIP.items():
        if block.page == page and _has_line(block, start):
            return Block(block.page, block.line, block.code, skip=reason)
    for (page, start), setup in EXTERNAL_SETUP.items():
        if block.page == page and _has_line(block, start):
            return Block(block.page, block.line, block.code, setup=setup, setup_line=0)
    return block


def _compile(code: str, page: str, line: int) -> types.CodeType:
    return compile("\n" * max(line - 1, 0) + code, str(ROOT / page), "exec")


def _free_port(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class _Helpers:
    """What a page's hidden setup can use, as ``docs_test``; undone after the page."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, stack: contextlib.ExitStack) -> None:
        self._monkeypatch = monkeypatch
        self._stack = stack

    def setenv(self, name: str, value: str) -> None:
        """Sets an environment variable for the page's run."""
        self._monkeypatch.setenv(name, value)

    def s3_server(self, endpoint_url: str, bucket: str) -> None:
        """Runs a loopback S3 server (moto) at ``endpoint_url`` with ``bucket``.

        The page's own AWS variables and files are kept out; a taken port skips the page.
        """
        from s3_server import moto_server, s3_access

        port = int(endpoint_url.rsplit(":", 1)[1])
        if not _free_port(port):
            pytest.skip(f"port {port} is taken; the page's S3 examples need it")
        url = self._stack.enter_context(_moto_at(port, moto_server))
        assert url == endpoint_url, url
        self._stack.enter_context(s3_access(url, self._monkeypatch))
        import boto3

        boto3.client(
            "s3",
            endpoint_url=url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=bucket)

    def process_group(self) -> None:
        """Starts a one-rank gloo process group over loopback TCP (destroyed after the page)."""
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        for name, value in (
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", str(port)),
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_RANK", "0"),
        ):
            self._monkeypatch.setenv(name, value)
        from gloo import destroy_process_group

        self._stack.callback(destroy_process_group)

    def allow_in_weights_only_load(self, *objects: Any) -> None:
        """Adds ``objects`` to ``torch.load(weights_only=True)``'s allowlist for the page's run."""
        import torch.serialization

        before = torch.serialization.get_safe_globals()
        torch.serialization.add_safe_globals(list(objects))

        def restore() -> None:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(before)

        self._stack.callback(restore)


@contextlib.contextmanager
def _moto_at(port: int, moto_server: Callable[..., Any]) -> Iterator[str]:
    """``moto_server()`` from tests/s3_server.py, on a given port."""
    from moto.server import ThreadedMotoServer

    original = ThreadedMotoServer.__init__

    @functools.wraps(original)
    def on_port(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["port"] = port
        original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ThreadedMotoServer, "__init__", on_port)
        context = moto_server()
        url = context.__enter__()
    try:
        yield url
    finally:
        context.__exit__(None, None, None)


def _page_params() -> list[Any]:
    params = []
    for path in PAGES:
        page = path.relative_to(ROOT).as_posix()
        if not any(block.skip is None for block in parse(path)):
            continue
        marks = [pytest.mark.slow] if page in SLOW_PAGES else []
        params.append(pytest.param(path, id=page, marks=marks))
    return params


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore:Your installed version of s3fs is very old:UserWarning")
@pytest.mark.parametrize("path", _page_params())
def test_page_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = parse(path)
    page = path.relative_to(ROOT).as_posix()
    monkeypatch.chdir(tmp_path)
    loaders: list[SavableDataLoader] = []
    original = SavableDataLoader.__init__

    @functools.wraps(original)
    def tracked(self: SavableDataLoader, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        loaders.append(self)  # only loaders that were built (a refused one owns nothing)

    monkeypatch.setattr(SavableDataLoader, "__init__", tracked)
    name = "docs_" + re.sub(r"\W", "_", page.removesuffix(".md"))
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [loader.close() for loader in loaders])
        module.__dict__["docs_test"] = _Helpers(monkeypatch, stack)
        for block in blocks:
            if block.skip is not None:
                continue
            began = time.perf_counter()
            try:
                if block.setup is not None:
                    exec(_compile(block.setup, page, block.setup_line), module.__dict__)
                exec(_compile(block.code, page, block.line), module.__dict__)
            except pytest.skip.Exception:
                raise
            except ModuleNotFoundError as error:
                if error.name not in _OPTIONAL:
                    raise AssertionError(f"{page}, block at line {block.line}: {error}") from error
                pytest.skip(f"{page} needs {error.name}, an optional extra not installed here")
            except BaseException as error:
                raise AssertionError(
                    f"{page}, block at line {block.line}: {type(error).__name__}: {error}"
                ) from error
            spent = time.perf_counter() - began
            print(f"{page}:{block.line}: {spent:.2f} s")


#: Packages of optional extras a page may import (the lowest-versions session lacks them).
_OPTIONAL = ("datasets",)


def test_directives_are_well_formed() -> None:
    """Every skip has a reason; each external setup or skip names exactly one block."""
    for page, start in [*EXTERNAL_SETUP, *EXTERNAL_SKIP]:
        path = ROOT / page
        if not path.exists():
            continue  # a page being written elsewhere, not yet there
        assert sum(_has_line(block, start) for block in parse(path)) == 1, (page, start)
    for path in PAGES:
        for block in parse(path):
            assert block.skip is None or len(block.skip) > 10, (block.page, block.line)


def test_parse_reads_directives() -> None:
    """Setups and skips attach to the next block; line numbers point into the page."""
    page = ROOT / "docs" / "_parse_check.md"
    text = (
        "# t\n\n<!-- test-setup: x = 1\ny = 2 -->\n\n```python\nprint(x + y)\n```\n\n"
        "<!-- test: skip (needs four ranks) -->\n```python\nboom()\n```\n\n"
        "- item\n\n  ```python\n  z = 3\n  ```\n"
    )
    blocks = parse(page, text)
    assert [(b.line, b.code, b.setup, b.skip) for b in blocks] == [
        (7, "print(x + y)", "x = 1\ny = 2", None),
        (12, "boom()", None, "needs four ranks"),
        (18, "z = 3", None, None),
    ]
    assert blocks[0].setup_line == 3
