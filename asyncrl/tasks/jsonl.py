"""Load user tasks from a JSONL file: one JSON object per line with a ``prompt``.

Errors name the file and 1-based line (``asyncrl.jsonl`` reads the lines).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrl.jsonl import JsonlError, iter_jsonl
from asyncrl.tasks.base import Task, TaskDataError


def _task_from_row(obj: dict[str, Any], where: str, default_id: str) -> Task:
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
    tasks: list[Task] = []
    first_line: dict[str, int] = {}
    try:
        for line_no, row in iter_jsonl(path):
            where = f"{path}, line {line_no}"
            task = _task_from_row(row, where, default_id=f"{path.stem}-{line_no}")
            if task.id in first_line:
                raise TaskDataError(f"{where}: duplicate id {task.id!r} (first seen on line {first_line[task.id]})")
            first_line[task.id] = line_no
            tasks.append(task)
    except JsonlError as exc:
        raise TaskDataError(str(exc).replace("file not found", "task file not found")) from None
    return tasks
