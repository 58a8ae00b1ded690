"""The Responses API on the gateway (``/v1/responses``), driven by the official ``openai``
SDK and by ``openai-agents`` in its default (Responses) mode: a function tool round trip
recorded token-exact — the assistant turns' tokens are the ones the engine sampled, the
tool result and the template's tokens masked — streamed and not, ``previous_response_id``
within a session, reasoning items, and refusals in OpenAI's error shape. Each test
starts its gateway on a free port and stops it, also when it fails."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil

import aiohttp
import pytest
import torch
from conftest import reference_logprobs
from openai import AsyncOpenAI, BadRequestError
from real_model import smollm2_dir  # noqa: F401 (a fixture)
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
             ({"input": USER, "tools": [{"name": "add"}]}, "tools[0]"),
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


def test_namespaced_functions_are_served_and_hosted_tools_left_out_and_said(tiny_policy):
    """What Codex sends: its sub-agent functions in a ``namespace``, and ``web_search``,
    a hosted tool no agent-side code runs."""
    model, tokenizer = tiny_policy
    tools = [{"type": "web_search"}, {"type": "namespace", "name": "math", "description": "sums", "tools": [FUNCTION]}]

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            scripted = Sampled(engine, tokenizer, CALL_TEXT, CALL_TEXT)
            llm = LLMClient(scripted, tokenizer, sampling)
            async with gateway.session(llm) as base_url:
                client = sdk(base_url)
                raw = await client.responses.with_raw_response.create(model="tiny", input=USER, tools=tools)
                events = await streamed_events(client, input=USER, tools=tools)
            return raw.headers["x-asyncrl-sampling"], raw.parse(), events, llm

    said, reply, events, llm = asyncio.run(main())
    assert "tools not offered to the model: web_search" in said
    [call] = reply.output
    assert call.type == "function_call" and call.name == "add" and call.namespace == "math"
    assert events[-1].response.output[0].namespace == "math"
    assert all(t.prompt_ids == chat_prompt_ids(tokenizer, [{"role": "user", "content": USER}], CHAT_TOOLS)
               for t in llm.trajectories)  # the namespace's function, rendered as any function


class Spy:
    """The engine, keeping every completion it hands out."""
    max_context = 1 << 30  # the engine contract's context: no bound that matters here

    def __init__(self, engine) -> None:
        self.engine, self.completions = engine, []

    async def generate(self, prompt_ids, sampling, on_tokens=None):
        completion = await self.engine.generate(prompt_ids, sampling, on_tokens=on_tokens)
        self.completions.append(completion)
        return completion

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.mark.slow
def test_codex_exec_runs_one_episode_through_a_session_recorded_token_exact(smollm2_dir, tmp_path):  # noqa: F811
    """A real harness, unpatched: Codex CLI's ``codex exec`` (the Responses API, streamed)
    pointed at a session on SmolLM2-135M-Instruct. Its default prompt (base instructions,
    sub-agent and goal tools: 9,191 tokens with 0.171.0) overflows SmolLM2's 8,192, which
    the gateway refuses naming both (docs/agents.md); with its own features off and short
    instructions, the episode runs and is recorded: every trained token one the engine
    sampled. Skipped without a ``codex`` binary (``npm install @openai/codex`` under a
    directory, then ``ASYNCRL_CODEX=<dir>/node_modules/.bin/codex``)."""
    codex = os.environ.get("ASYNCRL_CODEX") or shutil.which("codex")
    if codex is None:
        pytest.skip("no Codex CLI: npm install @openai/codex, then set ASYNCRL_CODEX to its node_modules/.bin/codex")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.engine import TorchEngine
    from asyncrl.rollout.client import stop_token_ids
    from asyncrl.rollout.gateway import Gateway
    from asyncrl.rollout.gateway.tool_calls import resolve_format
    from asyncrl.types import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    (tmp_path / "instructions.txt").write_text("You are a coding agent. Answer briefly.\n")
    (tmp_path / "work").mkdir()

    async def run(extra: list[str]):
        engine = Spy(TorchEngine(model, max_batch_size=4))
        sampling = SamplingParams(max_tokens=64, stop_token_ids=stop_token_ids(tokenizer))
        gateway = Gateway(tokenizer, resolve_format("auto", tokenizer), model_name="smollm2", engine=engine)
        llm = LLMClient(engine, tokenizer, sampling)
        try:
            await gateway.start()
            async with gateway.session(llm) as base_url:
                proc = await asyncio.create_subprocess_exec(
                    codex, "exec", "--skip-git-repo-check", *extra, "-c", "model_provider=asyncrl", "-c",
                    "model_providers.asyncrl.name=asyncrl", "-c", f'model_providers.asyncrl.base_url="{base_url}"',
                    "-c", "model_providers.asyncrl.wire_api=responses", "-c", "model_providers.asyncrl.env_key=KEY",
                    "-m", "smollm2", "What is 2+3? Answer with the number.", cwd=tmp_path / "work",
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    env={**os.environ, "CODEX_HOME": str(tmp_path), "KEY": "x"})
                out, err = await asyncio.wait_for(proc.communicate(), 1800)  # a loaded 2-core machine
        finally:
            await gateway.stop()
            await engine.engine.shutdown()
        return proc.returncode, out.decode(), err.decode(), llm, engine

    code, _, err, llm, _ = asyncio.run(run([]))
    assert code != 0 and not llm.trajectories
    assert re.search(r"the prompt has \d+ tokens; the model's context holds 8192", err), err[-2000:]
    lean = ["--disable", "multi_agent", "--disable", "goals", "--disable", "image_generation", "--disable",
            "view_image", "-c", "web_search=disabled", "-c", f"model_instructions_file={tmp_path / 'instructions.txt'}"]
    code, out, err, llm, engine = asyncio.run(run(lean))
    # a reply that runs out of tokens is an incomplete response, which Codex reports as an error: still an episode
    assert code == 0 or "Incomplete response returned, reason: max_output_tokens" in err, err[-2000:]
    assert llm.trajectories and engine.completions
    trained = [t for trajectory in llm.trajectories for t, m in zip(trajectory.response_ids, trajectory.loss_mask)
               if m]
    assert trained == [t for c in engine.completions for t in c.token_ids]  # every trained token as sampled
    last = tokenizer.decode(engine.completions[-1].token_ids, skip_special_tokens=True).strip()
    assert last and last.splitlines()[0] in out + err  # what Codex printed is what the model wrote
