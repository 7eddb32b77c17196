"""Tests of savable_loader.serialization: round trips, refusals, and every bad input."""

from __future__ import annotations

import collections
import enum
import gzip
import hashlib
import io
import json
import math
import os
import pickle
import random
import shlex
import struct
import zipfile
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from savable_loader.errors import StateError, StateFormatError
from savable_loader.serialization import (
    FILE_FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    HeaderInfo,
    dumps,
    loads,
    peek_header,
)

SAMPLE = {
    "format_version": 1,
    "workers": [
        {"id": 0, "next_index": 17, "dataset_state": None, "rng": b"\x00\x01\xff" * 100},
        {"id": 1, "next_index": 2**64 - 1, "dataset_state": {"offset": -(2**63)}, "rng": b""},
    ],
    "ratio": 0.1,
    "big_negative": -(2**63),
    "flags": [True, False, None],
    "text": "héllo wörld, 日本語, emoji \U0001f600",
    "empty": {"list": [], "dict": {}, "str": "", "bytes": b""},
    "nested": [[[[{"deep": [1, 2.5, "x", b"y"]}]]]],
    "key with spaces": 0,
}

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary()
)
PLAIN = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(), children, max_size=5)
    ),
    max_leaves=30,
)


def _file(body: bytes, *, version: int = FILE_FORMAT_VERSION, flags: int = 0) -> bytes:
    """A state file with a correct length and checksum around an arbitrary body."""
    digest = hashlib.blake2b(body, digest_size=32).digest()
    return MAGIC + struct.pack(">HHQ", version, flags, len(body)) + digest + body


def _flip(data: bytes, bit: int) -> bytes:
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    return bytes(flipped)


# Round trips.


def test_round_trip_of_nested_plain_data() -> None:
    data = dumps(SAMPLE)
    assert loads(data) == SAMPLE
    assert dumps(loads(data)) == data  # types survive too: bool, int, float, str, bytes differ


def test_types_are_preserved_exactly() -> None:
    loaded = loads(dumps([1, 1.0, True, "a", b"a", None]))
    assert isinstance(loaded, list)
    assert [type(x) for x in loaded] == [int, float, bool, str, bytes, type(None)]


def test_special_floats_round_trip() -> None:
    loaded = loads(dumps([math.nan, math.inf, -math.inf, -0.0]))
    assert isinstance(loaded, list)
    nan, inf, neg_inf, neg_zero = loaded
    assert math.isnan(nan)
    assert (inf, neg_inf) == (math.inf, -math.inf)
    assert math.copysign(1.0, neg_zero) == -1.0


def test_bytes_like_input_is_accepted() -> None:
    data = dumps(SAMPLE)
    assert loads(bytearray(data)) == SAMPLE  # type: ignore[arg-type]
    assert loads(memoryview(data)) == SAMPLE  # type: ignore[arg-type]


@given(PLAIN)
def test_round_trip_property(payload: object) -> None:
    data = dumps(payload)
    assert loads(data) == payload
    assert dumps(loads(data)) == data


# Header.


def test_header_layout() -> None:
    assert MAGIC == b"SAVLDR\r\n"
    assert FILE_FORMAT_VERSION == 1
    assert HEADER_SIZE == 52
    data = dumps(SAMPLE)
    body = data[HEADER_SIZE:]
    assert data[:8] == MAGIC
    assert data[8:10] == b"\x00\x01"
    assert data[10:12] == b"\x00\x00"
    assert int.from_bytes(data[12:20], "big") == len(body)
    assert data[20:52] == hashlib.blake2b(body, digest_size=32).digest()
    assert msgpack.unpackb(body, raw=False) == SAMPLE


def test_peek_header() -> None:
    data = dumps(SAMPLE)
    info = peek_header(data[:HEADER_SIZE])  # the header alone is enough
    body = data[HEADER_SIZE:]
    assert info == HeaderInfo(
        format_version=1,
        body_length=len(body),
        digest=hashlib.blake2b(body, digest_size=32).hexdigest(),
    )
    with pytest.raises(StateFormatError, match="newer savable_loader"):
        peek_header(_file(b"\xc0", version=2))


# Refusals of data that is not plain.


class Color(enum.IntEnum):
    RED = 1


def _self_containing() -> list[object]:
    loop: list[object] = []
    loop.append(loop)
    return loop


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (
            {"workers": [0, 1, {"dataset_state": (1, 2)}]},
            "workers[2].dataset_state: tuple is not plain data; use a list",
        ),
        ((1, 2), "the top level: tuple is not plain data"),
        ({"seen": {1, 2}}, "seen: set is not plain data; use a sorted list"),
        ({"seen": frozenset()}, "seen: frozenset is not plain data"),
        ({"seed": np.int64(3)}, "seed: numpy.int64 is not plain data; convert it with int(x)"),
        (
            {"perm": np.arange(3)},
            "perm: numpy.ndarray is not plain data; convert it with int(x), float(x), x.tolist()",
        ),
        (
            {"rng": torch.zeros(2)},
            "rng: torch.Tensor is not plain data; convert it with x.item(), x.tolist()",
        ),
        ({"x": [object()]}, "x[0]: object is not plain data (plain data is dict with str keys"),
        ({"buf": bytearray(b"a")}, "buf: bytearray is not plain data; convert it with bytes(...)"),
        (
            {"color": Color.RED},
            "color: Color (a subclass of int) is not plain data; convert it with int(x)",
        ),
        (
            {"od": collections.OrderedDict()},
            "od: OrderedDict (a subclass of dict) is not plain data",
        ),
        ({"a": {3: "x"}}, "a: dict key 3 is int, not str; keys must be str"),
        ({"a": {b"k": "x"}}, "a: dict key b'k' is bytes, not str"),
        (
            {"odd key": {"x-y": [None, 2**64]}},
            "['odd key']['x-y'][1]: int 18446744073709551616 is outside msgpack's range",
        ),
        ({"n": -(2**63) - 1}, "n: int -9223372036854775809 is outside msgpack's range"),
        ({"loop": _self_containing()}, "nested more than 500 levels deep"),
        ({"s": "\ud800"}, "msgpack refused it"),
    ],
)
def test_non_plain_data_is_refused_with_its_path(payload: object, expected: str) -> None:
    with pytest.raises(StateFormatError) as info:
        dumps(payload)
    assert expected in str(info.value)
    assert str(info.value).startswith("Cannot save the state: ")


# Bad input: every case names what is wrong.


def test_state_format_error_is_a_state_error() -> None:
    with pytest.raises(StateError):
        loads(b"")


def test_empty() -> None:
    with pytest.raises(StateFormatError, match=r"empty \(0 bytes\)"):
        loads(b"")


def test_truncated_at_every_length() -> None:
    data = dumps(SAMPLE)
    for length in range(1, len(data)):
        with pytest.raises(StateFormatError, match="truncated") as info:
            loads(data[:length])
        if length < len(MAGIC):
            assert "inside the 8-byte savable_loader signature" in str(info.value)
        elif length < HEADER_SIZE:
            assert f"shorter than the {HEADER_SIZE}-byte savable_loader header" in str(info.value)
        else:
            assert f"only {length - HEADER_SIZE} follow the header" in str(info.value)


def test_extra_bytes_after_the_body() -> None:
    with pytest.raises(StateFormatError, match="3 unexpected bytes after the"):
        loads(dumps(SAMPLE) + b"abc")


def test_every_bit_flip_in_the_body_fails_the_checksum() -> None:
    data = dumps(SAMPLE)
    for bit in range(HEADER_SIZE * 8, len(data) * 8):
        with pytest.raises(StateFormatError, match="corrupt: the checksum of its"):
            loads(_flip(data, bit))


def test_every_bit_flip_in_the_digest_fails_the_checksum() -> None:
    data = dumps(SAMPLE)
    for bit in range(20 * 8, HEADER_SIZE * 8):
        with pytest.raises(StateFormatError, match="checksum"):
            loads(_flip(data, bit))


def test_every_bit_flip_in_the_magic_is_not_a_state_file() -> None:
    data = dumps(SAMPLE)
    for bit in range(len(MAGIC) * 8):
        with pytest.raises(StateFormatError, match="Not a savable_loader state file"):
            loads(_flip(data, bit))


@given(PLAIN, st.data())
def test_any_bit_flip_anywhere_is_refused(payload: object, data: st.DataObject) -> None:
    encoded = dumps(payload)
    bit = data.draw(st.integers(min_value=0, max_value=len(encoded) * 8 - 1))
    with pytest.raises(StateFormatError):
        loads(_flip(encoded, bit))


def test_text_mode_copy_is_recognised() -> None:
    mangled = dumps(SAMPLE).replace(b"\r\n", b"\n", 1)
    with pytest.raises(StateFormatError, match="copied in text mode"):
        loads(mangled)


def test_random_bytes() -> None:
    rng = random.Random(0)
    for _ in range(100):
        data = rng.randbytes(rng.randrange(1, 200))
        with pytest.raises(StateFormatError, match="Not a savable_loader state file"):
            loads(data)


@given(st.binary(min_size=1))
def test_arbitrary_bytes_only_raise_state_format_error(data: bytes) -> None:
    with pytest.raises(StateFormatError):
        loads(data)


@given(st.binary())
def test_arbitrary_body_with_a_valid_checksum_is_plain_data_or_refused(body: bytes) -> None:
    try:
        payload = loads(_file(body))
    except StateFormatError:
        return
    dumps(payload)  # whatever decodes is plain data


@pytest.mark.parametrize("text", [b'{"workers": []}', b"  \n[1, 2]", b"\xef\xbb\xbf{}"])
def test_json(text: bytes) -> None:
    with pytest.raises(StateFormatError, match="looks like JSON text"):
        loads(text)


def test_json_of_a_real_state() -> None:
    text = json.dumps({"format_version": 1, "workers": []}, indent=2).encode()
    with pytest.raises(StateFormatError, match="JSON"):
        loads(text)


class _Exploit:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def test_the_exploit_works_when_unpickled(tmp_path: Path) -> None:
    """Control for the next test: the pickle really would run code."""
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(_Exploit(marker)))
    assert marker.exists()


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_is_recognised_and_never_run(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    data = pickle.dumps(_Exploit(marker), protocol=protocol)
    with pytest.raises(StateFormatError, match="looks like a Python pickle") as info:
        loads(data)
    assert "never unpickles files" in str(info.value)
    with pytest.raises(StateFormatError, match="body is not valid msgpack"):
        loads(_file(data))  # a pickle behind a valid header is not run either
    assert not marker.exists()


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickled_state_dict_is_recognised(protocol: int) -> None:
    with pytest.raises(StateFormatError, match="pickle"):
        loads(pickle.dumps(SAMPLE, protocol=protocol))


def test_torch_save_zip_checkpoint() -> None:
    buffer = io.BytesIO()
    torch.save({"loader": SAMPLE, "weights": torch.zeros(3)}, buffer)
    with pytest.raises(StateFormatError, match=r"looks like a zip archive, such as a torch\.save"):
        loads(buffer.getvalue())


def test_legacy_torch_save_is_a_pickle() -> None:
    buffer = io.BytesIO()
    torch.save({"loader": 1}, buffer, _use_new_zipfile_serialization=False)
    with pytest.raises(StateFormatError, match="pickle"):
        loads(buffer.getvalue())


def test_plain_zip() -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("state.msgpack", dumps(SAMPLE))
    with pytest.raises(StateFormatError, match="zip archive"):
        loads(buffer.getvalue())


def test_gzip() -> None:
    with pytest.raises(StateFormatError, match="gzip-compressed"):
        loads(gzip.compress(dumps(SAMPLE)))


def test_bare_msgpack() -> None:
    with pytest.raises(StateFormatError, match="may be bare msgpack"):
        loads(msgpack.packb(SAMPLE, use_bin_type=True))


@pytest.mark.parametrize("version", [2, 65535])
def test_future_version(version: int) -> None:
    with pytest.raises(StateFormatError, match=f"file format version {version}") as info:
        loads(_file(msgpack.packb({}), version=version))
    assert "a newer savable_loader wrote it" in str(info.value)
    assert "Upgrade savable_loader" in str(info.value)


def test_version_zero() -> None:
    with pytest.raises(StateFormatError, match="version 0, which no savable_loader writes"):
        loads(_file(msgpack.packb({}), version=0))


def test_unknown_flags() -> None:
    with pytest.raises(StateFormatError, match="header flags 0x0004") as info:
        loads(_file(msgpack.packb({}), flags=4))
    assert "Upgrade savable_loader" in str(info.value)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(
            msgpack.packb({b"k": 1}, use_bin_type=True),
            "not plain: the top level: dict key b'k' is bytes",
            id="bytes-key",
        ),
        pytest.param(
            msgpack.packb([msgpack.ExtType(5, b"x")]),
            "not plain: [0]: ExtType is not plain data",
            id="ext-type",
        ),
        pytest.param(
            msgpack.packb({"t": msgpack.Timestamp(1)}),
            "not plain: t: Timestamp is not plain data",
            id="timestamp",
        ),
        pytest.param(msgpack.packb({1: 2}), "body is not valid msgpack", id="int-key"),
        pytest.param(b"\x91" * 100_000 + b"\xc0", "body is not valid msgpack", id="too-deep"),
        pytest.param(b"\xdd\xff\xff\xff\xff", "body is not valid msgpack", id="4-billion-items"),
        pytest.param(b"\xa2\xff\xfe", "body is not valid msgpack", id="invalid-utf8"),
        pytest.param(b"\xc0\xc0", "body is not valid msgpack", id="two-objects"),
    ],
)
def test_checksummed_body_that_is_not_a_state(body: bytes, expected: str) -> None:
    with pytest.raises(StateFormatError, match="The state file is corrupt") as info:
        loads(_file(body))
    assert expected in str(info.value)


def test_text_instead_of_bytes() -> None:
    with pytest.raises(
        StateFormatError, match=r"got str; open state files in binary mode \('rb'\)"
    ):
        loads(dumps(SAMPLE).decode("latin-1"))  # type: ignore[arg-type]
