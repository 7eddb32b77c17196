"""A pipeline defined in a script restores when the script is imported, and vice versa.

NOTE [ Names from a script ] in ``savable_loader/state/names.py``: ``__main__.jitter`` of
``python train.py`` and ``train.jitter`` of ``import train`` are one name. Each test runs
real processes: ``train.py`` (written into ``tmp_path``) run as a script, as a module
(``python -m train``) or imported from another process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from savable_loader.state.names import QualName, name_changes, named, qualified_name

TRAIN = textwrap.dedent(
    """
    import json
    import os
    import sys

    import torch

    from savable_loader import SavableDataLoader, load_state, save_state
    from savable_loader.datasets import IndexedDataset


    class Squares:
        def __len__(self):
            return 23

        def __getitem__(self, index):
            return index * index


    def jitter(item, rng):
        return [item, int(rng.integers(1000))]


    def jitter_v2(item, rng):
        return [item, int(rng.integers(1000)) + 1]


    def collate(batch):
        return torch.tensor(batch).tolist()


    def build():
        fn = jitter_v2 if os.environ.get("TRAIN_CHANGED") else jitter
        return SavableDataLoader(
            IndexedDataset(Squares(), shuffle=True, seed=3).map(fn, seed=5),
            batch_size=3,
            num_workers=2,
            collate_fn=collate,
            seed=1,
        )


    def reference():
        with build() as loader:
            return [batch for _ in range(2) for batch in loader]


    def save(path, steps):
        with build() as loader:
            stream = iter(loader)
            for _ in range(steps):
                next(stream)
            save_state(loader.save_state_rank(), path)


    def resume(path):
        with build() as loader:
            try:
                loader.restore_state_rank(load_state(path))
            except Exception as error:
                return {"error": type(error).__name__, "message": str(error)}
            return [batch for _ in range(2) for batch in loader]


    if __name__ == "__main__":
        mode, path = sys.argv[1], sys.argv[2]
        if mode == "save":
            save(path, int(sys.argv[3]))
        else:
            print(json.dumps({"reference": reference, "resume": resume}[mode](*sys.argv[2:])))
    """
)

STEPS = 5  # batches taken before the save, in epoch 0 (8 batches an epoch)


def _run(tmp_path: Path, how: str, *arguments: str, changed: bool = False) -> Any:
    """Runs ``train`` in a new process: as a script, as a module, or imported."""
    if how == "script":
        command = [sys.executable, "train.py", *arguments]
    elif how == "module":
        command = [sys.executable, "-m", "train", *arguments]
    else:
        mode, *rest = arguments
        call = (
            "train.save(sys.argv[1], int(sys.argv[2]))"
            if mode == "save"
            else (f"print(json.dumps(train.{mode}(*sys.argv[1:])))")
        )
        command = [sys.executable, "-c", f"import json, sys, train; {call}", *rest]
    env = {**os.environ, "TRAIN_CHANGED": "1" if changed else ""}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout) if done.stdout.strip() else None


@pytest.fixture
def train(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(TRAIN)
    return tmp_path


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """The uninterrupted stream of ``train`` imported, run once for the module's tests:
    it does not depend on how the save or the restore ran."""
    folder = tmp_path_factory.mktemp("reference")
    (folder / "train.py").write_text(TRAIN)
    stream = _run(folder, "import", "reference")
    assert len(stream) == 16
    return stream


@pytest.mark.parametrize(
    ("saver", "restorer"),
    [("script", "import"), ("import", "script"), ("module", "import"), ("script", "module")],
)
def test_a_state_saved_by_the_script_restores_where_it_is_imported(
    train, reference, saver, restorer
):
    state = str(train / "state.msgpack")
    _run(train, saver, "save", state, str(STEPS))
    resumed = _run(train, restorer, "resume", state)
    assert resumed == reference[STEPS:]


def test_a_changed_function_is_named_with_both_names_and_the_fix(train):
    state = str(train / "state.msgpack")
    _run(train, "script", "save", state, str(STEPS))
    refused = _run(train, "import", "resume", state, changed=True)
    assert refused["error"] == "StateMismatchError"
    message = refused["message"]
    assert (
        "dataset.fn of Map was train.jitter when the state was saved and is train.jitter_v2 now"
    ) in message
    assert "collate" not in message  # only the callable that differs
    assert "Build the pipeline with the same functions and classes" in message


def test_a_state_of_an_earlier_version_saved_from_the_script_still_restores(train, reference):
    """Before the rule, a state from ``python train.py`` hashed ``__main__.jitter``."""
    legacy = textwrap.dedent(
        """
        from savable_loader.state.fingerprint import fingerprint

        with build() as loader:
            stream = iter(loader)
            for _ in range(5):
                next(stream)
            state = loader.save_state_rank()
            tree = loader.layout._tree(loader.layout.num_workers)
            old = fingerprint(tree, raw_names=True)
        assert "legacy.jitter" in str(tree) and old != state.fingerprint
        state = state.model_copy(update={"fingerprint": old, "callables": None})
        with build() as loader:
            loader.restore_state_rank(state)
            print(json.dumps([batch for _ in range(2) for batch in loader]))
        """
    )
    (train / "legacy.py").write_text(
        TRAIN.replace('if __name__ == "__main__":', "if False:") + legacy
    )
    done = subprocess.run(
        [sys.executable, "legacy.py"], cwd=train, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout) == reference[STEPS:]


def test_names_outside_a_script_keep_their_module():
    name = qualified_name(json.dumps)
    assert (str(name), name.raw) == ("json.dumps", "json.dumps")
    assert isinstance(name, QualName)


def test_a_name_in_main_takes_the_script_module_name(monkeypatch):
    def fn() -> None: ...

    monkeypatch.setattr(fn, "__module__", "__main__")
    main = type(sys)("__main__")
    main.__file__ = "/somewhere/train.py"
    monkeypatch.setitem(sys.modules, "__main__", main)
    name = qualified_name(fn)
    assert (str(name), name.raw) == (
        f"train.{fn.__qualname__}",
        f"__main__.{fn.__qualname__}",
    )
    del main.__file__
    assert str(qualified_name(fn)) == name.raw  # an interactive session keeps __main__


def test_name_changes_reports_only_same_shaped_pipelines():
    tree = {"type": "Map", "fn": QualName("a.f", "a.f"), "source": {"type": QualName("a.D", "a.D")}}
    assert named(tree, "dataset") == {"dataset.fn of Map": "a.f", "dataset.source.type": "a.D"}
    assert name_changes(None, {"x": "a.f"}) is None
    assert name_changes({"x": "a.f"}, {"x": "a.f"}) is None
    assert name_changes({"x": "a.f"}, {"y": "a.f"}) is None
    assert "x was a.f when the state was saved and is a.g now" in str(
        name_changes({"x": "a.f"}, {"x": "a.g"})
    )


def test_names_survive_pickling_into_spawned_workers():
    import pickle

    from savable_loader.state.names import qualified_name

    name = qualified_name(test_names_outside_a_script_keep_their_module)
    copy = pickle.loads(pickle.dumps(name))
    assert (copy, copy.raw, type(copy)) == (name, name.raw, type(name))
