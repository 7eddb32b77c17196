"""Saved loader states: typed models and the pipeline fingerprint."""

from .fingerprint import fingerprint
from .models import FORMAT_VERSION, Checkpoint, RankState, RngState, WorkerState

__all__ = ["FORMAT_VERSION", "Checkpoint", "RankState", "RngState", "WorkerState", "fingerprint"]
