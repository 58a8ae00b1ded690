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
    (for Countdown: the numbers and the target).

    ``messages``: the prompt as chat messages, when the dataset gives it so (verl's
    schema, TRL's conversational prompts); the single-turn workflow then sends these
    through the chat template, system message and all, and ``prompt`` is only their text
    for ids, logs and the validation hash. ``None``: ``prompt`` is the user's message."""

    id: str
    prompt: str
    data: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None


RewardFn = Callable[[Task, str], float]


@dataclass(frozen=True)
class TaskSplits:
    train: list[Task]
    validation: list[Task]


class TaskDataError(ValueError):
    """Raised for malformed user task data. Subclasses ValueError so callers that
    validate config generically still catch it, while the message points at the
    exact file and line to fix."""
