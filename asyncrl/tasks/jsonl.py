"""Load user tasks from a JSONL file: one JSON object per line with a ``prompt``.

Errors name the file and 1-based line so a user with a 100k-line file can fix it
without bisecting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.tasks.base import Task, TaskDataError


def _task_from_line(raw: str, where: str, default_id: str) -> Task:
    try:
        obj: Any = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise TaskDataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TaskDataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "prompt" not in obj:
        raise TaskDataError(f"{where}: missing required field 'prompt'")
    prompt = obj.pop("prompt")
    if not isinstance(prompt, str):
        raise TaskDataError(f"{where}: 'prompt' must be a string, got {type(prompt).__name__}")
    if not prompt:
        raise TaskDataError(f"{where}: 'prompt' must not be empty")
    task_id = obj.pop("id", default_id)
    # bool is an int subclass; an id of `true` is almost certainly a data mistake.
    if isinstance(task_id, bool) or not isinstance(task_id, (str, int)):
        raise TaskDataError(f"{where}: 'id' must be a string or integer, got {task_id!r}")
    return Task(id=str(task_id), prompt=prompt, data=obj)


def load_jsonl_tasks(path: str | Path) -> list[Task]:
    """All tasks in file order; blank lines are skipped. Fields other than ``prompt``
    and ``id`` go into ``Task.data`` for the reward function. Ids default to
    ``{stem}-{line_no}`` and must be unique, because results are keyed by id."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TaskDataError(f"task file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskDataError(f"cannot read task file {path}: {exc}") from None
    tasks: list[Task] = []
    first_line: dict[str, int] = {}
    # split("\n"), not splitlines(): JSON strings may hold raw U+2028 etc., which
    # splitlines() would treat as line breaks and so corrupt rows and line numbers.
    for line_no, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        where = f"{path}, line {line_no}"
        task = _task_from_line(raw, where, default_id=f"{path.stem}-{line_no}")
        if task.id in first_line:
            raise TaskDataError(
                f"{where}: duplicate id {task.id!r} (first seen on line {first_line[task.id]})"
            )
        first_line[task.id] = line_no
        tasks.append(task)
    return tasks
