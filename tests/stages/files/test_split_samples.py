"""File sources with ``split="samples"``: every rank reads as many samples, a restore on
the same layout or another one is exact, and bad states or changed files are refused
(NOTE [ Splitting files by samples ] and NOTE [ Elastic sample order ] in
``datasets/files/sample_split.py``)."""

from __future__ import annotations

import pickle
import random
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from sample_files import LENGTHS, write_jsonl, write_tar

from savable_loader import (
    ConfigError,
    SavableDataLoader,
    StateError,
    StateMismatchError,
    StorageError,
    WorkerConfig,
    WorkerContext,
)
from savable_loader.datasets import JsonLinesSource, TarSource
from savable_loader.datasets.files.sample_split import Spans, stream_run
from savable_loader.datasets.files.sharded import ShardedSource
from savable_loader.datasets.protocol.elastic import OldStream, ReshardPlan


def _jsonl_id(item: Any) -> int:
    return int(item["id"])


def _tar_id(item: Any) -> int:
    return int(item["id"])


KINDS: dict[str, tuple[Callable[..., ShardedSource[Any]], Callable[[Path], str], Any]] = {
    "jsonl": (JsonLinesSource, write_jsonl, _jsonl_id),
    "tar": (TarSource, write_tar, _tar_id),
}


@pytest.fixture(params=sorted(KINDS))
def kind(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


def _source(kind: str, folder: Path, **kwargs: Any) -> tuple[ShardedSource[Any], Any]:
    build, write, ident = KINDS[kind]
    return build(write(folder), **kwargs), ident


def _every(lengths: Sequence[int] = LENGTHS) -> list[int]:
    return [file * 100 + i for file, count in enumerate(lengths) for i in range(count)]


def _contexts(ranks: int, workers: int, batch: int | None) -> list[WorkerContext]:
    return [
        WorkerContext(rank, ranks, worker, workers, 0, batch)
        for rank in range(ranks)
        for worker in range(max(workers, 1))
    ]


def _batches(items: int, batch: int | None) -> int:
    return items if batch is None else -(-items // batch)


# -- one epoch ------------------------------------------------------------------------------


@pytest.mark.parametrize("even", ["pad", "drop"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7])
def test_every_rank_reads_as_many_samples_and_batches(
    tmp_path: Path, kind: str, ranks: int, even: Any
) -> None:
    source, ident = _source(kind, tmp_path, shuffle_shards=True, seed=2, even=even)
    every = _every()
    for workers, batch in ((0, None), (2, 3), (3, 2)):
        for epoch in range(2):
            order = [every[i] for i in _epoch_order(source, epoch)]
            per_rank: list[list[int]] = [[] for _ in range(ranks)]
            batches = [0] * ranks
            for context in _contexts(ranks, workers, batch):
                cursor = source.cursor(context)
                if epoch:
                    cursor.end_epoch()
                items = [ident(item) for item in cursor]
                per_rank[context.rank] += items
                batches[context.rank] += _batches(len(items), batch)
            sizes = {len(items) for items in per_rank}
            assert len(sizes) == 1, (workers, batch, [len(items) for items in per_rank])
            assert len(set(batches)) == 1
            read = sorted(item for items in per_rank for item in items)
            length = (
                -(-len(every) // ranks) * ranks if even == "pad" else len(every) // ranks * ranks
            )
            # The epoch's order read cyclically up to its padded or cut length.
            assert read == sorted(order[i % len(order)] for i in range(length))


def _epoch_order(source: ShardedSource[Any], epoch: int) -> list[int]:
    """Indices into ``_every()`` of the samples of ``epoch`` in the epoch's order."""
    starts = [0]
    for count in source.sample_counts():
        starts.append(starts[-1] + count)
    return [i for f in source.order(epoch) for i in range(starts[f], starts[f + 1])]


def test_a_rank_reads_a_contiguous_run_of_the_epoch(tmp_path: Path) -> None:
    source, _ = _source("jsonl", tmp_path)
    ids = [[item["id"] for item in source.cursor(c)] for c in _contexts(2, 0, None)]
    assert ids == [_every()[:16], _every()[16:]]


def test_samples_are_counted_once_and_travel_with_the_stage(tmp_path: Path) -> None:
    source, _ = _source("jsonl", tmp_path)
    counted: list[str] = []
    count = type(source).count_items

    def counting(self: Any, file: Any, url: str) -> int:
        counted.append(url)
        return count(self, file, url)

    type(source).count_items = counting  # type: ignore[method-assign]
    try:
        source.check_layout(WorkerContext(0, 2, 0, 2, 0, 4))
        copy = pickle.loads(pickle.dumps(source))
        assert list(copy.cursor(WorkerContext(1, 2, 1, 2, 0, 4)))
        assert list(source.cursor(WorkerContext(0, 2, 0, 2, 0, 4)))
    finally:
        type(source).count_items = count  # type: ignore[method-assign]
    assert sorted(counted) == sorted(source.urls)
    assert source.sample_counts() == tuple(LENGTHS)


def test_one_stream_reads_the_files_without_counting(tmp_path: Path) -> None:
    source, _ = _source("tar", tmp_path)
    cursor = source.cursor(WorkerContext(0, 1, 0, 0, 0, 2))
    assert [int(item["id"]) for item in cursor] == _every()
    assert source._counts is None


def test_a_layout_without_samples_for_a_rank_is_refused(tmp_path: Path) -> None:
    source, _ = _source("jsonl", tmp_path, even="drop")
    with pytest.raises(ConfigError, match=r"rank 0 would read no sample: 32 samples in 6 files"):
        source.check_layout(WorkerContext(0, 33, 0, 0, 0, None))
    source.check_layout(WorkerContext(0, 32, 0, 0, 0, None))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="check the files"):
        JsonLinesSource(str(empty / "*")).check_layout(WorkerContext(1, 2, 0, 0, 0, None))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split": "lines"}, "split must be"),
        ({"even": "wrap"}, "even must be"),
        ({"split": "files", "even": "drop"}, "applies to split"),
    ],
)
def test_bad_split_arguments_are_refused(tmp_path: Path, kwargs: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        JsonLinesSource(write_jsonl(tmp_path), **kwargs)


def test_config_names_split_only_for_samples(tmp_path: Path) -> None:
    pattern = write_jsonl(tmp_path)
    assert JsonLinesSource(pattern).config()["split"] == "samples"
    assert "split" not in JsonLinesSource(pattern, split="files").config()
    assert JsonLinesSource(pattern, even="drop").config()["even"] == "drop"
    assert str(JsonLinesSource(pattern, split="files")) == 'JsonLinesSource(6 files, split="files")'


# -- resume on the same layout ---------------------------------------------------------------


@pytest.mark.parametrize("layout", [(2, 2, 3), (3, 0, None), (1, 3, 2)])
def test_a_restore_at_every_point_continues_exactly(
    tmp_path: Path, kind: str, layout: tuple[int, int, int | None]
) -> None:
    source, ident = _source(kind, tmp_path, shuffle_shards=True, seed=9)
    ranks, workers, batch = layout
    for context in _contexts(ranks, workers, batch):
        cursor = source.cursor(context)
        states, items = [cursor.state()], []
        for _ in range(2):  # two epochs
            for item in cursor:
                items.append(ident(item))
                states.append(cursor.state())
        first_epoch = len(items) // 2
        for point, state in enumerate(states[:-1]):
            again = source.cursor(context)
            again.restore(state)
            rest = [ident(item) for item in again]
            assert rest == items[point : point + len(rest)]
            if point <= first_epoch:  # a skip lands where reading does
                skipped = source.cursor(context)
                assert skipped.skip(point) == point
                skipped_state = skipped.state()
                restored = source.cursor(context)
                restored.restore(skipped_state)
                assert [ident(item) for item in restored] == items[point:first_epoch]


def test_a_skip_reaches_the_file_only_when_read(tmp_path: Path) -> None:
    source, _ = _source("jsonl", tmp_path)
    context = WorkerContext(1, 2, 0, 0, 0, None)
    cursor = source.cursor(context)
    assert cursor.skip(5) == 5
    assert cursor.file is None
    state = cursor.state()
    assert state["taken"] == 5
    assert (state["at"], state["offset"]) == (0, 0)
    assert next(cursor)["id"] == _every()[16 + 5]
    assert cursor.skip(100) == 16 - 6
    assert cursor.state()["epoch"] == 1


# -- bad states and changed files -----------------------------------------------------------


def _state_after(source: ShardedSource[Any], context: WorkerContext, n: int) -> dict[str, Any]:
    cursor = source.cursor(context)
    for _ in range(n):
        next(cursor)
    return cursor.state()  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"taken": 17}, r"taken 17 is past the stream's 16 samples"),
        ({"file": 4, "at": 2}, r"is not where the stream's sample 3 lies"),
        ({"at": 10}, r"at sample 10 is not where .* \(file 3, sample 9\)"),
        ({"samples": 31}, r"saved over 31 samples and the files now hold 32"),
        ({"rest": [[3, 1]], "length": 4}, r"rest must hold ascending"),
        ({"rest": [[0, 3]]}, r"rest and length come together"),
        ({"shard": 0}, r'saved with split="files"'),
    ],
)
def test_bad_positions_are_refused_at_restore(
    tmp_path: Path, change: dict[str, Any], match: str
) -> None:
    source, _ = _source("jsonl", tmp_path)
    context = WorkerContext(1, 2, 0, 0, 0, None)
    state = {**_state_after(source, context, 3), **change}
    with pytest.raises(StateError, match=match):
        source.cursor(context).restore(state)


def test_a_file_past_the_end_of_one_stream_is_refused(tmp_path: Path) -> None:
    source, _ = _source("tar", tmp_path)
    state = {"epoch": 0, "taken": 0, "file": 10**6, "at": 0, "offset": 0}
    with pytest.raises(StateError, match=r"file 1000000 is past the epoch's 6 files"):
        source.cursor(WorkerContext(0, 1, 0, 0, 0, None)).restore(state)


def test_a_files_split_state_on_a_samples_source_is_refused(tmp_path: Path) -> None:
    source = TarSource(write_tar(tmp_path))
    state = {"epoch": 0, "shard": 0, "offset": 0}
    with pytest.raises(StateError, match=r'build it with split="files"'):
        source.cursor(WorkerContext(0, 1, 0, 0, 0, None)).restore(state)
    files = TarSource(str(tmp_path / "*.tar"), split="files")
    with pytest.raises(StateError, match=r'build it with split="samples"'):
        files.cursor(WorkerContext(0, 1, 0, 0, 0, None)).restore(
            _state_after(source, WorkerContext(0, 1, 0, 0, 0, None), 2)
        )


def test_a_file_that_shrank_after_counting_is_a_storage_error(tmp_path: Path) -> None:
    source, _ = _source("jsonl", tmp_path)
    context = WorkerContext(1, 2, 0, 0, 0, None)
    cursor = source.cursor(context)
    next(cursor)
    (tmp_path / "part-05.jsonl").write_text('{"id": 1}\n')
    with pytest.raises(
        StorageError, match=r"part-05.jsonl ended after 1 samples, fewer than the 9"
    ):
        list(cursor)


def test_a_malformed_line_is_passed_once_caught(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"id": 0}\n{"id": \n{"id": 2}\n{"id": 3}\n')
    source = JsonLinesSource(str(tmp_path / "a.jsonl"))
    cursor = source.cursor(WorkerContext(0, 2, 0, 0, 0, None))  # ids 0 and 1 of 4
    assert next(cursor) == {"id": 0}
    with pytest.raises(ConfigError, match="line 2: not valid JSON"):
        next(cursor)
    assert cursor.state()["taken"] == 2
    assert list(cursor) == []
    other = source.cursor(WorkerContext(1, 2, 0, 0, 0, None))
    assert list(other) == [{"id": 2}, {"id": 3}]  # skipping does not parse line 2


# -- elastic -------------------------------------------------------------------------------


def _reshard(
    source: ShardedSource[Any],
    epoch: int,
    saved: list[tuple[WorkerContext, Any]],
    new: list[WorkerContext],
    salt: int = 0,
) -> list[Any]:
    old = tuple(OldStream(context, state) for context, state in saved)
    return [source.reshard(ReshardPlan(epoch, old, context, salt)) for context in new]


def _progress(
    source: ShardedSource[Any],
    ident: Any,
    contexts: list[WorkerContext],
    states: list[Any],
    rng: random.Random,
) -> tuple[list[int], list[Any]]:
    """Each stream reads a random part of what its state leaves of the epoch: none, some,
    all of it, or all of it and the epoch's end (it then stands in the next epoch)."""
    read, after = [], []
    for context, state in zip(contexts, states, strict=True):
        cursor = source.cursor(context)
        cursor.restore(state)
        ahead = source.cursor(context)
        ahead.restore(state)
        rest = [ident(item) for item in ahead]
        n = rng.choice([0, len(rest), rng.randint(0, len(rest)), -1])
        if n < 0:
            assert [ident(item) for item in cursor] == rest  # to StopIteration
            read += rest
        else:
            read += rest[:n]
            for _ in range(n):
                next(cursor)
        after.append(cursor.state())
    return read, after


@pytest.mark.parametrize("even", ["pad", "drop"])
@pytest.mark.parametrize(
    "layouts",
    [[(2, 2, 3), (3, 0, None)], [(1, 0, None), (2, 3, 2)], [(3, 2, 2), (1, 2, 2), (4, 0, 3)]],
    ids=["2x2->3x0", "1x0->2x3", "3x2->1x2->4x0"],
)
def test_an_elastic_restore_reads_the_rest_once_on_equal_ranks(
    tmp_path: Path, kind: str, even: Any, layouts: list[tuple[int, int, int | None]]
) -> None:
    source, ident = _source(kind, tmp_path, shuffle_shards=True, seed=5, even=even)
    every = Counter(_every())
    for trial in range(6):
        rng = random.Random(trial)
        contexts = _contexts(*layouts[0])
        states: list[Any] = [None] * len(contexts)
        consumed: list[int] = []
        ranks = layouts[0][0]
        for layout in layouts[1:]:
            read, states = _progress(source, ident, contexts, states, rng)
            consumed += read
            new = _contexts(*layout)
            states = _reshard(source, 0, list(zip(contexts, states, strict=True)), new, trial)
            contexts, ranks = new, layout[0]
        rest_per_rank: list[list[int]] = [[] for _ in range(ranks)]
        for context, state in zip(contexts, states, strict=True):
            cursor = source.cursor(context)
            cursor.restore(state)
            rest_per_rank[context.rank] += [ident(item) for item in cursor]
            assert cursor.state()["epoch"] == 1
            assert "rest" not in cursor.state()
        assert len({len(rest) for rest in rest_per_rank}) == 1, "ranks read unequal rests"
        total = Counter(consumed) + Counter(item for rest in rest_per_rank for item in rest)
        extra, lost = sum((total - every).values()), sum((every - total).values())
        bound = sum(layout[0] for layout in layouts)  # fewer than a rank count per layout
        if even == "pad":
            assert lost == 0, "a sample was lost"
            assert extra < bound
        else:
            assert extra == 0, "a sample was read twice"
            assert lost < bound


def test_a_save_before_any_read_reshards_to_a_fresh_epoch(tmp_path: Path) -> None:
    source, _ = _source("jsonl", tmp_path)
    old = _contexts(2, 2, 3)
    (state,) = _reshard(source, 0, [(c, None) for c in old], [WorkerContext(0, 3, 0, 0, 0, None)])
    assert "rest" not in state
    assert state["taken"] == 0


def test_streams_in_different_epochs_are_refused(tmp_path: Path) -> None:
    source, _ = _source("jsonl", tmp_path)
    old = _contexts(2, 0, None)
    states = [_state_after(source, old[0], 2), {**_state_after(source, old[1], 2), "epoch": 3}]
    with pytest.raises(StateError, match="stands in epoch 3 while the loader resumes epoch 0"):
        _reshard(source, 0, list(zip(old, states, strict=True)), old)


def test_spans_arithmetic() -> None:
    spans = Spans(((0, 5), (8, 12)), 12)
    assert spans.total == 9
    assert [spans.id_at(k) for k in range(9)] == [0, 1, 2, 3, 4, 8, 9, 10, 11]
    assert spans.between(3, 7) == [(3, 5), (8, 10)]
    assert spans.without([(1, 3), (9, 10)]).spans == ((0, 1), (3, 5), (8, 9), (10, 12))
    assert spans.evened(4, "pad").spans == ((0, 5), (8, 12), (12, 15))
    assert spans.evened(4, "drop").spans == ((0, 5), (8, 11))
    assert stream_run(12, WorkerContext(1, 2, 1, 2, 0, 4)) == (10, 12)
    assert stream_run(12, WorkerContext(1, 2, 0, 2, 0, 4)) == (6, 10)


# -- through the loader ---------------------------------------------------------------------


def _ids(batch: Any) -> list[int]:
    """The sample ids of a batch: a tensor of ints (JSON lines) or a list of bytes (tar)."""
    return [int(value) for value in batch["id"]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loaders_on_every_rank_yield_as_many_batches_and_resume(
    tmp_path: Path, kind: str, num_workers: int
) -> None:
    build_source, write, _ = KINDS[kind]
    pattern = write(tmp_path)
    for ranks in (2, 3):
        counts, seen = [], Counter[int]()
        for rank in range(ranks):

            def build(rank: int = rank, ranks: int = ranks) -> SavableDataLoader:
                config = WorkerConfig(rank=rank, world_size=ranks)
                source = build_source(pattern, shuffle_shards=True, seed=1)
                return SavableDataLoader(
                    source, batch_size=4, num_workers=num_workers, worker_config=config
                )

            with build() as loader:
                whole = [[_ids(b) for b in loader] for _ in range(2)]
            counts.append([len(epoch) for epoch in whole])
            seen.update(i for batch in whole[0] for i in batch)
            with build() as loader:
                iterator = iter(loader)
                first = [_ids(next(iterator)) for _ in range(2)]
                state = loader.save_state_rank()
            with build() as loader:
                loader.restore_state_rank(state)
                rest = [_ids(b) for b in loader] + [[_ids(b) for b in loader]]
            assert first + rest[:-1] == whole[0]
            assert rest[-1] == whole[1]
        assert all(count == counts[0] for count in counts), counts
        # Every sample is read in an epoch, padding repeats fewer than one per rank.
        assert set(seen) == set(_every())
        assert sum(seen.values()) - len(_every()) < ranks


@pytest.mark.parametrize(
    ("lengths", "ranks", "workers", "batch", "named", "numbers", "fix"),
    [
        ([3], 1, 4, None, "rank 0 worker 0", "3 samples in 1 file over 4 streams", 3),
        # 32 samples on 2 ranks: 16 each, 4 batches of 4 for 5 workers.
        (LENGTHS, 2, 5, 4, "rank 1 worker 0", "32 samples in 6 files over 10 streams", 4),
        # 3 ranks pad 32 to 33: 11 each, 2 batches of 8 for 3 workers.
        (LENGTHS, 3, 3, 8, "rank 2 worker 0", "32 samples in 6 files over 9 streams", 2),
    ],
    ids=["1x4-unbatched", "2x5", "3x3-padded"],
)
def test_a_worker_without_samples_is_refused_when_built(
    tmp_path: Path,
    kind: str,
    lengths: list[int],
    ranks: int,
    workers: int,
    batch: int | None,
    named: str,
    numbers: str,
    fix: int,
) -> None:
    build_source, write, _ = KINDS[kind]
    pattern = write(tmp_path, lengths)

    def build(source: Any, workers: int) -> SavableDataLoader:
        config = WorkerConfig(rank=ranks - 1, world_size=ranks)
        return SavableDataLoader(
            source, batch_size=batch, num_workers=workers, worker_config=config
        )

    # An endless repeat would meet the empty worker only while reading; it is refused
    # as early as the plain source, before any worker starts.
    for source in (build_source(pattern), build_source(pattern).repeat()):
        with pytest.raises(ConfigError) as info:
            build(source, workers)
        message = str(info.value)
        assert f"{named} would read no sample" in message
        assert numbers in message
        assert f"use at most {fix} worker{'s' * (fix != 1)} per rank" in message
    # The fix it names works: every worker of the rank yields.
    with build(build_source(pattern), fix) as loader:
        batches = [_ids(b) if batch else [int(b["id"])] for b in loader]
    assert len(batches) >= fix
    assert len({tuple(ids) for ids in batches}) == len(batches)


def test_an_old_files_split_state_names_the_fix(tmp_path: Path) -> None:
    pattern = write_jsonl(tmp_path)
    with SavableDataLoader(JsonLinesSource(pattern, split="files"), batch_size=2) as loader:
        next(iter(loader))
        state = loader.save_state_rank()
    # A state saved before split existed has the fingerprint of split="files".
    current = SavableDataLoader(JsonLinesSource(pattern), batch_size=2)
    with current, pytest.raises(StateMismatchError, match=r'with split="files" to continue it'):
        current.restore_state_rank(state)
