"""Token-exact on a real model and a real BPE tokenizer: SmolLM2-135M-Instruct (fp32, CPU,
49,152-entry byte-level BPE, ChatML), where re-tokenizing text really does change ids.

One tool episode through the gateway, driven by the official ``openai`` SDK as an agent
writes it, with an abort for a weight update inside its second reply; then what the
learner recomputes from the recorded trajectory — through the code path training uses
(``pack_batch`` → ``Learner.logprobs``) — must match the engine's behavior logprobs, each token
against the weights that sampled it. And ``bench retokenize`` on a few chats.

The model is loaded once per module and the episode run once (``episode``); replies are
short, so the file stays well under a minute on two shared cores. Run with ``-s`` to see
the measured differences.
"""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import SpyEngine
from openai.types.chat import ChatCompletion
from real_model import smollm2_dir  # noqa: F401 (a fixture)
from test_gateway import ScriptedFirstReply, sdk, serving
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.bench.retokenize import Render, naive_text, retokenization_drift, run_retokenize_bench
from asyncrl.rollout.client import LLMClient, stop_token_ids
from asyncrl.config import AlgorithmConfig, OptimConfig
from asyncrl.learner.batch import pack_batch
from asyncrl.learner.learner import Learner
from asyncrl.types import NO_VERSION, Completion, SamplingParams, Trajectory

TOOLS = [{"type": "function", "function": {"name": "calculate", "description": "Evaluate an arithmetic expression",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}},
                                                          "required": ["expression"]}}}]
QUESTION = "What is 12.5% of 3,480? Use the calculator."
CALL_TEXT = '<tool_call>{"name": "calculate", "arguments": {"expression": "0.125 * 3480"}}</tool_call>'
# digits, runs of spaces, newlines, a tab, punctuation and non-ASCII: text BPE segments in many ways
TOOL_RESULT = "  435.0\n\n(= 12.5 % × 3 480 — ≈ 4.35e2; «ok» ✓ 東京)\t"
SECOND_REPLY_TOKENS = 24
ABORT_AFTER = 4  # engine tokens of the second reply before the weight update
SEED = 0  # the run's request seed: on the old weights this reply runs 48 tokens without ending, so the
# update lands inside it whatever the machine's speed (the tokens before the abort depend on the seed alone)
TOLERANCE = 1e-3
"""|learner - engine| on a logprob, both fp32 on CPU. Not bit-exact: the engine decodes one
token at a time against a KV cache (other matmul shapes, another summation order in
attention and every projection) while the learner runs one forward over the whole
sequence; over 30 layers that moved a logprob by at most 0.7-2.2e-5 (three seeds here; the
max is printed). 1e-3 leaves room for other CPU kernels and is still hundreds of times below
what the weight update changes (0.4-0.7, also checked), so a token scored against the
wrong weights, or shifted by one position, cannot pass."""


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:  # noqa: F811 (the fixture)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


@dataclass
class Episode:
    trajectories: list[Trajectory]
    old: PreTrainedModel  # the weights of version 0
    new: PreTrainedModel  # the engine's model, holding version 1's weights after the update
    tokenizer: PreTrainedTokenizerBase
    script: list[int]  # the first reply's ids (a scripted tool call)
    calls: list[tuple[list[int], Completion]]  # what the engine served in the second turn
    first: ChatCompletion  # the agent's replies, as the SDK handed them over
    second: ChatCompletion
    render: Render  # the client's own template rendering


@pytest.fixture(scope="module")
def episode(smollm2: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> Episode:
    """The agent: call with tools, run the tool the model called, send the result back and
    get the answer; a weight update (abort, load, resume) lands inside that answer."""
    old, tokenizer = smollm2
    engine_model = copy.deepcopy(old)
    generator = torch.Generator().manual_seed(0)
    new_weights = {k: v + 0.02 * v.std() * torch.randn(v.shape, generator=generator)
                   for k, v in old.named_parameters()}

    async def main():
        async with serving(engine_model, tokenizer) as (gateway, engine, _):
            spy = SpyEngine(engine)
            scripted = ScriptedFirstReply(spy, tokenizer, CALL_TEXT)
            llm = LLMClient(scripted, tokenizer, SamplingParams(
                max_tokens=SECOND_REPLY_TOKENS, stop_token_ids=stop_token_ids(tokenizer), seed=SEED))

            async def weight_update(second: asyncio.Task) -> None:
                while engine.stats.tokens < ABORT_AFTER and not second.done():  # done: the asserts say why
                    await asyncio.sleep(0.001)
                await engine.pause("abort")
                await engine.update_weights(new_weights, version=1)
                await engine.resume()

            async with gateway.session(llm) as base_url:
                client = sdk(base_url)
                messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
                first = await client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS)
                call = first.choices[0].message.tool_calls[0]
                messages.append(first.choices[0].message.model_dump())  # None fields included, as agents do
                messages.append({"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT})
                second = asyncio.create_task(client.chat.completions.create(
                    model="smollm2", messages=messages, tools=TOOLS, logprobs=True))
                await weight_update(second)
                second = await second
            return Episode(llm.trajectories, old, engine_model, tokenizer, scripted.script, spy.calls, first, second,
                           lambda m, prompt: llm.render(m, TOOLS, generation_prompt=prompt))

    return asyncio.run(main())


@pytest.mark.slow
def test_a_tool_episode_with_an_abort_is_token_exact_and_the_learner_reproduces_its_logprobs(episode):
    e = episode
    [t] = e.trajectories  # the second call extended the first
    tokenizer = e.tokenizer
    call = e.first.choices[0].message.tool_calls[0]
    assert call.function.name == "calculate" and json.loads(call.function.arguments) == {"expression": "0.125 * 3480"}
    assert QUESTION in tokenizer.decode(t.prompt_ids)

    ids, mask, lps, versions = t.response_ids, t.loss_mask, t.logprobs, t.versions
    n1, n2 = len(e.script), e.second.usage.completion_tokens  # one reply: the abort never showed
    assert n2 <= SECOND_REPLY_TOKENS
    # the first reply: the ids as written, version 0 (its logprobs are checked by the learner below)
    assert ids[:n1] == e.script and mask[:n1] == [1] * n1 and versions[:n1] == [0] * n1
    # between the replies: the template's and the tool's text, no loss, no logprob, no version
    between = slice(n1, len(ids) - n2)
    assert mask[between] == [0] * len(ids[between]) and set(lps[between]) == {0.0}
    assert set(versions[between]) == {NO_VERSION}
    assert TOOL_RESULT in tokenizer.decode(ids[between])
    # the second reply: exactly what the engine sampled, over the abort and the resume
    (prompt_a, part_a), (prompt_b, part_b) = e.calls  # the aborted part and the resumed one
    assert part_a.finish_reason == "abort" and prompt_a == t.prompt_ids + ids[:len(ids) - n2]
    assert prompt_b == prompt_a + part_a.token_ids  # resumed with prompt + partial tokens
    k = len(part_a.token_ids)
    assert ids[-n2:] == part_a.token_ids + part_b.token_ids and mask[-n2:] == [1] * n2
    assert lps[-n2:] == part_a.logprobs + part_b.logprobs
    assert 0 < k < n2 and versions[-n2:] == [0] * k + [1] * (n2 - k) and t.num_resumes == 1
    agent_seen = [c.logprob for c in e.second.choices[0].logprobs.content]
    assert agent_seen == pytest.approx(lps[-n2:], abs=1e-6)  # what the agent was shown is what was recorded

    # the learner's recompute, as the trainer does it: pack the trajectory, Learner.logprobs
    learner = Learner(e.old, tokenizer, algorithm=AlgorithmConfig(), optim=OptimConfig(), total_steps=1,
                      temperature=1.0)
    batch = pack_batch([t], [1.0], tokenizer.pad_token_id or 0)
    target_versions = torch.tensor([NO_VERSION] * (len(t.prompt_ids) - 1) + versions)  # on the target axis
    model_token = batch.loss_mask[0].bool()
    behavior = batch.behavior_logprobs[0]
    old_lp, new_lp = learner.logprobs(e.old, batch)[0], learner.logprobs(e.new, batch)[0]
    v0, v1 = model_token & (target_versions == 0), model_token & (target_versions == 1)
    assert int(v0.sum()) == n1 + k and int(v1.sum()) == n2 - k
    sampled_v0 = v0.clone()
    sampled_v0[:len(t.prompt_ids) - 1 + n1] = False  # version 0, sampled (the script's came from a full forward)
    diff_v0 = (old_lp[v0] - behavior[v0]).abs().max().item()
    diff_sampled_v0 = (old_lp[sampled_v0] - behavior[sampled_v0]).abs().max().item()
    diff_v1 = (new_lp[v1] - behavior[v1]).abs().max().item()
    moved = (old_lp[v1] - behavior[v1]).abs().max().item()  # version 1's tokens against the old weights
    print(f"\nlearner vs engine, max |Δ logprob|: version 0 {diff_v0:.2e} (sampled ones {diff_sampled_v0:.2e}), "
          f"version 1 {diff_v1:.2e}; version-1 tokens scored on the old weights {moved:.2e} "
          f"({n1} scripted + {k} sampled at v0, {n2 - k} at v1)")
    assert diff_v0 <= TOLERANCE and diff_v1 <= TOLERANCE
    assert moved > 10 * TOLERANCE  # the update changes logprobs far more than the tolerance allows


@pytest.mark.slow
def test_naive_retokenization_of_the_episode_and_the_recorded_ids(episode):
    """What a stack that keeps only text would train on: the conversation with its replies
    as text, rendered and encoded again. Recorded, not asserted: whether it drifts here
    depends on what the model sampled. What is asserted is that the trajectory holds the
    sampled ids themselves."""
    e = episode
    [t], tokenizer = e.trajectories, e.tokenizer
    sampled = [i for _, c in e.calls for i in c.token_ids]
    assert [i for i, m in zip(t.response_ids, t.loss_mask) if m] == e.script + sampled
    conversation = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": CALL_TEXT},
                    {"role": "tool", "content": TOOL_RESULT},
                    {"role": "assistant", "content": e.second.choices[0].message.content or ""}]
    text, spans = naive_text(e.render, conversation)
    drift = retokenization_drift(tokenizer, t.prompt_ids + t.response_ids, text, spans)
    print(f"\nnaive re-tokenization of the episode: {'same ids' if drift is None else drift}")


@pytest.mark.slow
def test_bench_retokenize_counts_add_up(smollm2_dir: Path):  # noqa: F811 (the fixture)
    result = run_retokenize_bench([f"model.path={smollm2_dir}", "num_conversations=4", "reply_tokens=8",
                                   "max_batch_size=4"])
    assert {"num_conversations", "retokenized_differs", "retokenized_differs_fraction", "first_difference",
            "by_kind", "examples", "tokens_per_s"} <= set(result)
    n, differs = result["num_conversations"], result["retokenized_differs"]
    assert n == 4 and 0 <= differs <= n and sum(result["first_difference"].values()) == differs
    assert result["retokenized_differs_fraction"] == differs / n
    assert sum(v["conversations"] for v in result["by_kind"].values()) == n
    assert sum(v["differs"] for v in result["by_kind"].values()) == differs
    assert len(result["examples"]) <= min(3, differs)
    assert 0 < result["tokens_sampled"] <= n * 2 * 8 and result["tokens_per_s"] > 0
