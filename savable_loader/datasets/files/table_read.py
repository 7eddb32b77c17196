"""Reading the table of a ``TableSource``: Parquet, CSV or JSON lines, held column by column.

NOTE [ Table formats ]
The format of a table file comes from ``format=`` or from its name, once a compression
extension (``.gz``, ``.bz2``, ``.xz``, ``.zst``) is taken off: ``.parquet``/``.pq`` is
Parquet, ``.csv`` is CSV, ``.jsonl``/``.ndjson``/``.json`` is JSON lines.

* Parquet is read with ``pyarrow`` (the ``parquet`` extra), the ecosystem's reader, and
  kept as an Arrow table: its columns keep their types and take about the bytes of their
  values, shared with forked workers without copies (Arrow buffers hold no Python
  reference counts). A row's values come out as ``pyarrow`` turns them into Python.
* CSV is read with the standard ``csv`` module, UTF-8 (a byte-order mark is dropped): the
  first row names the columns, and every value is a ``str`` (an empty field is ``""``).
* JSON lines with the standard ``json`` module: one object per line, blank lines
  skipped; the columns are the keys of all rows in the order first seen, and a row
  without a key has None there. A ``.json`` file whose first character is ``[`` holds one
  array of objects instead, read the same way.

CSV and JSON values are kept in one Python list per column, never one dict per row: about
the size of the values' Python objects (some 50 bytes plus the text of each string).
Several table files are concatenated in their sorted order; they must share one format,
and for Parquet and CSV one set of columns.
"""

from __future__ import annotations

import csv
import importlib
import io
import json
from typing import IO, Any, Literal

from ...errors import ConfigError

__all__ = ["Columns", "Format", "concatenate", "infer_format", "parse_table"]

#: The table formats (NOTE [ Table formats ]).
Format = Literal["parquet", "csv", "jsonl"]

_EXTENSIONS: dict[str, Format] = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
}
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_INSTALL = "pip install savable-loader[parquet]"


def infer_format(url: str, given: str | None) -> Format:
    """The format of table ``url``: ``given``, or the one its extension names.

    Raises:
        ConfigError: ``given`` is not a known format, or the extension names none.
    """
    if given is not None:
        if given == "json":
            return "jsonl"
        if given not in ("parquet", "csv", "jsonl"):
            raise ConfigError(
                f'TableSource format must be "parquet", "csv", "jsonl" or None, got {given!r}'
            )
        return given  # type: ignore[return-value]
    name = url.rsplit("/", 1)[-1].lower()
    for suffix in _COMPRESSIONS:
        name = name.removesuffix(suffix)
    extension = name[name.rfind(".") :] if "." in name else ""
    if extension not in _EXTENSIONS:
        raise ConfigError(
            f"TableSource cannot tell the format of {url} from its name; pass "
            'format="parquet", "csv" or "jsonl"'
        )
    return _EXTENSIONS[extension]


def _pyarrow() -> tuple[Any, Any]:
    """``pyarrow`` and ``pyarrow.parquet``, or a ConfigError naming the extra."""
    try:
        return importlib.import_module("pyarrow"), importlib.import_module("pyarrow.parquet")
    except ImportError:
        raise ConfigError(f"TableSource needs pyarrow to read Parquet tables: {_INSTALL}") from None


class Columns:
    """Rows of one or more tables, held column by column (NOTE [ Table formats ]).

    Args:
        format: The tables' format.
        names: The column names, in order.
        data: Per name, the column: a ``pyarrow.ChunkedArray`` for Parquet, else a list.
        ends: Per table file, the number of rows up to its end (cumulative).
    """

    def __init__(
        self, format: Format, names: list[str], data: dict[str, Any], ends: list[int]
    ) -> None:
        self.format: Format = format
        self.names = names
        self.data = data
        self.ends = ends

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def value(self, name: str, row: int) -> Any:
        """The value of column ``name`` in ``row``, as Python."""
        column = self.data[name]
        return column[row].as_py() if self.format == "parquet" else column[row]

    def row(self, row: int) -> dict[str, Any]:
        """The values of ``row`` by column name, as Python."""
        return {name: self.value(name, row) for name in self.names}

    def check_urls(self, name: str) -> None:
        """Refuses a files column ``name`` that is missing or holds other than strings
        (and nulls).

        Raises:
            ConfigError: Names the column, what it holds and the columns there are.
        """
        if name not in self.data:
            raise ConfigError(
                f"TableSource: the table has no column {name!r} named in files; its "
                f"columns: {self.names}"
            )
        column = self.data[name]
        if self.format == "parquet":
            pa = _pyarrow()[0]
            kind = column.type
            if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind):
                return
            bad = f"values of type {kind}"
        else:
            wrong = next((v for v in column if v is not None and not isinstance(v, str)), None)
            if wrong is None:
                return
            bad = f"a {type(wrong).__name__} ({wrong!r})"
        raise ConfigError(
            f"TableSource: files column {name!r} must hold URLs or paths as strings; it holds {bad}"
        )


def parse_table(url: str, file: IO[bytes], format: Format) -> tuple[list[str], Any]:
    """Parses one open table file: its column names and its columns (an Arrow table for
    Parquet, else a dict of lists). The caller retries storage errors.

    Raises:
        ConfigError: The file is not a table of ``format``; names the URL and the problem.
    """
    if format == "parquet":
        pa, pq = _pyarrow()
        try:
            table = pq.read_table(file)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as error:
            raise ConfigError(f"TableSource cannot parse {url} as Parquet: {error}") from None
        return list(table.column_names), table
    data = file.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ConfigError(f"TableSource: {url} is not UTF-8 text: {error}") from None
    if format == "csv":
        return _csv(url, io.StringIO(text, newline=""))
    return _json_lines(url, text)


def _csv(url: str, text: io.StringIO) -> tuple[list[str], dict[str, list[Any]]]:
    reader = csv.reader(text)
    try:
        names = next(reader, None)
        if names is None:
            raise ConfigError(f"TableSource: {url} is empty (a CSV table needs a header row)")
        if len(set(names)) != len(names):
            raise ConfigError(f"TableSource: the header of {url} repeats a column: {names}")
        columns: list[list[Any]] = [[] for _ in names]
        for record in reader:
            if not record:
                continue
            if len(record) != len(names):
                raise ConfigError(
                    f"TableSource: line {reader.line_num} of {url} has {len(record)} "
                    f"fields, the header {len(names)}"
                )
            for column, value in zip(columns, record, strict=True):
                column.append(value)
    except csv.Error as error:
        raise ConfigError(f"TableSource cannot parse {url} as CSV: {error}") from None
    return names, dict(zip(names, columns, strict=True))


def _json_lines(url: str, content: str) -> tuple[list[str], dict[str, list[Any]]]:
    records: list[tuple[int, Any]]
    try:
        if content.lstrip().startswith("["):
            records = list(enumerate(json.loads(content), 1))
        else:
            lines = enumerate(content.splitlines(), 1)
            records = [(n, json.loads(line)) for n, line in lines if line.strip()]
    except json.JSONDecodeError as error:
        raise ConfigError(f"TableSource cannot parse {url} as JSON lines: {error}") from None
    except RecursionError:
        raise ConfigError(f"TableSource cannot parse {url}: JSON nested too deep") from None
    names: dict[str, None] = {}
    for number, record in records:
        if not isinstance(record, dict):
            raise ConfigError(
                f"TableSource: row {number} of {url} is a {type(record).__name__}, not an object"
            )
        names.update(dict.fromkeys(record))
    columns = {name: [record.get(name) for _, record in records] for name in names}
    return list(names), columns


def concatenate(format: Format, parts: list[tuple[str, list[str], Any]]) -> Columns:
    """The rows of the parsed tables ``parts`` (``(url, names, columns)``), in order.

    Raises:
        ConfigError: No row in all, or two Parquet or CSV tables with other columns.
    """
    ends: list[int] = []
    total = 0
    first_url, names = parts[0][0], list(parts[0][1])
    for url, own, _ in parts:
        if format != "jsonl" and own != names:
            raise ConfigError(
                f"TableSource: {url} has the columns {own}, {first_url} has {names}; "
                "the tables of one source share their columns"
            )
        for name in own:
            if name not in names:
                names.append(name)
    data: dict[str, Any]
    if format == "parquet":
        pa = _pyarrow()[0]
        tables = [table for _, _, table in parts]
        try:
            combined = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
            raise ConfigError(
                f"TableSource: the Parquet tables do not concatenate: {error}"
            ) from None
        data = {name: combined.column(name) for name in names}
        for _, _, table in parts:
            total += table.num_rows
            ends.append(total)
    else:
        data = {name: [] for name in names}
        for _, _, columns in parts:
            rows = len(next(iter(columns.values()), []))
            for name in names:
                data[name].extend(columns.get(name, [None] * rows))
            total += rows
            ends.append(total)
    if not total:
        urls = ", ".join(url for url, _, _ in parts)
        raise ConfigError(f"TableSource: no row in {urls}; a table needs at least one row")
    return Columns(format, names, data, ends)
