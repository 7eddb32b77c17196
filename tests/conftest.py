"""Shared test configuration: Hypothesis profiles, a child-process leak check, the order
the test files run in, and the S3 fixtures.

NOTE [ Test folders ]
The test files live in folders that follow the package (``loader/``, ``resume/``,
``stages/`` and ``stages/files/`` for ``datasets/``, ``storage/``, ``state/``, ``rng/``,
``cli/``), plus
``processes/`` for what only worker processes show (start methods, faults, hangs),
``distributed/`` for real ranks (gloo jobs, DDP, the trainers, torchrun) and ``project/``
for the documentation, the package's structure and the packaging. A folder holds at most
15 test files. The helpers the tests share live in ``support/`` (``pipelines.py``,
``gloo.py``, ``s3_server.py``, ``golden/``...), which pyproject.toml puts on ``sys.path``
(``pythonpath``): they import under their own names (``from pipelines import
RandomCounter``), as the goldens' fingerprints require, and a test that starts Python
processes hands them ``support/`` through ``PYTHONPATH`` (``paths.pythonpath()``). The
folders are not packages: pytest imports each test file under its base name (the default
"prepend" import mode, which the spawned workers and the scripts run by path rely on), so
no two test files may share a name, and a test file imports another only from its own
folder; what files of several folders share goes to ``support/``. Since ``tests/`` and each
test file's folder are on ``sys.path``, a folder's name is importable as a namespace
package: one named after a library the tests import (``datasets/`` once) shadows that
library wherever it is not installed, and ``pytest.importorskip`` then fails instead of
skipping; ``tests/project/test_meta.py`` checks that no folder takes such a name.
"""

from __future__ import annotations

import contextlib
import glob
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from s3_server import S3, moto_server, s3_access

TESTS = Path(__file__).resolve().parent

# NOTE [ Hypothesis profiles ]
# "ci" (the default) is reproducible: derandomized, no deadline (multi-process
# tests have noisy timings). "dev" is a quicker exploratory run:
# HYPOTHESIS_PROFILE=dev pytest ...
settings.register_profile("ci", deadline=None, derandomize=True, max_examples=25)
settings.register_profile("dev", deadline=None, max_examples=10)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# NOTE [ Child-process leak check ]
# After every test, any process the test started must be gone. Children are found
# through multiprocessing.active_children() and, on Linux, /proc/self/task/*/children,
# which also lists torch DataLoader workers and processes started by other means.
# Workers started through a forkserver are children of the forkserver, so its
# children are checked too. The multiprocessing forkserver and resource tracker
# themselves are long-lived by design and are never counted as leaks.
LEAK_GRACE_SECONDS = 10.0
_INFRASTRUCTURE_MARKERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")
_HAS_PROC_CHILDREN = sys.platform.startswith("linux") and bool(
    glob.glob("/proc/self/task/*/children")
)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            raw = file.read()
    except OSError:
        return "<unavailable>"
    cmdline = raw.replace(b"\0", b" ").decode(errors="replace").strip() or "<empty>"
    return cmdline if len(cmdline) <= 300 else cmdline[:297] + "..."


def _is_running(pid: int) -> bool:
    """False once the process is gone or a zombie (it has exited, only not reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


def _proc_children(pid: int | str) -> set[int]:
    children: set[int] = set()
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as file:
                children.update(int(child) for child in file.read().split())
        except (OSError, ValueError):
            continue  # the thread or process exited meanwhile
    return children


def _is_infrastructure(pid: int) -> bool:
    cmdline = _cmdline(pid)
    return any(marker in cmdline for marker in _INFRASTRUCTURE_MARKERS)


def _child_pids() -> set[int]:
    """Running descendants that count as this test's processes (infrastructure excluded)."""
    # active_children() also reaps multiprocessing children that have exited.
    pids = {process.pid for process in multiprocessing.active_children() if process.pid}
    infrastructure: set[int] = set()
    if _HAS_PROC_CHILDREN:
        for pid in _proc_children("self"):
            if _is_infrastructure(pid):
                infrastructure.add(pid)
                # Workers forked by the forkserver share its cmdline; only the
                # direct child is infrastructure.
                pids.update(_proc_children(pid))
            else:
                pids.add(pid)
    return {pid for pid in pids - infrastructure if _is_running(pid)}


def _terminate(pids: set[int]) -> None:
    """Stop leaked processes so that one leak does not disturb later tests."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            multiprocessing.active_children()
            pids = {pid for pid in pids if _is_running(pid)}
            if not pids:
                return
            time.sleep(0.05)


@pytest.fixture(autouse=True)
def _no_leaked_child_processes() -> Iterator[None]:
    """Fail the test if a child process it started is still running afterwards."""
    before = _child_pids()
    yield
    deadline = time.monotonic() + LEAK_GRACE_SECONDS
    leaked = _child_pids() - before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked = _child_pids() - before
    if leaked:
        details = "\n".join(f"  pid {pid}: {_cmdline(pid)}" for pid in sorted(leaked))
        _terminate(leaked)
        pytest.fail(
            f"{len(leaked)} child process(es) still running {LEAK_GRACE_SECONDS:.0f} s "
            f"after the test (now terminated):\n{details}",
            pytrace=False,
        )


# NOTE [ In-memory files ]
# fsspec's memory:// filesystem keeps its files in one dict for the whole process, so a
# test's files would stay for the rest of the suite: the cache and source tests write
# shards of several MB there, which grew the pytest process by about 100 MB, and every
# fork of a worker costs in proportion to what the process holds (NOTE [ Heavy imports
# last ]). The files and folders a test adds are removed after it.


@pytest.fixture(autouse=True)
def _no_leftover_memory_files() -> Iterator[None]:
    from fsspec.implementations.memory import MemoryFileSystem

    files, folders = set(MemoryFileSystem.store), set(MemoryFileSystem.pseudo_dirs)
    yield
    for path in set(MemoryFileSystem.store) - files:
        MemoryFileSystem.store.pop(path, None)
    MemoryFileSystem.pseudo_dirs[:] = [d for d in MemoryFileSystem.pseudo_dirs if d in folders]


# NOTE [ Heavy imports last ]
# Every worker a test starts is forked from this process, and a fork costs in proportion
# to what the process has mapped: with the trainers, Hugging Face datasets, moto and
# pyarrow imported (the documentation pages import the trainers), the pytest process
# grows from about 290 MB to 600 MB and every loader's start and stop costs ~60% more.
# Some modules cost more than their size: once torch._dynamo is imported (by
# torch.distributed.checkpoint, lightning.fabric and the trainers), a loader's epoch with
# two workers takes ~25% more CPU time; moto and s3fs, 75 MB, add ~2%.
# So the test files whose tests import them run after all the others, in their collected
# order otherwise, and the test modules import them where used rather than at collection.
# A file goes last as a whole: pytest-xdist (--dist loadfile) runs all of a file's tests
# when its first test comes, so a file of light tests with one S3 test brought moto into
# the process a third of the way into the run, and the process took torch._dynamo soon
# after. The heavy files come in tiers: moto and s3fs (the S3 fixtures); torch._dynamo;
# Hugging Face datasets and pyarrow; the trainers.
# The tables name files by their path under tests/.
_HEAVY_TIERS = {
    "loader/test_checkpoints.py": 2,  # torch.distributed.checkpoint
    "loader/test_loader_surface.py": 2,  # lightning.fabric, in one test
    "stages/test_getitems.py": 3,  # Hugging Face datasets, in one test
    "stages/test_stateful_adapters.py": 3,
    "stages/files/test_table_source.py": 3,
    "project/test_docs.py": 4,
    "distributed/test_hf_trainer.py": 4,
}
_S3_FIXTURES = frozenset({"s3", "endpoint_url"})
_S3_TIER = 1


# NOTE [ Longest files first ]
# The suite runs in four pytest-xdist processes that take whole files in collection
# order (NOTE [ Four test processes ] in noxfile.py), each process asking for the next
# file when it is done. A long file taken last keeps one process busy while the others
# wait: at the end of a run, the trainer tests (two to four tests, 50 to 100 s a file)
# ran alone. So within each tier above the files that took longest (20 s or more of a
# 13-minute run) come first, longest first.
_LONGEST_MODULES = (
    "resume/test_resume.py",
    "distributed/test_lightning.py",
    "rng/test_small_states.py",
    "distributed/test_examples.py",
    "distributed/test_hf_trainer.py",
    "loader/test_conformance.py",
    "processes/test_soak.py",
    "distributed/test_accelerate.py",
    "stages/test_stateful_adapters.py",
    "resume/test_elastic.py",
    "processes/test_faults.py",
    "storage/test_storage_faults.py",
    "resume/test_cursor_resume.py",
    "processes/test_worker_semantics.py",
    "state/test_script_names.py",
    "project/test_docs.py",
    "cli/test_cli.py",
    "distributed/test_ddp_job.py",
    "stages/test_limit_repeat.py",
)


def _name(item: pytest.Item) -> str:
    """The item's file, by its path under tests/ (the key of the tables above)."""
    return item.path.relative_to(TESTS).as_posix()


def _heavy_tiers(items: list[pytest.Item]) -> dict[str, int]:
    """Each test file's tier (NOTE [ Heavy imports last ]): 0 for a file of light tests."""
    tiers: dict[str, int] = {}
    for item in items:
        name = _name(item)
        tier = _HEAVY_TIERS.get(name, 0)
        if _S3_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            tier = max(tier, _S3_TIER)
        tiers[name] = max(tiers.get(name, 0), tier)
    return tiers


def _longest(name: str) -> int:
    return _LONGEST_MODULES.index(name) if name in _LONGEST_MODULES else len(_LONGEST_MODULES)


# NOTE [ Long cases are slow ]
# Besides the tests marked ``slow`` where they are written, the cases below are slow: each
# took at least 5 s of a whole run with two test processes on a quiet 2-core machine
# (2026-11-29). The quick suite (``-m "not slow"``) leaves them out: a developer's quick
# run, and CI's run against the lowest versions (``nox -s tests_lowest``), whose CUDA
# build of torch 2.4 makes each start of a worker or an interpreter about three times
# dearer (the quick suite took 28 min there). Kept quick on purpose, though as long: one
# S3 loader through each way a worker reads (``test_s3_client.py``'s direct-botocore
# case, ``test_token_cache.py``'s workers through the cache), which the lowest fsspec and
# s3fs once broke. Whole CI runs every test. ``tests/project/test_meta.py`` checks that each
# named case exists.
_LONG_CASES = frozenset(
    {
        "distributed/test_lightning.py::test_single_process_resumes_exactly[mid-epoch]",
        "loader/test_iterator_state.py::test_it_resumes_exactly[2-False]",
        "loader/test_map_errors.py::test_a_save_anywhere_resumes_exactly_errors_included[2-collate]",
        "processes/test_fault_edges.py::test_stopping_workers_leaves_live_tensors_their_shared_memory[file_system]",
        "processes/test_unstarted_workers.py::test_a_worker_that_never_starts_is_a_worker_error_after_two_restarts",
        "project/test_docs.py::test_page_runs[docs/how-to/custom-dataset.md]",
        "project/test_docs.py::test_page_runs[docs/how-to/migrate.md]",
        "resume/test_cursor_resume.py::test_every_stage_resumes_exactly_at_every_position[composed]",
        "resume/test_cursor_resume.py::test_every_stage_resumes_exactly_at_every_position[endless-repeat-limited]",
        "resume/test_cursor_resume.py::test_every_stage_resumes_exactly_at_every_position[map-global-draws]",
        "resume/test_elastic.py::test_a_resharded_stream_resumes_exactly[indexed-3]",
        "resume/test_elastic.py::test_a_resharded_stream_resumes_exactly[noisy-2]",
        "resume/test_global_stream.py::test_seed_each_item_resumes_exactly_with_two_workers",
        "resume/test_hypothesis_resume.py::test_without_workers",
        "resume/test_resume.py::test_dataset_with_skip_fast_path",
        "resume/test_resume.py::test_map_style_dataset[2-True]",
        "resume/test_resume.py::test_stateful_object[2]",
        "resume/test_resume.py::test_workers_uneven_shards[2-3]",
        "resume/test_resume.py::test_workers_uneven_shards[2-None]",
        "rng/test_small_states.py::test_a_pipeline_that_draws_saves_bytes_and_resumes_exactly[2]",
        "rng/test_small_states.py::test_a_plain_dataset_resumes_exactly_in_later_epochs[2]",
        "rng/test_small_states.py::test_a_shuffle_over_a_plain_dataset_resumes_exactly[2]",
        "rng/test_small_states.py::test_a_shuffle_over_draws_keeps_bytes_once_drawn_and_resumes_exactly[2]",
        "rng/test_small_states.py::test_draws_after_some_items_resume_exactly_at_every_point[2]",
        "rng/test_small_states.py::test_draws_in_some_epochs_resume_exactly_at_every_point[2]",
        "rng/test_small_states.py::test_with_a_generator_the_stream_resumes_exactly[2]",
        "stages/files/test_counts_file.py::test_a_refused_early_request_of_the_counts_file_is_asked_again[3]",
        "stages/files/test_file_positions.py::test_resumes_exactly[2]",
        "stages/files/test_table_source.py::test_resumes_exactly[2]",
        "stages/files/test_tar_source.py::test_s3_shards_resume_exactly",
        "stages/test_blend_by_position.py::test_a_blend_read_by_position_resumes_exactly[2]",
        "stages/test_composed.py::test_composed_pipeline_on_s3_resumes_exactly_and_matches_local[0]",
        "stages/test_getitems.py::test_a_drawing_getitems_resumes_exactly[2]",
        "state/test_script_names.py::test_a_changed_function_is_named_with_both_names_and_the_fix",
        "state/test_script_names.py::test_a_state_saved_by_the_script_restores_where_it_is_imported[import-script]",
        "state/test_script_names.py::test_a_state_saved_by_the_script_restores_where_it_is_imported[module-import]",
        "state/test_script_names.py::test_a_state_saved_by_the_script_restores_where_it_is_imported[script-import]",
        "state/test_script_names.py::test_a_state_saved_by_the_script_restores_where_it_is_imported[script-module]",
        "storage/test_cache.py::test_workers_resume_exactly_through_the_cache",
        "storage/test_cache_stream.py::test_a_loader_reading_downloads_as_they_arrive_resumes_exactly",
        "storage/test_s3_client.py::test_a_stream_read_through_botocore_resumes_exactly[cache]",
        "storage/test_s3_client.py::test_a_stream_read_through_botocore_resumes_exactly[direct]",
        "storage/test_s3_client.py::test_sources_read_the_same_stream_through_either_client[cache-botocore]",
        "storage/test_s3_client.py::test_sources_read_the_same_stream_through_either_client[cache-obstore]",
        "storage/test_s3_client.py::test_sources_read_the_same_stream_through_either_client[direct-obstore]",
        "storage/test_storage_faults.py::test_a_state_saved_under_faults_restores_exactly[tokens-0]",
        "storage/test_storage_faults.py::test_faults_leave_the_stream_unchanged[jsonl-0]",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the long cases slow (NOTE [ Long cases are slow ]); runs the files whose tests
    import heavy modules last, by tier (NOTE [ Heavy imports last ]), the longest files
    first within each tier (NOTE [ Longest files first ])."""
    for item in items:
        if item.nodeid.removeprefix("tests/") in _LONG_CASES:
            item.add_marker(pytest.mark.slow)  # NOTE [ Long cases are slow ]
    tiers = _heavy_tiers(items)
    items[:] = sorted(items, key=lambda item: (tiers[_name(item)], _longest(_name(item))))


# NOTE [ S3 fixtures ]
# ``endpoint_url`` runs moto's S3 server on loopback once per test module that asks for
# it; ``s3`` gives a test its own bucket and credentials (tests/support/s3_server.py).


@pytest.fixture(scope="module")
def endpoint_url() -> Iterator[str]:
    """Runs moto's S3 server on 127.0.0.1 (a free port); stops it after the module."""
    with moto_server() as url:
        yield url


@pytest.fixture
def s3(endpoint_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3]:
    """A bucket of its own on the module's S3 server, reachable as :class:`S3` says."""
    with s3_access(endpoint_url, monkeypatch) as access:
        yield access
