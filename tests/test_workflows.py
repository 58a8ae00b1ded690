"""Workflows and the runner that contains their failures."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.client import LLMClient, Message, Response
from asyncrl.engine import TorchEngine
from asyncrl.evaluation import evaluate, pass_at_k
from asyncrl.tasks import Task, arithmetic_reward, generate_arithmetic
from asyncrl.types import Episode, SamplingParams
from asyncrl.workflows import MultiTurnWorkflow, SingleTurnWorkflow, run_episode

SAMPLING = SamplingParams(max_tokens=6, temperature=1.0)
TASK = Task(id="t0", prompt="2+3=", data={"answer": 5})


def run(tiny_policy, coro_fn, sampling=SAMPLING):
    model, tokenizer = tiny_policy

    async def main():
        engine = TorchEngine(model, max_batch_size=8)
        try:
            return await coro_fn(lambda: LLMClient(engine, tokenizer, sampling), engine, tokenizer)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_single_turn_scores_and_stamps_reward(tiny_policy):
    calls = []

    def reward(task, text):
        calls.append((task.id, text))
        return 0.75

    async def go(make_client, *_):
        return await run_episode(SingleTurnWorkflow(reward), TASK, make_client, timeout_s=30, max_retries=0)

    episode = run(tiny_policy, go)
    assert episode.status == "ok" and episode.reward == 0.75 and episode.attempts == 1
    assert calls == [("t0", episode.metadata["response"])]
    assert [t.reward for t in episode.trajectories] == [0.75]
    assert Episode.from_json(episode.to_json()) == episode  # JSON lines round-trip


class Raising:
    def __init__(self):
        self.attempts = 0

    async def run(self, task, llm):
        self.attempts += 1
        raise ZeroDivisionError("workflow bug")


class Hanging:
    async def run(self, task, llm):
        await asyncio.sleep(3600)


class Flaky:
    def __init__(self):
        self.attempts = 0

    async def run(self, task, llm):
        self.attempts += 1
        if self.attempts == 1:
            raise ConnectionError("transient")
        return Episode(task_id=task.id, reward=1.0)


def test_raising_workflow_becomes_error_episode_after_retries(tiny_policy):
    workflow = Raising()

    async def go(make_client, *_):
        return await run_episode(workflow, TASK, make_client, timeout_s=30, max_retries=2)

    episode = run(tiny_policy, go)
    assert episode.status == "error" and episode.finish_reason == "error"
    assert workflow.attempts == 3 and episode.attempts == 3
    assert "ZeroDivisionError: workflow bug" in episode.error and "Traceback" in episode.error
    assert episode.reward == 0.0


def test_hanging_workflow_times_out(tiny_policy):
    async def go(make_client, *_):
        start = time.perf_counter()
        episode = await run_episode(Hanging(), TASK, make_client, timeout_s=0.2, max_retries=1)
        return episode, time.perf_counter() - start

    episode, elapsed = run(tiny_policy, go)
    assert episode.status == "error" and "timed out" in episode.error and episode.attempts == 2
    assert elapsed < 5


def test_flaky_workflow_succeeds_on_retry(tiny_policy):
    workflow = Flaky()

    async def go(make_client, *_):
        return await run_episode(workflow, TASK, make_client, timeout_s=30, max_retries=1)

    episode = run(tiny_policy, go)
    assert episode.status == "ok" and episode.attempts == 2 and episode.reward == 1.0


def test_hanging_reward_function_does_not_block_the_loop(tiny_policy):
    def stuck_reward(task, text):
        time.sleep(5)
        return 1.0

    async def go(make_client, *_):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.create_task(ticker())
        start = time.perf_counter()
        workflow = SingleTurnWorkflow(stuck_reward, reward_timeout_s=0.3)
        episode = await run_episode(workflow, TASK, make_client, timeout_s=30, max_retries=0)
        tick.cancel()
        return episode, time.perf_counter() - start, ticks

    episode, elapsed, ticks = run(tiny_policy, go)
    assert episode.status == "error" and "TimeoutError" in episode.error
    assert elapsed < 3 and ticks > 5  # the event loop kept running while the reward hung


@pytest.mark.parametrize("bad", [None, "1.0", float("nan"), True])
def test_reward_function_must_return_a_finite_number(tiny_policy, bad):
    async def go(make_client, *_):
        workflow = SingleTurnWorkflow(lambda task, text: bad)
        return await run_episode(workflow, TASK, make_client, timeout_s=30, max_retries=0)

    episode = run(tiny_policy, go)
    assert episode.status == "error" and "expected a finite float" in episode.error


class CalculatorWorkflow(MultiTurnWorkflow):
    """The model talks; a 'calculator' tool answers each turn with a fixed result."""

    tools = [{"name": "calc"}]

    def initial_messages(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": task.prompt}]

    async def env_step(self, task, messages, response: Response):
        return [{"role": "tool", "content": "5"}], False

    async def reward(self, task, messages):
        return float(sum(m["role"] == "assistant" for m in messages))


def test_multi_turn_workflow_respects_turn_limit_and_masks_tools(tiny_policy):
    async def go(make_client, *_):
        return await run_episode(CalculatorWorkflow(max_turns=3), TASK, make_client, timeout_s=30, max_retries=0)

    # Every id is a stop id: each reply is one token that ends the turn ("stop").
    one_token_replies = SamplingParams(max_tokens=6, stop_token_ids=tuple(range(261)))
    episode = run(tiny_policy, go, one_token_replies)
    assert episode.status == "ok" and episode.reward == 3.0
    (traj,) = episode.trajectories
    assert len(traj.steps) == 3 and episode.metadata["turns"] == 3
    assert 0 in traj.loss_mask and 1 in traj.loss_mask
    roles = [m["role"] for m in episode.metadata["messages"]]
    # the environment also answers the last turn (its result may decide the reward)
    assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant", "tool"]

    truncated = run(tiny_policy, go)  # a reply cut at max_tokens ends the episode
    assert truncated.metadata["turns"] == 1 and truncated.finish_reason == "length"


def test_evaluate_counts_errors_and_scores(tiny_policy):
    tasks = generate_arithmetic(3, seed=0)

    def reward(task, text):
        if task.id == tasks[0].id:
            raise ValueError("bad row")
        return arithmetic_reward(task, text)

    async def go(make_client, engine, tokenizer):
        workflow = SingleTurnWorkflow(reward)
        return await evaluate(lambda task: run_episode(workflow, task, make_client, timeout_s=30, max_retries=0),
                              tasks, samples_per_task=2, max_concurrent=4)

    result = run(tiny_policy, go)
    assert result.num_errors == 2 and len(result.episodes) == 6
    assert set(result.pass_at) == {1, 2}


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
