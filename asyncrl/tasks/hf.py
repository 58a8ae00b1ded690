"""Tasks from a local dataset read through the ``datasets`` library (``task.name: hf``):
the data a TRL or verl user already has, used as it is.

Why a task of its own rather than a grown ``jsonl``: ``jsonl`` is asyncrl's own format,
read by asyncrl's own reader with file:line errors and no dependency; this one needs the
optional ``datasets`` package (``pip install 'asyncrl[data]'``) and speaks the other
frameworks' schemas and split names. Both make the same :class:`Task`.

What is read (local paths only: nothing is downloaded from a hub, so a run never depends
on a network or on a dataset changing under it): a directory written by
``save_to_disk`` (a ``Dataset`` or a ``DatasetDict``), or one ``.parquet``, ``.arrow``,
``.jsonl``/``.json`` file (a single split, ``train``).

The schemas, one row → one :class:`Task`:

- the prompt is the ``prompt`` column (``task.options.prompt_key``, verl's
  ``data.prompt_key``): text (the user's message) or a list of chat messages
  (``{"role", "content"}``), which go through the chat template as they are;
- every other column reaches the reward: as ``task.data`` for an asyncrl reward, as
  keyword arguments for a TRL one (its dataset's extra columns), and verl's
  ``data_source``, ``reward_model.ground_truth`` and ``extra_info`` as
  ``compute_score``'s arguments (``asyncrl/tasks/reward_forms.py``);
- the task id is the ``id`` column when there is one, else ``{file stem}-{split}-{row}``.

A row that does not fit stops the run before any work (exit 2) with the file, the row
(0-based, as ``dataset[row]`` reads it), the column and what was expected, and how many
other rows fail the same way: no row is skipped or repaired silently.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.tasks.base import Task, TaskDataError, TaskSplits

FILE_KINDS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json"}
OPTIONS = ("prompt_key",)
# `train`, `test[:64]`, `train[-10%:]`: a split name and an optional slice, as datasets writes them
_SPLIT = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)(?:\[(?P<start>-?\d+%?)?:(?P<stop>-?\d+%?)?\])?$")
_SHOWN_ROWS = 3


@dataclass(frozen=True)
class SplitSpec:
    """A split name and the rows ``[start:stop]`` of it (Python slice bounds, ``None`` open)."""

    name: str
    start: str | None = None
    stop: str | None = None

    @classmethod
    def parse(cls, text: str, key: str) -> SplitSpec:
        match = _SPLIT.match(text.strip())
        if match is None:
            raise TaskDataError(f"{key} {text!r}: expected a split name with an optional slice, e.g. 'test', "
                                "'train[:1000]', 'train[-64:]' or 'train[-10%:]'")
        return cls(match["name"], match["start"], match["stop"])

    def rows(self, length: int) -> range:
        def bound(text: str | None) -> int | None:
            if text is None:
                return None
            return round(length * int(text[:-1]) / 100) if text.endswith("%") else int(text)
        return range(length)[slice(bound(self.start), bound(self.stop))]


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise TaskDataError("task 'hf' reads datasets through the `datasets` package, which is not installed: "
                            "pip install 'asyncrl[data]' (or pip install datasets)") from None
    datasets.disable_progress_bars()
    return datasets


def _read(path: str | Path, key: str) -> dict[str, Any]:
    """``{split name: Dataset}`` of a local path."""
    file = Path(path).expanduser()
    if not file.exists():
        hub = re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)) is not None
        hint = (f"; asyncrl reads local datasets only and downloads nothing: save it first, e.g. "
                f"datasets.load_dataset({str(path)!r}).save_to_disk('data/my_set'), and set {key} to that directory"
                if hub else "")
        raise TaskDataError(f"{key} {str(path)!r}: no such file or directory{hint}")
    datasets = _datasets()
    try:
        if file.is_dir():
            loaded = datasets.load_from_disk(str(file), keep_in_memory=True)
            return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
        kind = FILE_KINDS.get(file.suffix.lower())
        if kind is None:
            raise TaskDataError(f"{key} {str(path)!r}: expected a save_to_disk directory or a "
                                f"{', '.join(FILE_KINDS)} file")
        if kind == "arrow":
            return {"train": datasets.Dataset.from_file(str(file), in_memory=True)}
        # The builders behind from_parquet/from_json write an Arrow cache; kept in memory and
        # in a directory of our own, a run leaves nothing behind in ~/.cache.
        with tempfile.TemporaryDirectory(prefix="asyncrl-hf-") as cache:
            reader = datasets.Dataset.from_parquet if kind == "parquet" else datasets.Dataset.from_json
            return {"train": reader(str(file), keep_in_memory=True, cache_dir=cache)}
    except TaskDataError:
        raise
    except Exception as exc:  # noqa: BLE001 (a corrupt file, a JSON line that does not parse, mixed types)
        raise TaskDataError(f"{key} {str(path)!r}: datasets could not read it: {type(exc).__name__}: {exc}") from None


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _is_message(value: Any) -> bool:
    return isinstance(value, Mapping) and isinstance(value.get("role"), str) and isinstance(value.get("content"), str)


def _prompt_problem(value: Any) -> str | None:
    """Why ``value`` is no prompt, or ``None`` when it is one."""
    if isinstance(value, str):
        return None if value else "an empty string"
    if isinstance(value, Sequence) and value and all(_is_message(m) for m in value):
        return None
    return f"{type(value).__name__} {_shown(value)}"


def _row_problems(row: Mapping[str, Any], prompt_key: str) -> list[tuple[str, str]]:
    """``(column, what was expected and what was found)`` for each way ``row`` does not fit."""
    problems = []
    found = _prompt_problem(row[prompt_key])
    if found is not None:
        expected = f"text or a non-empty list of chat messages ({{'role': str, 'content': str}}), found {found}"
        problems.append((prompt_key, expected))
    truth = row.get("reward_model")  # a struct column: a row without the key holds None there
    if "reward_model" in row and not (isinstance(truth, Mapping) and truth.get("ground_truth") is not None):
        problems.append(("reward_model", f"verl's {{'ground_truth': ...}}, found {_shown(truth)}"))
    task_id = row.get("id", "")
    if isinstance(task_id, bool) or not isinstance(task_id, (str, int)):
        problems.append(("id", f"a string or an integer, found {task_id!r}"))
    return problems


def _tasks(dataset: Any, rows: Sequence[int], source: tuple[str | Path, str], prompt_key: str) -> list[Task]:
    """The tasks of ``rows``; ``source``: (path, split name), for the errors and default ids
    (``{file stem}-{split}-{row}``, distinct between a train and a validation file)."""
    where, stem = f"{source[0]} (split {source[1]!r})", f"{Path(source[0]).stem}-{source[1]}"
    if prompt_key not in dataset.column_names:
        raise TaskDataError(f"{where}: no column {prompt_key!r} (the prompt); its columns: "
                            f"{', '.join(dataset.column_names)}. Name the prompt's column as task.options.prompt_key")
    tasks, bad = [], {}
    rows = list(rows)  # one columnar read of the rows taken, not a Python call per row
    for row_no, row in zip(rows, dataset.select(rows).to_list() if rows else []):
        problems = _row_problems(row, prompt_key)
        for column, expected in problems:
            bad.setdefault(column, []).append((row_no, expected))
        if problems:
            continue
        prompt = row.pop(prompt_key)
        messages = None if isinstance(prompt, str) else [dict(m) for m in prompt]
        text = prompt if messages is None else "\n".join(m["content"] for m in messages)
        task_id = str(row["id"]) if "id" in row else f"{stem}-{row_no}"
        tasks.append(Task(id=task_id, prompt=text, data=row, messages=messages))
    if bad:
        column, failures = next(iter(bad.items()))
        row_no, expected = failures[0]
        others = f" ({len(failures) - 1} more rows fail the same way: " \
                 f"{', '.join(str(r) for r, _ in failures[1:1 + _SHOWN_ROWS])}{'…' if len(failures) > 4 else ''})" \
            if len(failures) > 1 else ""
        raise TaskDataError(f"{where}, row {row_no}, column {column!r}: expected {expected}{others}; "
                            "fix the data (nothing was skipped)")
    return tasks


def _split(loaded: dict[str, Any], spec: SplitSpec, source: str, key: str) -> Any:
    if spec.name not in loaded:
        raise TaskDataError(f"{key} {spec.name!r}: {source} has no split {spec.name!r}; its splits: "
                            f"{', '.join(loaded)}")
    return loaded[spec.name]


def load_hf_splits(
    path: str | Path | None, *, split: str, validation_split: str | None, validation_path: str | Path | None,
    num_train: int, num_validation: int, options: Mapping[str, Any],
) -> TaskSplits:
    """Train and validation tasks. Validation: ``validation_split`` of ``validation_path``
    (its only split when that is a file) or of ``path``; with neither, the last
    ``num_validation`` rows of the train split, held out (seed-independent, as jsonl's).
    Rows both slices would take stay in validation only, so ``split: train`` with
    ``validation_split: train[-64:]`` trains on the rest. ``num_train`` caps the train
    tasks (0: all), ``num_validation`` the validation ones."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TaskDataError(f"task 'hf': unknown task.options {unknown}; it takes {', '.join(OPTIONS)}")
    if path is None:
        raise TaskDataError("task 'hf' needs task.path: a save_to_disk directory or a .parquet, .arrow or .jsonl file")
    prompt_key = str(options.get("prompt_key", "prompt"))
    loaded = _read(path, "task.path")
    train_spec = SplitSpec.parse(split, "task.split")
    train_set = _split(loaded, train_spec, str(path), "task.split")
    train_rows = train_spec.rows(len(train_set))
    if validation_path is not None:
        held = _read(validation_path, "task.validation_path")
        spec = SplitSpec.parse(validation_split or next(iter(held)), "task.validation_split")
        val_set, source = _split(held, spec, str(validation_path), "task.validation_split"), validation_path
        val_rows = spec.rows(len(val_set))
    else:
        if validation_split is not None:
            spec = SplitSpec.parse(validation_split, "task.validation_split")
            val_set = _split(loaded, spec, str(path), "task.validation_split")
            val_rows = spec.rows(len(val_set))
        else:  # the tail of the train split, as jsonl holds out
            spec, val_set, val_rows = train_spec, train_set, train_rows[len(train_rows) - num_validation:]
        if spec.name == train_spec.name:  # one split sliced twice: never train on a held-out row
            held_out = set(val_rows)
            train_rows = [r for r in train_rows if r not in held_out]
        source = path
    val_rows = list(val_rows)[:num_validation]
    if not train_rows:
        raise TaskDataError(f"task.path {str(path)!r}: no train rows left in {split!r} after holding out "
                            f"{len(val_rows)} for validation; add rows, lower task.num_validation or set "
                            "task.validation_split / task.validation_path")
    if not val_rows:
        raise TaskDataError(f"{source}: the validation split {spec.name!r} selects no rows")
    if num_train > 0:
        train_rows = list(train_rows)[:num_train]
    train = _tasks(train_set, train_rows, (path, train_spec.name), prompt_key)
    validation = _tasks(val_set, val_rows, (source, spec.name), prompt_key)
    _check_unique(train + validation, str(path))
    return TaskSplits(train=train, validation=validation)


def _check_unique(tasks: list[Task], where: str) -> None:
    """Results are keyed by task id, so two rows under one id would be mixed up."""
    seen: set[str] = set()
    for task in tasks:
        if task.id in seen:
            raise TaskDataError(f"{where}: task id {task.id!r} appears twice (column 'id'); ids must be unique "
                                "across the train and validation rows")
        seen.add(task.id)
