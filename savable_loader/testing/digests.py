"""Digests of items: equal items give equal digests (tensors by dtype, shape and bytes).

The harness keeps a digest of every item of the reference run instead of the item
(NOTE [ Divergence detail ] in ``restores.py``).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch


def digest(item: Any) -> str:
    """Returns a hex digest of an item's content: equal items give equal digests."""
    hasher = hashlib.blake2b(digest_size=16)
    _feed(hasher, item)
    return hasher.hexdigest()


def _feed(hasher: Any, item: Any) -> None:
    if isinstance(item, torch.Tensor):
        shape = tuple(item.shape)
        tensor = item.detach().cpu().contiguous().reshape(-1)
        hasher.update(f"T{tensor.dtype}{shape}".encode())
        hasher.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(item, np.ndarray):
        array = np.ascontiguousarray(item)
        hasher.update(f"N{array.dtype}{array.shape}".encode())
        hasher.update(array.tobytes())
    elif isinstance(item, dict):
        hasher.update(b"D%d" % len(item))
        for key in sorted(item, key=repr):
            _feed(hasher, key)
            _feed(hasher, item[key])
    elif isinstance(item, (list, tuple)):
        hasher.update(b"L%d" % len(item))
        for element in item:
            _feed(hasher, element)
    elif isinstance(item, (bytes, bytearray)):
        hasher.update(b"B" + bytes(item))
    else:
        hasher.update(f"{type(item).__name__}:{item!r}".encode())
