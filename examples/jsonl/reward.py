"""The reward for ``examples/jsonl/data.jsonl``: a plain function ``(task, response) -> float``.

A config names it as ``task.reward_fn: examples/jsonl/reward.py:score`` (a file path,
relative to where ``asyncrl`` runs) or, once it lives in an installed package, as
``mypkg.rewards:score``. ``task.prompt`` is the row's ``prompt``, ``task.data`` holds its
other fields (``id`` aside), ``response`` is the model's text without special tokens.
It runs on a worker thread with ``workflow.timeout_s``; it must return a finite number.
"""

from __future__ import annotations

from collections import Counter

from asyncrl.tasks import Task
from asyncrl.tasks.countdown import parse_expression  # whitelisted characters, no eval()


def score(task: Task, response: str) -> float:
    """1.0 when ``response`` is an expression over exactly the row's numbers that equals
    its target, else 0.0. No credit for format: a wrong expression is wrong."""
    parsed = parse_expression(response)
    if parsed is None:
        return 0.0
    value, literals = parsed
    uses_numbers = Counter(literals) == Counter(task.data["numbers"])
    return 1.0 if uses_numbers and value == task.data["target"] else 0.0
