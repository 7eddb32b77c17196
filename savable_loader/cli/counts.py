"""``savable-loader counts {tar,jsonl} URL... --out URL``: writes a counts file (NOTE
[ Counts files ] in ``savable_loader/datasets/files/counts_file.py``) from the shell."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..datasets import JsonLinesSource, TarSource
from ..errors import SavableLoaderError
from .output import _PROG, _err, _out, _plural

#: The sources whose samples a counts file records, by the command's name for them.
SOURCES = {"tar": TarSource, "jsonl": JsonLinesSource}


def _counts_parser(commands: Any) -> None:
    counts = commands.add_parser(
        "counts",
        help="count the samples of tar or JSON-lines files once, into a counts file",
        description=(
            "Count the samples of every file as a loader with split='samples' would, and "
            "write them with each file's size and ETag or modification time to a counts "
            "file (JSON), which a source built with counts=URL reads instead of counting. "
            "Remote credentials come from the usual environment (AWS_* for s3://) or "
            "--storage-options. Exit 0 once written, 2 on bad usage or a failed read or write."
        ),
    )
    counts.add_argument("kind", choices=sorted(SOURCES), help="the files' format")
    counts.add_argument("urls", nargs="+", metavar="URL", help="paths, globs or fsspec URLs")
    counts.add_argument(
        "--out", required=True, metavar="URL", help="where to write the counts file"
    )
    counts.add_argument(
        "--storage-options",
        default=None,
        metavar="JSON",
        help="fsspec options as a JSON object, e.g. '{\"anon\": true}'",
    )


def _counts(args: argparse.Namespace) -> int:
    command = f"{_PROG} counts"
    options: dict[str, Any] | None = None
    if args.storage_options is not None:
        try:
            options = json.loads(args.storage_options)
        except ValueError as error:
            _err(f"{command}: error: --storage-options is not JSON: {error}")
            return 2
        if not isinstance(options, dict):
            _err(f"{command}: error: --storage-options must be a JSON object")
            return 2
    try:
        source = SOURCES[args.kind](args.urls, storage_options=options)
        source.write_counts(args.out)
    except SavableLoaderError as error:
        _err(f"{command}: error: {error}")
        return 2
    counts = source.sample_counts()
    _out(f"{args.out}: {_plural(sum(counts), 'sample')} in {_plural(len(counts), 'file')}")
    return 0
