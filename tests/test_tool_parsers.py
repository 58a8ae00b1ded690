"""Tool-call formats: each parser on text as models sample it, each format round-tripped
through a chat template that teaches it (written here after Qwen2.5's, Llama 3.1's,
Mistral's, Qwen3-Coder's and vLLM's pythonic example template), ``auto`` picking the
format from the template, openings that continue byte for byte as the template writes a
call, and a tool episode through the gateway per format that stays one token-exact
trajectory."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import random

import pytest
from real_model import smollm2_dir  # noqa: F401 (a fixture)
from test_gateway import ScriptedFirstReply, sdk
from transformers import AutoTokenizer

from asyncrl.config import ConfigError, GatewayConfig
from asyncrl.engine import TorchEngine
from asyncrl.orchestrator.announce import template_notes
from asyncrl.rollout.chat_format import prepare, probe
from asyncrl.rollout.client import LLMClient, stop_token_ids
from asyncrl.rollout.gateway import Gateway
from asyncrl.rollout.gateway.tool_calls import (
    FORMATS,
    check_format_name,
    get_format,
    hermes,
    llama3_json,
    mistral,
    pythonic,
    qwen3_xml,
    resolve_format,
)
from asyncrl.types import SamplingParams


def calls_of(reply) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]


def assert_broken(parse, text: str, why: str) -> None:
    """A call that does not parse: the whole text as content, the reason in ``error``."""
    reply = parse(text)
    assert reply.content == text and not reply.tool_calls and reply.error is not None and why in reply.error, reply


# -- each parser on sampled-looking text ---------------------------------------------


def test_hermes_reads_blocks_with_text_around_and_any_spacing():
    text = ('Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "東京 ☃"}}\n</tool_call>\n'
            '<tool_call>{"name":"add","arguments":{"a":1,"b":[2, 3]}}</tool_call> done')
    reply = hermes(text)
    assert reply.error is None and reply.content == "Let me look.\n\n done"
    assert calls_of(reply) == [("search", {"q": "東京 ☃"}), ("add", {"a": 1, "b": [2, 3]})]
    assert hermes("no call here") == hermes("no call here") and hermes("no call here").content == "no call here"
    assert_broken(hermes, 'ok <tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>', "not JSON")
    assert_broken(hermes, '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', "not JSON")


def test_llama3_json_reads_calls_the_way_llama_3_writes_them():
    reply = llama3_json('{"name": "calculate", "parameters": {"expression": "17 * 23"}}')
    assert calls_of(reply) == [("calculate", {"expression": "17 * 23"})] and reply.content is None
    several = llama3_json(' {"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": "é"}}\n'
                          '{"name":"c","parameters":"{\\"y\\": 2}"}  and that is all')
    assert calls_of(several) == [("a", {}), ("b", {"x": "é"}), ("c", {"y": 2})]
    assert several.content == "and that is all"
    tagged = llama3_json('I will search.<|python_tag|>{"name": "search", "parameters": {"q": "x"}}')
    assert calls_of(tagged) == [("search", {"q": "x"})] and tagged.content == "I will search."
    # Not calls: prose, and a model answering in JSON (an object without parameters/arguments).
    for text in ("The answer is 391.", '{"name": "Ada", "age": 36}', "{not json at all}"):
        assert llama3_json(text).content == text and not llama3_json(text).tool_calls and not llama3_json(text).error
    assert_broken(llama3_json, '{"name": "calculate", "parameters": {"expression": "17 *', "not JSON")
    assert_broken(llama3_json, '<|python_tag|>brave_search.call(query="x")', "not JSON")
    assert_broken(llama3_json, '{"name": "f", "parameters": [1, 2]}', "not an object")


def test_mistral_reads_the_list_form_and_the_args_form():
    listed = mistral('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}, "id": "abc123XYZ"}, '
                     '{"name": "neg", "arguments": "{\\"a\\": -1}"}]')
    assert calls_of(listed) == [("add", {"a": 1}), ("neg", {"a": -1})] and listed.content is None
    assert listed.tool_calls[0].id == "abc123XYZ"  # the model's own id, which the template will want back
    assert len(listed.tool_calls[1].id) == 9 and listed.tool_calls[1].id.isalnum()
    assert calls_of(mistral('Sure.[TOOL_CALLS][{"name":"f","arguments":{}}]')) == [("f", {})]
    newer = mistral('Checking both.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}'
                    '[TOOL_CALLS]get_time[CALL_ID]q1w2e3r4t[ARGS] {"tz": "CET"}')
    assert calls_of(newer) == [("get_weather", {"city": "Zürich"}), ("get_time", {"tz": "CET"})]
    assert newer.content == "Checking both." and newer.tool_calls[1].id == "q1w2e3r4t"
    assert mistral("plain [text] here").content == "plain [text] here"
    assert_broken(mistral, '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}', "not JSON")
    assert_broken(mistral, "[TOOL_CALLS]get weather now", "neither")
    assert_broken(mistral, "[TOOL_CALLS] []", "empty")


def test_qwen3_xml_reads_parameters_and_converts_their_values():
    text = ("I'll write the file.\n<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/main.py\n</parameter>\n"
            "<parameter=content>\ndef f(x):\n    return x < 3 and \"ok\"\n\n</parameter>\n"
            "<parameter=mode>\n420\n</parameter>\n<parameter=overwrite>\nTrue\n</parameter>\n"
            '<parameter=meta>\n{"tags": ["a"], "n": null}\n</parameter>\n</function>\n</tool_call>\n'
            "<tool_call><function=ls><parameter=dir>/tmp<parameter=all>false</function></tool_call>")
    reply = qwen3_xml(text)
    assert reply.error is None and reply.content == "I'll write the file."
    assert calls_of(reply) == [
        ("write_file", {"path": "src/main.py", "content": 'def f(x):\n    return x < 3 and "ok"\n', "mode": 420,
                        "overwrite": True, "meta": {"tags": ["a"], "n": None}}),
        ("ls", {"dir": "/tmp", "all": False}),  # a forgotten </parameter> ends at the next one
    ]
    assert qwen3_xml("no tools needed").content == "no tools needed"
    assert_broken(qwen3_xml, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "<function=name>")
    assert_broken(qwen3_xml, "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n", "unclosed")


def test_pythonic_reads_literals_and_never_evaluates():
    reply = pythonic('[get_weather(city="San Francisco", days=3, metric=True), get_time(), '
                     "note(text='a ] in a string', tags=['x', 'y'], extra={'k': (1, -2.5)}, none=None, "
                     "ok=true, gone=null)]\nThat is the plan.")
    assert reply.error is None and reply.content == "That is the plan."
    assert calls_of(reply) == [
        ("get_weather", {"city": "San Francisco", "days": 3, "metric": True}), ("get_time", {}),
        ("note", {"text": "a ] in a string", "tags": ["x", "y"], "extra": {"k": [1, -2.5]}, "none": None,
                  "ok": True, "gone": None}),
    ]
    wrapped = pythonic('<|python_start|>[search(q="日本")]<|python_end|>')
    assert calls_of(wrapped) == [("search", {"q": "日本"})] and wrapped.content is None
    for text in ("[link](https://example.com)", "[1, 2, 3] are the numbers", "Call f(x) later."):
        assert pythonic(text).content == text and not pythonic(text).error
    assert_broken(pythonic, '[f(a=__import__("os").system("rm -rf /"))]', "not a literal")
    assert_broken(pythonic, "[f(1, 2)]", "argument=value")
    assert_broken(pythonic, "[f(a=1), g(b=]", "does not parse")
    assert_broken(pythonic, "[f(a={1, 2})]", "not a JSON value")


@pytest.mark.parametrize("name", list(FORMATS))
def test_no_parser_raises_on_any_text(name):
    """Fragments of every format, shuffled and cut: every parse returns a reply, and a
    reply with an error holds the whole text as content."""
    parse = FORMATS[name]
    pieces = ["<tool_call>", "</tool_call>", "<function=f>", "<parameter=x>", "</parameter>", "</function>",
              "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", "<|python_start|>", '{"name": "f"',
              '"parameters": {', '"arguments": ', "[f(", "a=1", ")]", "}", "{", "]", "[", ";", "\n", " ", "é",
              '"', "'", "\\", "NaN", "1e999", "[" * 60, "{" * 60]
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        reply = parse(text)
        assert reply.error is None or (reply.content == text and not reply.tool_calls)
    nested = "[" * 100_000 + "]" * 100_000  # past the recursion limit of json and ast alike
    for deep in (f'<tool_call>{{"name": "f", "arguments": {{"a": {nested}}}}}</tool_call>', f"[f(a={nested})]",
                 f'{{"name": "f", "parameters": {{"a": {nested}}}}}', f"[TOOL_CALLS] {nested}",
                 f"<tool_call><function=f><parameter=a>{nested}</parameter></function></tool_call>"):
        assert parse(deep).content is not None


# -- the templates that teach each format ----------------------------------------------

CHATML_TURNS = (  # Qwen2.5's turns: each call begins on a new line after the header or the content
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant' }}"
    "{%- if m.content %}{{ '\\n' + m.content }}{% endif %}{{ CALLS }}{{ eos_token + '\\n' }}"
    "{%- elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{{ eos_token + '\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + eos_token + '\\n' }}{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS_SYSTEM = ("{%- if tools %}{{ '<|im_start|>system\\n<tools>' }}{% for t in tools %}{{ '\\n' + t | tojson }}"
                "{% endfor %}{{ '\\n</tools>' + eos_token + '\\n' }}{% endif %}")

TEMPLATES = {
    # Qwen2.5's: each call on its own lines inside <tool_call>
    "hermes": TOOLS_SYSTEM + CHATML_TURNS.replace("{{ CALLS }}", (
        "{%- for c in m.tool_calls or [] %}{{ '\\n<tool_call>\\n{\"name\": \"' + c.function.name + "
        "'\", \"arguments\": ' }}{{ c.function.arguments | tojson }}{{ '}\\n</tool_call>' }}{% endfor %}")),
    # Llama 3.1's: the call as the whole turn, the arguments under "parameters"
    "llama3_json": (
        "{%- if tools %}{{ '<|start_header_id|>system<|end_header_id|>\\n\\nYou have these functions:' }}"
        "{% for t in tools %}{{ '\\n' + t | tojson }}{% endfor %}{{ eos_token }}{% endif %}"
        "{%- for m in messages %}"
        "{%- if m.role == 'assistant' and m.tool_calls %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% set c = m.tool_calls[0].function %}"
        "{{ '{\"name\": \"' + c.name + '\", ' }}{{ '\"parameters\": ' }}{{ c.arguments | tojson }}{{ '}' + eos_token }}"
        "{%- elif m.role == 'tool' %}{{ '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + eos_token }}"
        "{%- else %}{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + eos_token }}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"),
    # Mistral 7B v0.3's: a JSON list after [TOOL_CALLS], each call with its 9-character id (v0.3 also
    # puts a space before a plain reply, which no continuation of a sampled reply matches: left out)
    "mistral": (
        "{%- set users = messages | selectattr('role', 'equalto', 'user') | list %}"
        "{%- for m in messages %}"
        "{%- if m.role == 'user' %}"
        "{%- if tools and m == users[-1] %}"
        "{{ '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{% endif %}"
        "{{ '[INST] ' + m.content + '[/INST]' }}"
        "{%- elif m.tool_calls %}{{ '[TOOL_CALLS] [' }}{%- for c in m.tool_calls %}"
        "{%- if c.id is not defined or c.id | length != 9 %}{{ raise_exception('ids are 9 characters') }}{% endif %}"
        "{%- set out = c.function | tojson %}{{ out[:-1] + ', \"id\": \"' + c.id + '\"}' }}"
        "{%- if not loop.last %}{{ ', ' }}{% else %}{{ ']' + eos_token }}{% endif %}{% endfor %}"
        "{%- elif m.role == 'assistant' %}{{ m.content + eos_token }}"
        "{%- elif m.role == 'tool' %}"
        "{{ '[TOOL_RESULTS] {\"content\": ' + m.content | tojson + ', \"call_id\": \"' + m.tool_call_id + '\"}' }}"
        "{{ '[/TOOL_RESULTS]' }}{%- endif %}{%- endfor %}"),
    # Mistral Small 3.2's / Devstral's: [TOOL_CALLS]name[ARGS]{...} per call
    "mistral_args": (
        "{%- if tools %}{{ '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{% endif %}"
        "{%- for m in messages %}"
        "{%- if m.role == 'user' %}{{ '[INST]' + m.content + '[/INST]' }}"
        "{%- elif m.role == 'assistant' %}{{ m.content or '' }}{%- for c in m.tool_calls or [] %}"
        "{{ '[TOOL_CALLS]' + c.function.name + '[ARGS]' + c.function.arguments | tojson }}{% endfor %}{{ eos_token }}"
        "{%- elif m.role == 'tool' %}{{ '[TOOL_RESULTS]' + m.content + '[/TOOL_RESULTS]' }}{%- endif %}{%- endfor %}"),
    # Qwen3-Coder's: XML parameters, values written with Jinja's `string` (so a template given
    # the arguments as OpenAI's JSON string fails: they must come as an object)
    "qwen3_xml": TOOLS_SYSTEM + CHATML_TURNS.replace("{{ CALLS }}", (
        "{%- for c in m.tool_calls or [] %}{{ '\\n<tool_call>\\n<function=' + c.function.name + '>\\n' }}"
        "{%- for k, v in c.function.arguments | items %}{{ '<parameter=' + k + '>\\n' }}"
        "{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}"
        "{{ '\\n</parameter>\\n' }}{% endfor %}{{ '</function>\\n</tool_call>' }}{% endfor %}")),
    # vLLM's pythonic example template (Llama 3.2 style): Python reprs in one list
    "pythonic": TOOLS_SYSTEM + CHATML_TURNS.replace("{{ CALLS }}", (
        "{%- if m.tool_calls %}{{ '\\n[' }}{%- for c in m.tool_calls %}{{ c.function.name + '(' }}"
        "{%- for k in c.function.arguments %}{{ k + '=' }}{{ '%r' | format(c.function.arguments[k]) }}"
        "{%- if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ ')' }}"
        "{%- if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ ']' }}{% endif %}")),
}
FORMAT_OF = {"mistral_args": "mistral"}  # the template's key -> the format that reads it
ARGUMENTS = {"expression": "17 * 23", "note": "naïve «ok» ✓", "digits": 4, "exact": True, "tags": ["x", "y"]}
USER = {"role": "user", "content": "What is 17 * 23?"}
TOOLS = [{"type": "function", "function": {"name": "calculate", "description": "Evaluate arithmetic", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def taught(tokenizer, key: str):
    """``tokenizer`` with the template teaching ``key``'s format."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATES[key]
    return tok


def asking(calls: list[dict]) -> list[dict]:
    return [USER, {"role": "assistant", "content": None, "tool_calls": calls}]


def openai_call(name: str, arguments: dict, call_id: str = "a1b2c3d4e") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def rendered_turn(tok, messages: list[dict]) -> str:
    """The last assistant turn as the client renders it (through ``prepare``), from where
    the generation prompt ends."""
    support = probe(tok)
    asked = tok.apply_chat_template(*prepare(messages[:-1], TOOLS, support), tokenize=False,
                                    add_generation_prompt=True)
    whole = tok.apply_chat_template(*prepare(messages, TOOLS, support), tokenize=False)
    assert whole.startswith(asked)
    return whole[len(asked):]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):  # noqa: F811 (the fixture imported above)
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("key", list(TEMPLATES))
def test_a_call_round_trips_through_the_template_that_teaches_it(smollm2, key):
    """Render calls through the template, parse the assistant's text back: the same names
    and arguments; render the parsed calls again (as an agent sends them back): the same
    token ids on SmolLM2's byte-level BPE. ``auto`` picks the format, and its opening
    begins the rendered turn byte for byte."""
    tok = taught(smollm2, key)
    several = key != "llama3_json"  # Llama 3.1's template renders one call per turn
    calls = [openai_call("calculate", ARGUMENTS)] + (
        [openai_call("lookup", {"q": "東京"}, "z9y8x7w6v")] if several else [])
    messages = asking(calls)
    turn = rendered_turn(tok, messages)
    fmt = resolve_format("auto", tok)
    assert fmt.name == FORMAT_OF.get(key, key) and fmt.origin == "auto, from the chat template"
    reply = fmt.parse(turn)
    assert reply.error is None and reply.content in (None, tok.eos_token)
    assert calls_of(reply) == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]

    again = asking([{**c.to_openai(), "id": sent["id"]} for c, sent in zip(reply.tool_calls, calls)])
    ids = tok.apply_chat_template(*prepare(messages, TOOLS, probe(tok)), tokenize=True, return_dict=False)
    ids_again = tok.apply_chat_template(*prepare(again, TOOLS, probe(tok)), tokenize=True, return_dict=False)
    assert ids_again == ids

    assert turn.startswith(fmt.opening(None)) and turn.startswith(fmt.opening("calculate"))
    assert fmt.parse(fmt.opening("calculate") + turn[len(fmt.opening("calculate")):]).tool_calls


def test_auto_on_templates_without_tool_calls_is_the_hermes_fallback(smollm2, char_tokenizer):
    fmt = resolve_format("auto", smollm2)  # SmolLM2's template drops tool calls: asyncrl writes hermes
    assert fmt.name == "hermes" and "fallback" in fmt.origin
    turn = rendered_turn(smollm2, asking([openai_call("calculate", ARGUMENTS)]))
    assert turn.startswith(fmt.opening("calculate")) and fmt.opening("calculate") == (
        '<tool_call>{"name": "calculate", "arguments": ')
    assert calls_of(fmt.parse(turn)) == [("calculate", ARGUMENTS)]
    tiny = resolve_format("auto", char_tokenizer)  # the shipped tiny models' template writes hermes itself
    assert tiny.name == "hermes" and tiny.origin == "auto, from the chat template"


def test_openings_continue_into_a_call_each_format_parses():
    continuations = {"hermes": '{"x": 1}}\n</tool_call>', "llama3_json": '{"x": 1}}', "mistral": '{"x": 1}',
                     "qwen3_xml": "<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>", "pythonic": "x=1)]"}
    for name, rest in continuations.items():
        fmt = get_format(name)
        assert fmt.opening("f").startswith(fmt.opening(None))
        assert calls_of(fmt.parse(fmt.opening("f") + rest)) == [("f", {"x": 1})], name
    assert get_format("hermes").opening("f") == '<tool_call>\n{"name": "f", "arguments": '


def test_a_named_format_that_differs_from_the_templates_is_said(smollm2):
    fmt = resolve_format("hermes", taught(smollm2, "llama3_json"))
    assert fmt.name == "hermes" and "writes calls as llama3_json" in fmt.origin
    assert template_notes(smollm2, templated=False, tool_format=fmt) == [f"tool calls: hermes ({fmt.origin})"]
    auto = resolve_format("auto", taught(smollm2, "llama3_json"))
    assert template_notes(smollm2, templated=False, tool_format=auto) == [
        "tool calls: llama3_json (auto, from the chat template)"]


def test_auto_refuses_a_template_whose_calls_no_format_reads(smollm2):
    tok = copy.deepcopy(smollm2)
    tok.chat_template = TEMPLATES["hermes"].replace("<tool_call>", "<|tool▁call|>").replace("</tool_call>", "<|end|>")
    with pytest.raises(ConfigError, match=r"no built-in format reads .*module:function"):
        resolve_format("auto", tok)


def test_names_are_checked_before_any_model_loads():
    assert GatewayConfig().tool_parser == "auto"
    check_format_name("auto")
    for name in FORMATS:
        check_format_name(name)
    with pytest.raises(ConfigError, match="valid: auto, hermes, llama3_json, mistral, qwen3_xml, pythonic"):
        check_format_name("llama3")
    with pytest.raises(ConfigError, match="gateway.tool_parser"):
        check_format_name("no_such_module_q7x:parse")
    user = get_format("test_tool_parsers:calls_of")  # a user's parser: it parses, but has no opening
    assert user.opening(None) is None and user.opening("f") is None
    assert get_format("llama3_json")('{"name": "f", "parameters": {}}').tool_calls


def test_the_first_failure_per_format_is_warned_once(caplog):
    fmt = get_format("llama3_json")
    with caplog.at_level(logging.WARNING, logger="asyncrl.rollout.gateway.tool_calls"):
        for _ in range(3):
            assert fmt('{"name": "f", "parameters": {').error
        assert fmt("fine").error is None
    [warning] = [r.getMessage() for r in caplog.records if r.name == "asyncrl.rollout.gateway.tool_calls"]
    assert "gateway.tool_parser llama3_json" in warning and "not JSON" in warning and "auto" in warning


# -- through the gateway: the format the template teaches is read, the episode token-exact --

CALL_TEXTS = {  # a call as the model writes it after each template's generation prompt
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "llama3_json": '{"name": "add", "parameters": {"a": 2, "b": 3}}',
    "mistral": '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "k3j4h5g6f"}]',
    "mistral_args": '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}',
    "qwen3_xml": "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n"
                 "</function>\n</tool_call>",
    "pythonic": "[add(a=2, b=3)]",
}
ADD = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.mark.parametrize("key", list(TEMPLATES))
def test_a_tool_episode_in_each_format_through_the_gateway(tiny_policy, key):
    """The motivating case and its kin: a model taught by ``key``'s template writes its
    call; the gateway with ``tool_parser: auto`` returns it as ``tool_calls`` (not plain
    content), the agent sends it back with the result, and the episode is one trajectory
    holding the sampled ids untouched."""
    model, char_tokenizer = tiny_policy
    tok = taught(char_tokenizer, key)

    async def main():
        engine = TorchEngine(model, max_batch_size=4)
        sampling = SamplingParams(max_tokens=8, stop_token_ids=stop_token_ids(tok))
        gateway = Gateway(tok, resolve_format("auto", tok), model_name="tiny", engine=engine, sampling=sampling)
        await gateway.start()
        try:
            scripted = ScriptedFirstReply(engine, tok, CALL_TEXTS[key])
            llm = LLMClient(scripted, tok, sampling)
            async with gateway.session(llm) as base_url:
                client = sdk(base_url)
                messages = [{"role": "user", "content": "2 3 -> 5"}]
                first = await client.chat.completions.create(model="tiny", messages=messages, tools=ADD)
                call = first.choices[0].message.tool_calls[0]
                messages += [first.choices[0].message.model_dump(),
                             {"role": "tool", "tool_call_id": call.id, "content": "5"}]
                await client.chat.completions.create(model="tiny", messages=messages, tools=ADD)
            return first, llm, scripted, gateway.counts
        finally:
            await gateway.stop()
            await engine.shutdown()

    first, llm, scripted, counts = asyncio.run(main())
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and counts["tool_parse_errors"] == 0
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("add", {"a": 2, "b": 3})]
    [trajectory] = llm.trajectories  # the second call continued the first
    assert trajectory.response_ids[:len(scripted.script)] == scripted.script


def test_a_call_whose_marker_is_a_special_token_is_read_from_the_reply_that_keeps_it(smollm2_dir):  # noqa: F811
    """Mistral's tokenizers make ``[TOOL_CALLS]`` a special token: decoded without special
    tokens (the reply's text) the marker is gone and the call would come back as prose;
    the session reads it from the reply decoded with them."""
    from asyncrl.rollout.client import Response
    from asyncrl.rollout.gateway.session import read_calls

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    ids = tokenizer.encode('[TOOL_CALLS] [{"name": "calculate", "arguments": {"expression": "17 * 23"}}]',
                           add_special_tokens=False)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert "[TOOL_CALLS]" not in text  # what the agent would otherwise be handed as content
    response = Response(text, ids, "stop", recorded_text=tokenizer.decode(ids, skip_special_tokens=False))
    mistral = get_format("mistral")
    assert mistral(text).tool_calls == ()
    parsed = read_calls(mistral, text, response, None)
    assert calls_of(parsed) == [("calculate", {"expression": "17 * 23"})]
    plain = Response("no call here", ids[:2], "stop")  # nothing special kept: read as before
    assert read_calls(mistral, "no call here", plain, None) == mistral("no call here")
