"""The three loaders of ``benchmarks/bench_fair.py``, each over its own format.

Everything here runs in a child process of the benchmark (one per measurement, so that
no library's global state outlives it): :func:`write_format` writes one format of the
samples, :func:`read_epoch` builds one loader and reads one epoch.

NOTE [ Fair samples ]
Sample ``i`` is ``(bytes, label)``: 100,000 bytes drawn from ``numpy.random`` seeded
with ``i`` and the label ``i % 10``. Each format holds the same bytes, ``per_shard``
samples per file, in index order:

* ``tar`` (this library's ``TarSource``): ``shard-NNN.tar`` with the members
  ``<i>.bin`` and ``<i>.cls`` (the label in decimal), and a counts file beside them.
* ``mds`` (Mosaic Streaming): ``MDSWriter`` with the columns ``bin: bytes`` and
  ``cls: int``, no compression, and a ``size_limit`` that closes a shard after
  ``per_shard`` samples.
* ``litdata`` (LitData): ``litdata.optimize()`` of ``{"bin": bytes, "cls": int}`` with
  ``chunk_size=per_shard``, one worker (so the chunks keep the index order), no
  compression.

NOTE [ Mosaic without torchvision ]
``import streaming`` imports ``streaming.vision``, which needs torchvision. The only
torchvision wheel for torch 2.13 reachable here is the CUDA build, whose operators do not
load beside the CPU build of torch (``RuntimeError: operator torchvision::nms does not
exist``, raised on import), and installing it would break every other ``import
torchvision`` in the environment. Before importing Mosaic, a child process therefore puts
an empty module in ``sys.modules["streaming.vision"]``; nothing this benchmark uses comes
from it (``StreamingDataset``, ``StreamingDataLoader`` and ``MDSWriter`` live in
``streaming.base``).

NOTE [ LitData over plain HTTP ]
LitData downloads chunks with obstore, whose client refuses an ``http://`` endpoint
(``reqwest::Error { kind: Builder, source: BadScheme }``) unless its client options say
``allow_http``. LitData builds those options itself (the module-level dict
``litdata.streaming.downloader._OBSTORE_CLIENT_OPTIONS``) and takes no setting for them
(``AWS_ALLOW_HTTP`` in the environment is overridden by them), so the LitData child adds
``"allow_http": True`` to that dict before building its dataset; nothing else changes.
The loopback store speaks HTTP only.

NOTE [ Mosaic's client across fork ]
Building a ``StreamingDataset`` whose ``local`` folder lacks ``index.json`` downloads it
in the main process, through the stream's downloader, whose boto3 client keeps the
connection open in its pool. The workers fork with that client and its open connection,
and two of them reading answers on one socket take bytes from each other's answers. With
shuffle on, from an empty cache, 7 of 19 development runs of 10,000 samples failed this
way (``IndexError: Relative sample index 221 is not present in the shard.00025.mds
file``, or ``index 0 is out of bounds`` decoding a sample; 0 of 5 without the 30 ms
latency); one shard compared against its original had the right length and 8,188 bytes
missing 782,336 bytes in, the rest of its first 8 MiB part shifted. Over this plain-HTTP
endpoint nothing detects it (every answer keeps its length); over TLS it was not tried.
The adapter therefore calls ``clean_up()`` on each stream's downloader
(``stream._downloader``: Mosaic's own method, which drops the client) after building the
dataset, so that each worker builds its own client; 6 of 6 such runs read whole epochs.
The benchmark also compares every file of every cache with the original after each
measurement (``verify_cache`` in ``bench_fair.py``).

NOTE [ Work per item ]
Every loader maps each sample through :class:`Work`: ``common.burn`` for the item's
cost (NOTE [ Item cost ] in ``common.py``), timed with ``time.thread_time()`` into a
shared array (one slot per worker, forked into the workers), so that the loader's own
CPU per item is the measurement's CPU minus what the work itself took, not minus a
nominal figure. The work returns 1 for the item (the sample is dropped: only reading
it is measured) and :func:`collate` makes a batch of them.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import multiprocessing
import os
import resource
import sys
import tarfile
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import common
import numpy as np
from torch.utils.data import get_worker_info

SAMPLE_BYTES = 100_000
#: The loaders' settings (the issue's): workers and batch size.
WORKERS, BATCH = 2, 8
FORMATS = {"ours": "tar", "mosaic": "mds", "litdata": "litdata"}
#: Slots of the shared work-time array: (seconds, items) per worker.
_SLOTS = 16


def sample(index: int) -> tuple[bytes, int]:
    """Sample ``index`` (NOTE [ Fair samples ])."""
    return np.random.default_rng(index).bytes(SAMPLE_BYTES), index % 10


def _litdata_item(index: int) -> dict[str, Any]:
    data, label = sample(index)
    return {"bin": data, "cls": label}


def import_mosaic() -> Any:
    """``streaming`` with ``streaming.vision`` left out (NOTE [ Mosaic without torchvision ])."""
    if "streaming" not in sys.modules:
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


# -- writing the formats ----------------------------------------------------------------


def write_format(fmt: str, folder: Path, count: int, per_shard: int) -> None:
    """Writes ``count`` samples in format ``fmt`` under ``folder`` (NOTE [ Fair samples ])."""
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "tar":
        for shard in range(0, count, per_shard):
            with tarfile.open(folder / f"shard-{shard // per_shard:03d}.tar", "w") as tar:
                for index in range(shard, min(count, shard + per_shard)):
                    data, label = sample(index)
                    for ext, body in (("bin", data), ("cls", str(label).encode())):
                        info = tarfile.TarInfo(f"{index:06d}.{ext}")
                        info.size = len(body)
                        tar.addfile(info, io.BytesIO(body))
    elif fmt == "mds":
        streaming = import_mosaic()
        # A sample takes its two columns, a 4-byte size for the bytes column and a 4-byte
        # offset in the shard's header; the limit closes a shard after per_shard samples.
        per_sample = SAMPLE_BYTES + 8 + 4 + 4
        limit = per_shard * per_sample + 4 + per_sample // 2
        with streaming.MDSWriter(
            out=str(folder),
            columns={"bin": "bytes", "cls": "int"},
            compression=None,
            size_limit=limit,
        ) as writer:
            for index in range(count):
                data, label = sample(index)
                writer.write({"bin": data, "cls": label})
    elif fmt == "litdata":
        import litdata

        litdata.optimize(
            fn=_litdata_item,
            inputs=list(range(count)),
            output_dir=str(folder),
            chunk_size=per_shard,
            num_workers=1,
            verbose=False,
        )
    else:
        raise ValueError(f"unknown format {fmt!r}")


# -- one epoch ----------------------------------------------------------------------------


class Work:
    """Spends ``units`` repetitions of ``common.burn`` per item, timing them (NOTE
    [ Work per item ]); returns 1 (the item is dropped)."""

    def __init__(self, units: int, slots: Any) -> None:
        self.units = units
        self.slots = slots

    def __call__(self, item: Any) -> int:
        info = get_worker_info()
        slot = 0 if info is None else 1 + info.id % (_SLOTS // 2 - 1)
        began = time.thread_time()
        common.burn(self.units)
        self.slots[2 * slot] += time.thread_time() - began
        self.slots[2 * slot + 1] += 1
        return 1


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _ours(spec: dict[str, Any], work: Work) -> tuple[Any, Any]:
    from savable_loader import SavableDataLoader
    from savable_loader.datasets import TarSource

    kwargs: dict[str, Any] = {"counts": f"{spec['url']}/counts.json"}
    if spec["mode"] != "local":
        kwargs.update(storage_options=spec["storage_options"], cache_dir=spec["cache"])
    if spec["shuffle"]:
        kwargs.update(shuffle_shards=True, seed=0)
    source = TarSource(f"{spec['url']}/*.tar", **kwargs)
    if spec["shuffle"]:
        source = source.shuffle(buffer_size=spec["shuffle_buffer"], seed=0)
    loader = SavableDataLoader(
        source.map(work), batch_size=BATCH, num_workers=WORKERS, collate_fn=collate
    )
    return loader, loader.close


def _mosaic(spec: dict[str, Any], work: Work) -> tuple[Any, Any]:
    streaming = import_mosaic()

    class Dataset(streaming.StreamingDataset):  # type: ignore[misc, name-defined]
        def __getitem__(self, index: Any) -> Any:
            return work(super().__getitem__(index))

    local = spec["url"] if spec["mode"] == "local" else str(spec["cache"])
    remote = None if spec["mode"] == "local" else spec["url"]
    dataset = Dataset(
        remote=remote, local=local, batch_size=BATCH, shuffle=spec["shuffle"], shuffle_seed=0
    )
    # NOTE [ Mosaic's client across fork ]
    for stream in dataset.streams:
        stream._downloader.clean_up()
    loader = streaming.StreamingDataLoader(
        dataset, batch_size=BATCH, num_workers=WORKERS, collate_fn=collate
    )
    return loader, None


def _litdata(spec: dict[str, Any], work: Work) -> tuple[Any, Any]:
    import litdata
    from litdata.streaming import downloader

    # NOTE [ LitData over plain HTTP ]
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
    kwargs: dict[str, Any] = {}
    if spec["mode"] != "local":
        kwargs.update(storage_options=spec["litdata_options"], cache_dir=str(spec["cache"]))
    dataset = litdata.StreamingDataset(
        spec["url"], shuffle=spec["shuffle"], seed=0, transform=work, **kwargs
    )
    loader = litdata.StreamingDataLoader(
        dataset, batch_size=BATCH, num_workers=WORKERS, collate_fn=collate
    )
    return loader, None


def collate(items: list[int]) -> tuple[list[int]]:
    """A batch as ``(items,)``: Mosaic's ``StreamingDataLoader`` counts a batch's samples
    as ``len(batch[0])`` unless it is a tensor; every loader gets the same collate."""
    return (items,)


def import_library(library: str, remote: bool) -> None:
    """Imports what ``library`` needs before its clock starts: the library, and for a
    remote read the S3 client it uses (s3fs; boto3; boto3 and obstore)."""
    if library == "mosaic":
        import_mosaic()
    names = {
        "ours": ["savable_loader.datasets", *(["s3fs"] if remote else [])],
        "mosaic": ["boto3"],
        "litdata": ["litdata", "boto3", "obstore"],
    }[library]
    for name in names:
        importlib.import_module(name)


LOADERS = {"ours": _ours, "mosaic": _mosaic, "litdata": _litdata}


def read_epoch(spec: dict[str, Any]) -> dict[str, Any]:
    """Builds ``spec["library"]``'s loader as ``spec`` says and reads one epoch (or
    ``spec["max_seconds"]`` after the first batch); returns its figures.

    ``spec``: ``library``, ``mode`` (local, cold, warm), ``shuffle``,
    ``shuffle_buffer`` (ours' window: one shard's samples), ``url`` (the
    format's folder or ``s3://`` prefix), ``cache``, ``storage_options`` (fsspec's, for
    ours), ``litdata_options`` (boto3's, for LitData), ``units``, ``max_seconds``.
    """
    import_library(spec["library"], spec["mode"] != "local")
    slots = multiprocessing.RawArray("d", 2 * _SLOTS)
    work = Work(spec["units"], slots)
    cpu_before = _cpu_seconds()
    started = time.perf_counter()
    loader, close = LOADERS[spec["library"]](spec, work)
    iterator = iter(loader)
    items = len(next(iterator)[0])
    first_at = time.perf_counter()
    capped = False
    for batch in iterator:
        items += len(batch[0])
        if time.perf_counter() - first_at > spec["max_seconds"]:
            capped = True
            break
    ended = time.perf_counter()
    # Stop the workers now (torch's iterator joins them), so that their CPU is counted.
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    if close is not None:
        close()
    del iterator, loader
    closed = time.perf_counter()
    cpu = _cpu_seconds() - cpu_before
    work_s = sum(slots[2 * slot] for slot in range(_SLOTS))
    work_items = sum(slots[2 * slot + 1] for slot in range(_SLOTS))
    return {
        "items": items,
        "first_batch_s": first_at - started,
        "items_per_s": (items - BATCH) / (ended - first_at) if ended > first_at else 0.0,
        "epoch_s": ended - started,
        "wall_s": closed - started,
        "capped": capped,
        "cpu_s": cpu,
        "work_s": work_s,
        "work_items": int(work_items),
    }


def clean_mosaic_memory() -> None:
    """Unlinks the shared memory a Mosaic run left behind (its own cleaner)."""
    streaming = import_mosaic()
    from streaming.base.util import clean_stale_shared_memory

    del streaming
    with contextlib.suppress(Exception):
        clean_stale_shared_memory()


def child(conn: Any, task: str, payload: dict[str, Any]) -> None:
    """A child process's entry: pins itself (``payload["cpus"]``), sets the environment
    (``payload["env"]``), runs ``task`` and sends ``("ok", result)`` or
    ``("error", traceback)``."""
    import traceback

    try:
        if payload.get("cpus"):
            os.sched_setaffinity(0, set(payload["cpus"]))
        os.environ.update(payload.get("env", {}))
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again
        # Workers fork, as torch's on Linux by default (a spawned child would spawn them).
        multiprocessing.set_start_method("fork", force=True)
        if task == "write":
            write_format(payload["format"], Path(payload["folder"]), *payload["size"])
            result: Any = None
        elif task == "read":
            result = read_epoch(payload)
            if payload["library"] == "mosaic":
                clean_mosaic_memory()
        else:
            raise ValueError(f"unknown task {task!r}")
        conn.send(("ok", result))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
