"""A state through the state file encoding and back: :func:`roundtrip`, which every state
the harness restores goes through."""

from __future__ import annotations

from .. import serialization
from ..state.files import state_from_payload
from ..state.models import RankState
from .divergence import ResumeMismatch


def roundtrip(state: RankState) -> RankState:
    """Sends ``state`` through the state file encoding and back."""
    payload = serialization.loads(serialization.dumps({"kind": "rank", "state": state.to_plain()}))
    restored = state_from_payload(payload)
    if not isinstance(restored, RankState):
        raise ResumeMismatch("the state came back as a list of rank states")
    return restored
