"""The Anthropic Messages API on the gateway (``/v1/messages``), driven by the official
``anthropic`` SDK: tools and a ``tool_result`` round trip recorded token-exact, streamed
and not, the stop reasons, the ``x-api-key`` header, Anthropic's error shape; and one
conversation continued across the three dialects staying one trajectory. Each test
starts its gateway on a free port and stops it, also when it fails."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest
from test_gateway import CALL_TEXT, TOOLS, sdk, serving
from test_gateway_responses import ANSWER, FUNCTION, INSTRUCTIONS, USER, Sampled, assert_token_exact, tool_turn

from asyncrl.config import GatewayConfig
from asyncrl.engine import TorchEngine
from asyncrl.rollout.client import LLMClient, stop_token_ids
from asyncrl.rollout.gateway import Gateway, hermes
from asyncrl.tiny import chat_prompt_ids
from asyncrl.types import SamplingParams

anthropic = pytest.importorskip("anthropic")

TOOL = {"name": "add", "description": "a + b", "input_schema": FUNCTION["parameters"]}


def claude(base_url: str, **options) -> anthropic.AsyncAnthropic:
    """The SDK on a gateway or session URL (without ``/v1``: the SDK adds it)."""
    return anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), max_retries=0,
                                    **{"api_key": "unused", **options})


def test_a_tool_use_round_trip_is_recorded_token_exact_streamed_and_not(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            scripted = Sampled(engine, tokenizer, "I add. " + CALL_TEXT, ANSWER)
            llm = LLMClient(scripted, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                client = claude(base_url)
                messages = [{"role": "user", "content": USER}]
                first = await client.messages.create(model="tiny", max_tokens=64, system=INSTRUCTIONS,
                                                     messages=messages, tools=[TOOL])
                [use] = [block for block in first.content if block.type == "tool_use"]
                messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                           "content": [{"type": "text", "text": "5"}]}]}]
                async with client.messages.stream(model="tiny", max_tokens=64, system=INSTRUCTIONS,
                                                  messages=messages, tools=[TOOL]) as stream:
                    events = [event async for event in stream]
                    second = await stream.get_final_message()
            return first, events, second, llm, scripted

    first, events, second, llm, scripted = asyncio.run(main())
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["text", "tool_use"]
    assert first.content[0].text == "I add." and first.content[1].name == "add"
    assert first.content[1].input == {"a": 2, "b": 3} and first.content[1].id.startswith("call_")
    assert first.usage.output_tokens == len(scripted.completions[0].token_ids)
    assert second.stop_reason == "end_turn" and second.content[0].text == ANSWER
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == ANSWER

    [trajectory] = llm.trajectories  # the tool_use block sent back meant the reply as sampled
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": USER}]
    assert trajectory.prompt_ids == chat_prompt_ids(tokenizer, messages, TOOLS)
    assert_token_exact(trajectory, scripted, tokenizer, model, [tool_turn("5")])


def test_a_streamed_tool_use_arrives_as_input_json_and_the_real_engine_streams_text(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer, max_tokens=12) as (gateway, engine, sampling):
            llm = LLMClient(Sampled(engine, tokenizer, CALL_TEXT), tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                async with claude(base_url).messages.stream(model="tiny", max_tokens=64, tools=[TOOL],
                                                            messages=[{"role": "user", "content": USER}]) as s:
                    tool_events = [event async for event in s]
                    tool_message = await s.get_final_message()
            plain = claude(gateway.base_url)  # plain /v1, greedy: streamed and not give the same text
            unstreamed = await plain.messages.create(model="tiny", max_tokens=8, extra_body={"temperature": 0},
                                                     messages=[{"role": "user", "content": USER}])
            async with plain.messages.stream(model="tiny", max_tokens=8, extra_body={"temperature": 0},
                                             messages=[{"role": "user", "content": USER}]) as s:
                text = [e.delta.text async for e in s if e.type == "content_block_delta"]
                streamed = await s.get_final_message()
            return tool_events, tool_message, unstreamed, text, streamed

    tool_events, tool_message, unstreamed, text, streamed = asyncio.run(main())
    deltas = [e.delta for e in tool_events if e.type == "content_block_delta"]
    assert [d.type for d in deltas] == ["input_json_delta"] and json.loads(deltas[0].partial_json) == {"a": 2, "b": 3}
    assert tool_message.stop_reason == "tool_use" and tool_message.content[0].input == {"a": 2, "b": 3}
    assert unstreamed.stop_reason == streamed.stop_reason == "max_tokens"
    assert "".join(text) == unstreamed.content[0].text == streamed.content[0].text
    assert streamed.usage.output_tokens == unstreamed.usage.output_tokens == 8


def test_a_stop_sequence_is_named(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            llm = LLMClient(Sampled(engine, tokenizer, "5 END more"), tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                return await claude(base_url).messages.create(
                    model="tiny", max_tokens=64, stop_sequences=["NOPE", "END"],
                    messages=[{"role": "user", "content": USER}])

    reply = asyncio.run(main())
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "END"
    assert reply.content[0].text == "5 "


def test_one_conversation_across_three_dialects_is_one_trajectory(tiny_policy):
    """Responses calls the tool, Messages sends its result and gets the next call, chat
    completions sends that result: one trajectory, every reply swapped back as sampled."""
    model, tokenizer = tiny_policy
    second_call = CALL_TEXT.replace('"a":2', '"a":5')

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            scripted = Sampled(engine, tokenizer, CALL_TEXT, second_call, ANSWER)
            llm = LLMClient(scripted, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                first = await sdk(base_url).responses.create(model="tiny", instructions=INSTRUCTIONS, input=USER,
                                                             tools=[FUNCTION])
                call = first.output[0]
                second = await claude(base_url).messages.create(
                    model="tiny", max_tokens=64, system=INSTRUCTIONS, tools=[TOOL], messages=[
                        {"role": "user", "content": USER},
                        {"role": "assistant", "content": [{"type": "tool_use", "id": call.call_id, "name": call.name,
                                                           "input": json.loads(call.arguments)}]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.call_id,
                                                      "content": "5"}]}])
                use = second.content[0]
                third = await sdk(base_url).chat.completions.create(model="tiny", tools=TOOLS, messages=[
                    {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": USER},
                    {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                        "name": call.name, "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "5"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": use.id, "type": "function",
                         "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
                    {"role": "tool", "tool_call_id": use.id, "content": "8"}])
            return third, llm, scripted

    third, llm, scripted = asyncio.run(main())
    assert third.choices[0].message.content == ANSWER
    [trajectory] = llm.trajectories
    assert len(trajectory.steps) == 3
    assert_token_exact(trajectory, scripted, tokenizer, model, [tool_turn("5"), tool_turn("8")])


def test_a_request_ending_on_the_assistants_text_is_continued_as_anthropic_continues_a_prefill(tiny_policy):
    """Anthropic's prefill: the reply's text is the continuation; the model saw the prefill
    after the generation prompt, as environment tokens."""
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            scripted = Sampled(engine, tokenizer, " Paris")
            llm = LLMClient(scripted, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                reply = await claude(base_url).messages.create(
                    model="tiny", max_tokens=16, messages=[{"role": "user", "content": USER},
                                                           {"role": "assistant", "content": "Answer:"}])
            return reply, llm, scripted

    reply, llm, scripted = asyncio.run(main())
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == " Paris"
    forced = tokenizer.encode("Answer:", add_special_tokens=False)
    assert scripted.prompts[0] == chat_prompt_ids(tokenizer, [{"role": "user", "content": USER}]) + forced
    [trajectory] = llm.trajectories
    k = len(forced)
    assert trajectory.response_ids[:k] == forced and trajectory.loss_mask[:k] == [0] * k
    assert trajectory.loss_mask[k:] == [1] * len(scripted.completions[0].token_ids)


def test_the_api_key_is_taken_as_x_api_key_and_refusals_come_back_in_anthropic_shape(tiny_policy):
    model, tokenizer = tiny_policy
    user = [{"role": "user", "content": USER}]
    cases = [({"messages": user}, 400, "max_tokens"),
             ({"max_tokens": 8, "messages": []}, 400, "messages"),
             ({"max_tokens": 8, "messages": [*user, {"role": "assistant", "content": [
                 {"type": "tool_use", "id": "t1", "name": "add", "input": {}}]}]}, 400, "assistant's text to continue"),
             ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400, "text blocks"),
             ({"max_tokens": 8, "messages": user, "tools": [{"type": "web_search_20250305", "name": "w"}]}, 400,
              "custom tools"),
             ({"max_tokens": 8, "messages": user, "tool_choice": {"type": "any"}}, 400, "needs tools"),
             ({"max_tokens": 8, "messages": [{"role": "user", "content": "x" * 600}]}, 400,
              r"has 6\d\d tokens; the model's context holds 512")]

    async def main():
        engine = TorchEngine(model, max_batch_size=4)
        sampling = SamplingParams(max_tokens=4, stop_token_ids=stop_token_ids(tokenizer))
        gateway = Gateway(tokenizer, hermes, model_name="tiny", engine=engine, sampling=sampling,
                          settings=GatewayConfig(api_key="s3cret"))
        got = []
        try:
            await gateway.start()
            headers = {"x-api-key": "s3cret", "anthropic-version": "2023-06-01"}
            async with aiohttp.ClientSession() as http:
                for body, status, fragment in cases:
                    async with http.post(gateway.base_url + "/v1/messages", json={"model": "tiny", **body},
                                         headers=headers) as r:
                        got.append((r.status, await r.json(), status, fragment))
                for path in ("/v1/messages", "/v1/messages/nope"):  # the key checked; aiohttp's own 404 alike
                    async with http.post(gateway.base_url + path, json={}, headers={"x-api-key": "wrong"}) as r:
                        got.append((r.status, await r.json(), 401, "wrong API key"))
            async with aiohttp.ClientSession() as http:
                async with http.post(gateway.base_url + "/v1/messages/nope", json={}, headers=headers) as r:
                    got.append((r.status, await r.json(), 404, "no route POST /v1/messages/nope"))
            client = claude(gateway.base_url, api_key="s3cret")
            reply = await client.messages.create(model="tiny", max_tokens=4, messages=user)
            count = await client.messages.count_tokens(model="tiny", messages=user)
            try:
                await claude(gateway.base_url, api_key="wrong").messages.create(model="tiny", max_tokens=4,
                                                                                messages=user)
            except anthropic.AuthenticationError as exc:
                got.append((exc.status_code, exc.body, 401, "wrong API key"))
        finally:
            await gateway.stop()
            await engine.shutdown()
        return got, reply, count

    got, reply, count = asyncio.run(main())
    for status, body, expected, fragment in got:
        assert status == expected and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"} and re.search(fragment, body["error"]["message"]), body
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.input_tokens == count.input_tokens
    assert count.input_tokens == len(chat_prompt_ids(tokenizer, [{"role": "user", "content": USER}]))
