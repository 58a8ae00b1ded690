"""User code that a config names as ``module:attribute`` — reward functions, workflow
classes, advantage estimators, losses, hooks — is loaded here and nowhere else, so every
such name fails the same way: before any work, naming the config key and what is wrong."""

from __future__ import annotations

import importlib
from typing import Any


def load_named(spec: str, *, key: str, callable_: bool = True) -> Any:
    """Import ``package.module:attr`` (``attr`` may be dotted: ``mod:Class.method``).

    ``key`` is the config key the name came from; every error starts with it, because
    that is what the user must edit. Raises ``ValueError``.
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path or ":" in attr_path:
        raise ValueError(f"{key} {spec!r} must look like 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{key} {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{key} {spec!r}: {module_name!r} has no attribute {attr_path!r}") from None
    if callable_ and not callable(obj):
        raise ValueError(f"{key} {spec!r}: {attr_path!r} is not callable ({type(obj).__name__})")
    return obj
