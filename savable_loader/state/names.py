"""How a pipeline's ``config()`` names the functions and classes it is built from.

NOTE [ Names from a script ]
A stage's ``config()`` names its callables (a ``Map`` function, a ``Filter`` predicate,
the ``collate_fn``, a dataset's class) as ``module.qualname``, and those names feed the
pipeline fingerprint. A function defined in the script ``python train.py`` runs lives in
the module ``__main__``, while the same function is ``train.fn`` once another process
imports ``train``: one pipeline, two names. So a name in ``__main__`` (or
``__mp_main__``, the script's module in a spawned worker) is written with the module
name the script has when imported: ``__main__.__spec__.name`` under ``python -m``, else
the stem of ``__main__.__file__`` (``train`` for ``train.py``). ``__main__`` stays when
there is no script (an interactive session). Only the module part of ``__main__`` names
changes; every other name, and so every other fingerprint, is as before.

:class:`QualName` is a ``str`` (the fingerprint hashes it as one) that remembers the name
as written before this rule (``raw``), so a state saved from a script by an earlier
version still matches (``Layout.matches`` in ``_resume/layout.py``). Being a type of its own, it
also marks a name in the config tree, so a state can carry its pipeline's names
(``named``) and a refused restore can say which one differs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = ["QualName", "name_changes", "named", "qualified_name", "script_module"]

_SCRIPT_MODULES = ("__main__", "__mp_main__")


class QualName(str):
    """A ``module.qualname`` in a config tree; ``raw`` is the name with the module as
    the object reports it (``__main__`` for a script's)."""

    __slots__ = ("raw",)

    raw: str

    def __new__(cls, name: str, raw: str) -> QualName:
        self = super().__new__(cls, name)
        self.raw = raw
        return self

    def __reduce__(self) -> tuple[type[QualName], tuple[str, str]]:
        # Stages keep names; under spawn and forkserver they are pickled into the workers.
        return (QualName, (str(self), self.raw))


def qualified_name(obj: object, *, unnamed: str | None = None) -> QualName:
    """The name of a function or class for ``config()`` (NOTE [ Names from a script ]).

    Args:
        obj: A function, class or callable object.
        unnamed: The qualname to write when ``obj`` has none (a ``functools.partial``);
            by default the qualname of its type.
    """
    module = getattr(obj, "__module__", None) or "?"
    name = getattr(obj, "__qualname__", None)
    if not isinstance(name, str) or not name:
        name = type(obj).__qualname__ if unnamed is None else unnamed
    return QualName(f"{script_module(module)}.{name}", f"{module}.{name}")


def script_module(module: str) -> str:
    """``module``, or for the script's own module the name it has when imported."""
    if module not in _SCRIPT_MODULES:
        return module
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    spec_name = getattr(spec, "name", None)
    if isinstance(spec_name, str) and spec_name and spec_name not in _SCRIPT_MODULES:
        return spec_name
    path = getattr(main, "__file__", None)
    if isinstance(path, str) and path:
        return Path(path).stem
    return module


def named(tree: Any, path: str = "") -> dict[str, str]:
    """Every :class:`QualName` in a config tree, by where it stands: ``path`` or, for a
    name inside a stage's config, ``path of <stage type>``."""
    found: dict[str, str] = {}
    if isinstance(tree, dict):
        kind = tree.get("type")
        stage = f" of {kind}" if isinstance(kind, str) and not isinstance(kind, QualName) else ""
        for key, value in tree.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(value, QualName):
                found[where + stage] = str(value)
            else:
                found.update(named(value, where))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            found.update(named(value, f"{path}[{index}]"))
    return found


def name_changes(saved: dict[str, str] | None, current: dict[str, str]) -> str | None:
    """Which function or class differs between the names a state was saved with and the
    pipeline's now, as a sentence with the fix.

    Returns None when the state carries no names, when they agree, or when the pipelines
    differ in shape (stages added or removed): then the fingerprint says it all.
    """
    if saved is None or saved.keys() != current.keys():
        return None
    changes = [
        f"{where} was {saved[where]} when the state was saved and is {current[where]} now"
        for where in sorted(saved)
        if saved[where] != current[where]
    ]
    if not changes:
        return None
    return (
        "the pipeline fingerprint differs because the pipeline names another function or "
        f"class: {'; '.join(changes)}. Build the "
        "pipeline with the same functions and classes (a script's own are matched by the "
        "script's module name: __main__.fn of python train.py is train.fn), or, if the "
        "change is meant and the stream may differ, start without this state"
    )
