"""Transient storage errors are retried with backoff, permanent ones are not (NOTE [ Retries ]).

A fault-injecting fsspec filesystem (``flaky://``, an in-memory one whose files raise a
chosen error on chosen reads, opens and seeks) feeds the file sources; the stream read
with faults must equal the fault-free one item for item.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import tarfile
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from savable_loader import SavableDataLoader, StorageError
from savable_loader.config import WorkerContext
from savable_loader.datasets.files.jsonl import JsonLinesSource
from savable_loader.datasets.files.sharded import ShardedSource
from savable_loader.datasets.files.tar import TarSource
from savable_loader.errors import ConfigError
from savable_loader.storage import retry

LENGTHS = [5, 3, 8, 1, 6]  # items per file


class Faults:
    """Which calls of the flaky files fail, counted over every file of the process."""

    def __init__(self) -> None:
        self.raised = multiprocessing.get_context("fork").Value("i", 0)
        self.reset()

    def reset(
        self,
        *,
        read: Any = (),
        open: Any = (),
        seek: Any = (),
        error: Callable[[], BaseException] | None = None,
    ) -> None:
        """``read``/``open``/``seek``: the call numbers (from 1) that fail, or "all"."""
        self.plan = {"read": read, "open": open, "seek": seek}
        self.calls = {"read": 0, "open": 0, "seek": 0}
        self.error = error or (lambda: ConnectionResetError(104, "Connection reset by peer"))
        self.armed = True
        with self.raised.get_lock():
            self.raised.value = 0

    def hit(self, kind: str) -> None:
        if not self.armed:
            return
        self.calls[kind] += 1
        plan = self.plan[kind]
        if plan == "all" or self.calls[kind] in plan:
            with self.raised.get_lock():
                self.raised.value += 1
            raise self.error()

    @property
    def total(self) -> int:
        """The faults planned (a process raises no more)."""
        return sum(len(plan) for plan in self.plan.values())

    @property
    def count(self) -> int:
        return int(self.raised.value)


FAULTS = Faults()


class FlakyFile(io.BytesIO):
    def read(self, size: int | None = -1) -> bytes:
        FAULTS.hit("read")
        return super().read(size)

    def readline(self, size: int | None = -1) -> bytes:
        FAULTS.hit("read")
        return super().readline(size)

    def readinto(self, buffer: Any) -> int:
        FAULTS.hit("read")
        return super().readinto(buffer)

    def __next__(self) -> bytes:
        line = self.readline()
        if not line:
            raise StopIteration
        return line

    def seek(self, offset: int, whence: int = 0) -> int:
        FAULTS.hit("seek")
        return super().seek(offset, whence)


class FlakyFileSystem(MemoryFileSystem):
    protocol = "flaky"
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        return super()._strip_protocol(str(path).removeprefix("flaky://"))

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if mode != "rb":
            return super()._open(path, mode, **kwargs)
        path = self._strip_protocol(path)
        FAULTS.hit("open")
        if path not in self.store:
            raise FileNotFoundError(path)
        return FlakyFile(bytes(self.store[path].getbuffer()))


fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)


# -- data ---------------------------------------------------------------------------------


def _jsonl(file: int, count: int) -> bytes:
    lines = [json.dumps({"id": file * 100 + i, "pad": "x" * i}) for i in range(count)]
    return ("\n\n".join(lines) + "\n").encode()  # blank lines between items


def _tar(file: int, count: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for i in range(count):
            # members over tarfile's 10 KB reads, so faults also fall inside a sample
            text = b"%d," % (file * 100 + i) * 1500 * (i + 1)
            for ext, data in (("txt", text), ("cls", b"%d" % i)):
                info = tarfile.TarInfo(f"s{file}/{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _write(kind: str) -> str:
    FlakyFileSystem.store.clear()
    fs = FlakyFileSystem()
    for file, count in enumerate(LENGTHS):
        gz = file % 2 == 1
        name = f"/{kind}/part-{file}.{'jsonl' if kind == 'jsonl' else 'tar'}"
        data = _jsonl(file, count) if kind == "jsonl" else _tar(file, count)
        if gz:
            import gzip

            name, data = name + ".gz", gzip.compress(data)
        fs.pipe_file(name, data)
    return f"flaky:///{kind}/part-*"


def _ident(item: Any) -> Any:
    if isinstance(item, dict) and "__key__" in item:
        return (item["__key__"], item["txt"], item["cls"])
    return item["id"]


def _source(kind: str, **kwargs: Any) -> ShardedSource[Any]:
    FAULTS.armed = False
    try:
        source: ShardedSource[Any]
        if kind == "jsonl":
            source = JsonLinesSource(_write(kind), **kwargs)
        else:
            source = TarSource(_write(kind), **kwargs)
        source.sample_counts()  # counted fault-free: the counting pass is not the cursor's
    finally:
        FAULTS.armed = True
    return source


CONTEXTS = {
    "one stream": [WorkerContext(0, 1, 0, 0, 0, None)],
    "2 ranks x 2 workers": [
        WorkerContext(rank, 2, worker, 2, 0, None) for rank in range(2) for worker in range(2)
    ],
}


def _read(source: ShardedSource[Any], contexts: list[WorkerContext], epochs: int = 2) -> Any:
    streams = []
    for context in contexts:
        cursor = source.cursor(context)
        streams.append([[_ident(item) for item in cursor] for _ in range(epochs)])
        cursor.close()
    return streams


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The waits of the retries, none slept."""
    slept: list[float] = []
    monkeypatch.setattr(retry, "sleep", slept.append)
    FAULTS.reset()
    yield slept
    FAULTS.reset()


def _retries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "savable_loader.storage.retry" and record.levelno == logging.WARNING
    ]


# -- a retried stream equals a fault-free one ---------------------------------------------

FAULT_PLANS = {
    "reads": {"read": {2, 3, 4, 9, 17, 18, 30, 41, 42, 43, 44, 60}},
    "opens": {"open": {1, 2, 4, 7, 8}},
    "seeks": {"seek": {1, 2, 3, 5}, "read": {6, 25}},
}


@pytest.mark.parametrize("kind", ["jsonl", "tar"])
@pytest.mark.parametrize("split", ["samples", "files"])
@pytest.mark.parametrize("layout", sorted(CONTEXTS))
@pytest.mark.parametrize("plan", sorted(FAULT_PLANS))
def test_a_retried_stream_equals_a_fault_free_one(
    kind: str,
    split: str,
    layout: str,
    plan: str,
    waits: list[float],
    caplog: pytest.LogCaptureFixture,
) -> None:
    contexts = CONTEXTS[layout]
    source = _source(kind, split=split, shuffle_shards=True, seed=3)
    FAULTS.armed = False
    want = _read(source, contexts)
    FAULTS.reset(**FAULT_PLANS[plan])
    caplog.set_level(logging.WARNING, logger="savable_loader")
    got = _read(source, contexts)
    assert got == want
    assert sum(len(epoch) for stream in want for epoch in stream) >= 2 * sum(LENGTHS)  # padded
    assert FAULTS.count > 0
    assert len(_retries(caplog)) == FAULTS.count == len(waits)
    assert all("flaky://" in message and "retry" in message for message in _retries(caplog))


@pytest.mark.parametrize("kind", ["jsonl", "tar"])
def test_a_restore_under_faults_resumes_exactly(kind: str, waits: list[float]) -> None:
    source = _source(kind)
    context = WorkerContext(0, 1, 0, 0, 0, None)
    FAULTS.armed = False
    want = [_ident(item) for item in source.cursor(context)]
    FAULTS.reset(read={1, 3, 5, 8, 13, 21, 34}, open={2, 5}, seek={1, 3})
    for k in range(len(want) + 1):
        cursor = source.cursor(context)
        head = [_ident(item) for item in cursor.take(k)]
        state = cursor.state()
        cursor.close()
        restored = source.cursor(context)
        restored.restore(state)
        assert head + [_ident(item) for item in restored] == want, k
    assert FAULTS.count > 0


# -- permanent errors, exhausted attempts, backoff ----------------------------------------


@pytest.mark.parametrize("kind", ["jsonl", "tar"])
@pytest.mark.parametrize(
    "error",
    [
        lambda: PermissionError(13, "Access Denied"),
        lambda: FileNotFoundError(2, "No such key"),
        lambda: OSError(5, "Input/output error"),  # unknown: not retried
        lambda: RuntimeError("a bug"),
    ],
)
def test_a_permanent_error_is_raised_at_once(
    kind: str, error: Callable[[], BaseException], waits: list[float]
) -> None:
    source = _source(kind)
    FAULTS.reset(read={3}, error=error)
    with pytest.raises(StorageError, match="flaky:///") as raised:
        list(source.cursor(WorkerContext(0, 1, 0, 0, 0, None)))
    assert waits == []
    assert FAULTS.count == 1
    assert raised.value.__cause__ is not None


def test_a_missing_file_is_not_retried(waits: list[float]) -> None:
    source = _source("jsonl", split="files")
    FlakyFileSystem.store.clear()
    with pytest.raises(StorageError, match=r"flaky:///jsonl/part-0\.jsonl: not found"):
        next(iter(source.cursor(WorkerContext(0, 1, 0, 0, 0, None))))
    assert waits == []


def test_a_malformed_item_is_not_retried(waits: list[float]) -> None:
    FlakyFileSystem.store.clear()
    FlakyFileSystem().pipe_file("/bad.jsonl", b'{"id": 1}\nnot json\n{"id": 3}\n')
    cursor = JsonLinesSource("flaky:///bad.jsonl").cursor(WorkerContext(0, 1, 0, 0, 0, None))
    assert next(cursor) == {"id": 1}
    with pytest.raises(ConfigError, match="line 2"):
        next(cursor)
    assert next(cursor) == {"id": 3}
    assert waits == []


@pytest.mark.parametrize("kind", ["jsonl", "tar"])
@pytest.mark.parametrize("split", ["samples", "files"])
def test_exhausted_attempts_name_the_url_the_attempts_and_the_last_error(
    kind: str, split: str, waits: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    source = _source(kind, split=split)
    FAULTS.reset(read="all", error=lambda: TimeoutError("read timed out"))
    caplog.set_level(logging.WARNING, logger="savable_loader")
    policy = retry.DEFAULT_POLICY
    with pytest.raises(StorageError) as raised:
        next(iter(source.cursor(WorkerContext(0, 1, 0, 0, 0, None))))
    message = str(raised.value)
    assert f"flaky:///{kind}/part-0." in message
    assert f"{policy.attempts} attempts" in message
    assert "read timed out" in message
    assert FAULTS.count == policy.attempts
    assert len(waits) == len(_retries(caplog)) == policy.attempts - 1


def test_after_a_give_up_reading_on_resumes_at_the_same_item(waits: list[float]) -> None:
    source = _source("jsonl")
    context = WorkerContext(0, 2, 0, 0, 0, None)  # a run of the samples: a count matters
    FAULTS.armed = False
    want = [_ident(item) for item in source.cursor(context)]
    cursor = source.cursor(context)
    head = [_ident(item) for item in cursor.take(3)]
    # the blank line after item 3 is read, then every attempt at the next line fails
    attempts = retry.DEFAULT_POLICY.attempts
    FAULTS.reset(read=set(range(2, 2 + attempts)))
    with pytest.raises(StorageError, match="attempts"):
        next(cursor)
    FAULTS.armed = False
    assert head + [_ident(item) for item in cursor] == want


def test_waits_grow_and_are_capped(monkeypatch: pytest.MonkeyPatch, waits: list[float]) -> None:
    policy = retry.RetryPolicy(attempts=9, base_delay=0.5, max_delay=4.0)
    monkeypatch.setattr(retry, "DEFAULT_POLICY", policy)

    class Top:
        def random(self) -> float:
            return 1.0

    monkeypatch.setattr(retry, "_rng", Top())
    source = _source("tar")
    FAULTS.reset(read="all")
    with pytest.raises(StorageError, match="9 attempts"):
        list(source.cursor(WorkerContext(0, 1, 0, 0, 0, None)))
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    assert policy.max_wait == sum(waits)


def test_jittered_waits_stay_under_their_caps() -> None:
    policy = retry.DEFAULT_POLICY
    assert (policy.attempts, policy.base_delay, policy.max_delay) == (8, 0.25, 10.0)
    assert policy.max_wait == pytest.approx(25.75)
    draws = [[policy.delay(n) for _ in range(200)] for n in range(1, policy.attempts)]
    for n, drawn in enumerate(draws, 1):
        assert all(0 <= wait <= policy.cap(n) for wait in drawn)
        assert max(drawn) > policy.cap(n) / 2  # jittered over the whole range
    assert len({round(wait, 9) for wait in draws[-1]}) > 100


@pytest.mark.parametrize("bad", [{"attempts": 0}, {"base_delay": -1.0}, {"max_delay": 0.01}])
def test_a_bad_policy_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="RetryPolicy"):
        retry.RetryPolicy(**bad)


# -- classification -----------------------------------------------------------------------


def _chained(error: BaseException) -> StorageError:
    try:
        try:
            raise error
        except BaseException as exc:
            raise StorageError("Cannot read flaky:///x") from exc
    except StorageError as wrapped:
        return wrapped


def _client_error(code: str, status: int) -> BaseException:
    botocore = pytest.importorskip("botocore.exceptions")
    response = {
        "Error": {"Code": code, "Message": code},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return botocore.ClientError(response, "GetObject")  # type: ignore[no-any-return]


def test_transient_and_permanent_errors_are_told_apart() -> None:
    botocore = pytest.importorskip("botocore.exceptions")
    transient = [
        TimeoutError("timed out"),
        ConnectionResetError(104, "reset"),
        ConnectionAbortedError(),
        ConnectionRefusedError(),
        botocore.EndpointConnectionError(endpoint_url="http://s3"),
        botocore.ReadTimeoutError(endpoint_url="http://s3"),
        botocore.ConnectionClosedError(endpoint_url="http://s3"),
        _client_error("SlowDown", 503),
        _client_error("Throttling", 400),
        _client_error("InternalError", 500),
        _client_error("Whatever", 429),
        _client_error("Whatever", 502),
    ]
    permanent = [
        FileNotFoundError(2, "missing"),
        PermissionError(13, "denied"),
        IsADirectoryError(21, "folder"),
        _client_error("NoSuchKey", 404),
        _client_error("AccessDenied", 403),
        _client_error("403", 403),
        OSError(5, "eio"),
        ValueError("unknown"),
        ConfigError("malformed"),
    ]
    for error in transient:
        assert retry.is_transient(_chained(error)), error
    for error in permanent:
        assert not retry.is_transient(_chained(error)), error
    # s3fs turns SlowDown into an OSError whose cause is the ClientError
    slow = OSError(16, "Device or resource busy")
    slow.__cause__ = _client_error("SlowDown", 503)
    assert retry.is_transient(_chained(slow))
    # the nearest known error decides: a timeout met while handling a missing key
    assert retry.is_transient(_timeout_in_a_miss())


def _timeout_in_a_miss() -> BaseException:
    try:
        try:
            raise FileNotFoundError(2, "cache miss")
        except FileNotFoundError:
            raise TimeoutError("timed out")  # noqa: B904 (a context, not a cause)
    except TimeoutError as exc:
        return exc


def test_aiohttp_errors_are_classified_by_status() -> None:
    aiohttp = pytest.importorskip("aiohttp")
    assert retry.is_transient(_chained(aiohttp.ServerDisconnectedError()))
    assert retry.is_transient(_chained(aiohttp.ClientPayloadError("cut")))

    def response(status: int) -> BaseException:
        return aiohttp.ClientResponseError(None, (), status=status)  # type: ignore[arg-type]

    assert retry.is_transient(_chained(response(503)))
    assert retry.is_transient(_chained(response(429)))
    assert not retry.is_transient(_chained(response(404)))
    assert not retry.is_transient(_chained(response(403)))


# -- through the loader: workers, save and restore ----------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["jsonl", "tar"])
def test_a_loader_with_workers_resumes_exactly_under_faults(kind: str, waits: list[float]) -> None:
    def loader(source: ShardedSource[Any]) -> SavableDataLoader:
        return SavableDataLoader(
            source,
            batch_size=None,
            num_workers=2,
            multiprocessing_context="fork",
        )

    source = _source(kind)
    FAULTS.armed = False
    with loader(source) as reference:
        want = [_ident(item) for item in reference]
    assert len(want) == sum(LENGTHS)
    # fewer faults per process than attempts: whatever a worker reads, no read gives up
    FAULTS.reset(read={2, 3, 12, 30}, open={3}, seek={1})
    assert FAULTS.total < retry.DEFAULT_POLICY.attempts
    for k in (0, 5, len(want) // 2 + 1, len(want)):
        with loader(source) as first:
            items = iter(first)
            head = [_ident(next(items)) for _ in range(k)]
            state = first.save_state_rank()
        with loader(source) as second:
            second.restore_state_rank(state)
            assert head + [_ident(item) for item in second] == want, k
    assert FAULTS.count > 0  # counted across the workers


# -- a policy per source, and the counting pass -------------------------------------------


@pytest.mark.parametrize("kind", ["jsonl", "tar"])
def test_a_source_s_own_policy_is_used(kind: str, waits: list[float]) -> None:
    source = _source(kind, retry=retry.RetryPolicy(attempts=2, base_delay=0.5, max_delay=0.5))
    FAULTS.reset(read={1, 2})  # two failures in a row: beyond 2 attempts in all
    with pytest.raises(StorageError, match=r"2 attempts failed with transient errors"):
        list(source.cursor(WorkerContext(0, 1, 0, 0, 0, None)))
    assert len(waits) == 1
    assert 0 <= waits[0] <= 0.5
    assert source.config() == _source(kind).config()  # not part of the fingerprint


def test_a_policy_that_is_not_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="retry must be a RetryPolicy"):
        JsonLinesSource(_write("jsonl"), retry=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["jsonl", "tar"])
def test_counting_the_samples_retries_too(kind: str, waits: list[float]) -> None:
    FAULTS.armed = False
    pattern = _write(kind)
    build = JsonLinesSource if kind == "jsonl" else TarSource
    want = build(pattern).sample_counts()
    FAULTS.reset(open={1, 3}, read={2, 5, 9})
    assert build(pattern).sample_counts() == want
    assert FAULTS.count == len(waits) > 0
