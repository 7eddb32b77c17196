"""``JsonLinesSource``: one JSON object per line of sharded, optionally compressed files.

NOTE [ JSON lines position ]
A stream's position is the file it reads (``shard``, an index into its own list of
the epoch, NOTE [ Shard listing and assignment ] in ``datasets/files/sharded.py``), the lines
already read in that file (``line``, blank ones included) and the byte offset of the next line
in the decompressed file (``offset``). Restoring opens the file and seeks to
``offset``: the lines before it are never read again in Python (a compressed file is
decompressed up to there, NOTE [ Seeking into compressed files ]). ``line`` only keeps
error messages' line numbers right after a restore.

NOTE [ Malformed lines ]
A line that is not JSON raises :class:`~savable_loader.errors.ConfigError`, the
library's error for input it cannot honour; it is also a ``ValueError``, as json's own
error is, so ``except ValueError`` keeps catching it. The position has already moved
past the line, so a caller that catches the error and reads on gets the next line.
Failures to read the bytes (missing file, network, a corrupt gzip stream) are
:class:`~savable_loader.errors.StorageError`.
"""

from __future__ import annotations

import json
from typing import IO, Any

from pydantic import Field

from ...config import WorkerContext
from ...errors import ConfigError
from .cursor import ShardCursor
from .sharded import SampleState, ShardedSource, ShardState, storage_errors

__all__ = ["JsonLinesSource"]


class _State(ShardState):
    """A JSON lines stream's position with ``split="files"`` (NOTE [ JSON lines position ])."""

    line: int = Field(ge=0, description="Lines of that file already read, blank ones too.")
    offset: int = Field(ge=0, description="Byte offset of the next line, decompressed.")


class _SampleState(SampleState):
    """A JSON lines stream's position with ``split="samples"`` (NOTE [ JSON lines position ])."""

    line: int = Field(ge=0, description="Lines of that file before offset, blank ones too.")


class JsonLinesSource(ShardedSource[Any]):
    """Yields the parsed JSON object of every non-blank line of a list of files.

    Args:
        urls: A path, glob or fsspec URL (``s3://bucket/*.jsonl.gz``, ``memory://...``),
            or a list of them; globs are expanded and the files sorted. Compressed files
            are read by their extension (``.gz``, ``.bz2``, ``.xz``...).
        shuffle_shards: Visit the files in a new order every epoch, drawn from
            ``(seed, epoch)``; lines within a file stay in order.
        seed: Seed of the file orders.
        storage_options: Passed to fsspec (credentials, endpoint...); not part of the
            pipeline's ``config()``.

    Raises:
        ConfigError: An argument is invalid or a glob matches nothing; when read, a line
            is not JSON (the message names the file and the line number).
        StorageError: Listing or reading a file failed (the message names the URL).

    State:
        ``{"epoch": e, "shard": s, "line": n, "offset": b}``: the epoch, the index of
        the file in this stream's list, the lines read in it and the byte offset of the
        next line (NOTE [ JSON lines position ]). After a restore onto another number of
        workers or ranks, the resumed epoch's state also holds ``done_below``, ``done``
        and ``started`` (``[place, offset, line]`` entries): the files finished and
        begun before it, whose rest this stream shares with the others (NOTE [ Elastic
        file order ] in ``datasets/files/reshard.py``). Restore opens the file and seeks to the
        offset; nothing is replayed beyond what the loader's checkpoint policy replays.
        ``skip`` reads: reading is the replay.
    """

    position_fields = ("offset", "line")
    State = _State
    SampleModel = _SampleState

    def cursor(self, context: WorkerContext) -> JsonLinesCursor:
        return JsonLinesCursor(self, context)

    def count_items(self, file: IO[bytes], url: str) -> int:
        """The non-blank lines of ``file`` (NOTE [ Counting samples ] in
        ``datasets/files/sharded.py``)."""
        return sum(1 for raw in file if raw.strip())


class JsonLinesCursor(ShardCursor[Any]):
    """Reads a :class:`JsonLinesSource` for one rank and worker; one open file at most."""

    def __init__(self, stage: JsonLinesSource, context: WorkerContext) -> None:
        super().__init__(stage, context)
        self.line = 0

    def read_item(self, url: str) -> Any:
        raw = self._line(url)
        return None if raw is None else _parse(raw, url, self.line)

    def pass_item(self, url: str) -> bool:
        return self._line(url) is not None

    def _line(self, url: str) -> bytes | None:
        """The next non-blank line, unparsed; None at the end of the file."""
        file = self.open_file(url)
        while True:
            with storage_errors(url):
                raw = file.readline()
            if not raw:
                self.file_done = True
                return None
            self.line += 1
            self.offset += len(raw)
            if raw.strip():
                return raw

    def position(self) -> tuple[int, ...]:
        return self.offset, self.line

    def set_position(self, position: tuple[int, ...]) -> None:
        self.offset, self.line = position


def _parse(raw: bytes, url: str, line: int) -> Any:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{url}, line {line}: not valid JSON ({exc})") from exc
    except RecursionError:
        raise ConfigError(f"{url}, line {line}: JSON nested too deep to parse") from None
