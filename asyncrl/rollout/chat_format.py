"""Chat templates that were not written for tool use, made to carry it anyway.

Many instruct models ship a template that silently drops ``tools=`` and assistant
``tool_calls`` and renders a ``tool`` message as a role the model never saw, or raises on
``content: None``. An agent run on such a model would then act without ever seeing its
tools, and nothing would say so. :func:`probe` finds out once per template what it
renders, by rendering sentinel messages; :func:`prepare` rewrites a conversation so that
what the template would lose is spelled out as plain text in the hermes format
(``<tool_call>{"name": …, "arguments": …}</tool_call>``, which the gateway's ``hermes``
parser reads back). What a template does render is left to it, with a call's arguments
handed over as an object, the form Hugging Face templates are written for. The probe
also records what its call became (``TemplateSupport.call_text``): the tool-call format
the model was taught, which ``gateway.tool_parser: auto`` reads.

:func:`prepare` works message by message (plus one system block that depends only on the
first message and the tools), so preparing a conversation is a prefix of preparing its
continuation: the client's token-exact multi-turn relies on that.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]

PROBE_FUNCTION = "asyncrl_probe_fn_q7x"
PROBE_ARGUMENTS = {"asyncrl_probe_arg_q7x": 1}
"""The call the probe renders; ``TemplateSupport.call_text`` is what it became."""
_SENTINEL_RESULT = "asyncrl_probe_result_q7x"
_SENTINEL_ROLE = "asyncrl_probe_role_q7x"
_SENTINEL_CALL_ID = "probe0001"  # 9 alphanumerics: Mistral's templates refuse any other id


@dataclass(frozen=True)
class TemplateSupport:
    """What a chat template renders itself. A False field is rendered by :func:`prepare`."""

    tools: bool  # the ``tools=`` definitions reach the prompt
    tool_calls: bool  # an assistant message's ``tool_calls`` reach the prompt
    tool_role: bool  # a ``tool`` message is rendered as a tool result the template knows
    none_content: bool  # ``content: None`` renders as empty text (no error, no "None")
    call_text: str | None = field(default=None, compare=False)
    """The probe's call (``PROBE_FUNCTION`` with ``PROBE_ARGUMENTS``) as the model is shown
    it, from where the generation prompt ends: the template's rendering, or the hermes
    fallback's where the template drops calls. The tool-call format the model was taught is
    read from it (``gateway.tool_parser: auto``). None when even that failed to render."""

    @property
    def complete(self) -> bool:
        return self.tools and self.tool_calls and self.tool_role and self.none_content


_probed: dict[str, TemplateSupport] = {}
_probed_lock = threading.Lock()  # the gateway renders on its threads too


def probe(tokenizer: PreTrainedTokenizerBase) -> TemplateSupport:
    """What ``tokenizer``'s chat template renders, found by rendering sentinels and cached
    per template text (every client of a run shares one tokenizer). Raises ``ValueError``
    when it has no chat template."""
    template = tokenizer.chat_template
    if template is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
    key = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    with _probed_lock:
        if key not in _probed:
            _probed[key] = _probe(tokenizer)
        return _probed[key]


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[Message], tools: list[dict[str, Any]] | None,
                *, generation_prompt: bool) -> str:
    """The one chat renderer: the chat template's text for ``messages`` after :func:`prepare`
    has written out what the template would drop (the probe is cached per template, so
    this costs a dict lookup). The rollout client (``LLMClient.render``) and SFT
    (``asyncrl/sft/render.py``) both render through it, so SFT trains on the text the
    client samples from. ``generation_prompt``: end with the opening of the model's next
    turn, as a prompt does. Raises ``ValueError`` when the tokenizer has no chat template."""
    messages, tools = prepare(messages, tools, probe(tokenizer))
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[Message], tools: list[dict[str, Any]] | None = None,
            *, generation_prompt: bool = False) -> str | None:
    """The template's text, or None when it raises: a template is arbitrary Jinja, and an
    error on a sentinel only means it does not handle that feature."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception:  # noqa: BLE001 (jinja, TypeError, KeyError, a template's raise_exception...)
        return None


def _probe(tokenizer: PreTrainedTokenizerBase) -> TemplateSupport:
    user = {"role": "user", "content": "hi"}
    tool_def = [{"type": "function", "function": {
        "name": PROBE_FUNCTION, "description": "probe", "parameters": {
            "type": "object", "properties": {name: {"type": "integer"} for name in PROBE_ARGUMENTS}}}}]
    tools_ok = PROBE_FUNCTION in (_render(tokenizer, [user], tool_def) or "")
    # Arguments as an object: what prepare hands a template (see _template_arguments).
    calling = {"role": "assistant", "content": "", "tool_calls": [{"id": _SENTINEL_CALL_ID, "type": "function",
                                                                   "function": {"name": PROBE_FUNCTION,
                                                                                "arguments": PROBE_ARGUMENTS}}]}
    with_tools = tool_def if tools_ok else None
    calls_ok = PROBE_FUNCTION in (_render(tokenizer, [user, calling], with_tools) or "")

    # A tool result after a call. A template that renders any role as a plain header (as
    # SmolLM2's does) shows the model a "tool" turn it was never taught; that counts as
    # support only when the template was written for tools (ours: a plain "tool" turn).
    before = [user, calling if calls_ok else {"role": "assistant", "content": "ok"}]

    def result(role: str) -> str | None:
        return _render(tokenizer, before + [{"role": role, "content": _SENTINEL_RESULT, "name": PROBE_FUNCTION,
                                             "tool_call_id": _SENTINEL_CALL_ID}], with_tools)

    as_tool = result("tool")
    as_other = result(_SENTINEL_ROLE)
    generic = as_other is not None and as_other.replace(_SENTINEL_ROLE, "tool") == as_tool
    role_ok = as_tool is not None and _SENTINEL_RESULT in as_tool and (tools_ok or not generic)

    empty = _render(tokenizer, [user, {"role": "assistant", "content": ""}])
    none = _render(tokenizer, [user, {"role": "assistant", "content": None}])
    support = TemplateSupport(tools=tools_ok, tool_calls=calls_ok, tool_role=role_ok,
                              none_content=none is not None and none == empty)
    # The call as the client would render it: through prepare, so the fallback's text where the template has none.
    asked = _render(tokenizer, *prepare([user], tool_def, support), generation_prompt=True)
    answered = _render(tokenizer, *prepare([user, calling], tool_def, support))
    if asked is None or answered is None:
        return support
    return replace(support, call_text=answered[len(os.path.commonprefix([asked, answered])):])


def prepare(messages: list[Message], tools: list[dict[str, Any]] | None,
            support: TemplateSupport) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """The conversation and tools to hand the template: what ``support`` says it would lose
    or fail on, written out as text. Pure: returns new lists, changed messages are new dicts,
    the caller's are never mutated."""
    out = [_prepare_message(m, support) for m in messages]
    if not tools:
        return out, None if tools is None else list(tools)
    if support.tools:
        return out, list(tools)
    block = _tools_block(tools, results_as_text=not support.tool_role)
    first = out[0] if out else None
    if first is not None and first.get("role") == "system" and isinstance(first.get("content") or "", str):
        out[0] = {**first, "content": f"{first['content']}\n\n{block}" if first.get("content") else block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, None


def _prepare_message(message: Message, support: TemplateSupport) -> Message:
    m = message
    if m.get("content", "") is None and not support.none_content:
        m = {**m, "content": ""}
    if m.get("tool_calls") and support.tool_calls:
        m = {**m, "tool_calls": [_template_arguments(c) for c in m["tool_calls"]]}
    if m.get("tool_calls") and not support.tool_calls:
        calls = "\n".join(_call_text(c) for c in m["tool_calls"])
        m = {k: v for k, v in m.items() if k != "tool_calls"}
        m["content"] = f"{m['content']}\n{calls}" if m.get("content") else calls
    if m.get("role") == "tool" and not support.tool_role:
        m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
    return m


def _template_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """``call`` with its arguments as an object when they are OpenAI's JSON string holding
    one: Hugging Face templates expect an object (Llama 3.x's and Mistral's ``tojson`` it,
    so a string would render double-encoded, a call the model never saw; Qwen3-Coder's
    iterates its items, so a string fails). Other strings are left as sent."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except (ValueError, RecursionError):
        return call
    return {**call, "function": {**fn, "arguments": arguments}} if isinstance(arguments, dict) else call


def _call_text(call: dict[str, Any]) -> str:
    """One OpenAI tool call as the hermes text a model would have written for it."""
    fn = call.get("function", call)
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # not JSON: shown as the string it is
    body = json.dumps({"name": fn.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>{body}</tool_call>"


def _tools_block(tools: list[dict[str, Any]], *, results_as_text: bool) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    lines = [
        "You can call the functions described below; each is one JSON object between <tools> and </tools>.",
        f"<tools>\n{listing}\n</tools>",
        ("To call a function, answer with a JSON object that names it and gives its arguments, "
         "between <tool_call> and </tool_call>, like this:"),
        '<tool_call>{"name": "function_name", "arguments": {"argument_name": "value"}}</tool_call>',
        "Write one such block for each call; several blocks may follow one another.",
    ]
    if results_as_text:
        lines.append("The result of each call is given back to you between <tool_response> and </tool_response>.")
    return "\n".join(lines)


def describe(support: TemplateSupport) -> str | None:
    """One line for the start banner saying what asyncrl renders in the template's place;
    None when the template renders everything itself."""
    if support.complete:
        return None
    lost = [name for name, ok in (("tools", support.tools), ("tool calls", support.tool_calls),
                                  ("tool results", support.tool_role)) if not ok]
    parts = []
    if lost:
        head = "no tool support — " if len(lost) == 3 else "partial tool support — "
        listed = ", ".join(lost[:-1]) + " and " + lost[-1] if len(lost) > 1 else lost[0]
        parts.append(f"{head}{listed} rendered by asyncrl's fallback (hermes <tool_call> format)")
    if not support.none_content:
        parts.append("content None sent as empty text")
    return "chat template: " + "; ".join(parts)
