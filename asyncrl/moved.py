"""Public import paths that moved: the old path still imports — as the new module itself,
so a class is the same object under either name — with a ``DeprecationWarning`` naming the
new path. A moved name keeps working until a release says it is gone (docs/usage.md,
"Moved import paths")."""

from __future__ import annotations

import sys
import warnings
from types import ModuleType


def warn(old: str, new: str) -> None:
    """Say, once, at the line that imported the shim module ``old``, where its names went."""
    warnings.warn(f"{old} moved to {new}: import it from there ({old} is a deprecated alias)",
                  DeprecationWarning, stacklevel=4)  # past warn, its caller and the shim (import machinery is skipped)


def alias(old: str, new: ModuleType, *submodules: ModuleType) -> None:
    """Make the module being imported as ``old`` be ``new``, and ``old.<name>`` each of
    ``submodules`` (modules of ``new``'s package that were importable under ``old``), so
    ``import old.sub`` finds them rather than loading a second copy. Call it from the shim
    module ``old``, at import: it warns once, at the line that imported ``old``."""
    warn(old, new.__name__)
    for sub in submodules:
        sys.modules[f"{old}.{sub.__name__.rpartition('.')[2]}"] = sub
    sys.modules[old] = new
