"""A synthetic benchmark task whose response lengths have a long tail.

Synchronous RL wastes its time where a few responses are many times longer than the
median: every step waits for the longest. This task makes that shape on purpose: each
task asks for L digits, with L short for most tasks and many times longer for a few,
and caps its own response at L tokens (``data["max_tokens"]``, honoured by the
single-turn workflow). The reward, the fraction of the L asked-for characters that are
digits, is dense, so every mode has something to learn and groups rarely tie.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from asyncrl.tasks.base import Task


def iter_longtail(seed: int, *, short: tuple[int, int] = (8, 16), long: tuple[int, int] = (96, 160),
                  long_fraction: float = 0.1) -> Iterator[Task]:
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"longtail: long_fraction must be in [0, 1], got {long_fraction}")
    rng = random.Random(seed)
    i = 0
    while True:
        length = rng.randint(*long) if rng.random() < long_fraction else rng.randint(*short)
        nonce = rng.randint(0, 99999)  # keeps prompts distinct, so the hash split has room
        yield Task(id=f"longtail-{seed}-{i}", prompt=f"{length} digits {nonce}",
                   data={"length": length, "max_tokens": length})
        i += 1


def longtail_reward(task: Task, response: str) -> float:
    """Fraction of the first ``length`` characters asked for that are digits."""
    length = int(task.data["length"])
    return sum(c.isdigit() for c in response[:length]) / length
