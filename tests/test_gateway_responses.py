"""The Responses API on the gateway (``/v1/responses``), driven by the official ``openai``
SDK and by ``openai-agents`` in its default (Responses) mode: a function tool round trip
recorded token-exact — the assistant turns' tokens are the ones the engine sampled, the
tool result and the template's tokens masked — streamed and not, ``previous_response_id``
within a session, reasoning items, and refusals in OpenAI's error shape. Each test
starts its gateway on a free port and stops it, also when it fails."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest
import torch
from conftest import reference_logprobs
from openai import AsyncOpenAI, BadRequestError
from test_gateway import CALL_TEXT, sdk, serving
from test_gateway_requests import THINK_TEMPLATE, Scripted, tokenizer_with

from asyncrl.rollout.client import LLMClient
from asyncrl.tiny import chat_prompt_ids

FUNCTION = {"type": "function", "name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
CHAT_TOOLS = [{"type": "function", "function": {k: FUNCTION[k] for k in ("name", "description", "parameters")}}]
INSTRUCTIONS = "Add."
USER = "2 3 -> 5"
ANSWER = "5"


class Sampled(Scripted):
    """``Scripted``, keeping every completion the engine handed out (the scripted ones and
    the model's own): what the trajectory's trained tokens must be."""

    def __init__(self, engine, tokenizer, *texts: str) -> None:
        super().__init__(engine, tokenizer, *texts)
        self.completions: list = []

    async def generate(self, prompt_ids, sampling):
        completion = await super().generate(prompt_ids, sampling)
        self.completions.append(completion)
        return completion


def assert_token_exact(trajectory, engine: Sampled, tokenizer, model, between: list[str]) -> None:
    """The trajectory is the engine's completions, in order, with mask 1 and their own
    logprobs, and between them only environment tokens (mask 0, logprob 0) decoding to
    ``between``: the tool results and the template's tokens."""
    ids, mask = trajectory.response_ids, trajectory.loss_mask
    assert len(engine.completions) == len(between) + 1
    at = 0
    for i, completion in enumerate(engine.completions):
        n = len(completion.token_ids)
        assert ids[at:at + n] == completion.token_ids and mask[at:at + n] == [1] * n
        assert trajectory.logprobs[at:at + n] == pytest.approx(completion.logprobs)
        at += n
        if i < len(between):
            gap = tokenizer.encode(between[i], add_special_tokens=False)
            assert ids[at:at + len(gap)] == gap and mask[at:at + len(gap)] == [0] * len(gap)
            assert set(trajectory.logprobs[at:at + len(gap)]) == {0.0}
            at += len(gap)
    assert at == len(ids)
    trained = torch.tensor(mask, dtype=torch.bool)  # and those logprobs are the policy's
    reference = reference_logprobs(model, trajectory.prompt_ids, ids)
    torch.testing.assert_close(torch.tensor(trajectory.logprobs)[trained], reference[trained], atol=1e-4, rtol=1e-4)


def tool_turn(result: str) -> str:
    """What the chat template writes between a reply and the next: the tool's result."""
    return f"\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"


def test_a_function_tool_round_trip_is_recorded_token_exact(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            scripted = Sampled(engine, tokenizer, CALL_TEXT, ANSWER)
            llm = LLMClient(scripted, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                client = sdk(base_url)
                first = await client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=USER,
                                                      tools=[FUNCTION])
                [call] = [item for item in first.output if item.type == "function_call"]
                items = [{"role": "user", "content": USER}, *[i.model_dump() for i in first.output],
                         {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
                second = await client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=items,
                                                       tools=[FUNCTION])
            return first, second, llm, scripted

    first, second, llm, scripted = asyncio.run(main())
    assert first.status == "completed" and [i.type for i in first.output] == ["function_call"]
    call = first.output[0]
    assert call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3} and call.call_id.startswith("call_")
    assert second.output_text == ANSWER and [i.type for i in second.output] == ["message"]
    assert first.usage.output_tokens == len(scripted.completions[0].token_ids)

    [trajectory] = llm.trajectories  # the second call continued the first
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": USER}]
    assert trajectory.prompt_ids == chat_prompt_ids(tokenizer, messages, CHAT_TOOLS)
    assert_token_exact(trajectory, scripted, tokenizer, model, [tool_turn("5")])


async def streamed_events(client: AsyncOpenAI, **fields) -> list:
    stream = await client.responses.create(model="tiny", stream=True, **fields)
    return [event async for event in stream]


def test_a_stream_sends_the_events_the_sdk_parses_and_adds_up_to_the_reply(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer, max_tokens=12) as (gateway, engine, sampling):
            scripted = Sampled(engine, tokenizer, "I call. " + CALL_TEXT)
            llm = LLMClient(scripted, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                client = sdk(base_url)
                calls = await streamed_events(client, input=USER, tools=[FUNCTION])
                # the model's own text, token by token (real engine), after the call's result
                prior = calls[-1].response.id
                text = await streamed_events(client, previous_response_id=prior, tools=[FUNCTION], input=[
                    {"type": "function_call_output", "call_id": calls[-1].response.output[1].call_id,
                     "output": "5"}])
            plain = sdk(gateway.base_url + "/v1")  # greedy, streamed and not
            unstreamed = await plain.responses.create(model="tiny", input=USER, temperature=0, max_output_tokens=8)
            greedy = await streamed_events(plain, input=USER, temperature=0, max_output_tokens=8)
            return calls, text, greedy, unstreamed, llm, scripted

    calls, text, greedy, unstreamed, llm, scripted = asyncio.run(main())
    kinds = [e.type for e in calls]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in calls] == list(range(len(calls)))
    done = calls[-1].response
    assert done.output[0].content[0].text == "I call." == calls[4].delta.strip()
    assert calls[10].arguments == done.output[1].arguments and json.loads(calls[10].arguments) == {"a": 2, "b": 3}
    assert calls[8].item.type == "function_call" and calls[8].item.call_id == done.output[1].call_id

    deltas = "".join(e.delta for e in text if e.type == "response.output_text.delta")
    final = text[-1].response
    assert text[-1].type in ("response.completed", "response.incomplete") and deltas == final.output_text
    [trajectory] = llm.trajectories  # previous_response_id continued the same conversation
    assert_token_exact(trajectory, scripted, tokenizer, model, [tool_turn("5")])
    assert len(trajectory.steps) == 2
    assert "".join(e.delta for e in greedy if e.type == "response.output_text.delta") == unstreamed.output_text
    assert greedy[-1].response.output_text == unstreamed.output_text and unstreamed.status == "incomplete"
    assert unstreamed.incomplete_details.reason == "max_output_tokens" and unstreamed.usage.output_tokens == 8


def test_reasoning_comes_back_as_a_reasoning_item_and_the_next_turn_goes_on_token_exact(tiny_policy):
    model, _ = tiny_policy
    tokenizer = tokenizer_with(THINK_TEMPLATE)
    reply = "<think>2 and 3</think>\n\n" + CALL_TEXT

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            scripted = Sampled(engine, tokenizer, reply, "<think>so</think>\n\n" + ANSWER)
            llm = LLMClient(scripted, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                client = sdk(base_url)
                first = await client.responses.create(model="tiny", input=USER, tools=[FUNCTION])
                items = [{"role": "user", "content": USER}, *[i.model_dump() for i in first.output],
                         {"type": "function_call_output", "call_id": first.output[1].call_id, "output": "5"}]
                stream = await streamed_events(client, input=items, tools=[FUNCTION])
            return first, stream, llm, scripted

    first, stream, llm, scripted = asyncio.run(main())
    assert [i.type for i in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == "2 and 3"
    thought = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
    final = stream[-1].response
    assert thought == "so" and [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output_text == ANSWER
    [trajectory] = llm.trajectories  # the reasoning item sent back meant the reply as sampled
    assert_token_exact(trajectory, scripted, tokenizer, model, [tool_turn("5")])


def test_an_openai_agents_agent_runs_one_episode_through_a_session(tiny_policy):
    """The Agents SDK's default model (``OpenAIResponsesModel``) against a session: the
    agent calls its tool, gets the result, answers; the episode is one trajectory."""
    agents = pytest.importorskip("agents")
    model, tokenizer = tiny_policy
    added = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """a + b"""
        added.append((a, b))
        return a + b

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            scripted = Sampled(engine, tokenizer, CALL_TEXT, ANSWER)
            llm = LLMClient(scripted, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                agents.set_tracing_disabled(True)
                agent = agents.Agent(name="adder", instructions=INSTRUCTIONS, tools=[add],
                                     model=agents.OpenAIResponsesModel("tiny", sdk(base_url)))
                result = await agents.Runner.run(agent, USER, max_turns=3)
            return result, llm, scripted

    result, llm, scripted = asyncio.run(main())
    assert added == [(2, 3)] and result.final_output == ANSWER
    [trajectory] = llm.trajectories
    assert_token_exact(trajectory, scripted, tokenizer, model, [tool_turn("5")])


def test_refusals_come_back_in_openai_shape(tiny_policy):
    model, tokenizer = tiny_policy
    cases = [({"input": []}, "input"),
             ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
              "input[0].content[0]"),
             ({"input": USER, "tools": [{"type": "web_search"}]}, "tools[0].type"),
             ({"input": USER, "previous_response_id": "resp_nope"}, "previous_response_id"),
             ({"input": USER, "text": {"format": {"type": "json_object"}}}, "text.format"),
             ({"input": USER, "max_output_tokens": 0}, "max_output_tokens"),
             ({"input": USER, "tool_choice": "required"}, "tool_choice"),
             ({"input": "x" * 600}, "input")]

    async def main():
        got = []
        async with serving(model, tokenizer) as (gateway, _, _), aiohttp.ClientSession() as http:
            for body, param in cases:
                async with http.post(gateway.base_url + "/v1/responses", json={"model": "tiny", **body}) as r:
                    got.append((r.status, await r.json(), param))
            try:
                await sdk(gateway.base_url + "/v1").responses.create(model="tiny", input="y" * 600)
            except BadRequestError as exc:
                got.append((exc.status_code, exc.body and {"error": exc.body}, "input"))
        return got

    for status, body, param in asyncio.run(main()):
        assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["param"] == param, body
    assert re.search(r"has 6\d\d tokens; the model's context holds 512", body["error"]["message"])  # both sizes
