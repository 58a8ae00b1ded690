"""The OpenAI-agent example's own reward: an answer that ignores the task's numbers cannot
farm the format credit (the shipped policy collapsed onto answering "1" for it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.plugins import load_named
from asyncrl.tasks.base import Task
from asyncrl.tasks.countdown import countdown_reward

pytest.importorskip("openai")
AGENT = Path(__file__).resolve().parents[1] / "examples" / "openai_agent" / "agent.py"
TASK = Task("t", "8 6 8 -> 22", data={"numbers": [8, 6, 8], "target": 22})


@pytest.fixture(scope="module")
def score():
    return load_named(f"{AGENT}:score", key="test")


@pytest.mark.parametrize(("answer", "expected"), [
    ("8+6+8", 1.0),  # a solution
    ("8*6-8", 0.1),  # every number, once: the whole format credit
    ("(6-1)*8", 0.1 * 2 / 3),  # two of the three numbers, one extra
    ("8+6+8+1", 0.1 * 3 / 4),  # all three, and one more
    ("1", 0.0),  # the collapse: none of the numbers
    ("((8", 0.0), ("", 0.0),  # no expression
])
def test_the_format_credit_grows_with_the_task_numbers_used(score, answer, expected):
    assert score(TASK, answer) == pytest.approx(expected)


def test_where_the_task_default_paid_the_collapsed_answer(score):
    assert countdown_reward(TASK, "1") == 0.1 and score(TASK, "1") == 0.0
    assert score(Task("u", "1 2 3 -> 6", data={"numbers": [1, 2, 3], "target": 6}), "1") == pytest.approx(0.1 / 3)
