"""The values torch's ``Stateful`` objects put in a state, written as plain data.

NOTE [ Values of a Stateful object's state ]
Torch's ``Stateful`` protocol puts no bound on what ``state_dict()`` returns, and
objects written for it save what their own code needs back: a generator's state as a
tensor (``torch.get_rng_state()``), NumPy arrays, ``random.getstate()``'s tuple, dicts
keyed by worker number. torchdata's ``StatefulDataLoader`` keeps them as they are,
because its states are pickled. A state of this library is plain data (``plain.py``):
it reads back from a file without running code. So ``from_stateful`` writes each such
value as a tagged dict, ``{"__sl_value__": kind, ...}``, and reads it back as what it
was before handing the state to ``load_state_dict``:

- a tensor: its dtype's name, its shape and its bytes (a CPU copy of it);
- a NumPy array or scalar: its dtype string, its shape and its bytes;
- a tuple: its items (a plain state would turn it into a list, and
  ``random.setstate`` refuses a list);
- a dict with a key that is not a str, or with the key ``"__sl_value__"`` itself: its
  ``[key, value]`` pairs, so no dict of yours is ever read as a tag.

Everything else passes through unchanged, and what plain data cannot hold (a set, an
object) is refused where it always was, naming its path. Reading a tag checks it
whole: a crafted state gets a ``StateError``, never an array of the wrong size. A
tensor comes back on the CPU; ``load_state_dict`` moves it where it belongs, as it
would after ``torch.load(..., map_location="cpu")``.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import torch

from ...errors import StateError

__all__ = ["TAG", "decode", "encode"]

#: The key that marks a tagged value (NOTE [ Values of a Stateful object's state ]).
TAG = "__sl_value__"
#: The dtypes a tensor is saved in: all but the quantized, the bit-packed and the
#: sub-byte placeholder ones (``torch.int4``), which have no bytes to save.
_TORCH_DTYPES = {
    name: dtype
    for dtype in vars(torch).values()
    if isinstance(dtype, torch.dtype)
    and not re.match(r"q|bits|u?int[1-7]$", name := str(dtype).removeprefix("torch."))
}
_NUMPY_KINDS = frozenset("biufcSU")


def encode(value: Any) -> Any:
    """Returns ``value`` with its tensors, arrays, tuples and non-str-keyed dicts tagged."""
    if isinstance(value, dict):
        if all(type(key) is str for key in value) and TAG not in value:
            return {key: encode(item) for key, item in value.items()}
        return {TAG: "dict", "items": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [encode(item) for item in value]
    if isinstance(value, tuple):
        return {TAG: "tuple", "items": [encode(item) for item in value]}
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value)
    if isinstance(value, np.ndarray | np.generic):
        return _encode_array(value)
    return value


def decode(value: Any) -> Any:
    """Reads back what :func:`encode` wrote.

    Raises:
        StateError: A tag is unknown or does not hold what its kind needs.
    """
    if isinstance(value, list):
        return [decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    if TAG not in value:
        return {key: decode(item) for key, item in value.items()}
    kind = value[TAG]
    if kind == "dict":
        return {_hashable(decode(k)): decode(v) for k, v in _pairs(value)}
    if kind == "tuple":
        return tuple(decode(item) for item in _field(value, "items", list))
    if kind == "tensor":
        return _decode_tensor(value)
    if kind in ("ndarray", "numpy"):
        return _decode_array(value)
    raise StateError(f"from_stateful: a saved value has the unknown kind {kind!r}")


def _encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    name = str(tensor.dtype).removeprefix("torch.")
    if tensor.layout != torch.strided or tensor.is_quantized or name not in _TORCH_DTYPES:
        raise StateError(
            f"from_stateful: a {tensor.dtype} tensor of layout {tensor.layout} in the "
            "object's state cannot be saved; save a dense tensor"
        )
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {TAG: "tensor", "dtype": name, "shape": list(tensor.shape), "data": data}


def _decode_tensor(value: dict[str, Any]) -> torch.Tensor:
    name = _field(value, "dtype", str)
    dtype = _TORCH_DTYPES.get(name)
    if dtype is None:
        raise StateError(f"from_stateful: a saved tensor has the unknown dtype {name!r}")
    shape = _shape(value)
    data = _field(value, "data", bytes)
    size = math.prod(shape) * dtype.itemsize
    if len(data) != size:
        raise StateError(
            f"from_stateful: a saved {name} tensor of shape {shape!r:.60} needs {size} bytes, "
            f"the state holds {len(data)}"
        )
    try:
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
    except (RuntimeError, ValueError) as error:  # dimensions torch refuses
        raise StateError(
            f"from_stateful: a saved {name} tensor cannot be built: {error}"
        ) from error


def _encode_array(array: np.ndarray[Any, Any] | np.generic) -> dict[str, Any]:
    dtype = array.dtype
    if dtype.kind not in _NUMPY_KINDS or dtype.fields is not None:
        raise StateError(
            f"from_stateful: a NumPy value of dtype {dtype} in the object's state cannot "
            "be saved; save numbers, strings or bytes"
        )
    kind = "ndarray" if isinstance(array, np.ndarray) else "numpy"
    data = np.ascontiguousarray(array).tobytes()
    return {TAG: kind, "dtype": dtype.str, "shape": list(np.shape(array)), "data": data}


def _decode_array(value: dict[str, Any]) -> Any:
    text = _field(value, "dtype", str)
    try:
        dtype = np.dtype(text)
    except TypeError as error:
        raise StateError(f"from_stateful: a saved array has the bad dtype {text!r}") from error
    if dtype.kind not in _NUMPY_KINDS or dtype.fields is not None or dtype.itemsize == 0:
        raise StateError(f"from_stateful: a saved array has the refused dtype {text!r}")
    shape = _shape(value)
    data = _field(value, "data", bytes)
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise StateError(
            f"from_stateful: a saved {text} array of shape {shape!r:.60} does not match its "
            f"{len(data)} bytes"
        )
    try:
        array = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    except ValueError as error:  # dimensions NumPy refuses
        raise StateError(f"from_stateful: a saved {text} array cannot be built: {error}") from error
    return array[()] if value[TAG] == "numpy" else array


def _field(value: dict[str, Any], key: str, kind: type) -> Any:
    field = value.get(key)
    if not isinstance(field, kind):
        raise StateError(
            f"from_stateful: a saved {value[TAG]} needs {key!r} as {kind.__name__}, "
            f"the state holds {field!r:.60}"
        )
    return field


def _shape(value: dict[str, Any]) -> list[int]:
    shape: list[Any] = _field(value, "shape", list)
    if len(shape) > 64 or not all(type(n) is int and n >= 0 for n in shape):
        raise StateError(f"from_stateful: a saved {value[TAG]} has the bad shape {shape!r:.60}")
    return shape


def _pairs(value: dict[str, Any]) -> list[list[Any]]:
    pairs: list[Any] = _field(value, "items", list)
    if not all(isinstance(pair, list) and len(pair) == 2 for pair in pairs):
        raise StateError("from_stateful: a saved dict needs its items as [key, value] pairs")
    return pairs


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError as error:
        raise StateError(f"from_stateful: a saved dict key {key!r:.60} is not hashable") from error
    return key
