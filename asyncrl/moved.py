"""Public import paths that moved: the old path still imports — as the new module itself,
so a class is the same object under either name — with a ``DeprecationWarning`` naming the
new path. A moved name keeps working until a release says it is gone (docs/usage.md,
"Moved import paths").

Two ways, by where the old path is. A shim file at the old path (``asyncrl/client.py``)
imports the new module and calls :func:`alias`; it stands on the floor of what it aliases.
Where a file at the old path would make its folder import one that imports it back
(``asyncrl/tasks/verifiers_env.py`` aliasing ``rollout/workflows/``, which imports
``tasks/``), the old path is a row of :data:`MOVED_MODULES` instead: no file, and an import
finder (:func:`install`, run by ``asyncrl/__init__.py``) builds the module from the row when
something imports it, and only then. The package itself never imports an old path."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

MOVED_MODULES: dict[str, dict[str, tuple[str, ...]]] = {
    # workflow.agent: asyncrl.tasks.verifiers_env:run was taught; the module split in two, on two floors
    "asyncrl.tasks.verifiers_env": {
        "asyncrl.rollout.workflows.verifiers_agent": ("TasksetTools", "converse", "run"),
        "asyncrl.tasks.verifiers_tasks": ("DEFAULT_MAX_TURNS", "INSTALL_HINT", "load_verifiers_splits",
                                          "prompt_messages", "score_conversation", "score_reply", "verifiers_tasks"),
    },
}
"""old module path -> {new module: the names it had that now live there}."""


def warn(old: str, new: str, stacklevel: int = 4) -> None:
    """Say, once, at the line that imported the old module ``old``, where its names went.
    ``stacklevel``: 4 past this function, its caller and the shim file (the import
    machinery's frames are skipped); 3 from :class:`MovedModules`, which has no file."""
    warnings.warn(f"{old} moved to {new}: import it from there ({old} is a deprecated alias)",
                  DeprecationWarning, stacklevel=stacklevel)


def alias(old: str, new: ModuleType, *submodules: ModuleType) -> None:
    """Make the module being imported as ``old`` be ``new``, and ``old.<name>`` each of
    ``submodules`` (modules of ``new``'s package that were importable under ``old``), so
    ``import old.sub`` finds them rather than loading a second copy. Call it from the shim
    module ``old``, at import: it warns once, at the line that imported ``old``."""
    warn(old, new.__name__)
    for sub in submodules:
        sys.modules[f"{old}.{sub.__name__.rpartition('.')[2]}"] = sub
    sys.modules[old] = new


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The import finder of :data:`MOVED_MODULES`: after every other finder (a file wins), an
    old path of the table becomes a module holding its names, imported from their new
    modules at that moment, with one warning naming them."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED_MODULES else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        moved = MOVED_MODULES[module.__name__]
        for new, names in moved.items():
            source = importlib.import_module(new)
            module.__dict__.update({name: getattr(source, name) for name in names})
        module.__all__ = sorted(name for names in moved.values() for name in names)
        warn(module.__name__, " and ".join(moved), stacklevel=3)


def install() -> None:
    """Put :class:`MovedModules` last on ``sys.meta_path``, once."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
