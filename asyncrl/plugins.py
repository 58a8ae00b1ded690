"""User code that a config names as ``module:attribute`` — reward functions, workflow
classes, advantage estimators, losses, hooks — is loaded here and nowhere else, so every
such name fails the same way: before any work, naming the config key and what is wrong.

The module may also be a Python file, ``path/to/file.py:attribute`` (relative to the
working directory, like ``task.path``), so that a reward module beside a data file works
from ``asyncrl train`` without installing it or setting ``PYTHONPATH``: the console
script's ``sys.path`` does not hold the working directory, so ``examples.jsonl.reward``
would not import there.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def load_named(spec: str, *, key: str, callable_: bool = True) -> Any:
    """Import ``package.module:attr`` or ``path/to/file.py:attr`` (``attr`` may be
    dotted: ``mod:Class.method``).

    ``key`` is the config key the name came from; every error starts with it, because
    that is what the user must edit. Raises ``ValueError``.
    """
    target, sep, attr_path = spec.rpartition(":")
    is_file = target.endswith(".py")
    # one colon only, except inside a file path (a Windows drive letter)
    if not sep or not target or not attr_path or (":" in target and not is_file):
        raise ValueError(f"{key} {spec!r} must look like 'package.module:function' or 'path/to/file.py:function'")
    obj: Any = _import_file(target, spec, key) if is_file else _import_module(target, spec, key)
    parts = attr_path.split(".")
    for i, part in enumerate(parts):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{key} {spec!r}: {target!r} has no attribute {attr_path!r}"
                             + _did_you_mean(obj, part, f"{target}:" + "".join(f"{p}." for p in parts[:i]),
                                             callable_)) from None
    if callable_ and not callable(obj):
        raise ValueError(f"{key} {spec!r}: {attr_path!r} is not callable ({type(obj).__name__})")
    return obj


def check_call(obj: Any, spec: str, *, key: str, args: tuple[str, ...]) -> None:
    """Refuse, before any work, a named callable that cannot take the positional ``args`` (their
    names, as the docs call them) the run will pass; a class is checked through its ``run``
    method, as an agent class is called (``Class().run(...)``). ``ValueError`` naming ``key``,
    ``spec`` and the signature. A callable without an introspectable signature passes."""
    fn, shown_name = obj, getattr(obj, "__qualname__", repr(obj))
    if inspect.isclass(obj):
        fn, shown_name = getattr(obj, "run", None), f"{shown_name}.run"
        if not callable(fn):
            raise ValueError(f"{key} {spec!r}: class {obj.__qualname__} has no run({', '.join(args)}) method")
        args = ("self", *args)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*(object() for _ in args))
    except TypeError as exc:
        raise ValueError(f"{key} {spec!r}: {shown_name}{signature} cannot be called as "
                         f"({', '.join(a for a in args if a != 'self')}): {exc}") from None


MAX_LISTED = 10
"""Names listed when none is close to the missing one."""


def _did_you_mean(owner: Any, missing: str, prefix: str, callables: bool) -> str:
    """The public names of ``owner`` (a module or class) closest to the ``missing`` one,
    as whole names to paste (``prefix`` + name); else the ones it defines, so a typo is
    one edit away. Only callables where the name is to be called (``callables``)."""
    names = [n for n in dir(owner) if not n.startswith("_") and (not callables or callable(getattr(owner, n, None)))]
    close = difflib.get_close_matches(missing, names, n=3, cutoff=0.6)
    if close:
        return "; did you mean " + " or ".join(repr(prefix + n) for n in close) + "?"
    own = getattr(owner, "__name__", None)
    defined = [n for n in names if getattr(getattr(owner, n), "__module__", own) == own] or names
    if not defined:
        return "; it has no public " + ("callable" if callables else "name")
    shown = ", ".join(sorted(defined)[:MAX_LISTED])
    more = f" and {len(defined) - MAX_LISTED} more" if len(defined) > MAX_LISTED else ""
    return f"; its public {'callables' if callables else 'names'}: {shown}{more}"


def _import_module(module_name: str, spec: str, key: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{key} {spec!r}: cannot import module {module_name!r}: {exc}") from exc


def _import_file(path: str, spec: str, key: str) -> ModuleType:
    """Execute the file once per process as its own module, registered in ``sys.modules``
    under a name derived from its absolute path: naming it twice (pre-flight, then each
    worker; or as both ``task.reward_fn`` and inside a workflow) yields the same objects,
    and pickling, dataclasses and ``typing.get_type_hints`` find the module. The file's
    directory is not put on ``sys.path``: it imports installed packages, not its
    neighbours (make a package and use ``module:function`` for that)."""
    file = Path(path).resolve()
    if not file.is_file():
        raise ValueError(f"{key} {spec!r}: file not found: {file}")
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:10]
    name = f"asyncrl_user_{_identifier(file.stem)}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{key} {spec!r}: cannot load {file} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except ImportError as exc:
        del sys.modules[name]
        raise ValueError(f"{key} {spec!r}: cannot import file {str(file)!r}: {exc}") from exc
    except BaseException:
        del sys.modules[name]  # a half-run module must not be reused; its own error propagates
        raise
    return module


def _identifier(stem: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in stem)
