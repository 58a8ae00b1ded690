"""The reward of the cookbook's arithmetic env, for ``asyncrl train``: 1 when the last integer
in the reply is the sum (``ArithmeticEnv.check_answer``: ``-?\\d+`` after dropping commas).
The env's format term (-0.1 without the stop token) is left out: a reward function sees the
reply's text, not how it ended. Compare the cookbook's ``correct`` metric to this."""

from __future__ import annotations

import re

from asyncrl.tasks import Task

_INTEGER = re.compile(r"-?\d+")


def score(task: Task, response: str) -> float:
    found = _INTEGER.findall(response.replace(",", ""))
    return 1.0 if found and int(found[-1]) == int(task.data["answer"]) else 0.0
