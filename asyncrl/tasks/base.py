"""What a task is, and what a reward function is.

A reward function is a plain Python function ``(task, response_text) -> float``; a config
names it as ``module:function`` so users can swap it without touching the workflow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    """One prompt to roll out. ``data`` holds whatever the reward function needs
    (for Countdown: the numbers and the target)."""

    id: str
    prompt: str
    data: dict[str, Any] = field(default_factory=dict)


RewardFn = Callable[[Task, str], float]


@dataclass(frozen=True)
class TaskSplits:
    train: list[Task]
    validation: list[Task]


class TaskDataError(ValueError):
    """Raised for malformed user task data. Subclasses ValueError so callers that
    validate config generically still catch it, while the message points at the
    exact file and line to fix."""
