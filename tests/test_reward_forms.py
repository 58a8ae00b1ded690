"""Reward functions written for TRL and verl run unchanged (``asyncrl/tasks/reward_forms.py``):
recognised by their parameters, a TRL one called once for a group's completions, async
ones awaited, and what they raise or return handled as asyncrl's own rewards are.

The reward functions below are written in the form the two projects' documentation shows
(TRL's GRPOTrainer guide: ``def reward_func(completions, **kwargs)`` returning a list;
verl's custom reward function: ``compute_score(data_source, solution_str, ground_truth,
extra_info=None)``), not copied from their code."""

from __future__ import annotations

import asyncio
import math

import pytest

from asyncrl.config import Config, ConfigError
from asyncrl.rollout.client import Response
from asyncrl.rollout.workflows import SingleTurnWorkflow, run_episode
from asyncrl.rollout.workflows.registry import build_reward_fn
from asyncrl.tasks import Task
from asyncrl.tasks.reward_forms import ForeignReward, check_reward_fits, recognise_reward
from asyncrl.types import SamplingParams

CHAT_TASK = Task(id="c0", prompt="3 4 -> 7", data={"target": 7, "numbers": [3, 4]},
                 messages=[{"role": "system", "content": "Answer with an expression."},
                           {"role": "user", "content": "3 4 -> 7"}])
TEXT_TASK = Task(id="t0", prompt="3 4 -> 7", data={"target": 7, "numbers": [3, 4]})
VERL_TASK = Task(id="v0", prompt="3 4 -> 7", messages=[{"role": "user", "content": "3 4 -> 7"}],
                 data={"data_source": "countdown", "reward_model": {"style": "rule", "ground_truth": "7"},
                       "extra_info": {"numbers": [3, 4]}})


class ScriptedLLM:
    """Stands in for the client: answers each chat with the next scripted reply, after a
    pause per reply so the group's episodes overlap as they do on an engine."""

    def __init__(self, replies: list[str], seen: list) -> None:
        self.replies, self.seen = replies, seen
        self.sampling = SamplingParams(max_tokens=8)
        self.trajectories: list = []
        self.template_rewrites = 0

    async def chat(self, messages, sampling=None):
        self.seen.append(messages)
        await asyncio.sleep(0.01)
        text = self.replies.pop(0)
        return Response(text=text, token_ids=[ord(c) for c in text], finish_reason="stop")

    async def generate(self, prompt, sampling=None):
        return await self.chat(prompt, sampling)


def run_group(workflow, task, replies, *, max_retries=0, timeout_s=10.0):
    """The n episodes of ``task`` together, as a rollout worker runs a group."""
    seen, queue = [], list(replies)

    async def main():
        return await asyncio.gather(*[
            run_episode(workflow, task, lambda: ScriptedLLM(queue, seen), timeout_s=timeout_s, max_retries=max_retries)
            for _ in range(len(replies) // (max_retries + 1))])

    return asyncio.run(main()), seen


# --- TRL: the forms its guide shows ---------------------------------------------------------


def reward_len(completions, **kwargs):
    """TRL's guide's first example: prefer completions near 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


TRL_CALLS: list[dict] = []


def correct_target(prompts, completions, target, **kwargs):
    """A TRL reward reading a dataset column (``target``) as a keyword argument."""
    TRL_CALLS.append({"prompts": prompts, "completions": completions, "target": target, **kwargs})
    contents = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if content.strip() == "3+4" and t == 7 else 0.0 for content, t in zip(contents, target)]


async def async_correct(prompts, completions, target, **kwargs):
    await asyncio.sleep(0)
    return correct_target(prompts, completions, target, **kwargs)


def test_a_trl_reward_is_called_once_per_group_with_its_columns_and_conversational_completions():
    TRL_CALLS.clear()
    reward = recognise_reward(correct_target, "tests:correct_target")
    assert isinstance(reward, ForeignReward) and reward.form == "trl" and reward.batched
    workflow = SingleTurnWorkflow(reward)
    episodes, seen = run_group(workflow, CHAT_TASK, ["3+4", "4+3", "7", "3+4"])
    assert [e.reward for e in episodes] == [1.0, 0.0, 0.0, 1.0]
    assert workflow.group_reward.calls == 1 and len(TRL_CALLS) == 1  # one call, the whole group
    call = TRL_CALLS[0]
    assert call["prompts"] == [CHAT_TASK.messages] * 4  # conversational: messages in, messages out
    assert call["completions"][0] == [{"role": "assistant", "content": "3+4"}]
    assert call["target"] == [7] * 4 and call["numbers"] == [[3, 4]] * 4  # every column, one value per completion
    assert call["completion_ids"][0] == [ord("3"), ord("+"), ord("4")]
    assert call["trainer_state"] is None
    assert seen == [CHAT_TASK.messages] * 4  # the dataset's messages, system turn included, reached the chat


def test_a_trl_reward_on_text_prompts_gets_text_and_an_async_one_is_awaited():
    TRL_CALLS.clear()
    episodes, _ = run_group(SingleTurnWorkflow(recognise_reward(async_correct, "tests:async_correct")),
                            TEXT_TASK, ["3+4", "x"])
    assert [e.reward for e in episodes] == [1.0, 0.0]
    assert TRL_CALLS[0]["prompts"] == ["3 4 -> 7", "3 4 -> 7"] and TRL_CALLS[0]["completions"] == ["3+4", "x"]
    episodes, _ = run_group(SingleTurnWorkflow(recognise_reward(reward_len, "tests:reward_len")), TEXT_TASK,
                            ["a" * 20, "a" * 5])
    assert [e.reward for e in episodes] == [0.0, -15.0]


def test_a_trl_reward_that_raises_or_returns_the_wrong_length_fails_its_episodes_as_an_asyncrl_reward_does():
    def broken(completions, **kwargs):
        raise ZeroDivisionError("reward bug")

    def short(completions, **kwargs):
        return [1.0]

    for fn, message in ((broken, "ZeroDivisionError: reward bug"), (short, "expected a list of 2 floats")):
        # two episodes, one retry each: the group's call fails, both are retried, both fail again
        episodes, _ = run_group(SingleTurnWorkflow(recognise_reward(fn, f"tests:{fn.__name__}")), TEXT_TASK,
                                ["a", "b", "c", "d"], max_retries=1)
        assert [(e.status, e.attempts) for e in episodes] == [("error", 2), ("error", 2)]
        assert message in episodes[0].errors[0].exception


def test_a_non_finite_trl_reward_reaches_the_run_s_check_as_an_asyncrl_one_does():
    episodes, _ = run_group(SingleTurnWorkflow(recognise_reward(lambda completions, **kw: [math.nan] * len(completions),
                                                                "tests:nan")), TEXT_TASK, ["a", "b"])
    assert all(e.status == "ok" and math.isnan(e.reward) for e in episodes)  # asyncrl/algorithms/finite.py stops it


def test_an_episode_that_fails_before_its_completion_does_not_hold_up_its_group():
    chats = []

    class FailingSecond(ScriptedLLM):
        async def chat(self, messages, sampling=None):
            chats.append(messages)
            if len(chats) == 2:  # the second episode's generation fails; its siblings wait only for each other
                raise ConnectionError("engine hiccup")
            return await super().chat(messages, sampling)

    workflow = SingleTurnWorkflow(recognise_reward(correct_target, "tests:correct_target"))
    queue = ["3+4", "3+4"]

    async def main():
        return await asyncio.gather(*[
            run_episode(workflow, TEXT_TASK, lambda: FailingSecond(queue, []), timeout_s=5, max_retries=0)
            for _ in range(3)])

    episodes = asyncio.run(main())
    assert sorted(e.status for e in episodes) == ["error", "ok", "ok"]
    assert workflow.group_reward.calls == 1


# --- verl: compute_score as its docs write it -------------------------------------------------


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom reward function form: a dict with "score" (and what else it logs)."""
    value = 1.0 if solution_str.strip() in ("3+4", "4+3") and ground_truth == "7" else 0.0
    return {"score": value, "uses_numbers": extra_info == {"numbers": [3, 4]}, "source": data_source}


async def async_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == "3+4")


def test_a_verl_compute_score_scores_each_completion_from_verl_s_schema():
    reward = recognise_reward(compute_score, "tests:compute_score")
    assert isinstance(reward, ForeignReward) and reward.form == "verl" and not reward.batched
    episodes, _ = run_group(SingleTurnWorkflow(reward), VERL_TASK, ["4+3", "8"])
    assert [e.reward for e in episodes] == [1.0, 0.0]
    episodes, _ = run_group(SingleTurnWorkflow(recognise_reward(async_compute_score, "tests:async")), VERL_TASK,
                            ["3+4", "4+3"])
    assert [e.reward for e in episodes] == [1.0, 0.0]


def test_a_verl_dict_without_score_is_a_type_error_naming_the_function():
    reward = recognise_reward(lambda data_source, solution_str, ground_truth, extra_info=None: {"acc": 1},
                              "mine:score")
    with pytest.raises(TypeError, match="mine:score returned a dict without 'score'"):
        reward(VERL_TASK, "7")


def test_verl_s_batched_form_is_one_call():
    calls = []

    def compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
        calls.append(solution_strs)
        return [float(s == "3+4") for s in solution_strs]

    episodes, _ = run_group(SingleTurnWorkflow(recognise_reward(compute_score_batch, "tests:batch")), VERL_TASK,
                            ["3+4", "1", "3+4"])
    assert [e.reward for e in episodes] == [1.0, 0.0, 1.0] and calls == [["3+4", "1", "3+4"]]


# --- what is refused before any work ------------------------------------------------------------


def test_a_function_of_no_known_form_exits_2_naming_it_its_signature_and_the_forms(tmp_path):
    (tmp_path / "mine.py").write_text("def score(text):\n    return 1.0\n")
    cfg = Config.model_validate({"task": {"name": "countdown", "reward_fn": f"{tmp_path}/mine.py:score"}})
    with pytest.raises(ConfigError) as refused:
        build_reward_fn(cfg)
    message = str(refused.value)
    assert "mine.py:score" in message and "score(text)" in message
    assert "reward(prompts, completions, **kwargs)" in message and "compute_score(data_source, solution_str" in message


def test_a_reward_the_rows_cannot_feed_is_refused_naming_the_task_and_the_column():
    with pytest.raises(ValueError, match="needs column 'reward_model'.*task 't0'"):
        check_reward_fits(recognise_reward(compute_score, "tests:compute_score"), [TEXT_TASK])
    with pytest.raises(ValueError, match="takes 'solution', which task 't0' has no column for"):
        check_reward_fits(recognise_reward(lambda completions, solution: [], "tests:acc"), [TEXT_TASK])
    check_reward_fits(recognise_reward(correct_target, "tests:correct_target"), [TEXT_TASK, CHAT_TASK])


def test_asyncrl_s_own_form_is_left_as_it_is_and_may_be_async():
    def score(task, response):
        return 1.0

    assert recognise_reward(score, "m:score") is score

    async def ascore(task, response):
        return 0.5

    episodes, _ = run_group(SingleTurnWorkflow(recognise_reward(ascore, "m:ascore")), TEXT_TASK, ["a"])
    assert episodes[0].reward == 0.5


def test_a_batched_reward_past_its_timeout_fails_its_episodes_and_the_next_group_goes_on():
    async def slow(completions, **kwargs):
        await asyncio.sleep(3600)

    workflow = SingleTurnWorkflow(recognise_reward(slow, "tests:slow"), reward_timeout_s=0.2)
    episodes, _ = run_group(workflow, TEXT_TASK, ["a", "b"])
    assert [e.status for e in episodes] == ["error", "error"]
    assert "TimeoutError" in episodes[0].errors[0].exception
    assert workflow.group_reward._open == {}  # nothing left waiting: the next group starts afresh
