"""The client: token-exact multi-turn, masks, no aliasing, hidden partial-rollout resume."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from conftest import SpyEngine, reference_logprobs
from tolerances import assert_same_logprobs

from asyncrl.engine import TorchEngine
from asyncrl.rollout.client import LLMClient
from asyncrl.types import NO_VERSION, SamplingParams

SAMPLING = SamplingParams(max_tokens=12, temperature=1.0)


def run_chat(model, tokenizer, turns):
    """Drive a conversation: user asks, model answers, a tool answers, model answers again."""
    async def main():
        spy = SpyEngine(TorchEngine(model, max_batch_size=4, seed=1))
        llm = LLMClient(spy, tokenizer, SAMPLING)
        messages = [{"role": "user", "content": "3 5 7 -> 22"}]
        seen = []
        for turn in range(turns):
            response = await llm.chat(messages)
            seen.append(copy.deepcopy(messages))
            messages.append(response.message)
            messages.append({"role": "tool", "content": f"result {turn}"})
        await spy.engine.shutdown()
        return llm, spy, seen, messages

    return asyncio.run(main())


@pytest.mark.equivalence
def test_multi_turn_masks_and_exact_ids(tiny_policy):
    model, tokenizer = tiny_policy
    llm, spy, seen, _ = run_chat(model, tokenizer, turns=3)
    assert len(llm.trajectories) == 1
    traj = llm.trajectories[0]
    first_prompt, _ = spy.calls[0]
    assert traj.prompt_ids == first_prompt
    assert tokenizer.decode(first_prompt) == "<|im_start|>user\n3 5 7 -> 22<|im_end|>\n<|im_start|>assistant\n"

    # Walk the response: each engine call contributes its exact ids with mask 1; what lies
    # between two calls is environment text with mask 0, logprob 0 and no version.
    pos = 0
    for i, (prompt, completion) in enumerate(spy.calls):
        assert prompt == traj.prompt_ids + traj.response_ids[:pos]  # the engine saw exactly the history
        n = len(completion.token_ids)
        assert traj.response_ids[pos:pos + n] == completion.token_ids
        assert traj.loss_mask[pos:pos + n] == [1] * n
        assert traj.logprobs[pos:pos + n] == completion.logprobs
        pos += n
        if i + 1 < len(spy.calls):
            gap = len(spy.calls[i + 1][0]) - len(prompt) - n
            assert gap > 0
            assert traj.loss_mask[pos:pos + gap] == [0] * gap
            assert traj.logprobs[pos:pos + gap] == [0.0] * gap
            assert traj.versions[pos:pos + gap] == [NO_VERSION] * gap
            env_text = tokenizer.decode(traj.response_ids[pos:pos + gap])
            assert env_text.endswith(f"<|im_start|>tool\nresult {i}<|im_end|>\n<|im_start|>assistant\n")
            pos += gap
    assert pos == len(traj.response_ids)
    assert len(traj.steps) == 3

    # The learner's recompute over the whole stitched sequence reproduces every model
    # token's behavior logprob (environment tokens are masked out).
    ref = reference_logprobs(model, traj.prompt_ids, traj.response_ids)
    mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
    positions = len(traj.prompt_ids) + len(traj.response_ids)
    assert_same_logprobs(torch.tensor(traj.logprobs)[mask], ref[mask], model, positions)


def test_steps_keep_their_own_messages(tiny_policy):
    model, tokenizer = tiny_policy
    llm, _, seen, messages = run_chat(model, tokenizer, turns=2)
    steps = llm.trajectories[0].steps
    assert [s.messages for s in steps] == seen
    assert steps[0].messages is not steps[1].messages
    assert len(steps[0].messages) == 1 and len(steps[1].messages) == 3
    messages[0]["content"] = "mutated later"  # the workflow mutates its list afterwards
    assert steps[0].messages[0]["content"] == "3 5 7 -> 22"
    assert steps[1].messages[0]["content"] == "3 5 7 -> 22"


def test_chat_that_does_not_extend_opens_new_trajectory(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        engine = TorchEngine(model)
        llm = LLMClient(engine, tokenizer, SAMPLING)
        await llm.chat([{"role": "user", "content": "1+1="}])
        await llm.chat([{"role": "user", "content": "2+2="}])
        await llm.generate("3+3=")
        await engine.shutdown()
        return llm

    llm = asyncio.run(main())
    assert len(llm.trajectories) == 3
    assert all(t.loss_mask and set(t.loss_mask) == {1} for t in llm.trajectories)


@pytest.mark.equivalence
def test_abort_resume_is_stitched_token_for_token(tiny_policy):
    model, tokenizer = tiny_policy
    old_model = copy.deepcopy(model)
    torch.manual_seed(3)
    new_weights = {k: v + 0.1 * torch.randn_like(v) for k, v in model.named_parameters()}
    sampling = SamplingParams(max_tokens=150, temperature=1.0)  # no stop token: runs to length

    async def main():
        engine = TorchEngine(model, max_batch_size=4)
        spy = SpyEngine(engine)
        llm = LLMClient(spy, tokenizer, sampling)
        task = asyncio.create_task(llm.generate("3 5 7 -> 22"))
        while engine.stats.tokens < 20:
            await asyncio.sleep(0.001)
        await engine.pause("abort")
        await engine.update_weights(new_weights, version=1)
        await engine.resume()
        response = await task
        await engine.shutdown()
        return llm, spy, response

    llm, spy, response = asyncio.run(main())
    traj = llm.trajectories[0]
    (p0, c0), (p1, c1) = spy.calls
    assert c0.finish_reason == "abort" and c1.finish_reason == "length"
    assert p1 == p0 + c0.token_ids  # resubmitted prompt + partial tokens
    assert traj.prompt_ids == p0
    assert traj.response_ids == c0.token_ids + c1.token_ids == response.token_ids
    assert len(traj.response_ids) == 150  # the budget was the remainder, not a fresh 150
    assert traj.logprobs == c0.logprobs + c1.logprobs
    k = len(c0.token_ids)
    assert k >= 20 and traj.versions == [0] * k + [1] * (150 - k)  # the switch is exactly at the update
    assert traj.resumed and traj.num_resumes == 1 and traj.finish_reason == "length"
    # Before the update the old weights sampled, after it the new ones (with a fresh prefill).
    ids, lps = traj.response_ids, torch.tensor(traj.logprobs)
    assert_same_logprobs(lps[:k], reference_logprobs(old_model, p0, ids)[:k], old_model, len(p0) + len(ids))
    assert_same_logprobs(lps[k:], reference_logprobs(model, p0, ids)[k:], model, len(p0) + len(ids))


def test_a_groups_prompt_is_rendered_once_and_again_when_the_template_changes(tiny_policy, monkeypatch):
    """The n samples of a group open with the same messages: one render between them. A
    changed template, or messages the cache cannot key (not JSON), render afresh."""
    model, tokenizer = tiny_policy
    tokenizer = copy.deepcopy(tokenizer)  # its own cache entries and template
    renders = []
    real_render = LLMClient.render
    monkeypatch.setattr(LLMClient, "render", lambda self, *a, **k: renders.append(a) or real_render(self, *a, **k))
    messages = [{"role": "user", "content": "3 5 7 -> 22"}]

    async def prompts(msgs, n):
        engine = TorchEngine(model, max_batch_size=4, seed=1)
        try:
            clients = [LLMClient(engine, tokenizer, SAMPLING) for _ in range(n)]
            for llm in clients:
                await llm.chat(copy.deepcopy(msgs))
            return [llm.trajectories[0].prompt_ids for llm in clients]
        finally:
            await engine.shutdown()

    first = asyncio.run(prompts(messages, 3))
    assert len(renders) == 1 and first[0] == first[1] == first[2]
    assert first[0] is not first[1]  # each trajectory its own list
    assert tokenizer.decode(first[0]) == "<|im_start|>user\n3 5 7 -> 22<|im_end|>\n<|im_start|>assistant\n"
    tokenizer.chat_template = tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> ")
    changed = asyncio.run(prompts(messages, 2))
    assert len(renders) == 2 and changed[0] != first[0] and changed[0] == changed[1]
    odd = [{"role": "user", "content": "3 5 7 -> 22", "meta": object()}]  # not JSON: no key, rendered each time
    asyncio.run(prompts(odd, 2))
    assert len(renders) == 4
