"""Per-turn rewards from an agent reach training: set in process (``LLMClient.set_turn_reward``)
or posted to the gateway (``POST <session>/v1/turn_reward``, through the ``openai`` SDK's own
client), each lands on its model call's last sampled token of the batch's ``rewards`` and
from there in GAE; a group-relative estimator compares the episodes' totals. Worked by
hand on scripted replies (no model: the engine below writes fixed tokens). The gateway
test starts its server on a free port and stops it, also when it fails."""

from __future__ import annotations

import asyncio
import contextlib
import math

import aiohttp
import openai
import pytest
import torch
from openai import AsyncOpenAI

from asyncrl.algorithms import gae
from asyncrl.config import load_config
from asyncrl.learner import pack_batch
from asyncrl.orchestrator.rollout_loop import RolloutLoop
from asyncrl.orchestrator.task_stream import Draw
from asyncrl.orchestrator.watchdog import Watchdog
from asyncrl.rollout.client import LLMClient, stop_token_ids
from asyncrl.rollout.gateway import Gateway, get_format, set_turn_reward
from asyncrl.rollout.workflows import MultiTurnWorkflow
from asyncrl.tasks.base import Task
from asyncrl.types import Completion, Episode, SamplingParams, Step, Trajectory

REPLIES = ["ab", "xyz"]  # the engine's replies, in order: 2 + EOS and 3 + EOS tokens


class ScriptedEngine:
    """Writes ``REPLIES`` (each closed by EOS), logprob −1 a token, at version 0."""
    max_context = 1 << 30
    version = 0

    def __init__(self, tokenizer) -> None:
        self.scripts = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in REPLIES]
        self.calls = 0

    async def generate(self, prompt_ids, sampling):
        ids = self.scripts[self.calls]
        self.calls += 1
        return Completion(list(ids), [-1.0] * len(ids), [0] * len(ids), "stop")


def client(tokenizer) -> LLMClient:
    return LLMClient(ScriptedEngine(tokenizer), tokenizer,
                     SamplingParams(max_tokens=8, stop_token_ids=stop_token_ids(tokenizer)))


async def two_turns(llm: LLMClient) -> None:
    """The model replies, the user answers, the model replies again: one trajectory."""
    messages = [{"role": "user", "content": "q"}]
    first = await llm.chat(messages)
    await llm.chat(messages + [first.message, {"role": "user", "content": "more"}])


def test_turn_rewards_land_on_each_calls_last_token_and_gae_crosses_the_users_turn(char_tokenizer):
    llm = client(char_tokenizer)
    asyncio.run(two_turns(llm))
    assert llm.set_turn_reward(0.5, turn=0) == 0
    assert llm.set_turn_reward(9.0) == 1  # the latest call …
    assert llm.set_turn_reward(0.25, turn=-1) == 1  # … set again: replaced, not added
    [trajectory] = llm.trajectories
    assert [s.reward for s in trajectory.steps] == [0.5, 0.25]
    # Response positions: turn 1 is 0..2 ("a", "b", EOS), then the user's turn (mask 0), then turn 2's
    # 4 tokens ending the response. On the target axis position i is entry p − 1 + i.
    p, mask = len(trajectory.prompt_ids), trajectory.loss_mask
    assert mask[:3] == [1, 1, 1] and mask[-4:] == [1, 1, 1, 1] and sum(mask) == 7
    batch = pack_batch([trajectory], [1.0], pad_id=0, outcomes=True)  # the outcome 1.0
    rewards = batch.rewards[0]
    want = torch.zeros_like(rewards)
    want[p - 1 + 2] = 0.5  # turn 1's EOS
    want[p - 1 + len(mask) - 1] = 1.25  # turn 2's EOS: its 0.25 and the outcome
    assert torch.equal(rewards, want)
    # γ = λ = 1 and V = 0: an action's advantage is the reward still to come, across the user's turn
    # at no cost: 1.75 on turn 1's tokens, 1.25 on turn 2's; 0 off the actions.
    advantages, _ = gae(batch.rewards, torch.zeros_like(rewards)[None], batch.loss_mask, gamma=1.0, lam=1.0)
    turn1 = slice(p - 1, p + 2)
    turn2 = slice(p - 1 + len(mask) - 4, p - 1 + len(mask))
    assert advantages[0, turn1].tolist() == [1.75] * 3 and advantages[0, turn2].tolist() == [1.25] * 4
    assert float(advantages.sum()) == 1.75 * 3 + 1.25 * 4


class GradedTurns(MultiTurnWorkflow):
    """The user answers each reply; the first reply's answer is worth 0.5, the second's 0."""

    def initial_messages(self, task):
        return [{"role": "user", "content": task.prompt}]

    async def env_step(self, task, messages, response):
        return [{"role": "user", "content": "more"}], len(messages) >= 4

    async def turn_reward(self, task, messages, new_messages, done):
        return 0.0 if done else 0.5

    async def reward(self, task, messages):
        return 1.0


def test_a_multi_turn_workflow_gives_its_turns_rewards_through_its_hook(char_tokenizer):
    llm = client(char_tokenizer)
    episode = asyncio.run(GradedTurns(max_turns=4).run(Task(id="t", prompt="q"), llm))
    [trajectory] = episode.trajectories
    assert episode.metadata["turns"] == 2 and episode.reward == 1.0
    assert [s.reward for s in trajectory.steps] == [0.5, 0.0]  # the second turn ended it: no turn reward
    assert episode.total_reward == 1.5


@pytest.mark.parametrize("reward, turn, says", [
    (1.0, 2, r"^turn 2 is not a model call of this episode \(turns 0\.\.1, or -1 for the latest\)$"),
    (1.0, -3, r"^turn -3 is not a model call"),
    (math.nan, -1, r"^a turn's reward must be a finite number, got nan$"),
    (True, -1, r"^a turn's reward must be a finite number, got True$"),
])
def test_a_turn_reward_that_cannot_be_placed_is_refused_in_one_line(char_tokenizer, reward, turn, says):
    llm = client(char_tokenizer)
    asyncio.run(two_turns(llm))
    with pytest.raises(ValueError, match=says):
        llm.set_turn_reward(reward, turn)
    assert [s.reward for s in llm.trajectories[0].steps] == [0.0, 0.0]


def test_no_turn_to_reward_before_the_first_reply(char_tokenizer):
    with pytest.raises(ValueError, match=r"^turn -1 is not a model call of this episode \(none yet: reward a turn "
                                         r"after its reply\)$"):
        client(char_tokenizer).set_turn_reward(1.0)


@contextlib.asynccontextmanager
async def serving(tokenizer):
    gateway = Gateway(tokenizer, get_format("hermes"), model_name="tiny")
    await gateway.start()
    try:
        yield gateway
    finally:
        await gateway.stop()


def test_an_agent_posts_turn_rewards_to_its_session_through_the_sdk(char_tokenizer):
    llm = client(char_tokenizer)

    async def main():
        async with serving(char_tokenizer) as gateway:
            async with gateway.session(llm) as base_url:
                sdk = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
                messages = [{"role": "user", "content": "q"}]
                first = await sdk.chat.completions.create(model="tiny", messages=messages)
                answers = [await set_turn_reward(sdk, 0.5)]  # the latest call: turn 0
                messages += [first.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "more"}]
                await sdk.chat.completions.create(model="tiny", messages=messages)
                answers.append(await set_turn_reward(sdk, -0.25, turn=1))
                refusals = []
                for body in ({"reward": 1.0, "turn": 2}, {"reward": "1"}, {"reward": 1.0, "turns": 1}):
                    with pytest.raises(openai.BadRequestError) as caught:
                        await sdk.post("turn_reward", body=body, cast_to=dict)
                    refusals.append(caught.value)
                async with aiohttp.ClientSession() as http:  # what the SDK cannot send: a bare NaN
                    async with http.post(f"{base_url}/turn_reward", data='{"reward": NaN}') as nan:
                        refusals_nan = (nan.status, (await nan.json())["error"]["param"])
                    async with http.post(f"{gateway.base_url}/sessions/nope/v1/turn_reward",
                                         json={"reward": 1.0}) as unknown:
                        unknown_status = unknown.status
                    async with http.post(f"{gateway.base_url}/v1/turn_reward", json={"reward": 1.0}) as plain:
                        plain_status = plain.status
            return answers, refusals, refusals_nan, unknown_status, plain_status

    answers, refusals, refusal_nan, unknown_status, plain_status = asyncio.run(main())
    assert answers == [{"turn": 0, "reward": 0.5}, {"turn": 1, "reward": -0.25}]
    [trajectory] = llm.trajectories
    assert [s.reward for s in trajectory.steps] == [0.5, -0.25]
    turn_range, not_a_number, unknown_field = (r.body for r in refusals)
    assert turn_range["param"] == "turn" and turn_range["message"].startswith("turn 2 is not a model call")
    assert not_a_number["param"] == "reward" and unknown_field["param"] == "turns"
    assert refusal_nan == (400, "reward")
    assert unknown_status == 404 and plain_status == 404  # a plain /v1 call belongs to no episode


def test_group_relative_estimators_compare_totals_and_gae_gets_the_outcome(tmp_path):
    # Two episodes of one task: outcome 1 with turn rewards 0 and −1 (total 0); outcome 0 with a turn
    # reward 0.5 (total 0.5). GRPO on totals [0, 0.5]: mean 0.25, Bessel std √0.125 ⇒ ∓0.7071; on the
    # outcomes it would have been the other way round. GAE's estimator passes the outcomes [1, 0].
    def episode(outcome: float, turns: list[float]) -> Episode:
        trajectory = Trajectory(prompt_ids=[1], response_ids=[2] * len(turns), loss_mask=[1] * len(turns),
                                logprobs=[0.0] * len(turns), versions=[0] * len(turns),
                                steps=[Step(None, 1 + i, 1, "stop", reward=r) for i, r in enumerate(turns)])
        return Episode("t", [trajectory], reward=outcome)

    class Rollout:
        async def run_group(self, task, n, epoch, replay):
            return [episode(1.0, [0.0, -1.0]), episode(0.0, [0.5])]

    def advantages(overrides: list[str]) -> list[float]:
        cfg = load_config(None, ["task.name=addition", f"output_dir={tmp_path}", "group_size=2", *overrides])
        loop = RolloutLoop(cfg, [Task("t", "q")], 0, Watchdog(cfg.watchdog))
        loop.in_flight[1] = Draw(0, 0, 1)

        async def one_group():  # what RolloutLoop.run does for one task, without its task stream
            await loop.gate.acquire()
            await loop._group(Rollout(), loop.tasks[0], 0, 1, lambda: 0.0, lambda e: None, lambda *a: None)
            return await loop.buffer.take(1, 0)

        [ready] = asyncio.run(one_group())
        return ready.group.advantages

    grpo = advantages(["algorithm.advantage=grpo"])
    assert grpo == pytest.approx([-0.25 / (math.sqrt(0.125) + 1e-6), 0.25 / (math.sqrt(0.125) + 1e-6)], rel=1e-6)
    assert advantages(["algorithm.advantage=gae", "critic.value_clip=0.2"]) == [1.0, 0.0]
