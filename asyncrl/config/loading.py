"""YAML and dotted overrides in, a validated ``Config`` out; a run's settings and their changes."""

from __future__ import annotations

import typing

import json
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from asyncrl.config.base import ConfigError
from asyncrl.config.hints import _explain
from asyncrl.config.root import Config
from asyncrl.config.schedule import flatten_schedule_keys
from asyncrl.jsonl import read_jsonl


def all_keys(model: type[BaseModel], prefix: str = "", *, within_optional: bool = False) -> list[str]:
    """Every key of ``model``, dotted; a ``flat`` section's keys without its name (``mode``).
    An optional section (``model.lora``, ``critic``: ``null`` = off) is one key, its value
    the section or null; ``within_optional``: its keys too (``critic.value_clip``), as the
    reference page documents them and a misspelt one is matched."""
    keys = []
    for name, field in model.model_fields.items():
        sub = field.annotation
        optional = [a for a in typing.get_args(sub) if isinstance(a, type) and issubclass(a, BaseModel)]
        if optional and within_optional:
            keys += [prefix + name, *all_keys(optional[0], f"{prefix}{name}.", within_optional=True)]
        elif isinstance(sub, type) and issubclass(sub, BaseModel):
            keys += all_keys(sub, prefix if getattr(sub, "flat", False) else f"{prefix}{name}.",
                             within_optional=within_optional)
        else:
            keys.append(prefix + name)
    return keys


M = TypeVar("M", bound=BaseModel)


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``3e-4`` (no dot) as a string; every learning rate someone types
    looks like that, so floats follow YAML 1.2 here."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"),
    list("-+0123456789."))


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def validate(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, all_keys(model, within_optional=True))) from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted ``key=value`` overrides (values parse as YAML) to a nested dict."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        _set_dotted(data, key.strip(), _load_yaml(raw) if raw.strip() else None)
    return data


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML config file's mapping of keys; ``ConfigError`` naming the file otherwise
    (``train``'s and ``sft``'s configs are read the same way)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = _load_yaml(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of keys, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    data = read_config_file(path) if path is not None else {}
    try:  # the file's `schedule:` keys as the top-level ones they are, so `mode=…` overrides either spelling
        data = flatten_schedule_keys(data)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return validate(Config, apply_overrides(data, [o.strip().removeprefix("schedule.") for o in overrides]))


CONFIG_FILE = "config.yaml"
"""A train run's settings as it started, in its ``output_dir``: written once, never rewritten."""


CONFIG_CHANGES_FILE = "config_changes.jsonl"
"""Beside it, one line per resume that changed settings: ``resumed_from_step``, ``time`` and
``changed`` (each dotted key with its ``old`` and ``new`` value)."""


NOT_SETTINGS = frozenset({"resume"})
"""Keys that say how a run was started, not how it trains: never a changed setting."""


def save_config(config: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))


def settings(data: dict[str, Any]) -> dict[str, Any]:
    """Each config key's value in ``data`` (a config as nested dicts), by dotted key. A key
    whose value is a mapping of its own (``workflow.options``) stays whole; one ``data``
    lacks is left out."""
    found, plain = {}, json.loads(json.dumps(data, default=str))  # as config_changes.jsonl holds values
    for key in all_keys(Config):
        node: Any = plain
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            found[key] = node
    return found


def run_settings(output_dir: str | Path) -> dict[str, Any] | None:
    """The settings the run in ``output_dir`` last trained with, by dotted key: its
    ``config.yaml`` with each change recorded in ``config_changes.jsonl`` applied in order
    (None without a ``config.yaml``). Keys added to the schema since take their defaults."""
    path = Path(output_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        data = _load_yaml(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} holds the run's settings but is not valid YAML ({exc}); mend it, or remove it "
                          "to record this command's settings in its place") from None
    data = data if isinstance(data, dict) else {}
    try:
        data = validate(Config, data).model_dump()
    except ConfigError:  # written under an older schema: its keys as written
        pass
    found = settings(data)
    changes = Path(output_dir) / CONFIG_CHANGES_FILE
    for row in read_jsonl(changes) if changes.is_file() else []:
        found.update({key: change["new"] for key, change in row["changed"].items()})
    return found


def changed_settings(before: dict[str, Any], config: Config) -> dict[str, tuple[Any, Any]]:
    """Each setting of ``config`` that differs from ``before`` (:func:`run_settings`), as
    ``key: (old, new)``. ``resume`` is not a setting, and ``output_dir`` has changed only
    when it names another directory (not the same one spelled another way)."""
    changed = {}
    for key, new in settings(config.model_dump()).items():
        if key in NOT_SETTINGS or key not in before or before[key] == new:
            continue
        if key == "output_dir" and Path(before[key]).resolve() == Path(new).resolve():
            continue
        changed[key] = (before[key], new)
    return changed


def record_config_changes(output_dir: str | Path, step: int, changed: Mapping[str, tuple[Any, Any]]) -> Path:
    """Append a resume's changed settings to ``config_changes.jsonl``; returns its path."""
    path = Path(output_dir) / CONFIG_CHANGES_FILE
    row = {"resumed_from_step": step, "time": datetime.now(UTC).isoformat(timespec="seconds"),
           "changed": {key: {"old": old, "new": new} for key, (old, new) in changed.items()}}
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    return path


def describe_changes(changed: Mapping[str, tuple[Any, Any]]) -> list[str]:
    """``key old → new``, one a setting."""
    def shown(value: Any) -> str:
        return value if isinstance(value, str) and value.strip() == value and value else json.dumps(value)

    return [f"{key} {shown(old)} → {shown(new)}" for key, (old, new) in changed.items()]


SHORTHANDS = {"weight_sync": "method", "task.sampler": "name"}
"""A section set to a plain value sets this key of it: ``weight_sync=collective``,
``task.sampler=adaptive``."""


SWITCHES = frozenset({"model.lora", "critic", "critic.lora"})
"""Optional sections (``null`` = off) that ``true`` turns on: ``model.lora=true`` keeps any
of its keys already set (or takes every default), ``false`` turns it off, and setting one
of its keys (``model.lora.alpha=8``) turns it on, whichever order the overrides come in."""


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    if key in SHORTHANDS and not isinstance(value, dict):  # keeps the section's other keys
        key = f"{key}.{SHORTHANDS[key]}"
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        section = ".".join(parts[: i + 1])
        if section in SHORTHANDS and isinstance(node.get(part), str):  # the file said `weight_sync: collective`
            node[part] = {SHORTHANDS[section]: node[part]}
        if section in SWITCHES and not isinstance(node.get(part), dict):  # `lora: true` or `null`, then a key of it
            node[part] = {}
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {key!r}: {'.'.join(parts[: i + 1])!r} is not a section")
    if key in SWITCHES and isinstance(value, bool):  # `model.lora=true` keeps the keys already set
        value = (node[parts[-1]] if isinstance(node.get(parts[-1]), dict) else {}) if value else None
    node[parts[-1]] = value
