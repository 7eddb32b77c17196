"""Small files of samples that the tests of several folders write: WebDataset-style tar
shards, and the JSON lines and tar files of uneven lengths the ``split="samples"`` and
counts-file tests read (NOTE [ Test folders ] in tests/conftest.py)."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Samples per file of :func:`write_jsonl` and :func:`write_tar`: uneven, one empty.
LENGTHS = [7, 0, 3, 12, 1, 9]


def tar_member(
    name: str, data: bytes, kind: bytes = tarfile.REGTYPE
) -> tuple[tarfile.TarInfo, Any]:
    """A member for :func:`tar_bytes`: a file holding ``data``, or a member of another
    ``kind`` (a folder, a link) without data."""
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, io.BytesIO(data) if kind == tarfile.REGTYPE else None


def tar_bytes(members: list[tuple[tarfile.TarInfo, Any]], mode: str = "w", **kwargs: Any) -> bytes:
    """The bytes of a tar file of ``members``, written with ``tarfile.open(mode=mode)``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode, **kwargs) as tar:
        for info, data in members:
            tar.addfile(info, data)
    return buffer.getvalue()


def tar_shard(shard: int, count: int, mode: str = "w") -> bytes:
    """A WebDataset-style shard of ``count`` samples ``shard{shard}/{i:04d}``, each a
    ``.txt`` of ``i + 1`` repeats of ``"{shard}:{i}"`` and a ``.cls.json`` of ``i``."""
    members = []
    for i in range(count):
        key = f"shard{shard}/{i:04d}"
        members.append(tar_member(f"{key}.txt", f"{shard}:{i}".encode() * (i + 1)))
        members.append(tar_member(f"{key}.cls.json", b'{"cls": %d}' % i))
    return tar_bytes(members, mode)


def write_jsonl(folder: Path, lengths: Sequence[int] = LENGTHS) -> str:
    """Writes ``part-NN.jsonl`` files of ``{"id": file * 100 + i}`` rows (a blank line,
    no sample, in each file of more than 2); returns their glob pattern."""
    for file, count in enumerate(lengths):
        rows = [json.dumps({"id": file * 100 + i}) for i in range(count)]
        if count > 2:
            rows.insert(2, "   ")  # a blank line is no sample
        (folder / f"part-{file:02d}.jsonl").write_text("".join(row + "\n" for row in rows))
    return str(folder / "*.jsonl")


def write_tar(folder: Path, lengths: Sequence[int] = LENGTHS) -> str:
    """Writes ``shard-NN.tar`` files of samples ``{i:04d}`` (``.txt`` of ``i + 1`` bytes,
    ``.id`` of ``shard * 100 + i``); returns their glob pattern."""
    for shard, count in enumerate(lengths):
        with tarfile.open(folder / f"shard-{shard:02d}.tar", "w") as tar:
            for i in range(count):
                for ext, data in (("txt", b"x" * (i + 1)), ("id", b"%d" % (shard * 100 + i))):
                    info = tarfile.TarInfo(f"{i:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(folder / "*.tar")
