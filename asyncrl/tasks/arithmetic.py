"""Single-digit addition: the easiest possible task, so tests and smoke runs can check
that learning happens at all without waiting on a hard problem."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from itertools import islice

from asyncrl.tasks.base import Task

_INT_RE = re.compile(r"[+-]?[0-9]+")


def iter_arithmetic(seed: int, *, low: int = 0, high: int = 9) -> Iterator[Task]:
    """Endless deterministic stream; ``generate_arithmetic`` takes a prefix of it, so
    callers that need "n more distinct tasks" can keep drawing from the same seed."""
    if low > high:
        raise ValueError(f"arithmetic: low ({low}) must be <= high ({high})")
    rng = random.Random(seed)
    i = 0
    while True:
        a, b = rng.randint(low, high), rng.randint(low, high)
        yield Task(id=f"arithmetic-{seed}-{i}", prompt=f"{a}+{b}=", data={"answer": a + b})
        i += 1


def generate_arithmetic(num_tasks: int, seed: int, *, low: int = 0, high: int = 9) -> list[Task]:
    """``num_tasks`` problems ``a+b=`` with a, b uniform in [low, high]."""
    if num_tasks < 0:
        raise ValueError(f"num_tasks must be >= 0, got {num_tasks}")
    return list(islice(iter_arithmetic(seed, low=low, high=high), num_tasks))


def arithmetic_reward(task: Task, response: str) -> float:
    """1.0 iff the response is exactly the integer answer. A strict ASCII regex is used
    instead of bare ``int()``, which would also accept ``1_0`` or non-ASCII digits."""
    text = response.strip()
    if not _INT_RE.fullmatch(text):
        return 0.0
    return 1.0 if int(text) == int(task.data["answer"]) else 0.0
