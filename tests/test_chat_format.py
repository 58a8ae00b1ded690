"""Chat templates not written for us: the probe, the hermes fallback, and templates that
rewrite earlier turns. No model runs: a scripted engine answers with fixed token ids."""

from __future__ import annotations

import asyncio
import copy
import json
import logging

import pytest
from real_model import smollm2_dir  # noqa: F401 (a fixture)
from transformers import AutoTokenizer

import asyncrl.rollout.client
from asyncrl.rollout.chat_format import TemplateSupport, describe, prepare, probe
from asyncrl.rollout.client import LLMClient, stop_token_ids
from asyncrl.rollout.gateway import hermes
from asyncrl.types import Completion, SamplingParams

NONE = TemplateSupport(tools=False, tool_calls=False, tool_role=False, none_content=False)
ALL = TemplateSupport(tools=True, tool_calls=True, tool_role=True, none_content=True)
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def few_shot_conversation() -> list[dict]:
    """A tool conversation as an agent sends it: an OpenAI-form call with ``content: None``
    (the model did not sample it), its result, then a new question."""
    return [
        {"role": "user", "content": "what is 1 + 1?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
        {"role": "assistant", "content": "1 + 1 = 2"},
        {"role": "user", "content": "and 2 + 3?"},
    ]


class Scripted:
    """An engine that answers each call with the next scripted text, then end-of-turn."""
    max_context = 1 << 30  # the engine contract's context: no bound that matters here

    def __init__(self, tokenizer, *texts: str) -> None:
        self.replies = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in texts]
        self.prompts: list[list[int]] = []
        self.version = 0

    async def generate(self, prompt_ids, sampling):
        self.prompts.append(list(prompt_ids))
        ids = self.replies[len(self.prompts) - 1]
        return Completion(list(ids), [0.0] * len(ids), [0] * len(ids), "stop")


def client(tokenizer, *texts: str) -> LLMClient:
    sampling = SamplingParams(max_tokens=64, stop_token_ids=stop_token_ids(tokenizer))
    return LLMClient(Scripted(tokenizer, *texts), tokenizer, sampling)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):  # noqa: F811 (the fixture imported above)
    return AutoTokenizer.from_pretrained(smollm2_dir)


# -- prepare, by hand --------------------------------------------------------------


def test_prepare_writes_out_what_the_template_drops():
    messages = few_shot_conversation()
    sent = copy.deepcopy(messages)
    out, tools = prepare(messages, TOOLS, NONE)
    assert messages == sent  # the caller's list and dicts are untouched
    assert tools is None  # the template is not handed what it would drop
    system, *rest = out
    assert system["role"] == "system"
    listed = system["content"].split("<tools>\n")[1].split("\n</tools>")[0]
    assert [json.loads(line) for line in listed.splitlines()] == TOOLS
    assert "<tool_response>" in system["content"]  # results come back as text: the prompt says how
    assert rest == [
        {"role": "user", "content": "what is 1 + 1?"},
        {"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'},
        {"role": "user", "content": "<tool_response>\n2\n</tool_response>"},
        {"role": "assistant", "content": "1 + 1 = 2"},
        {"role": "user", "content": "and 2 + 3?"},
    ]
    # The call written out is what the gateway's parser reads back.
    parsed = hermes(rest[1]["content"])
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("add", {"a": 1, "b": 1})]


def test_prepare_appends_to_a_system_prompt_and_keeps_call_text():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "let me add", "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]}]
    out, _ = prepare(messages, TOOLS, NONE)
    assert out[0]["content"].startswith("Be brief.\n\nYou can call the functions")
    assert len(out) == 3
    assert out[2] == {"role": "assistant",
                      "content": 'let me add\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'}
    # Tool results a template renders itself: the prompt does not promise <tool_response>.
    out, _ = prepare(messages, TOOLS, TemplateSupport(tools=False, tool_calls=False, tool_role=True,
                                                      none_content=True))
    assert "<tool_response>" not in out[0]["content"]


def test_prepare_leaves_what_the_template_supports():
    messages = few_shot_conversation()
    out, tools = prepare(messages, TOOLS, ALL)
    # The call's arguments go to the template as an object, as Hugging Face templates expect.
    decoded = copy.deepcopy(messages)
    decoded[1]["tool_calls"][0]["function"]["arguments"] = {"a": 1, "b": 1}
    assert out == decoded and tools == TOOLS
    assert messages == few_shot_conversation()  # the caller's dicts are untouched
    assert out is not messages and tools is not TOOLS
    assert prepare(messages, None, NONE)[1] is None


@pytest.mark.parametrize("support", [NONE, ALL, TemplateSupport(True, False, False, True)])
def test_prepare_is_prefix_consistent(support):
    """Preparing a conversation is a prefix of preparing its continuation: the client's
    token-exact multi-turn rests on it."""
    messages = few_shot_conversation() + [
        {"role": "assistant", "content": CALL},  # a call the model sampled: kept as its text
        {"role": "tool", "content": "5"}, {"role": "tool", "content": "(done)"},
        {"role": "assistant", "content": "5"}]
    whole, _ = prepare(messages, TOOLS, support)
    for k in range(1, len(messages)):
        part, _ = prepare(messages[:k], TOOLS, support)
        assert whole[: len(part)] == part


def test_describe():
    assert describe(ALL) is None
    assert describe(NONE) == ("chat template: no tool support — tools, tool calls and tool results rendered "
                              "by asyncrl's fallback (hermes <tool_call> format); content None sent as empty text")
    assert describe(TemplateSupport(True, True, False, True)) == (
        "chat template: partial tool support — tool results rendered by asyncrl's fallback (hermes <tool_call> "
        "format)")


# -- the probe -------------------------------------------------------------------


def test_probe_our_template_supports_everything(char_tokenizer):
    support = probe(char_tokenizer)
    assert support == ALL and probe(char_tokenizer) is support  # cached per template
    # Its output through the client is the template's own.
    llm = client(char_tokenizer)
    messages = few_shot_conversation()
    assert llm.render(messages, TOOLS, generation_prompt=True) == char_tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)


def test_probe_smollm2_supports_no_tools(smollm2):
    assert probe(smollm2) == NONE
    assert describe(probe(smollm2)).startswith("chat template: no tool support")


def test_probe_survives_a_template_that_raises(char_tokenizer):
    raising = copy.deepcopy(char_tokenizer)
    raising.chat_template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                             "{{ raise_exception('bad role') }}{% endif %}{{ m['role'] + ': ' + m['content'] }}"
                             "{% endfor %}")
    assert probe(raising) == NONE


# -- through the client, on SmolLM2 ------------------------------------------------


def test_smollm2_tool_round_trip_through_the_client(smollm2):
    """Tools reach the prompt, the model's call parses, a few-shot call with ``content:
    None`` and tool results render, and the whole exchange stays one token-exact trajectory."""
    llm = client(smollm2, CALL, "2 + 3 = 5")
    messages = few_shot_conversation()

    async def main():
        first = await llm.chat(messages, tools=TOOLS)
        messages.extend([first.message, {"role": "tool", "tool_call_id": "x", "content": "5"}])
        second = await llm.chat(messages, tools=TOOLS)
        messages.append(second.message)
        return first

    first = asyncio.run(main())
    prompt = smollm2.decode(llm.engine.prompts[0])
    assert '"name": "add"' in prompt and "<tools>" in prompt and "SmolLM" not in prompt  # our system prompt
    assert '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>' in prompt  # the few-shot call
    parsed = hermes(first.text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("add", {"a": 2, "b": 3})]

    assert len(llm.trajectories) == 1 and llm.template_rewrites == 0
    traj = llm.trajectories[0]
    between = smollm2.decode(llm.engine.prompts[1][len(llm.engine.prompts[0]) + len(llm.engine.replies[0]):])
    assert between == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # The stitched trajectory is the whole conversation rendered afresh.
    fresh = llm.render(messages, TOOLS, generation_prompt=False)
    assert smollm2.decode(traj.prompt_ids + traj.response_ids) + "\n" == fresh


def test_content_none_through_the_client(smollm2):
    llm = client(smollm2, "ok")
    messages = [{"role": "system", "content": None}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]
    response = asyncio.run(llm.chat(messages))
    assert response.text == "ok"
    assert smollm2.decode(llm.engine.prompts[0]).startswith("<|im_start|>system\n<|im_end|>\n")


# -- templates that rewrite earlier turns -----------------------------------------

# Drops the reasoning of every assistant turn but the last, as Qwen3's template does.
REWRITING = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last and '</think>' in c %}{% set c = c.split('</think>')[-1] %}"
    "{% endif %}{{ c + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_rewriting_template_starts_a_new_trajectory(char_tokenizer, monkeypatch, caplog):
    monkeypatch.setattr(asyncrl.rollout.client, "_warned_rewrites", set())
    tokenizer = copy.deepcopy(char_tokenizer)
    tokenizer.chat_template = REWRITING
    tokenizer.name_or_path = "rewriting-test"
    replies = ["<think>3+5=8</think>8", "<think>8*2</think>16", "<think>16-1</think>15"]
    llm = client(tokenizer, *replies)
    messages = [{"role": "user", "content": "3 + 5?"}]

    async def main():
        for question in ("times 2?", "minus 1?", None):
            response = await llm.chat(messages)
            messages.append(response.message)
            if question:
                messages.append({"role": "user", "content": question})

    with caplog.at_level(logging.WARNING, logger="asyncrl.rollout.client"):
        asyncio.run(main())
    assert len(llm.trajectories) == 3 and llm.template_rewrites == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "asyncrl.rollout.client"]
    assert len(warnings) == 1  # once per process, not per turn
    assert "'rewriting-test'" in warnings[0] and "rewrites earlier turns" in warnings[0]
    for traj, prompt, reply, text in zip(llm.trajectories, llm.engine.prompts, llm.engine.replies, replies):
        assert traj.prompt_ids == prompt and traj.response_ids == reply  # each keeps exactly what it sampled
        assert traj.loss_mask == [1] * len(reply)
    # Each new trajectory's prompt is the conversation as the template renders it now.
    assert tokenizer.decode(llm.trajectories[2].prompt_ids) == (
        "<|im_start|>user\n3 + 5?<|im_end|>\n<|im_start|>assistant\n8<|im_end|>\n<|im_start|>user\ntimes 2?<|im_end|>\n"
        "<|im_start|>assistant\n16<|im_end|>\n<|im_start|>user\nminus 1?<|im_end|>\n<|im_start|>assistant\n")
