"""Several reward functions as one (``asyncrl/tasks/reward_sum.py``), as TRL's
``reward_funcs`` with ``reward_weights``: the reward is the weighted sum over the functions
that scored a completion (``None``: not applicable, left out), each function's values kept
apart by name in the step rows and the samples; verl's score-dict extras kept."""

from __future__ import annotations

import math

import pytest
from test_reward_forms import TEXT_TASK, VERL_TASK, run_group

from asyncrl.cli import main
from asyncrl.config import Config, ConfigError
from asyncrl.orchestrator.buffer import ReadyGroup
from asyncrl.orchestrator.metrics import reward_part_means, sample_rows
from asyncrl.rollout.workflows import SingleTurnWorkflow
from asyncrl.tasks.from_config import build_reward_fn
from asyncrl.tasks.reward_forms import recognise_reward
from asyncrl.tasks.reward_sum import RewardSum
from asyncrl.types import Episode, Group, Trajectory


def exact(task, response: str) -> float:
    """asyncrl's own form: 1 for the right expression."""
    return 1.0 if response == "3+4" else 0.0


def length_penalty(completions, **kwargs):
    """TRL's form, batched: 0 at three characters, -1 per character off."""
    return [-abs(3 - len(c)) for c in completions]


def only_long(completions, **kwargs):
    """TRL's "not applicable": None for completions under three characters."""
    return [None if len(c) < 3 else 0.5 for c in completions]


def never(completions, **kwargs):
    return [None if len(c) < 3 else 2.0 for c in completions]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's form returning a dict: the score and what verl would log beside it."""
    right = solution_str == "3+4"
    return {"score": 1.0 if right else 0.0, "acc": right, "pred": solution_str}


def summed(*fns, weights=None):
    return RewardSum([recognise_reward(fn, f"tests:{fn.__name__}") for fn in fns], weights)


def test_the_reward_is_the_weighted_sum_with_each_function_kept_by_name():
    workflow = SingleTurnWorkflow(summed(exact, length_penalty, weights=[2.0, 0.5]))
    episodes, _ = run_group(workflow, TEXT_TASK, ["3+4", "7", "3+44"])
    # 2·1 + 0.5·0 ; 2·0 + 0.5·(-2) ; 2·0 + 0.5·(-1)
    assert [e.reward for e in episodes] == [2.0, -1.0, -0.5]
    assert [e.rewards for e in episodes] == [{"exact": 1.0, "length_penalty": 0.0},
                                             {"exact": 0.0, "length_penalty": -2.0},
                                             {"exact": 0.0, "length_penalty": -1.0}]
    assert workflow.group_reward.calls == 1  # the batched member: one call for the group, as alone


def test_none_leaves_a_function_out_of_the_sum_and_out_of_its_mean():
    workflow = SingleTurnWorkflow(summed(exact, only_long))  # weights: 1.0 each, TRL's default
    episodes, _ = run_group(workflow, TEXT_TASK, ["3+4", "7", "3+44"])
    assert [e.reward for e in episodes] == [1.5, 0.0, 0.5]
    assert episodes[1].rewards == {"exact": 0.0, "only_long": None}
    means = reward_part_means(episodes)
    assert means["reward/exact/mean"] == pytest.approx(1 / 3)
    assert means["reward/only_long/mean"] == 0.5  # over the two it applied to, not three


def test_a_completion_no_function_scores_fails_alone():
    workflow = SingleTurnWorkflow(summed(only_long, never))
    episodes, _ = run_group(workflow, TEXT_TASK, ["3+4", "7", "3+44"])
    assert [e.status for e in episodes] == ["ok", "error", "ok"]
    assert "every reward function (only_long, never) returned None" in episodes[1].error
    assert [episodes[0].reward, episodes[2].reward] == [2.5, 2.5]


def test_a_function_never_applicable_is_logged_as_nan():
    assert math.isnan(reward_part_means([Episode("t", rewards={"f": None, "g": 1.0})])["reward/f/mean"])
    assert reward_part_means([Episode("t")]) == {}  # a single reward adds no keys


def test_a_single_verl_function_keeps_its_extra_keys():
    episodes, _ = run_group(SingleTurnWorkflow(recognise_reward(compute_score, "tests:cs")), VERL_TASK, ["3+4", "9"])
    assert [e.reward for e in episodes] == [1.0, 0.0]
    assert [e.reward_extras for e in episodes] == [{"acc": True, "pred": "3+4"}, {"acc": False, "pred": "9"}]
    assert episodes[0].rewards == {}  # one function: nothing to tell apart


def test_in_a_list_verl_extras_are_named_by_their_function():
    episodes, _ = run_group(SingleTurnWorkflow(summed(compute_score, exact, weights=[1.0, -1.0])), VERL_TASK,
                            ["3+4"])
    assert episodes[0].reward == 0.0 and episodes[0].rewards == {"compute_score": 1.0, "exact": 1.0}
    assert episodes[0].reward_extras == {"compute_score/acc": True, "compute_score/pred": "3+4"}


def test_sample_rows_carry_each_function_and_the_extras():
    trajectory = Trajectory([1], [2, 3], [1, 1], [-1.0, -1.0], [0, 0], reward=0.5)
    episode = Episode("t0", [trajectory], reward=0.5, rewards={"exact": 0.0, "only_long": 0.5},
                      reward_extras={"only_long/why": "long"})
    (row,) = sample_rows(1, 0, [ReadyGroup(Group("t0", [episode], advantages=[0.0]), 0)], lambda ids: "x")
    assert row["rewards"] == {"exact": 0.0, "only_long": 0.5} and row["reward_extras"] == {"only_long/why": "long"}
    plain = Episode("t0", [trajectory], reward=0.5)
    (row,) = sample_rows(1, 0, [ReadyGroup(Group("t0", [plain], advantages=[0.0]), 0)], lambda ids: "x")
    assert "rewards" not in row and "reward_extras" not in row


def test_weights_of_another_length_are_refused_naming_both_lengths(tmp_path, capsys):
    code = main(["train", "examples/jsonl/train.yaml", f"output_dir={tmp_path}",
                 "task.reward_fn=[examples/jsonl/reward.py:score, tests/test_reward_sum.py:exact]",
                 "task.reward_weights=[1.0, 0.5, 2.0]"])
    err = capsys.readouterr().err
    assert code == 2 and "task.reward_weights has 3 weights for 2 reward functions" in err


def test_the_config_builds_a_list_and_names_its_bad_member():
    cfg = Config.model_validate({"task": {"name": "jsonl", "path": "examples/jsonl/data.jsonl",
                                          "reward_fn": ["tests/test_reward_sum.py:exact",
                                                        "tests/test_reward_sum.py:length_penalty"],
                                          "reward_weights": [1, 2]}})
    reward = build_reward_fn(cfg)
    assert isinstance(reward, RewardSum) and reward.names == ["exact", "length_penalty"] and reward.weights == [1, 2]
    cfg.task.reward_fn = ["tests/test_reward_sum.py:exact", "tests/test_reward_sum.py:exactt"]
    with pytest.raises(ConfigError, match=r"task.reward_fn\[1\] .*no attribute 'exactt'"):
        build_reward_fn(cfg)
    cfg.task.reward_fn, cfg.task.reward_weights = None, [1.0]
    with pytest.raises(ConfigError, match="task.reward_weights weighs the functions of task.reward_fn"):
        build_reward_fn(cfg)


def test_two_functions_under_one_name_are_refused():
    with pytest.raises(ValueError, match="two functions called 'exact'"):
        summed(exact, exact)
