"""Plain data to self-describing bytes and back: msgpack behind a checked header, no I/O.

:func:`dumps` refuses anything that is not plain data (dict with str keys, list, str,
int, float, bool, None, bytes) and names where it sits; :func:`loads` checks the header,
the length and the checksum before it decodes a byte, and tells a truncated, corrupt,
foreign (pickle, JSON, zip) or newer file apart in its message. Reading never executes
anything: the body is msgpack decoded without hooks, and the result is checked to be plain.

NOTE [ State file format ]
    A state file is a fixed 52-byte header followed by the body, all integers big-endian::

        offset  size  field
        0       8     magic b"SAVLDR\\r\\n"; the CR LF catches a copy in text mode
        8       2     file format version (FILE_FORMAT_VERSION, 1)
        10      2     reserved flags, 0; a reader refuses flags it does not know
        12      8     body length in bytes
        20      32    BLAKE2b-256 digest of the body (hashlib.blake2b(digest_size=32))
        52      ...   body: msgpack.packb(payload, use_bin_type=True)

    The magic and the version field keep their place in every future version, so any
    release can say "written by a newer savable_loader" instead of "corrupt". The digest
    covers the body only; a damaged header field shows as a bad signature, an unknown
    version or flag, or a length that disagrees with the data. Tuples, sets, subclasses of
    the plain types (``IntEnum``, ``OrderedDict``...), ``bytearray``, numpy values and
    tensors are refused rather than converted, because msgpack would hand back something
    else than was saved (a tuple comes back a list); a state must read back equal and of
    the same types. Integers must fit msgpack's range, -2**63 to 2**64-1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import msgpack

from .errors import StateFormatError
from .plain import find_non_plain

__all__ = [
    "FILE_FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "HeaderInfo",
    "dumps",
    "loads",
    "peek_header",
]

MAGIC = b"SAVLDR\r\n"
FILE_FORMAT_VERSION = 1
_HEADER = struct.Struct(">8sHHQ32s")
HEADER_SIZE = _HEADER.size
_UPGRADE = "Upgrade savable_loader (pip install -U savable-loader) to read it."


@dataclasses.dataclass(frozen=True)
class HeaderInfo:
    """What a state file's header says, for ``savable-loader inspect``.

    Attributes:
        format_version: The file format version the file was written with.
        body_length: The length of the msgpack body in bytes.
        digest: The BLAKE2b-256 digest of the body recorded in the header, as hex.
    """

    format_version: int
    body_length: int
    digest: str


def dumps(payload: object) -> bytes:
    """Encodes plain data as a state file's bytes (header plus msgpack body).

    Args:
        payload: Plain data: dicts with str keys, lists, str, int, float, bool, None, bytes.

    Returns:
        The bytes of a state file; :func:`loads` gives back an equal payload of the same types.

    Raises:
        StateFormatError: ``payload`` holds something else; the message names its path
            (for example ``workers[2].dataset_state``) and how to convert it.
    """
    problem = find_non_plain(payload)
    if problem is not None:
        raise StateFormatError(f"Cannot save the state: {problem}.")
    try:
        body: bytes = msgpack.packb(payload, use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as exc:  # unencodable str (lone surrogate)
        raise StateFormatError(f"Cannot save the state: msgpack refused it: {exc}.") from exc
    digest = hashlib.blake2b(body, digest_size=32).digest()
    return _HEADER.pack(MAGIC, FILE_FORMAT_VERSION, 0, len(body), digest) + body


def loads(data: bytes) -> object:
    """Decodes a state file's bytes, checking header, length and checksum first.

    Args:
        data: The bytes of a state file written by :func:`dumps`.

    Returns:
        The payload that was saved: plain data only.

    Raises:
        StateFormatError: ``data`` is empty, truncated, not a savable_loader state file
            (the message recognises pickle, JSON, zip and gzip), corrupt, or written by a
            newer savable_loader.
    """
    data = _as_bytes(data)
    info = peek_header(data)
    body = memoryview(data)[HEADER_SIZE:]  # checked and decoded in place, not copied
    if len(body) < info.body_length:
        raise StateFormatError(
            f"The state data is truncated: its header announces a body of {info.body_length} bytes "
            f"but only {len(body)} follow the header (an interrupted write or an incomplete copy?)."
        )
    if len(body) > info.body_length:
        raise StateFormatError(
            f"The state data has {len(body) - info.body_length} unexpected bytes after the "
            f"{info.body_length}-byte body its header announces: something was appended to it."
        )
    if hashlib.blake2b(body, digest_size=32).hexdigest() != info.digest:
        raise StateFormatError(
            f"The state file is corrupt: the checksum of its {len(body)}-byte body does not match "
            "the one in its header (bytes changed after it was written: a disk, memory or transfer "
            "error). Use another checkpoint."
        )
    n = len(body)
    try:
        payload = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n,
            max_ext_len=n,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise StateFormatError(
            f"The state file is corrupt: its checksum matches but its body is not valid msgpack "
            f"({str(exc) or type(exc).__name__}); it was not written by savable_loader."
        ) from exc
    problem = find_non_plain(payload)
    if problem is not None:
        raise StateFormatError(
            f"The state file is corrupt: its body holds data that is not plain: {problem}."
        )
    return payload


def peek_header(data: bytes) -> HeaderInfo:
    """Reads and checks a state file's header without looking at the body.

    Args:
        data: The bytes of a state file, or at least its first ``HEADER_SIZE`` bytes.

    Returns:
        The header's fields.

    Raises:
        StateFormatError: As :func:`loads`, for every problem a header alone can show.
    """
    data = _as_bytes(data)
    if not data:
        raise StateFormatError(
            "The state data is empty (0 bytes), so it is not a savable_loader state file; "
            "a write that never completed can leave an empty file."
        )
    if not data.startswith(MAGIC):
        if MAGIC.startswith(data):
            raise StateFormatError(
                f"The state data is truncated: it is only {len(data)} bytes long and ends inside "
                "the 8-byte savable_loader signature."
            )
        raise StateFormatError(_foreign_message(data))
    if len(data) < HEADER_SIZE:
        raise StateFormatError(
            f"The state data is truncated: it is {len(data)} bytes long, shorter than the "
            f"{HEADER_SIZE}-byte savable_loader header."
        )
    _, version, flags, body_length, digest = _HEADER.unpack_from(data)
    if version > FILE_FORMAT_VERSION:
        raise StateFormatError(
            f"This state file has file format version {version}, but this savable_loader reads "
            f"versions up to {FILE_FORMAT_VERSION}: a newer savable_loader wrote it. {_UPGRADE}"
        )
    if version < 1:
        raise StateFormatError(
            f"This state file has file format version {version}, which no savable_loader writes: "
            "its header is corrupt."
        )
    if flags:
        raise StateFormatError(
            f"This state file sets header flags 0x{flags:04x} that this savable_loader does not "
            f"know: it was written by a newer savable_loader, or its header is corrupt. {_UPGRADE}"
        )
    return HeaderInfo(format_version=version, body_length=body_length, digest=digest.hex())


def _as_bytes(data: object) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    raise StateFormatError(
        f"Expected the bytes of a state file, got {type(data).__name__}; "
        "open state files in binary mode ('rb')."
    )


def _foreign_message(data: bytes) -> str:
    start = "Not a savable_loader state file:"
    if (data[0] == 0x80 and len(data) > 1 and 2 <= data[1] <= 5) or (
        data[:1] in (b"(", b"c", b"}", b"]") and data.endswith(b".")
    ):
        return (
            f"{start} it looks like a Python pickle (from pickle.dump or an old torch.save). "
            "savable_loader never unpickles files, since unpickling can run arbitrary code; "
            "save loader states with savable_loader.save_state."
        )
    if data.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return (
            f"{start} it looks like a zip archive, such as a torch.save checkpoint. savable_loader "
            "does not read torch.save files, since they hold pickles; save loader states with "
            "savable_loader.save_state, or put the loader's state_dict() in your checkpoint."
        )
    if data.lstrip(b" \t\r\n").removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")[:1] in (b"{", b"["):
        return (
            f"{start} it looks like JSON text. State files are binary (a header and msgpack); "
            "if you stored a state dict as JSON yourself, read it with json.load and pass the dict."
        )
    if data.startswith(b"\x1f\x8b"):
        return f"{start} it looks like gzip-compressed data; decompress it first."
    if data.startswith(b"SAVLDR"):
        return (
            f"{start} it starts with the signature's letters, but bytes 6-7 are {data[6:8]!r} "
            "instead of b'\\r\\n', as when a file is copied in text mode (FTP ASCII mode, git "
            "autocrlf, open(path, 'w')). The file is damaged; copy it again in binary mode."
        )
    hint = ""
    if len(data) > 1 and 0x81 <= data[0] <= 0x8F and 0xA0 <= data[1] <= 0xBF:
        hint = " It may be bare msgpack, written without savable_loader's header."
    return (
        f"{start} it does not start with the signature {MAGIC!r} "
        f"(it starts with {data[:8]!r}).{hint}"
    )
