"""The OpenAI-compatible gateway, driven by the official ``openai`` SDK: plain chats,
a tool round trip recorded token-exact, an abort for a weight update inside a tool
episode, many sessions at once, and every refusal in OpenAI's error shape. Each test
starts its gateway on a free port and stops it, also when it fails."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json

import aiohttp
import pytest
import torch
from conftest import reference_logprobs
from openai import AsyncOpenAI
from tolerances import assert_same_logprobs

from asyncrl.engine import TorchEngine
from asyncrl.rollout.client import LLMClient, stop_token_ids
from asyncrl.rollout.gateway import Gateway, get_format, hermes
from asyncrl.tiny import chat_prompt_ids
from asyncrl.types import Completion, SamplingParams

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL_TEXT = '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>'  # spacing the SDK will not echo


class ScriptedFirstReply:
    """The real engine, except that its first reply is a tool call written here (a random
    tiny model does not write one), carrying the real model's logprobs for those tokens."""
    max_context = 1 << 30  # the engine contract's context: no bound that matters here

    def __init__(self, engine: TorchEngine, tokenizer, text: str) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.script = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        self.calls = 0

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def stats(self):
        return self.engine.stats

    async def generate(self, prompt_ids, sampling):
        self.calls += 1
        if self.calls > 1:
            return await self.engine.generate(prompt_ids, sampling)
        lps = reference_logprobs(self.engine.model, list(prompt_ids), self.script).tolist()
        return Completion(list(self.script), lps, [self.engine.version] * len(self.script), "stop")


@contextlib.asynccontextmanager
async def serving(model, tokenizer, max_tokens=16):
    engine = TorchEngine(model, max_batch_size=64)
    sampling = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids(tokenizer))
    gateway = Gateway(tokenizer, get_format("hermes"), model_name="tiny", engine=engine, sampling=sampling)
    await gateway.start()
    try:
        yield gateway, engine, sampling
    finally:
        await gateway.stop()
        await engine.shutdown()


def sdk(base_url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)


@pytest.mark.equivalence
def test_plain_chat_streaming_and_logprobs(tiny_policy):
    model, tokenizer = tiny_policy
    messages = [{"role": "user", "content": "3 5 7 -> 22"}]

    async def main():
        async with serving(model, tokenizer) as (gateway, _, _):
            client = sdk(f"{gateway.base_url}/v1")
            plain = await client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                                         max_tokens=12, logprobs=True)
            stream = await client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                                          max_tokens=12, stream=True)
            streamed, usage = "", None
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    streamed += chunk.choices[0].delta.content
                usage = getattr(chunk, "usage", None) or usage
            models = await client.models.list()
            return plain, streamed, usage, models

    plain, streamed, usage, models = asyncio.run(main())
    choice = plain.choices[0]
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    assert streamed == choice.message.content  # the same reply, streamed
    assert usage.completion_tokens == plain.usage.completion_tokens == len(choice.logprobs.content)
    prompt = chat_prompt_ids(tokenizer, messages)
    assert plain.usage.prompt_tokens == len(prompt)
    sampled = tokenizer.encode("".join(t.token for t in choice.logprobs.content), add_special_tokens=False)
    expected = reference_logprobs(model, prompt, sampled)  # greedy: log-softmax of the raw logits
    assert_same_logprobs([t.logprob for t in choice.logprobs.content], expected, model, len(prompt) + len(sampled))
    assert [m.id for m in models.data] == ["tiny"]


async def tool_episode(gateway, llm, during_second_turn=None):
    """An agent as users write them: call, run the tool, send its result, get the answer."""
    async with gateway.session(llm) as base_url:
        client = sdk(base_url)
        messages = [{"role": "user", "content": "2 3 -> 5"}]
        first = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        messages.append(first.choices[0].message.model_dump())  # as the SDK hands it back, None fields included
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
        second = asyncio.create_task(client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS))
        if during_second_turn is not None:
            await during_second_turn()
        return first, await second


@pytest.mark.equivalence
def test_a_tool_round_trip_is_recorded_token_exact(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            scripted = ScriptedFirstReply(engine, tokenizer, CALL_TEXT)
            llm = LLMClient(scripted, tokenizer, sampling)
            first, second = await tool_episode(gateway, llm)
            return first, second, llm, scripted

    first, second, llm, scripted = asyncio.run(main())
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert isinstance(second.choices[0].message.content, str)

    [trajectory] = llm.trajectories  # the second call extended the first: one trajectory
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "2 3 -> 5"}], TOOLS)
    assert trajectory.prompt_ids == prompt
    n1 = len(scripted.script)
    ids, mask = trajectory.response_ids, trajectory.loss_mask
    assert ids[:n1] == scripted.script and mask[:n1] == [1] * n1  # the sampled ids, untouched
    n2 = second.usage.completion_tokens
    template = ids[n1:len(ids) - n2]  # between the two replies: only the template's own tokens
    assert mask[n1:len(ids) - n2] == [0] * len(template) and mask[len(ids) - n2:] == [1] * n2
    assert tokenizer.decode(template) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    lps = torch.tensor(trajectory.logprobs)
    reference = reference_logprobs(model, prompt, ids)
    model_tokens = torch.tensor(mask, dtype=torch.bool)
    assert_same_logprobs(lps[model_tokens], reference[model_tokens], model, len(prompt) + len(ids))
    assert set(lps[~model_tokens].tolist()) == {0.0}


@pytest.mark.equivalence
def test_an_abort_inside_the_second_turn_stays_inside_the_gateway(tiny_policy):
    model, tokenizer = tiny_policy
    old = copy.deepcopy(model)
    torch.manual_seed(5)
    new_weights = {k: v + 0.1 * torch.randn_like(v) for k, v in model.named_parameters()}

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, _):
            scripted = ScriptedFirstReply(engine, tokenizer, CALL_TEXT)
            llm = LLMClient(scripted, tokenizer, SamplingParams(max_tokens=120))  # no stop token: runs to length

            async def weight_update():
                while engine.stats.tokens < 20:
                    await asyncio.sleep(0.001)
                await engine.pause("abort")
                await engine.update_weights(new_weights, version=1)
                await engine.resume()

            first, second = await tool_episode(gateway, llm, weight_update)
            return second, llm, scripted

    second, llm, scripted = asyncio.run(main())
    assert second.choices[0].finish_reason == "length"  # one normal reply: the abort never showed
    assert second.usage.completion_tokens == 120  # the budget was the remainder after the resume
    [trajectory] = llm.trajectories
    n1 = len(scripted.script)
    tail = trajectory.versions[len(trajectory.versions) - 120:]
    k = tail.count(0)
    assert k >= 20 and tail == [0] * k + [1] * (120 - k)  # versions switch exactly at the update
    assert trajectory.num_resumes == 1 and trajectory.versions[:n1] == [0] * n1
    ids, lps = trajectory.response_ids, torch.tensor(trajectory.logprobs)
    prompt = trajectory.prompt_ids
    start = len(ids) - 120
    positions = len(prompt) + len(ids)
    assert_same_logprobs(lps[start:start + k], reference_logprobs(old, prompt, ids)[start:start + k], old, positions)
    assert_same_logprobs(lps[start + k:], reference_logprobs(model, prompt, ids)[start + k:], model, positions)


def test_64_concurrent_sessions_keep_their_own_calls(tiny_policy):
    model, tokenizer = tiny_policy

    async def agent(gateway, llm, i):
        async with gateway.session(llm) as base_url:
            client = sdk(base_url)
            messages = [{"role": "user", "content": f"{i} 1 -> {i + 1}"}]
            reply = await client.chat.completions.create(model="tiny", messages=messages)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": f"again {i}"}]
            await client.chat.completions.create(model="tiny", messages=messages)

    async def main():
        async with serving(model, tokenizer, max_tokens=8) as (gateway, engine, sampling):
            clients = [LLMClient(engine, tokenizer, sampling) for _ in range(64)]
            await asyncio.gather(*[agent(gateway, llm, i) for i, llm in enumerate(clients)])
            return clients, len(gateway.sessions)

    clients, open_sessions = asyncio.run(main())
    assert open_sessions == 0
    for i, llm in enumerate(clients):
        [trajectory] = llm.trajectories
        text = tokenizer.decode(trajectory.prompt_ids + trajectory.response_ids)
        assert f"{i} 1 -> {i + 1}" in text and f"again {i}<" in text and len(trajectory.steps) == 2
        assert not any(f"again {j}<" in text for j in range(64) if j != i)


def test_refusals_come_back_in_openai_shape_and_the_server_keeps_serving(tiny_policy):
    model, tokenizer = tiny_policy
    good = {"model": "tiny", "messages": [{"role": "user", "content": "1 2 -> 3"}]}
    cases = [
        ("/sessions/nope/v1/chat/completions", good, 404, "no session 'nope'"),
        ("/v1/chat/completions", "{not json", 400, "not JSON"),
        ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
        ("/v1/chat/completions", {**good, "temperature": "hot"}, 400, "temperature"),
        ("/v1/chat/completions", {**good, "n": 2}, 400, "n > 1"),
        ("/v1/chat/completions", {**good, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        ("/v1/chat/completions", {**good, "messages": [{"role": "user", "content": "x" * 600}]}, 400,
         "the model's context holds 512"),
    ]

    async def main():
        results = []
        async with serving(model, tokenizer) as (gateway, engine, _), aiohttp.ClientSession() as http:
            for path, body, status, fragment in cases:
                data = body if isinstance(body, str) else json.dumps(body)
                async with http.post(gateway.base_url + path, data=data) as r:
                    results.append((r.status, await r.json(), status, fragment))
                async with http.get(gateway.base_url + "/health") as r:
                    assert r.status == 200
            await engine.shutdown()  # a dead engine: 503, and the server still answers
            async with http.post(gateway.base_url + "/v1/chat/completions", json=good) as r:
                results.append((r.status, await r.json(), 503, "engine has stopped"))
            async with http.get(gateway.base_url + "/health") as r:
                assert r.status == 200
        return results

    for got, body, status, fragment in asyncio.run(main()):
        assert got == status, body
        assert set(body["error"]) == {"message", "type", "param", "code"} and fragment in body["error"]["message"]


@pytest.mark.parametrize("text, content, calls, error", [
    ('hi <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "hi", [("f", {"x": 1})], None),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", {"x": 1})], None),
    ("plain answer", "plain answer", [], None),
    ('<tool_call>{"name": "f", "arguments": {</tool_call>', None, [], "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', None, [], "no 'name'"),
    ('<tool_call>{"name": "f"}', None, [], "unclosed"),
])
def test_hermes_parser(text, content, calls, error):
    parsed = hermes(text)
    if error:  # a broken call is the reply as plain text, never an exception
        assert parsed.content == text and not parsed.tool_calls and error in parsed.error
    else:
        assert parsed.content == content and parsed.error is None
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls


def test_a_broken_tool_call_is_plain_content_and_counted(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            llm = LLMClient(ScriptedFirstReply(engine, tokenizer, '<tool_call>{"name": "add", '), tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                reply = await sdk(base_url).chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "2 3 -> 5"}], tools=TOOLS)
            return reply, gateway.counts

    reply, counts = asyncio.run(main())
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == '<tool_call>{"name": "add", '
    assert counts["tool_parse_errors"] == 1


def test_training_sessions_keep_the_runs_sampling_and_say_so(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            llm = LLMClient(engine, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                raw = await sdk(base_url).chat.completions.with_raw_response.create(
                    model="tiny", messages=[{"role": "user", "content": "1 2 -> 3"}], temperature=0.3, seed=7,
                    max_tokens=4)
            return raw.headers.get("x-asyncrl-sampling"), raw.parse(), gateway.counts, llm

    header, reply, counts, llm = asyncio.run(main())
    assert "temperature=0.3 overridden by the run's 1.0" in header and "seed ignored" in header
    assert header in reply.system_fingerprint and counts["sampling_overrides"] == 1
    assert reply.usage.completion_tokens <= 4  # max_tokens is honoured (up to the run's cap)
    assert len(llm.trajectories[0].response_ids) == reply.usage.completion_tokens
