"""Malformed states are refused by the restore, before any worker starts (NOTE [ States
checked at the door ] in ``datasets/protocol/stage.py``), and ``state_dict()`` is JSON.

Before the check, a checkpoint whose pipeline state was None (or a stage's ``parent``)
passed the restore and started the epoch over while the loader kept the saved position;
a JSON lines byte offset past the end of its file skipped the rest of the file; and
garbage at the batching level, in a state saved between epochs or in a ``Repeat`` /
``Map`` field passed the restore and failed at the first ``next()``. The systematic test
takes real states of a few pipelines, puts a None, a wrong type, a negative, a huge value
and a wrong nesting in each field of the pipeline state in turn, and checks that the
restore refuses it or that the loader then reads exactly the position it describes.
"""

from __future__ import annotations

import base64
import copy
import functools
import gzip
import io
import itertools
import json
import operator
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from savable_loader import SavableDataLoader, StateError, StateFormatError
from savable_loader.config import WorkerContext
from savable_loader.datasets import IndexedDataset, JsonLinesSource
from savable_loader.state.files import encode_state
from savable_loader.state.models import RankState

#: Keeps every item (a filter reads its source as a stream).
KEEP = functools.partial(operator.is_not, None)

DATA = list(range(20))
BATCH = 2
TAKEN = 3
#: The most batches a check reads after a restore: more than an epoch of every pipeline.
READ = 40
#: What each field is set to in turn (``"nested"``: the saved value wrapped in a list).
BAD_VALUES: dict[str, Any] = {"None": None, "str": "x", "negative": -1, "huge": 2**62}


def _noisy(item: int, rng: np.random.Generator) -> float:
    return item + float(rng.random())


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two JSON lines files of 10 rows each (rows 0..9 and 100..109), and a gzipped one."""
    path = tmp_path_factory.mktemp("jsonl")
    for f in range(2):
        rows = "".join(json.dumps(f * 100 + i) + "\n" for i in range(10))
        (path / f"{f}.jsonl").write_text(rows)
    with gzip.open(path / "z.jsonl.gz", "wt") as file:
        file.write("".join(json.dumps(i) + "\n" for i in range(10)))
    return path


Build = Callable[[Path], Any]

PIPELINES: dict[str, Build] = {
    "map-style": lambda folder: DATA,
    "seeded map": lambda folder: IndexedDataset(DATA).map(_noisy, seed=3),
    "jsonl files": lambda folder: JsonLinesSource(str(folder / "*.jsonl"), split="files"),
    "jsonl samples": lambda folder: JsonLinesSource(str(folder / "*.jsonl")),
    # Read by position (NOTE [ File sources by position ] in datasets/file_positions.py).
    "jsonl global": lambda folder: JsonLinesSource(str(folder / "*.jsonl"), split="global"),
    # Over a filter, a repeat reads as a stream (its own state).
    "repeat": lambda folder: IndexedDataset(DATA).filter(KEEP).repeat(2),
    # Over a filter, a limit counts per stream (its own state); over a map-style dataset
    # it is read by position (NOTE [ Limit by position ] in datasets/limit.py).
    "limit": lambda folder: IndexedDataset(DATA).filter(KEEP).limit(7),
    "limit by position": lambda folder: IndexedDataset(DATA).limit(7),
    # A filter reads as a stream only: the shuffle below keeps its windows of a stream.
    "shuffle": lambda folder: IndexedDataset(DATA).filter(KEEP).shuffle(buffer_size=4, seed=1),
    # Read by position (NOTE [ Pipelines read by position ] in datasets/global_view.py).
    "shuffle by position": lambda folder: IndexedDataset(DATA).shuffle(buffer_size=4, seed=1),
}


def _loader(build: Build, folder: Path, **kwargs: Any) -> SavableDataLoader:
    return SavableDataLoader(build(folder), batch_size=BATCH, **kwargs)


def _saved(build: Build, folder: Path, *, between: bool) -> dict[str, Any]:
    """A state mid-epoch (after ``TAKEN`` batches) or between epochs, as plain data."""
    with _loader(build, folder) as loader:
        iterator = iter(loader)
        if between:
            for _ in iterator:
                pass
        else:
            for _ in range(TAKEN):
                next(iterator)
        return loader.save_state_rank().to_plain()


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every node of ``value``, ``value`` itself first."""
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*path, index))


def _mutations(state: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every field of worker 0's pipeline state set to every bad value in turn."""
    for path in _paths(state["workers"][0]["checkpoint"]["state"]):
        keys = ("workers", 0, "checkpoint", "state", *path)
        for name, value in [*BAD_VALUES.items(), ("nested", "nested")]:
            mutated = copy.deepcopy(state)
            node = mutated
            for key in keys[:-1]:
                node = node[key]
            saved = node[keys[-1]]
            new = [saved] if name == "nested" else value
            if new == saved and type(new) is type(saved):
                continue
            node[keys[-1]] = new
            yield f"{'.'.join(map(str, path)) or 'state'} = {name}", mutated


def _read(batches: Iterator[Any]) -> list[Any]:
    return [batch.tolist() for batch in itertools.islice(batches, READ)]


def _as_read_from(loader: SavableDataLoader, state: dict[str, Any]) -> list[Any] | None:
    """What the pipeline's cursor restored to ``state`` reads; None when only a loader's
    worker can read it (generators named by their seeded epoch)."""
    layout = loader.layout
    context = WorkerContext(0, 1, 0, 0, layout.seed, layout.batch_size)
    cursor = layout.root.cursor(context)
    cursor.restore(copy.deepcopy(state["workers"][0]["checkpoint"]["state"]))
    try:
        return _read(cursor)
    except StateError:
        return None
    finally:
        cursor.close()


@pytest.mark.parametrize("between", [False, True], ids=["mid-epoch", "between epochs"])
@pytest.mark.parametrize("name", list(PIPELINES))
def test_every_mutated_field_is_refused_or_read_as_its_position(
    folder: Path, name: str, between: bool
) -> None:
    build = PIPELINES[name]
    state = _saved(build, folder, between=between)
    accepted_but_failing: list[str] = []
    for label, mutated in _mutations(state):
        with _loader(build, folder) as loader:
            try:
                loader.restore_state_rank(mutated)
            except StateError:
                continue
            try:
                got = _read(iter(loader))
            except Exception as error:
                accepted_but_failing.append(f"{label}: {type(error).__name__}: {error}")
                continue
            expected = _as_read_from(loader, mutated)
            assert expected is None or got == expected, label
    assert not accepted_but_failing, "restored, then failed:\n" + "\n".join(accepted_but_failing)


def _edit(state: dict[str, Any], path: str, value: Any, *, worker: int = 0) -> dict[str, Any]:
    edited = copy.deepcopy(state)
    node = edited["workers"][worker]["checkpoint"]
    keys = ["state", *path.split(".")] if path else ["state"]
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    return edited


@pytest.mark.parametrize(
    ("path", "where"),
    [
        ("", r"workers\[0\]\.checkpoint\.state is None where the position of Batch"),
        ("parent", r"workers\[0\]\.checkpoint\.state\.parent is None where .* IndexedDataset"),
    ],
)
@pytest.mark.parametrize("between", [False, True], ids=["mid-epoch", "between epochs"])
def test_a_none_where_a_position_must_be_is_refused(
    folder: Path, path: str, where: str, between: bool
) -> None:
    """Before: restored, and the epoch started over ([0, 1] where [6, 7] came next)."""
    build = PIPELINES["map-style"]
    state = _edit(_saved(build, folder, between=between), path, None)
    with _loader(build, folder) as loader, pytest.raises(StateFormatError, match=where):
        loader.restore_state_rank(state)


def test_a_none_parent_deep_in_the_pipeline_names_its_path(folder: Path) -> None:
    build = PIPELINES["seeded map"]
    state = _edit(_saved(build, folder, between=False), "parent.parent", None)
    with _loader(build, folder) as loader:
        with pytest.raises(StateError, match=r"state\.parent\.parent is None .*IndexedDataset"):
            loader.restore_state_rank(state)
        with pytest.raises(StateError, match="is None"):
            loader.load_state_dict(state)


def test_a_worker_that_never_started_restores_from_its_start(folder: Path) -> None:
    """A worker without a checkpoint is the library's own way to save the start."""
    build = PIPELINES["map-style"]
    with _loader(build, folder, num_workers=0) as loader:
        state = loader.save_state_rank()
        assert state.workers[0].checkpoint is None
        expected = _read(iter(loader))
    with _loader(build, folder) as loader:
        loader.restore_state_rank(state.to_plain())
        assert _read(iter(loader)) == expected


# Garbage the replay check did not see: at the batching level, in a state saved between
# epochs (ended workers were not looked at), and in Repeat's and Map's own fields.
GARBAGE = [
    ("map-style", False, "exhausted", "x", r"state: Batch: malformed state \(exhausted"),
    ("map-style", False, "extra", 1, r"Batch: malformed state \(extra"),
    ("map-style", False, "", [1, 2], "expected a dict with a 'parent' entry"),
    ("map-style", True, "parent.pos", -1, r"state\.parent: IndexedDataset: malformed"),
    ("map-style", True, "parent.epoch", "x", r"state\.parent: IndexedDataset: malformed"),
    ("map-style", True, "parent.pos", 10**6, "past this worker's shard"),
    ("map-style", True, "exhausted", None, r"Batch: malformed state \(exhausted"),
    ("repeat", False, "parent.passes", 2, "passes 2 in the state is not below times=2"),
    ("repeat", False, "parent.passes", -1, r"Repeat.*malformed state \(passes"),
    ("repeat", True, "parent.passes", "1", r"Repeat.*malformed state \(passes"),
    ("seeded map", False, "parent.position", -5, r"Map: malformed state \(position"),
    ("seeded map", False, "parent.epoch", 1.5, r"Map: malformed state \(epoch"),
    ("seeded map", True, "parent.salt", "s", r"Map: malformed state \(salt"),
    ("limit", False, "parent.count", 8, "count 8 in the state exceeds n=7"),
    ("limit by position", False, "parent.pos", 8, "past this worker's shard"),
    ("shuffle", False, "parent.emitted", 5, "emitted 5 items of a window but buffer_size is 4"),
    ("shuffle by position", False, "parent.pos", -3, r"IndexedDataset: malformed state \(pos"),
    ("shuffle by position", False, "parent.window", 1, r"malformed state \(window"),
]


@pytest.mark.parametrize(
    ("name", "between", "path", "value", "message"),
    GARBAGE,
    ids=[f"{c[0]}{' between' if c[1] else ''} {c[2] or 'state'}={c[3]!r}" for c in GARBAGE],
)
def test_garbage_is_refused_by_the_restore_naming_the_field(
    folder: Path, name: str, between: bool, path: str, value: Any, message: str
) -> None:
    build = PIPELINES[name]
    state = _edit(_saved(build, folder, between=between), path, value)
    with _loader(build, folder) as loader:
        with pytest.raises(StateError, match=message) as caught:
            loader.restore_state_rank(state)
        assert r"workers[0].checkpoint.state" in str(caught.value)
        assert "saved:" in str(caught.value)  # the saved value, cut short
        # The refused restore left the loader as it was: it reads its stream from the start.
        with _loader(build, folder) as fresh:
            assert _read(iter(loader)) == _read(iter(fresh))


# -- byte offsets of file sources ---------------------------------------------------------


@pytest.mark.parametrize("split", ["files", "samples"])
@pytest.mark.parametrize("offset", [21, 10**6, 2**62])
def test_an_offset_past_the_end_of_its_file_is_refused_at_restore(
    folder: Path, split: str, offset: int
) -> None:
    """Before: restored, and the rest of the file was skipped silently (num_workers=0)."""

    def build(folder: Path) -> JsonLinesSource:
        return JsonLinesSource(str(folder / "*.jsonl"), split=split)

    state = _edit(_saved(build, folder, between=False), "parent.offset", offset)
    url = str(folder / "0.jsonl")
    message = re.escape(f"byte offset {offset} lies past the end of {url}, which holds 20 bytes")
    with _loader(build, folder) as loader, pytest.raises(StateError, match=message):
        loader.restore_state_rank(state)


def test_an_offset_past_the_end_of_a_compressed_file_names_its_decompressed_size(
    folder: Path,
) -> None:
    def build(folder: Path) -> JsonLinesSource:
        return JsonLinesSource(str(folder / "z.jsonl.gz"), split="files")

    state = _edit(_saved(build, folder, between=False), "parent.offset", 500)
    with _loader(build, folder) as loader, pytest.raises(StateError, match="holds 20 bytes"):
        loader.restore_state_rank(state)


def test_an_offset_at_the_end_of_its_file_is_a_position(folder: Path) -> None:
    """Saved right after a file's last line, the offset is the file's size."""

    def build(folder: Path) -> JsonLinesSource:
        return JsonLinesSource(str(folder / "*.jsonl"), split="files")

    with _loader(build, folder) as loader:
        iterator = iter(loader)
        for _ in range(5):  # the 10 rows of 0.jsonl
            next(iterator)
        state = loader.save_state_rank().to_plain()
        rest = _read(iterator)
    assert state["workers"][0]["checkpoint"]["state"]["parent"]["offset"] == 20
    with _loader(build, folder) as loader:
        loader.restore_state_rank(state)
        assert (
            _read(iter(loader))
            == rest
            == [[100, 101], [102, 103], [104, 105], [106, 107], [108, 109]]
        )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("split", ["files", "samples"])
def test_with_workers_an_offset_past_the_end_fails_at_the_first_read_naming_it(
    folder: Path, split: str
) -> None:
    """Before: the rest of the file was skipped ("files"), or the read failed as "the file
    changed while the job ran" ("samples")."""

    def build(folder: Path) -> JsonLinesSource:
        return JsonLinesSource(str(folder / "*.jsonl"), split=split)

    with _loader(build, folder, num_workers=2) as loader:
        iterator = iter(loader)
        for _ in range(TAKEN):
            next(iterator)
        state = _edit(loader.save_state_rank().to_plain(), "parent.offset", 10**6)
    url = str(folder / "0.jsonl")
    with _loader(build, folder, num_workers=2) as loader:
        loader.restore_state_rank(state)
        with pytest.raises(
            StateError, match=re.escape(f"offset 1000000 lies past the end of {url}")
        ):
            list(loader)


# -- state_dict() ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_round_trips_through_json(folder: Path, num_workers: int) -> None:
    """Before: ``json.dumps`` refused the bytes of ``{"rank_0": <bytes>}``."""
    build = PIPELINES["seeded map"]
    with _loader(build, folder, num_workers=num_workers) as loader:
        iterator = iter(loader)
        for _ in range(TAKEN):
            next(iterator)
        text = json.dumps({"step": 3, "loader": loader.state_dict()})
        rest = _read(iterator)
    with _loader(build, folder, num_workers=num_workers) as loader:
        loader.load_state_dict(json.loads(text)["loader"])
        assert _read(iter(loader)) == rest


def test_state_dict_loads_with_weights_only_and_as_older_versions_wrote_it(folder: Path) -> None:
    build = PIPELINES["map-style"]
    with _loader(build, folder) as loader:
        iterator = iter(loader)
        next(iterator)
        state_dict = loader.state_dict()
        state = loader.save_state_rank()
        rest = _read(iterator)
    (entry,) = state_dict.values()
    assert isinstance(entry, str)
    assert RankState.from_plain(state.to_plain()) == state
    assert base64.b64decode(entry) == encode_state(state)
    buffer = io.BytesIO()
    torch.save({"loader": state_dict}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["loader"]  # a str: no safe globals
    older = {"rank_0": encode_state(state)}  # what versions before returned
    for form in (loaded, older, state.to_plain()):
        with _loader(build, folder) as fresh:
            fresh.load_state_dict(form)
            assert _read(iter(fresh)) == rest


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("not base64!", "Expected a state file's bytes or their base64 text, got the str"),
        (base64.b64encode(b"SAVLDR junk").decode(), "Not a savable_loader state file"),
        (12, "got int"),
    ],
)
def test_a_malformed_state_dict_entry_is_refused(folder: Path, entry: Any, message: str) -> None:
    loader = _loader(PIPELINES["map-style"], folder)
    with loader, pytest.raises(StateFormatError, match=message):
        loader.load_state_dict({"rank_0": entry})
