"""What agent frameworks send the gateway, through the official ``openai`` SDK: fields it
refuses (``response_format`` JSON modes, ``logit_bias``) with the reason, never ignored in
silence. Each test starts its gateway on a free port and stops it, also when it fails."""

from __future__ import annotations

import asyncio
import contextlib

import openai
import pytest
from openai import AsyncOpenAI

from asyncrl.engine import TorchEngine
from asyncrl.rollout.client import LLMClient, stop_token_ids
from asyncrl.rollout.gateway import Gateway, hermes
from asyncrl.types import SamplingParams

USER = [{"role": "user", "content": "2 3 -> 5"}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}, "strict": True}}


@contextlib.asynccontextmanager
async def serving(model, tokenizer, max_tokens=8, temperature=1.0, parser=hermes):
    engine = TorchEngine(model, max_batch_size=8)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                              stop_token_ids=stop_token_ids(tokenizer))
    gateway = Gateway(tokenizer, parser, model_name="tiny", engine=engine, sampling=sampling)
    await gateway.start()
    try:
        yield gateway, engine, sampling
    finally:
        await gateway.stop()
        await engine.shutdown()


def sdk(base_url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)


async def refusal(client: AsyncOpenAI, **fields) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="tiny", messages=USER, **fields)
    return caught.value


# -- 1. response_format and logit_bias: refused with the reason, never ignored ---------------
@pytest.mark.parametrize("fields, param, fragment", [
    ({"response_format": {"type": "json_object"}}, "response_format", "constrained decoding"),
    ({"response_format": SCHEMA}, "response_format", "tool_choice naming a function"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "expected \"text\""),
    ({"logit_bias": {"5": 10}}, "logit_bias", "behaviour logprobs"),
])
def test_fields_that_would_change_the_distribution_are_refused_naming_them(tiny_policy, fields, param, fragment):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            plain = await refusal(sdk(f"{gateway.base_url}/v1"), **fields)
            llm = LLMClient(engine, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                in_session = await refusal(sdk(base_url), **fields)
            return plain, in_session, llm

    plain, in_session, llm = asyncio.run(main())
    for error in (plain, in_session):
        assert error.status_code == 400 and error.param == param and error.type == "invalid_request_error"
        assert fragment in error.message and param.split(".")[0] in error.message
    assert llm.trajectories == []  # refused before anything was sampled


def test_the_defaults_of_those_fields_are_served(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer) as (gateway, _, _):
            client = sdk(f"{gateway.base_url}/v1")
            replies = [await client.chat.completions.create(model="tiny", messages=USER, **fields)
                       for fields in ({"response_format": {"type": "text"}}, {"logit_bias": {}},
                                      {"logit_bias": {"5": 0}})]
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny", messages=USER, frequency_penalty=0.5)
            return replies, raw.headers.get("x-asyncrl-sampling"), raw.parse()

    replies, header, penalised = asyncio.run(main())
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in replies)
    # outside training too, a field the engine does not apply is said, not dropped in silence
    assert header == "frequency_penalty ignored" and header in penalised.system_fingerprint


def test_a_seed_is_honoured_outside_training(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer, max_tokens=12) as (gateway, _, _):
            client = sdk(f"{gateway.base_url}/v1")
            return [(await client.chat.completions.create(model="tiny", messages=USER, seed=seed,
                                                          temperature=1.0)).choices[0].message.content
                    for seed in (3, 3, -3)]

    first, again, negative = asyncio.run(main())
    assert first == again and isinstance(negative, str)  # a negative seed is folded into range, not a 500
