"""Reward functions as TRL's ``GRPOTrainer`` takes them, used by asyncrl unchanged.

TRL calls ``reward_funcs`` with ``prompts``, ``completions`` and every other dataset column
as a keyword argument, one value per completion, and wants one float per completion
back. So does asyncrl (``task.reward_fn: examples/from_trl/reward.py:countdown_reward``):
once for each group's completions, on a worker thread (an ``async def`` is awaited).
``completion_ids`` are the sampled tokens; ``trainer_state`` comes as ``None``. Several, as
``reward_funcs=[...]`` with ``reward_weights``: ``task.reward_fn`` a list (train.yaml shows it).
"""

from __future__ import annotations

from collections import Counter

from asyncrl.tasks.countdown import parse_expression  # whitelisted characters, no eval()


def countdown_reward(completions, numbers, target, **kwargs) -> list[float]:
    """1.0 for an expression over exactly the row's numbers that equals its target."""
    rewards = []
    for completion, nums, goal in zip(completions, numbers, target):
        text = completion[0]["content"] if isinstance(completion, list) else completion  # conversational or text
        parsed = parse_expression(text)
        right = parsed is not None and parsed[0] == goal and Counter(parsed[1]) == Counter(nums)
        rewards.append(1.0 if right else 0.0)
    return rewards


def short_answer(completions, **kwargs) -> list[float]:
    """A format reward, as TRL's guides pair with a correctness one: 1.0 for an answer of at
    most 12 characters, the length of an expression over three numbers."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if len(text.strip()) <= 12 else 0.0 for text in texts]
