"""Checkpoint directories (NOTE [ Per-rank checkpoint directories ] in
``checkpoint_dir.py``): every rank writes its own file, the metadata comes last, a save
killed half-way leaves the previous checkpoint valid, and a restore reads what it needs."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
import weakref
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from gloo import in_rank_order, outcome, run_ranks

import savable_loader.checkpoint_dir as module
from savable_loader import (
    SavableDataLoader,
    StateFileNotFoundError,
    StateFormatError,
    StorageError,
    WorkerConfig,
    load_checkpoint,
    save_checkpoint,
    save_state,
    serialization,
)
from savable_loader.storage import urls as storage

N, BATCH = 29, 3


def _loader(rank: int = 0, world_size: int = 1, num_workers: int = 0) -> SavableDataLoader:
    config = WorkerConfig(rank=rank, world_size=world_size)
    return SavableDataLoader(
        list(range(N)),
        batch_size=BATCH,
        shuffle=True,
        num_workers=num_workers,
        seed=3,
        worker_config=config,
    )


#: The epoch each loader is in the middle of: a new iter() starts a new epoch, as with torch.
_EPOCHS: weakref.WeakKeyDictionary[SavableDataLoader, Iterator[Any]] = weakref.WeakKeyDictionary()


def _ids(loader: SavableDataLoader, count: int | None = None) -> list[list[int]]:
    """The next ``count`` batches of the epoch in progress (the rest of it when None); a
    new epoch when none is in progress."""
    iterator = _EPOCHS.pop(loader) if loader in _EPOCHS else iter(loader)
    out = []
    for batch in iterator:
        out.append(batch.tolist())
        if count is not None and len(out) == count:
            _EPOCHS[loader] = iterator
            break
    return out


# -- one process ---------------------------------------------------------------------------


def test_a_directory_round_trips_in_one_process(tmp_path: Path) -> None:
    with _loader() as loader:
        head = _ids(loader, 3)
        save_checkpoint(loader, tmp_path / "ckpt")
        rest = _ids(loader)
    files = sorted(
        p.relative_to(tmp_path / "ckpt").as_posix()
        for p in (tmp_path / "ckpt").rglob("*")
        if p.is_file()
    )
    assert files[-1] == "metadata.msgpack"
    assert len(files) == 2
    assert files[0].endswith("/rank-0.msgpack")
    with _loader() as resumed:
        load_checkpoint(resumed, tmp_path / "ckpt")
        assert _ids(resumed) == rest
    assert head


def test_no_checkpoint_yet_is_a_file_not_found_error(tmp_path: Path) -> None:
    with _loader() as loader, pytest.raises(FileNotFoundError) as info:
        load_checkpoint(loader, tmp_path / "nothing")
    assert isinstance(info.value, StateFileNotFoundError)


def test_a_save_killed_before_its_metadata_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    with _loader() as loader:
        _ids(loader, 2)
        save_checkpoint(loader, folder)
        after_first = _ids(_loader_at(folder))
        _ids(loader, 2)
        # The second save dies after its rank file and before the metadata.
        real = storage.write_bytes

        def failing(url: Any, data: bytes, **kwargs: Any) -> None:
            if os.fspath(url).endswith(module.METADATA):
                raise OSError("killed before the metadata was written")
            real(url, data, **kwargs)

        storage.write_bytes = failing
        try:
            with pytest.raises(OSError, match="killed"):
                save_checkpoint(loader, folder)
        finally:
            storage.write_bytes = real
    assert len([p for p in folder.iterdir() if p.is_dir()]) == 2  # the first save's is kept
    assert _ids(_loader_at(folder)) == after_first


def _loader_at(folder: Path) -> SavableDataLoader:
    loader = _loader()
    load_checkpoint(loader, folder)
    return loader


def test_earlier_saves_are_removed_once_the_new_one_is_complete(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    with _loader() as loader:
        for _ in range(3):
            _ids(loader, 1)
            save_checkpoint(loader, folder)
    assert len([p for p in folder.iterdir() if p.is_dir()]) == 1


@pytest.fixture(params=["local", "memory"])
def base(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh folder, local or ``memory://``, that the checkpoint directory goes into."""
    if request.param == "local":
        yield str(tmp_path)
    else:
        yield f"memory://savable-loader-tests/{uuid.uuid4().hex}"


def _names(url: str) -> set[str]:
    fs, path = fsspec.url_to_fs(url)
    return {str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)}


def _write(url: str, data: bytes) -> None:
    fs, path = fsspec.url_to_fs(url)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, data)


def _save_id(folder: str) -> str:
    metadata = serialization.loads(storage.read_bytes(f"{folder}/metadata.msgpack"))
    assert isinstance(metadata, dict)
    return str(metadata["save"])


def test_a_save_removes_only_the_files_the_previous_metadata_lists(base: str) -> None:
    folder = f"{base}/ckpt"
    run = uuid.uuid4().hex  # a user's folder named by a uuid4 (an MLflow run id)
    digest = hashlib.md5(b"data").hexdigest()  # a user's file named by its MD5
    _write(f"{folder}/{run}/params.json", b"{}")
    _write(f"{folder}/{digest}", b"data")
    with _loader() as loader:
        _ids(loader, 1)
        save_checkpoint(loader, folder)
        first = _save_id(folder)
        _write(f"{folder}/{first}/notes.txt", b"mine")  # the user's, in the library's folder
        _ids(loader, 1)
        save_checkpoint(loader, folder)
        second = _save_id(folder)
        assert _names(folder) == {"metadata.msgpack", run, digest, first, second}
        _ids(loader, 1)
        save_checkpoint(loader, folder)
        third = _save_id(folder)
        rest = _ids(loader)
    assert _names(folder) == {"metadata.msgpack", run, digest, first, third}
    assert _names(f"{folder}/{run}") == {"params.json"}
    assert _names(f"{folder}/{first}") == {"notes.txt"}  # the rank file went, the folder stays
    assert _names(f"{folder}/{third}") == {"rank-0.msgpack"}
    with _loader() as resumed:
        load_checkpoint(resumed, folder)
        assert _ids(resumed) == rest


def test_a_save_folder_replaced_by_a_link_is_not_followed(tmp_path: Path) -> None:
    """Whoever can write the checkpoint directory can swap a save's folder for a link; the
    next save's clean-up must not delete the files where it points."""
    folder, outside = tmp_path / "ckpt", tmp_path / "outside"
    with _loader() as loader:
        _ids(loader, 1)
        save_checkpoint(loader, str(folder))
        first = _save_id(str(folder))
        outside.mkdir()
        (outside / "rank-0.msgpack").write_bytes(b"someone else's")
        shutil.rmtree(folder / first)
        (folder / first).symlink_to(outside, target_is_directory=True)
        _ids(loader, 1)
        save_checkpoint(loader, str(folder))
    assert (outside / "rank-0.msgpack").read_bytes() == b"someone else's"
    assert (folder / first).is_symlink()


def test_a_save_over_forged_metadata_removes_nothing_it_names(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep me")
    with _loader() as loader:
        save_checkpoint(loader, folder)
        save = _save_id(str(folder))
        _forge(str(folder), files=["../victim.txt"], save=save)
        save_checkpoint(loader, folder)
    assert victim.read_bytes() == b"keep me"


def _forge(folder: str, **fields: Any) -> None:
    """Rewrites the metadata of ``folder`` with ``fields`` changed."""
    url = f"{folder}/metadata.msgpack"
    payload = serialization.loads(storage.read_bytes(url))
    assert isinstance(payload, dict)
    storage.write_bytes(url, serialization.dumps({**payload, **fields}))


@pytest.mark.parametrize("entry", ["outside", "other save", "other rank", "order"])
def test_a_load_reads_only_the_files_the_library_writes(
    base: str, entry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, other = f"{base}/ckpt", uuid.uuid4().hex
    with _loader() as loader:
        _ids(loader, 1)
        save_checkpoint(loader, folder)
        save = _save_id(folder)
        _ids(loader, 2)
        # Valid states where the forged names lead, so that reading them would succeed.
        save_state(loader.save_state_rank(), f"{base}/outside/state.msgpack")
        save_state(loader.save_state_rank(), f"{folder}/{other}/rank-0.msgpack")
    files, world_size = {
        "outside": (["../outside/state.msgpack"], 1),
        "other save": ([f"{other}/rank-0.msgpack"], 1),
        "other rank": ([f"{save}/rank-1.msgpack"], 1),
        "order": ([f"{save}/rank-1.msgpack", f"{save}/rank-0.msgpack"], 2),
    }[entry]
    _forge(folder, files=files, world_size=world_size)
    opened: list[str] = []
    monkeypatch.setattr(module, "load_state", lambda url, **kwargs: opened.append(url))
    with _loader() as loader, pytest.raises(StateFormatError) as info:
        load_checkpoint(loader, folder)
    assert repr(files[0]) in str(info.value)
    assert opened == []


def test_a_load_error_quotes_no_bytes_of_a_file_outside(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    (tmp_path / "secret.txt").write_bytes(b"TOPSECRET password")
    with _loader() as loader:
        save_checkpoint(loader, folder)
    _forge(str(folder), files=["../secret.txt"])
    with _loader() as loader, pytest.raises(StateFormatError) as info:
        load_checkpoint(loader, folder)
    assert "TOPSECRE" not in str(info.value)
    assert "'../secret.txt'" in str(info.value)


def test_a_damaged_metadata_file_is_a_state_error(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    with _loader() as loader:
        save_checkpoint(loader, folder)
    (folder / "metadata.msgpack").write_bytes(b"garbage")
    with _loader() as loader, pytest.raises(StateFormatError):
        load_checkpoint(loader, folder)


# -- ranks over gloo -----------------------------------------------------------------------


def _job_save(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    """Each rank reads 2 batches, saves into a directory, reads the rest of two epochs."""
    with _loader(rank, world_size, num_workers=1) as loader:
        head = _ids(loader, 2)
        save_checkpoint(loader, tmp / f"ckpt-{world_size}")
        rest, after = _ids(loader), _ids(loader)
    return {"head": head, "rest": rest, "next": after}


def _job_restore(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    """Restores the directory the 2-rank job wrote, onto ``world_size`` ranks."""
    opened: list[str] = []
    real = module.load_state

    def tracked(url: Any, **kwargs: Any) -> Any:
        opened.append(os.path.basename(os.fspath(url)))
        return real(url, **kwargs)

    module.load_state = tracked  # type: ignore[assignment]
    with _loader(rank, world_size, num_workers=1) as loader:
        load_checkpoint(loader, tmp / "ckpt-2")
        rest, after = _ids(loader), _ids(loader)
    return {"rest": rest, "next": after, "opened": opened}


def _job_metadata_fails(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    """Every rank saves; rank 0's write of the metadata fails."""
    real = storage.write_bytes

    def failing(url: Any, data: bytes, **kwargs: Any) -> None:
        if os.fspath(url).endswith(module.METADATA):
            raise StorageError(f"Cannot write {url}: the disk is full.")
        real(url, data, **kwargs)

    if rank == 0:
        storage.write_bytes = failing
    with _loader(rank, world_size) as loader:
        _ids(loader, 1)
        name, message, _ = outcome(lambda: save_checkpoint(loader, tmp / "ckpt-failed"))
    return {"error": name, "message": message}


_JOBS = {"save": _job_save, "restore": _job_restore, "metadata_fails": _job_metadata_fails}


def _launch(job: str, world_size: int, tmp: Path) -> list[dict[str, Any]]:
    reports = run_ranks(_JOBS[job], world_size, tmp, timeout=120)
    return in_rank_order(reports, world_size, job)


@pytest.mark.slow
def test_ranks_write_their_own_files_and_restore_on_the_same_or_another_layout(
    tmp_path: Path,
) -> None:
    saved = _launch("save", 2, tmp_path)
    folder = tmp_path / "ckpt-2"
    saves = [p for p in folder.iterdir() if p.is_dir()]
    assert len(saves) == 1
    assert sorted(p.name for p in saves[0].iterdir()) == ["rank-0.msgpack", "rank-1.msgpack"]
    same = _launch("restore", 2, tmp_path)
    for key in ("rest", "next"):
        assert [report[key] for report in same] == [report[key] for report in saved]
    assert [report["opened"] for report in same] == [["rank-0.msgpack"], ["rank-1.msgpack"]]
    wider = _launch("restore", 3, tmp_path)
    assert wider[0]["opened"] == ["rank-0.msgpack", "rank-1.msgpack"]  # read once, on rank 0
    assert wider[1]["opened"] == wider[2]["opened"] == []
    # The rest of the interrupted epoch moves to 3 ranks: as many batches on each, and
    # exactly the items the 2 ranks had left (18 positions of their padded epoch of 30,
    # which 3 ranks share without padding more), none lost, none repeated.
    firsts = [len(report["rest"]) for report in wider]
    assert len(set(firsts)) == 1

    def items(reports: list[dict[str, Any]], key: str) -> Counter[int]:
        return Counter(item for report in reports for batch in report[key] for item in batch)

    assert items(wider, "rest") == items(saved, "rest")
    assert set(items(saved, "head") + items(wider, "rest")) == set(range(N))
    # The next epoch is a fresh 3-rank run's.
    for rank, report in enumerate(wider):
        with _loader(rank, 3, num_workers=1) as fresh:
            _ids(fresh)
            assert report["next"] == _ids(fresh), f"rank {rank}: the next epoch differs"


@pytest.mark.slow
def test_every_rank_raises_when_the_metadata_write_fails(tmp_path: Path) -> None:
    reports = _launch("metadata_fails", 2, tmp_path)
    assert [report["error"] for report in reports] == ["StorageError", "StorageError"]
    assert "the disk is full" in reports[1]["message"]
    assert not (tmp_path / "ckpt-failed" / "metadata.msgpack").exists()
