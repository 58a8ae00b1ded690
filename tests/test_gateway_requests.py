"""What agent frameworks send the gateway, through the official ``openai`` SDK: fields it
refuses (``response_format`` JSON modes, ``logit_bias``) with the reason, never ignored in
silence; ``tool_choice`` forcing a call (its opening recorded as environment tokens, the
next turn still token-exact) or forbidding one; ``<think>`` reasoning handed out as
``reasoning_content`` and kept in the trajectory; streams sent token by token (an engine
that samples its next token only once the agent saw the last shows it without a clock),
adding up to the reply unstreamed and recording the same trajectory. Each test starts its gateway on a free port
and stops it, also when it fails."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import openai
import pytest
import torch
from conftest import reference_logprobs
from openai import AsyncOpenAI
from tolerances import assert_same_logprobs

from asyncrl.engine import TorchEngine
from asyncrl.engine.protocol import EngineClosedError
from asyncrl.rollout.client import LLMClient, stop_token_ids
from asyncrl.rollout.gateway import Gateway, ParsedReply, reasoning, streaming, tool_choice
from asyncrl.rollout.gateway.tool_calls import ToolFormat, get_format, hermes
from asyncrl.tiny import CHAT_TEMPLATE, build_char_tokenizer, chat_prompt_ids
from asyncrl.types import NO_VERSION, Completion, SamplingParams

USER = [{"role": "user", "content": "2 3 -> 5"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
HERMES = get_format("hermes")  # the format, with the opening a forced call begins with
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}, "strict": True}}


@contextlib.asynccontextmanager
async def serving(model, tokenizer, max_tokens=8, temperature=1.0, parser=HERMES):
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


# -- 2. tool_choice: a forced call's opening is the environment's, the rest the model's -------
class Scripted:
    """The real engine, except that its first replies are written here (a random tiny model
    writes no tool call), carrying the real model's logprobs for those tokens; every
    prompt it is sent is kept."""
    max_context = 1 << 30  # the engine contract's context: no bound that matters here

    def __init__(self, engine: TorchEngine, tokenizer, *texts: str) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.scripts = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in texts]
        self.prompts: list[list[int]] = []

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, prompt_ids, sampling):
        self.prompts.append(list(prompt_ids))
        if len(self.prompts) > len(self.scripts):
            return await self.engine.generate(prompt_ids, sampling)
        script = self.scripts[len(self.prompts) - 1]
        lps = reference_logprobs(self.engine.model, list(prompt_ids), script).tolist()
        return Completion(list(script), lps, [self.engine.version] * len(script), "stop")

    def __getattr__(self, name):
        return getattr(self.engine, name)


NAMED = {"type": "function", "function": {"name": "add"}}


FORCED_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'  # as Qwen writes one


@pytest.mark.equivalence
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_call_writes_its_opening_as_environment_tokens_and_goes_on_token_exact(tiny_policy, choice):
    model, tokenizer = tiny_policy
    opening = HERMES.opening(None if choice == "required" else "add")
    assert FORCED_CALL.startswith(opening) and (choice == "required" or '"add"' in opening)
    continuation = FORCED_CALL[len(opening):]  # what the model writes after the opening

    async def main():
        async with serving(model, tokenizer, max_tokens=16) as (gateway, engine, sampling):
            scripted = Scripted(engine, tokenizer, continuation)
            llm = LLMClient(scripted, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                client = sdk(base_url)
                messages = list(USER)
                first = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                                             tool_choice=choice)
                call = first.choices[0].message.tool_calls[0]
                messages += [first.choices[0].message.model_dump(),
                             {"role": "tool", "tool_call_id": call.id, "content": "5"}]
                second = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
            return first, second, llm, scripted

    first, second, llm, scripted = asyncio.run(main())
    choice_ = first.choices[0]
    assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
    [call] = choice_.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    forced = tokenizer.encode(opening, add_special_tokens=False)
    prompt = chat_prompt_ids(tokenizer, USER, TOOLS)
    assert scripted.prompts[0] == prompt + forced  # the model was conditioned on the opening
    sampled = scripted.scripts[0]
    assert first.usage.completion_tokens == len(sampled) and first.usage.prompt_tokens == len(prompt + forced)

    [trajectory] = llm.trajectories  # the second call continued the first: one trajectory
    ids, mask, versions = trajectory.response_ids, trajectory.loss_mask, trajectory.versions
    k, n = len(forced), len(sampled)
    assert trajectory.prompt_ids == prompt and ids[:k] == forced and ids[k:k + n] == sampled
    assert mask[:k] == [0] * k and versions[:k] == [NO_VERSION] * k and trajectory.logprobs[:k] == [0.0] * k
    assert mask[k:k + n] == [1] * n and versions[k:k + n] == [0] * n  # only what was sampled is trained
    assert tokenizer.decode(ids[k + n:len(ids) - second.usage.completion_tokens]) == (
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")  # between the turns: the template's text
    assert scripted.prompts[1] == trajectory.prompt_ids + ids[:len(ids) - second.usage.completion_tokens]
    assert_same_logprobs(trajectory.logprobs[k:k + n], reference_logprobs(model, prompt + forced, sampled), model,
                         len(prompt + forced) + len(sampled))


PREFILL = "Answer:"
PREFILLED = {"continue_final_message": True, "add_generation_prompt": False}  # vLLM's extra body fields


@pytest.mark.equivalence
def test_a_prefill_is_continued_written_as_environment_tokens_and_the_next_turn_goes_on_token_exact(tiny_policy):
    """vLLM's ``continue_final_message``: the reply continues the assistant's text; the
    prefill reaches the model as environment tokens (mask 0: nobody sampled it), the reply
    handed back is the continuation (as vLLM returns it), and the agent's next call, with
    the whole turn sent back, extends the same trajectory."""
    model, tokenizer = tiny_policy
    continuation = " 5"

    async def main():
        async with serving(model, tokenizer, max_tokens=16) as (gateway, engine, sampling):
            scripted = Scripted(engine, tokenizer, continuation)
            llm = LLMClient(scripted, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                client = sdk(base_url)
                messages = [*USER, {"role": "assistant", "content": PREFILL}]
                first = await client.chat.completions.create(model="tiny", messages=messages, extra_body=PREFILLED)
                messages = [*USER, {"role": "assistant", "content": PREFILL + first.choices[0].message.content},
                            {"role": "user", "content": "and 4 4?"}]
                second = await client.chat.completions.create(model="tiny", messages=messages)
            return first, second, llm, scripted

    first, second, llm, scripted = asyncio.run(main())
    assert first.choices[0].message.content == continuation and first.choices[0].finish_reason == "stop"
    forced = tokenizer.encode(PREFILL, add_special_tokens=False)
    prompt = chat_prompt_ids(tokenizer, USER)
    assert scripted.prompts[0] == prompt + forced  # no assistant turn of its own: the prefill opens the reply
    sampled = scripted.scripts[0]
    assert first.usage.completion_tokens == len(sampled) and first.usage.prompt_tokens == len(prompt + forced)
    [trajectory] = llm.trajectories  # the whole turn sent back was matched: one trajectory
    ids, mask, k, n = trajectory.response_ids, trajectory.loss_mask, len(forced), len(sampled)
    assert trajectory.prompt_ids == prompt and ids[:k] == forced and ids[k:k + n] == sampled
    assert mask[:k] == [0] * k and trajectory.versions[:k] == [NO_VERSION] * k and mask[k:k + n] == [1] * n
    assert scripted.prompts[1] == prompt + ids[:len(ids) - second.usage.completion_tokens]
    assert_same_logprobs(trajectory.logprobs[k:k + n], reference_logprobs(model, prompt + forced, sampled), model,
                         len(prompt + forced) + len(sampled))


@pytest.mark.parametrize("messages, fields, param, fragment", [
    ([*USER, {"role": "assistant", "content": PREFILL}], {"continue_final_message": True}, "add_generation_prompt",
     "needs add_generation_prompt: false"),
    (USER, PREFILLED, "messages[0]", "must be the assistant's text"),
    ([*USER, {"role": "assistant", "content": PREFILL}], {"add_generation_prompt": False}, "add_generation_prompt",
     "only with continue_final_message"),
    ([*USER, {"role": "assistant", "content": PREFILL}], {**PREFILLED, "tools": TOOLS, "tool_choice": "required"},
     "tool_choice", "both the prefill and the call's opening"),
])
def test_a_prefill_that_cannot_be_served_is_refused_naming_why(tiny_policy, messages, fields, param, fragment):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            llm = LLMClient(engine, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                body = {k: v for k, v in fields.items() if k in ("tools", "tool_choice")}
                extra = {k: v for k, v in fields.items() if k not in body}
                with pytest.raises(openai.BadRequestError) as caught:
                    await sdk(base_url).chat.completions.create(model="tiny", messages=messages, extra_body=extra,
                                                                **body)
            return caught.value, llm

    error, llm = asyncio.run(main())
    assert error.body["param"] == param and fragment in error.body["message"]
    assert llm.trajectories == []  # refused before anything was sampled


def test_tool_choice_none_keeps_the_tools_rendered_and_returns_a_call_as_content(tiny_policy):
    model, tokenizer = tiny_policy
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            scripted = Scripted(engine, tokenizer, call)
            llm = LLMClient(scripted, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                reply = await sdk(base_url).chat.completions.create(model="tiny", messages=USER, tools=TOOLS,
                                                                    tool_choice="none")
            return reply, llm

    reply, llm = asyncio.run(main())
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls and choice.message.content == call
    assert llm.trajectories[0].prompt_ids == chat_prompt_ids(tokenizer, USER, TOOLS)  # the tools still rendered


def plain_parser(text: str) -> ParsedReply:  # a parser that is a plain function: no opening to force a call with
    return hermes(text)


@pytest.mark.parametrize("fields, parser, fragment", [
    ({"tool_choice": "required"}, HERMES, '"required" needs tools'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}}, HERMES,
     "names function 'mul', which is not in tools (they are: 'add')"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, HERMES, '{"type": "function"'),
    ({"tools": TOOLS, "tool_choice": "always"}, HERMES, "'always'"),
    ({"tools": TOOLS, "tool_choice": "required"}, ToolFormat("plain_parser", plain_parser),
     "(plain_parser) has no fixed opening"),
    ({"tools": TOOLS, "tool_choice": "required"}, ToolFormat("mine:parse", plain_parser),  # a user's, as loaded
     "(mine:parse) has no fixed opening"),
])
def test_a_tool_choice_that_cannot_be_honoured_is_refused_naming_why(tiny_policy, fields, parser, fragment):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer, parser=parser) as (gateway, engine, sampling):
            llm = LLMClient(engine, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                return await refusal(sdk(base_url), **fields), llm

    error, llm = asyncio.run(main())
    assert error.status_code == 400 and error.param == "tool_choice" and fragment in error.message, error.message
    assert llm.trajectories == []


# -- 3. reasoning_content: <think> split off for the agent, kept in the trajectory --------------
# the tiny template, taught <think>: a turn's reasoning_content is rendered inside the tags before its
# content, and everything else renders as before (so it only appends: turns continue token-exact)
THINK_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if m['content'] is string %}",
    "{% if m['reasoning_content'] is defined and m['reasoning_content'] %}"
    "{{ '<think>' + m['reasoning_content'] + '</think>' }}{% endif %}{% if m['content'] is string %}")
OPENED_TEMPLATE = THINK_TEMPLATE.replace("{{ '<|im_start|>assistant\\n' }}{% endif %}",
                                         "{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")


def tokenizer_with(template: str):
    tokenizer = build_char_tokenizer()  # a fresh one: the fixtures' is shared by the session
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize("template, text, expected", [
    (CHAT_TEMPLATE, "<think>a</think>b", (None, "<think>a</think>b")),  # a template without the tags: no split
    (THINK_TEMPLATE, "<think>\n2+3\n</think>\n\n5", ("\n2+3\n", "5")),
    (THINK_TEMPLATE, "  <think>x</think>", ("x", "")),
    (THINK_TEMPLATE, "<think>cut off while thin", ("cut off while thin", "")),
    (THINK_TEMPLATE, "5 </think> 6", (None, "5 </think> 6")),  # a closing tag alone is not reasoning
    (THINK_TEMPLATE, "5", (None, "5")),
    (OPENED_TEMPLATE, "2+3\n</think>\n\n5", ("2+3\n", "5")),  # the prompt opened it: the reply begins inside
    (OPENED_TEMPLATE, "still thinking", ("still thinking", "")),
])
def test_reasoning_is_split_as_the_template_teaches_it(template, text, expected):
    assert reasoning.split(text, reasoning.thinking(tokenizer_with(template))) == expected


@pytest.mark.parametrize("echo", [
    lambda message: {"role": "assistant", "content": message.content},  # the answer only, as most agents keep it
    lambda message: message.model_dump(),  # everything the SDK parsed, reasoning_content included
])
def test_reasoning_goes_to_reasoning_content_and_the_next_turn_continues_token_exact(tiny_policy, echo):
    model, _ = tiny_policy
    tokenizer = tokenizer_with(THINK_TEMPLATE)
    thought = "<think>2+3 is 5</think>\n\n5"
    call_in_thought = '<think>maybe <tool_call>{"name": "add", "arguments": {}}</tool_call></think>no call'

    async def main():
        async with serving(model, tokenizer, max_tokens=12) as (gateway, engine, sampling):
            scripted = Scripted(engine, tokenizer, thought, call_in_thought)
            llm = LLMClient(scripted, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                client = sdk(base_url)
                messages = list(USER)
                first = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
                messages += [echo(first.choices[0].message), {"role": "user", "content": "and 3 4?"}]
                second = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
            return first, second, llm, scripted

    first, second, llm, scripted = asyncio.run(main())
    message = first.choices[0].message
    assert message.reasoning_content == "2+3 is 5" and message.content == "5"
    [trajectory] = llm.trajectories  # the echo was swapped for the reply as sampled: one trajectory
    n = len(scripted.scripts[0])
    assert trajectory.response_ids[:n] == scripted.scripts[0] and trajectory.loss_mask[:n] == [1] * n
    assert tokenizer.decode(trajectory.response_ids[:n]) == thought + "<|im_end|>"  # the reasoning was trained
    # a call written while thinking is reasoning, not a call
    second_message = second.choices[0].message
    assert not second_message.tool_calls and second.choices[0].finish_reason == "stop"
    assert second_message.content == "no call" and "<tool_call>" in second_message.reasoning_content


# -- 4. streaming: text sent as it is sampled, adding up to the reply unstreamed ----------------
def streamed(stream: streaming.ReplyStream, text: str, final: tuple[str | None, str | None]) -> dict[str, str]:
    """Feed ``text`` one character at a time, then the parsed reply: what the agent was sent."""
    sent = {"reasoning_content": "", "content": ""}
    for n in range(len(text) + 1):
        for key, value in stream.update(text[:n]).items():
            assert not sent[key] or value  # never an empty delta
            sent[key] += value
    for key, value in stream.finish(*final).items():
        sent[key] += value
    return sent


@pytest.mark.parametrize("template, tools, stops, text", [
    (CHAT_TEMPLATE, False, (), "plain answer  \n"),
    (CHAT_TEMPLATE, True, (), 'hi <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'),
    (CHAT_TEMPLATE, True, (), "a <tool never written"),
    (CHAT_TEMPLATE, False, ("STOP",), "abc STOP and on"),
    (THINK_TEMPLATE, True, (), "<think>a b</think>\n\nanswer"),
    (THINK_TEMPLATE, True, (), "<think>a <tool_call>x</tool_call></think>c"),
    (THINK_TEMPLATE, False, (), "<thinking is a word"),
    (THINK_TEMPLATE, False, (), "<think>cut while thin"),
    (OPENED_TEMPLATE, False, (), "abc</think>\n\nx"),
])
def test_a_streamed_reply_adds_up_to_the_reply_unstreamed(template, tools, stops, text):
    thinking = reasoning.thinking(tokenizer_with(template))
    choice = tool_choice.AUTO if tools else tool_choice.ToolChoice(parse=False)
    reply = text[:text.index(stops[0])] if stops else text  # the client cuts the reply before a stop string
    thought, answer = reasoning.split(reply, thinking)
    parsed = hermes(answer) if tools else ParsedReply(answer)
    stream = streaming.for_chat(choice, thinking, HERMES, list(stops))
    sent = streamed(stream, text, (thought, parsed.content))
    assert sent == {"reasoning_content": thought or "", "content": parsed.content or ""}


def test_the_detokenizer_gives_the_text_decoding_every_id_gives(char_tokenizer):
    text = "héllo wörld 漢字 ok"
    ids = char_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # byte-level: some characters are spelt by several tokens
    detokenizer = streaming.Detokenizer(char_tokenizer)
    seen = [detokenizer.add([i]) for i in ids]
    assert seen[-1] == text and all("\ufffd" not in s and text.startswith(s) for s in seen)


def test_the_torch_engine_hands_out_each_token_before_the_completion(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        engine = TorchEngine(model, max_batch_size=4)
        got: list[list[int]] = []
        try:
            completion = await engine.generate(chat_prompt_ids(tokenizer, USER), SamplingParams(max_tokens=12),
                                               on_tokens=got.append)
            return completion, list(got)  # a copy taken as the completion returns: nothing arrives later
        finally:
            await engine.shutdown()

    completion, got = asyncio.run(main())
    assert all(len(step) == 1 for step in got) and sum(got, []) == completion.token_ids


class Streamed:
    """An engine that streams a reply written here, one token per step, with the real
    model's logprobs; gated, it samples the next token only once the test says so (after
    the agent saw the last one), so no reply can reach the agent whole."""
    max_context = 1 << 30  # the engine contract's context: no bound that matters here

    def __init__(self, engine: TorchEngine, tokenizer, text: str, *, gated: bool = False, fail_after: int = 0):
        self.engine, self.gated, self.fail_after = engine, gated, fail_after
        self.script = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        self.proceed = asyncio.Event()
        self.finished = False

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, prompt_ids, sampling, on_tokens=None):
        for i, token in enumerate(self.script):
            if self.fail_after and i == self.fail_after:
                raise EngineClosedError("the engine died mid-reply")
            if on_tokens is not None:
                on_tokens([token])
            if self.gated and i < len(self.script) - 1:
                await self.proceed.wait()
                self.proceed.clear()
        self.finished = True
        lps = reference_logprobs(self.engine.model, list(prompt_ids), self.script).tolist()
        return Completion(list(self.script), lps, [self.engine.version] * len(self.script), "stop")

    def __getattr__(self, name):
        return getattr(self.engine, name)


async def chunks_of(client: AsyncOpenAI, on_chunk=None, **fields) -> list:
    stream = await client.chat.completions.create(model="tiny", messages=USER, stream=True, **fields)
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        if on_chunk is not None:
            on_chunk(chunk)
    return chunks


def test_each_token_reaches_the_agent_before_generation_ends(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            streamed_engine = Streamed(engine, tokenizer, "12345", gated=True)
            llm = LLMClient(streamed_engine, tokenizer, sampling)
            seen = []  # (content, whether the engine had finished) per chunk, in arrival order

            def on_chunk(chunk):
                if chunk.choices and chunk.choices[0].delta.content:
                    seen.append((chunk.choices[0].delta.content, streamed_engine.finished))
                    streamed_engine.proceed.set()  # only now may the next token be sampled

            async with gateway.session(llm) as base_url:
                chunks = await asyncio.wait_for(chunks_of(sdk(base_url), on_chunk), 120)  # a hang is a failure
            return seen, chunks, llm, streamed_engine

    seen, chunks, llm, streamed_engine = asyncio.run(main())
    assert seen == [(c, False) for c in "12345"]  # five chunks, each before the engine finished
    assert streamed_engine.finished and chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == 6  # the five digits and the end of the turn
    [trajectory] = llm.trajectories
    assert trajectory.response_ids == streamed_engine.script and trajectory.loss_mask == [1] * 6


def test_a_stream_holds_tool_calls_for_the_end_and_says_reasoning_apart(tiny_policy):
    model, _ = tiny_policy
    tokenizer = tokenizer_with(THINK_TEMPLATE)
    text = '<think>2 3</think>\n\nhi <tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            llm = LLMClient(Streamed(engine, tokenizer, text), tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                return await chunks_of(sdk(base_url), tools=TOOLS)

    deltas = [c.choices[0].delta for c in asyncio.run(main()) if c.choices]
    reasoning_sent = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    content_sent = [d.content for d in deltas if d.content]
    calls = [d.tool_calls for d in deltas if d.tool_calls]
    assert "".join(reasoning_sent) == "2 3" and "".join(content_sent) == "hi"  # none of the call's text
    [[call]] = calls  # the call, whole, in one delta after all the text, then the finish
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2}
    assert [bool(d.tool_calls) for d in deltas][-2:] == [True, False]


def test_a_forced_call_streams_as_it_answers_unstreamed_and_records_the_same(tiny_policy):
    model, tokenizer = tiny_policy
    opening = HERMES.opening("add")

    async def run(stream: bool):
        async with serving(model, tokenizer, max_tokens=24) as (gateway, engine, sampling):
            scripted = Streamed(engine, tokenizer, FORCED_CALL[len(opening):])
            llm = LLMClient(scripted, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                client = sdk(base_url)
                if stream:
                    reply = await chunks_of(client, tools=TOOLS, tool_choice=NAMED)
                else:
                    reply = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS,
                                                                 tool_choice=NAMED)
            return reply, llm.trajectories

    chunks, streamed_trajectories = asyncio.run(run(True))
    reply, trajectories = asyncio.run(run(False))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)  # nothing of the call's text as content
    [[call]] = [d.tool_calls for d in deltas if d.tool_calls]
    assert (call.function.name, call.function.arguments) == (reply.choices[0].message.tool_calls[0].function.name,
                                                             reply.choices[0].message.tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [t.to_dict() for t in streamed_trajectories] == [t.to_dict() for t in trajectories]


def test_a_prefilled_reply_streams_its_continuation_and_records_what_unstreamed_records(tiny_policy):
    model, tokenizer = tiny_policy
    messages = [*USER, {"role": "assistant", "content": PREFILL}]

    async def run(stream: bool):
        async with serving(model, tokenizer, max_tokens=24) as (gateway, engine, sampling):
            llm = LLMClient(Streamed(engine, tokenizer, " 5, as 2 + 3"), tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                reply = await sdk(base_url).chat.completions.create(model="tiny", messages=messages, stream=stream,
                                                                     extra_body=PREFILLED)
                chunks = [chunk async for chunk in reply] if stream else reply
            return chunks, llm.trajectories

    chunks, streamed_trajectories = asyncio.run(run(True))
    reply, trajectories = asyncio.run(run(False))
    assert reply.choices[0].message.content == " 5, as 2 + 3"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " 5, as 2 + 3"
    assert [t.to_dict() for t in streamed_trajectories] == [t.to_dict() for t in trajectories]


def test_a_stream_matches_the_reply_unstreamed_on_the_real_engine(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer, max_tokens=24, temperature=0.0) as (gateway, engine, sampling):
            results = []
            for stream in (True, False):
                llm = LLMClient(engine, tokenizer, sampling)
                async with gateway.session(llm) as base_url:
                    client = sdk(base_url)
                    if stream:
                        chunks = await chunks_of(client)
                        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                    else:
                        text = (await client.chat.completions.create(
                            model="tiny", messages=USER)).choices[0].message.content
                results.append((text, llm.trajectories[0]))
            return results

    (streamed_text, streamed_trajectory), (text, trajectory) = asyncio.run(main())
    assert streamed_text == text and len(trajectory.response_ids) > 1
    assert streamed_trajectory.response_ids == trajectory.response_ids  # greedy: the same reply, recorded the same
    assert streamed_trajectory.loss_mask == trajectory.loss_mask and streamed_trajectory.versions == trajectory.versions
    torch.testing.assert_close(torch.tensor(streamed_trajectory.logprobs), torch.tensor(trajectory.logprobs))


def test_an_engine_that_fails_mid_stream_ends_it_with_an_error_the_sdk_raises(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            llm = LLMClient(Streamed(engine, tokenizer, "12345", fail_after=3), tokenizer, sampling)
            got = []
            async with gateway.session(llm) as base_url:
                with pytest.raises(openai.APIError) as caught:
                    await chunks_of(sdk(base_url),
                                    lambda c: got.append(c.choices[0].delta.content if c.choices else None))
            async with aiohttp.ClientSession() as http, http.get(gateway.base_url + "/health") as r:
                return caught.value, got, r.status

    error, got, health = asyncio.run(main())
    assert "".join(c or "" for c in got) == "123" and "engine has stopped" in error.message and health == 200


def test_a_text_completion_streams_too(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer, max_tokens=12) as (gateway, _, _):
            client = sdk(f"{gateway.base_url}/v1")
            stream = await client.completions.create(model="tiny", prompt="1 2 ->", stream=True, temperature=0)
            parts = [c async for c in stream]
            whole = await client.completions.create(model="tiny", prompt="1 2 ->", temperature=0)
            return parts, whole

    parts, whole = asyncio.run(main())
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_an_agent_that_hangs_up_mid_stream_leaves_the_reply_recorded_and_the_gateway_serving(tiny_policy):
    model, tokenizer = tiny_policy

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            streamed_engine = Streamed(engine, tokenizer, "12345", gated=True)
            llm = LLMClient(streamed_engine, tokenizer, sampling)
            async with gateway.session(llm) as base_url, aiohttp.ClientSession() as http:
                body = {"model": "tiny", "messages": USER, "stream": True}
                async with http.post(base_url + "/chat/completions", json=body) as r:
                    first = await r.content.readline()  # the role chunk, then gone
                while not streamed_engine.finished:  # the reply goes on without its reader
                    streamed_engine.proceed.set()
                    await asyncio.sleep(0.01)
                while llm.trajectories[0].finish_reason != "stop" or not llm.trajectories[0].steps:
                    await asyncio.sleep(0.01)
                async with http.get(gateway.base_url + "/health") as health:
                    return first, llm, health.status

    first, llm, status = asyncio.run(asyncio.wait_for(main(), 120))  # a reply that never ends is a failure
    assert first.startswith(b"data: ") and status == 200
    [trajectory] = llm.trajectories
    assert len(trajectory.response_ids) == 6 and trajectory.steps[0].response_tokens == 6
