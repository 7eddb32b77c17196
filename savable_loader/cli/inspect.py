"""``savable-loader inspect URL``: a summary of what a state file holds, as text or JSON.

Per worker it also says what the checkpoint keeps of the worker's global generators
(``generators`` of a rank, one entry per worker): ``"bytes"`` (their states, about 10 KB),
``"seeded for epoch E"`` (untouched since the loader seeded them for epoch E, NOTE
[ Untouched generators ] in ``rng/generators.py``) or None (no checkpoint).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import msgpack

from .. import serialization
from ..errors import SavableLoaderError
from ..state.files import read_state_bytes, state_from_payload
from ..state.models import RankState, WorkerState
from .output import _PROG, _err, _out

_STATE_WIDTH = 60


def _one_line(error: BaseException) -> str:
    return "; ".join(part.strip() for part in str(error).splitlines() if part.strip())


def _inspect(url: str, *, as_json: bool) -> int:
    try:
        # What load_state(url) does (NOTE [ Bounded reads ] in state/files.py), keeping
        # the bytes for the header's summary.
        data = read_state_bytes(url)
        header = serialization.peek_header(data)
        payload = serialization.loads(data)
        loaded = state_from_payload(payload)
    except SavableLoaderError as error:
        _err(f"{_PROG} inspect: {url}: {_one_line(error)}")
        return 2
    except RecursionError:  # the checks bound nesting; a crafted file still gets one line
        _err(f"{_PROG} inspect: {url}: not a valid loader state: nested too deeply")
        return 2
    states = loaded if isinstance(loaded, list) else [loaded]
    summary: dict[str, Any] = {
        "url": url,
        "file_size": len(data),
        "file_format_version": header.format_version,
        "body_length": header.body_length,
        "checksum_blake2b": header.digest,
        "kind": "global" if isinstance(loaded, list) else "rank",
        "ranks": [_rank_summary(state) for state in states],
    }
    if as_json:
        _out(json.dumps(summary, indent=2))
    else:
        for line in _render(summary):
            _out(line)
    return 0


def _rank_summary(state: RankState) -> dict[str, Any]:
    return {
        "state_format_version": state.format_version,
        "library_version": state.library_version,
        "rank": state.rank,
        "world_size": state.world_size,
        "num_workers": state.num_workers,
        "batch_size": state.batch_size,
        "seed": state.seed,
        "epoch": state.epoch,
        "between_epochs": state.between_epochs,
        "fingerprint": state.fingerprint,
        "next_worker": state.next_worker,
        "order": _order_summary(state),
        "workers": [_worker_summary(worker) for worker in state.workers],
        "generators": [_generators(worker) for worker in state.workers],
    }


def _generators(worker: WorkerState) -> str | None:
    """What the worker's checkpoint keeps of its global generators."""
    checkpoint = worker.checkpoint
    if checkpoint is None:
        return None
    if checkpoint.rng is not None:
        return "bytes"
    return f"seeded for epoch {checkpoint.seeded_epoch}"


def _order_summary(state: RankState) -> dict[str, Any] | None:
    """How the main process drew the epoch's order (samplers, ``generator=``), if it did."""
    order = state.order
    if order is None:
        return None
    return {
        "epoch": order.epoch,
        "generators": len(order.before.generators),
        "sampler_state": order.before.sampler is not None,
        "sampler_epoch": order.before.sampler_epoch,
    }


def _worker_summary(worker: WorkerState) -> dict[str, Any]:
    checkpoint = worker.checkpoint
    summary: dict[str, Any] = {
        "worker_id": worker.worker_id,
        "delivered": worker.delivered,
        "ended": worker.ended,
        "checkpoint_seq": None,
        "replay": worker.replay,
        "exhausted": None,
        "dataset_state": None,
        "dataset_state_bytes": None,
    }
    if checkpoint is not None:
        # The outer level is the loader's batching stage (NOTE [ Batching is a stage ] in
        # datasets/batch.py); what is under it is the dataset's (the pipeline's) state.
        state = checkpoint.state
        batching = isinstance(state, dict) and set(state) == {"parent", "exhausted"}
        pipeline = state["parent"] if batching else state
        summary.update(
            checkpoint_seq=checkpoint.seq,
            exhausted=state["exhausted"] if batching else None,
            dataset_state=_displayable(pipeline),
            dataset_state_bytes=len(msgpack.packb(pipeline, use_bin_type=True)),
        )
    return summary


def _displayable(value: Any) -> Any:
    """Makes a state printable as JSON: bytes become ``"<N bytes>"``."""
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        return {
            key if isinstance(key, str) else json.dumps(_displayable(key)): _displayable(item)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_displayable(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def _render(summary: dict[str, Any]) -> Iterator[str]:
    ranks = summary["ranks"]
    yield f"savable_loader state file: {summary['url']}"
    yield (
        f"  size:                 {summary['file_size']:,} bytes "
        f"(header {serialization.HEADER_SIZE}, body {summary['body_length']:,})"
    )
    yield (
        f"  file format version:  {summary['file_format_version']} "
        f"(checksum blake2b-256 {summary['checksum_blake2b'][:16]}..., verified)"
    )
    if summary["kind"] == "rank":
        yield "  holds:                one rank's state (save_state_rank)"
    else:
        yield f"  holds:                {len(ranks)} rank states (save_state_global)"
    if ranks:
        formats = sorted({str(rank["state_format_version"]) for rank in ranks})
        versions = sorted({rank["library_version"] for rank in ranks})
        yield f"  state format version: {', '.join(formats)}"
        yield f"  library version:      {', '.join(versions)}"
    for rank in ranks:
        yield ""
        yield from _render_rank(rank)


def _render_rank(rank: dict[str, Any]) -> Iterator[str]:
    workers = rank["num_workers"]
    batch = rank["batch_size"]
    yield (
        f"rank {rank['rank']} of {rank['world_size']}: "
        f"{workers if workers else 'no'} worker{'' if workers == 1 else 's'}, "
        f"batch size {batch if batch is not None else 'None (no batching)'}, seed {rank['seed']}"
    )
    if rank["between_epochs"]:
        position = f"epoch {rank['epoch']} ended (the next iter() starts epoch {rank['epoch'] + 1})"
    else:
        position = f"epoch {rank['epoch']} in progress, next worker {rank['next_worker']}"
    yield f"  {position}"
    yield f"  fingerprint {rank['fingerprint']}"
    order = rank.get("order")
    if order is not None:
        sampler_epoch = order["sampler_epoch"]
        yield (
            f"  order of epoch {order['epoch']} drawn in the main process: "
            f"{order['generators']} generator state(s) of yours, the global generators'"
            + (", the sampler's state_dict()" if order["sampler_state"] else "")
            + (f", sampler epoch {sampler_epoch}" if sampler_epoch is not None else "")
        )
    header = [
        "worker",
        "delivered",
        "ended",
        "checkpoint seq",
        "replay",
        "exhausted",
        "generators",
    ]
    rows = [
        [
            str(w["worker_id"]),
            str(w["delivered"]),
            _yes_no(w["ended"]),
            "-" if w["checkpoint_seq"] is None else str(w["checkpoint_seq"]),
            str(w["replay"]),
            "-" if w["exhausted"] is None else _yes_no(w["exhausted"]),
            "-" if generators is None else generators,
        ]
        for w, generators in zip(rank["workers"], rank["generators"], strict=True)
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    yield (
        "  "
        + "  ".join(f"{h:>{n}}" for h, n in zip(header, widths, strict=True))
        + "  dataset state"
    )
    for row, worker in zip(rows, rank["workers"], strict=True):
        cells = "  ".join(f"{cell:>{n}}" for cell, n in zip(row, widths, strict=True))
        yield f"  {cells}  {_compact(worker)}"


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _compact(worker: dict[str, Any]) -> str:
    if worker["dataset_state_bytes"] is None:
        return "(none: starts from the dataset's initial state)"
    text = json.dumps(worker["dataset_state"], separators=(",", ":"))
    if len(text) > _STATE_WIDTH:
        text = text[: _STATE_WIDTH - 3] + "..."
    return f"{text} ({worker['dataset_state_bytes']} B)"
