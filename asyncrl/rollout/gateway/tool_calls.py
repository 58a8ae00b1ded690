"""Model text → OpenAI ``tool_calls``, by a named parser.

A parser maps the decoded reply to content and tool calls. It never raises on what a
model wrote: text that looks like a broken tool call comes back as plain content with
``error`` set (the gateway counts it, ``rollout/tool_parse_errors_total``), because a
half-trained policy writes broken calls all the time and an agent must see an answer,
not a 500. Parsers are ``hermes`` (the ``<tool_call>{"name": …, "arguments": …}</tool_call>``
blocks of Qwen and Hermes models) or a user's ``module:function`` with the same signature.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.plugins import load_named


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's wire format)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    error: str | None = None  # why text that looked like a tool call was returned as content


ToolParser = Callable[[str], ParsedReply]

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def hermes(text: str) -> ParsedReply:
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` blocks; the text around
    them is the content. One broken block returns the whole reply as content."""
    if "<tool_call>" not in text:
        return ParsedReply(text)
    calls = []
    for raw in _HERMES_BLOCK.findall(text):
        try:
            call = json.loads(raw)
        except json.JSONDecodeError as exc:
            return ParsedReply(text, error=f"tool call is not JSON ({exc.msg})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return ParsedReply(text, error="tool call has no 'name'")
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # already a JSON string: it must hold an object
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return ParsedReply(text, error="tool call 'arguments' is not JSON")
        if not isinstance(arguments, dict):
            return ParsedReply(text, error="tool call 'arguments' is not an object")
        calls.append(ToolCall(call["name"], json.dumps(arguments)))
    rest = _HERMES_BLOCK.sub("", text)
    if "<tool_call>" in rest or "</tool_call>" in rest:
        return ParsedReply(text, error="unclosed <tool_call>")
    return ParsedReply(rest.strip() or None, tuple(calls))


PARSERS: dict[str, ToolParser] = {"hermes": hermes}


def get_parser(name: str) -> ToolParser:
    """A built-in parser by name, or a user's ``module:function``; raises ``ValueError``."""
    if name in PARSERS:
        return PARSERS[name]
    if ":" not in name:
        raise ValueError(f"gateway.tool_parser {name!r}: valid: {', '.join(PARSERS)} or module:function")
    return load_named(name, key="gateway.tool_parser")
