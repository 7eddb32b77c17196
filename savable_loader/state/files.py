"""``save_state`` / ``load_state``: loader states in files at any fsspec URL.

A file holds one payload, ``{"kind": "rank", "state": ...}`` for what
``save_state_rank()`` returns or ``{"kind": "global", "states": [...]}`` for a list of
them (one per rank), encoded by :mod:`savable_loader.serialization` (msgpack behind a
checked header; never pickle) and written by :mod:`savable_loader.storage` (atomic for
local paths).

NOTE [ Bounded reads ]
A state file is untrusted input, so reading one costs bounded memory and time whatever
the file is. :func:`load_state` reads the first 64 KiB (the whole of a small file) and
refuses a foreign or damaged header there, before it reads the rest; then it refuses a
file whose size (or, when the size is unknown, the body its header announces) is beyond
``max_bytes`` (default :data:`MAX_STATE_BYTES`, 1 GiB), and otherwise reads at most
``max_bytes + 1`` bytes, so that a source without a known size (a stream) cannot make
it read on. A local path must be a regular file: a FIFO would block the reader until a
writer comes, and a character device (``/dev/zero``) never ends; both are refused before
they are opened for reading, and the file is opened non-blocking and checked again.

1 GiB is far above any state a loader writes: a rank's state holds its workers'
checkpoints, about 13 KB of generator states each plus the pipeline's small state, so
one rank of 8 workers weighs ~100 KB and a global state of 1,000 such ranks ~100 MB. A
larger state (thousands of ranks in one file) reads with ``max_bytes`` raised, or per
rank (``save_state_rank``). Decoding copies nothing more: the body is checked and
decoded in place, so reading a file costs about its size in memory.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from collections.abc import Sequence
from typing import IO, Any, Literal, overload

from .. import serialization
from ..errors import StateFormatError, StorageError
from ..storage import urls as storage
from ..storage.filesystems import url_to_fs
from .models import RankState

__all__ = [
    "MAX_STATE_BYTES",
    "decode_state",
    "encode_state",
    "load_state",
    "read_state_bytes",
    "save_state",
]

_States = RankState | Sequence[RankState]

#: The largest state file :func:`load_state` reads unless told otherwise, in bytes
#: (NOTE [ Bounded reads ]).
MAX_STATE_BYTES = 1 << 30

_KINDS = ("rank", "global")
#: Bytes read before the header is checked: a small file whole, a large one's start.
_SNIFF = 1 << 16


def save_state(
    state: RankState | Sequence[RankState], url: str | os.PathLike[str], **storage_options: Any
) -> None:
    """Writes a loader state (one rank's, or a list with one per rank) to ``url``.

    Args:
        state: What ``save_state_rank()`` or ``save_state_global()`` returned.
        url: A local path (written atomically) or any fsspec URL (``memory://``, ``s3://``).
        **storage_options: Passed to fsspec (credentials, endpoint).

    Raises:
        StateFormatError: ``state`` is not a loader state.
        StorageError: Writing failed.
    """
    storage.write_bytes(url, encode_state(state), **storage_options)


@overload
def encode_state(state: _States, *, text: Literal[False] = ...) -> bytes: ...


@overload
def encode_state(state: _States, *, text: Literal[True]) -> str: ...


def encode_state(state: _States, *, text: bool = False) -> bytes | str:
    """Returns the bytes of a state file holding ``state`` (what :func:`save_state` writes),
    or with ``text`` those bytes in base64 text (an entry of ``state_dict()``)."""
    data = _encoded(state)
    return base64.b64encode(data).decode("ascii") if text else data


def _encoded(state: _States) -> bytes:
    if isinstance(state, RankState):
        payload: dict[str, Any] = {"kind": "rank", "state": state.to_plain()}
    elif isinstance(state, Sequence) and all(isinstance(s, RankState) for s in state):
        payload = {"kind": "global", "states": [s.to_plain() for s in state]}
    else:
        raise StateFormatError(
            f"save_state takes what save_state_rank() or save_state_global() returns, "
            f"got {type(state).__name__}"
        )
    return serialization.dumps(payload)


def decode_state(data: bytes | str) -> RankState | list[RankState]:
    """Returns the state held by what :func:`encode_state` returned: bytes, or base64 text.

    Raises:
        StateFormatError: ``data`` is not a valid loader state.
    """
    if isinstance(data, str):
        text = data
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            shown = text if len(text) <= 40 else f"{text[:37]}..."
            raise StateFormatError(
                f"Expected a state file's bytes or their base64 text, got the str {shown!r}"
            ) from None
    return state_from_payload(serialization.loads(data))


def load_state(
    url: str | os.PathLike[str], *, max_bytes: int | None = None, **storage_options: Any
) -> RankState | list[RankState]:
    """Reads a loader state written by :func:`save_state`.

    Args:
        url: A local path or any fsspec URL.
        max_bytes: The largest file to read, in bytes; None: :data:`MAX_STATE_BYTES`
            (1 GiB). A larger file is refused after its header is read (NOTE [ Bounded
            reads ]).
        **storage_options: Passed to fsspec (credentials, endpoint).

    Raises:
        StateFormatError: The file is not a valid loader state (corrupt, truncated,
            foreign, pickle, of an unknown format version, or larger than ``max_bytes``).
            Nothing is executed.
        StateFileNotFoundError: Nothing exists at ``url``; also a ``FileNotFoundError``,
            so ``except FileNotFoundError:`` starts a first run fresh.
        StorageError: Reading failed, or a local path is not a regular file (a FIFO, a
            device, a folder).
    """
    return decode_state(read_state_bytes(url, max_bytes=max_bytes, **storage_options))


def read_state_bytes(
    url: str | os.PathLike[str], *, max_bytes: int | None = None, **storage_options: Any
) -> bytes:
    """Reads a state file's bytes at a bounded cost (NOTE [ Bounded reads ]).

    The header is checked before the body is read; the body is not checked.

    Raises:
        StateFormatError: The header is not a savable_loader header, or the file is
            larger than ``max_bytes`` (:data:`MAX_STATE_BYTES` when None).
        StateFileNotFoundError: Nothing exists at ``url`` (also a ``FileNotFoundError``).
        StorageError: Reading failed, or a local path is not a regular file.
    """
    limit = MAX_STATE_BYTES if max_bytes is None else max_bytes
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < serialization.HEADER_SIZE:
        raise StateFormatError(
            f"max_bytes must be an int of at least {serialization.HEADER_SIZE} (the header), "
            f"got {limit!r}"
        )
    url, local = storage._resolve(url, storage_options)
    if local is not None:
        return _read_local(url, local, limit)
    try:
        with storage._remote_errors(url, "read"):
            fs, path = url_to_fs(url, **storage_options)
            with fs.open(path, "rb") as file:
                size = getattr(file, "size", None)
                return _read_bounded(url, file, size if isinstance(size, int) else None, limit)
    except StorageError as error:
        if isinstance(error.__cause__, StateFormatError):  # the bytes' fault, not the read's
            raise error.__cause__ from None
        raise


def _read_local(url: str, path: str, limit: int) -> bytes:
    try:
        kind = _not_regular(os.stat(path).st_mode)
        if kind is not None:
            raise StorageError(f"Cannot read {url}: it is {kind}, not a regular file.")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        with open(fd, "rb") as file:
            info = os.fstat(file.fileno())
            kind = _not_regular(info.st_mode)  # replaced between the two looks
            if kind is not None:
                raise StorageError(f"Cannot read {url}: it is {kind}, not a regular file.")
            return _read_bounded(url, file, info.st_size, limit)
    except FileNotFoundError as exc:
        raise storage._not_found(url) from exc  # NOTE [ A missing state file ]
    except OSError as exc:
        raise StorageError(f"Cannot read {url}: {storage.describe_error(exc)}.") from exc


def _not_regular(mode: int) -> str | None:
    """What a file of ``mode`` is when it is not a regular file (None when it is)."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe), which would block the reader until a writer comes"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device, which may never end (/dev/zero)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def _read_bounded(url: str, file: IO[bytes], size: int | None, limit: int) -> bytes:
    """Reads the start, checks the header and the sizes against ``limit``, then the rest."""
    # A small file is read whole at once, so a foreign one is named as it always was
    # (a protocol-0 pickle is recognised by its last byte); a large one stops here.
    head = _read_up_to(file, min(_SNIFF, limit + 1))
    info = serialization.peek_header(head)  # a foreign or damaged file stops here
    # A known size is what will be read; a header announcing more is a truncated file,
    # which decoding names as such. Without a known size, the header is all there is.
    expected = size if size is not None else serialization.HEADER_SIZE + info.body_length
    if expected > limit:
        what = f"it has {size:,}" if size is not None else f"its header announces {expected:,}"
        raise StateFormatError(
            f"The state file {url} is too large: {what} bytes, more than max_bytes="
            f"{limit:,} (NOTE [ Bounded reads ]; a loader's state is far smaller). If it "
            "really is a state this large, pass a larger max_bytes to load_state."
        )
    if len(head) < _SNIFF:
        data = head  # the whole file
    elif size is not None and file.seekable():
        # One read of the whole file: a single buffer of its size, nothing joined.
        file.seek(0)
        data = _read_up_to(file, size + 1)
    else:
        data = head + _read_up_to(file, limit + 1 - len(head))
    if len(data) > limit:  # a source whose size was not known, or that grew
        raise StateFormatError(
            f"The state file {url} is too large: more than max_bytes={limit:,} bytes."
        )
    return data


def _read_up_to(file: IO[bytes], n: int) -> bytes:
    """Up to ``n`` bytes: fewer only at the end of the file. A file that gives them in
    one read gives them without a copy (``join`` returns a lone part as it is)."""
    parts: list[bytes] = []
    while n > 0:
        part = file.read(n)
        if not part:
            break
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def state_from_payload(payload: Any) -> RankState | list[RankState]:
    """Validates a decoded file payload into the state it holds."""
    if not isinstance(payload, dict) or payload.get("kind") not in _KINDS:
        raise StateFormatError(
            "the file is a savable_loader file but holds no loader state "
            f"(expected a dict with kind in {_KINDS})"
        )
    if payload["kind"] == "rank":
        return RankState.from_plain(payload.get("state"))
    states = payload.get("states")
    if not isinstance(states, list):
        raise StateFormatError("a global loader state holds a list of rank states")
    return [RankState.from_plain(s) for s in states]
