"""A reward function as verl's ``custom_reward_function`` takes it, used by asyncrl unchanged.

verl calls ``compute_score(data_source, solution_str, ground_truth, extra_info)`` once per
response with the row's ``data_source``, ``reward_model.ground_truth`` and ``extra_info``;
it returns a float, or a dict whose ``"score"`` is the reward. asyncrl does the same
(``task.reward_fn: examples/from_verl/reward.py:compute_score``), on a worker thread.
"""

from __future__ import annotations

from collections import Counter

from asyncrl.tasks.countdown import parse_expression  # whitelisted characters, no eval()


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 for an expression over exactly the numbers in ``extra_info`` that equals the ground truth."""
    parsed = parse_expression(solution_str)
    if parsed is None:
        return {"score": 0.0, "parsed": False}
    value, literals = parsed
    right = value == int(ground_truth) and Counter(literals) == Counter(extra_info["numbers"])
    return {"score": 1.0 if right else 0.0, "parsed": True}
