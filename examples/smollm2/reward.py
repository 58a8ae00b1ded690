"""The reward of ``examples/smollm2``: right when the last number in the reply is the sum.

Format-robust on purpose: an instruct model answers "13 + 14 = 27", "The answer is 27."
or "27" — all right, and a strict "just the number" check would score the first two 0
and teach the format before the arithmetic. Only the last number counts, so a reply
cannot collect credit by listing candidates; a reply cut at ``sampling.max_tokens``
usually ends on something else and scores 0.
"""

from __future__ import annotations

import re

from asyncrl.tasks import Task

_NUMBER = re.compile(r"-?\d[\d,]*")


def score(task: Task, response: str) -> float:
    numbers = _NUMBER.findall(response)
    if not numbers:
        return 0.0
    return 1.0 if int(numbers[-1].replace(",", "")) == int(task.data["answer"]) else 0.0
