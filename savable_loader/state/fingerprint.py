"""A stable hash of what identifies a pipeline and the loader arguments shaping its stream.

NOTE [ Pipeline fingerprint ]
A state carries the fingerprint of the loader that saved it: a hash of the pipeline's
``config()`` tree (each stage's, nested) plus the loader arguments that shape the stream
(batch size, ``drop_last``, seed, number of workers, the ``collate_fn``'s name). A
restore refuses a state saved under another fingerprint, naming both, so that a state
never silently continues another pipeline. The state also carries the names of the
pipeline's functions and classes (``RankState.callables``), so that the refusal names the
one that differs; a script's own names are written as the script's module names (NOTE
[ Names from a script ] in ``names.py``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..errors import ConfigError
from .names import QualName

__all__ = ["fingerprint"]


def fingerprint(tree: dict[str, Any], *, raw_names: bool = False) -> str:
    """Returns a 16-hex-digit hash of a tree of plain data, independent of dict order.

    Args:
        tree: The tree.
        raw_names: Hash each :class:`~savable_loader.state.names.QualName` as its module
            reports it (``__main__.fn``), as versions before NOTE [ Names from a script ]
            in ``state/names.py`` did.

    Raises:
        ConfigError: The tree holds something other than dict (str keys), list, tuple,
            str, int, float, bool or None; the message names its path.
    """
    canonical = json.dumps(_check(tree, "config", raw_names), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _check(value: Any, path: str, raw_names: bool) -> Any:
    if raw_names and isinstance(value, QualName):
        return value.raw
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_check(item, f"{path}[{index}]", raw_names) for index, item in enumerate(value)]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise ConfigError(f"{path} has a non-str key {key!r}; config() keys are str")
        return {key: _check(item, f"{path}.{key}", raw_names) for key, item in value.items()}
    raise ConfigError(
        f"{path} is a {type(value).__name__}; config() must return plain data "
        "(dict, list, str, int, float, bool, None) so its fingerprint is stable"
    )
