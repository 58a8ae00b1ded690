"""What a tool parser returns, and the pieces every parser shares.

A parser maps the decoded reply to content and tool calls. It never raises on what a
model wrote: text that looks like a broken tool call comes back as plain content with
``error`` set (the gateway counts it, ``rollout/tool_parse_errors_total``), because a
half-trained policy writes broken calls all the time and an agent must see an answer,
not a 500. Inside a parser a broken call raises :class:`BrokenCall`; :func:`never_raises`
turns that (and JSON nested past Python's recursion limit) into such a reply, so each
parser reads as the happy path.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


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


class BrokenCall(ValueError):
    """Text that looks like a tool call and does not parse; the message says why."""


def never_raises(parse: ToolParser) -> ToolParser:
    """``parse`` with a :class:`BrokenCall` (or nesting too deep to parse) returned as the
    whole text as content, the reason in ``error``."""
    @functools.wraps(parse)
    def parser(text: str) -> ParsedReply:
        try:
            return parse(text)
        except BrokenCall as exc:
            return ParsedReply(text, error=str(exc))
        except RecursionError:
            return ParsedReply(text, error="tool call nests too deeply to parse")
    return parser


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# NaN and Infinity are not JSON: a reply's arguments must be what every agent's json.loads reads.
_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def json_at(text: str, at: int = 0) -> tuple[Any, int]:
    """The JSON value that begins at ``text[at]`` and the index just past it (what follows
    is not read). Raises :class:`BrokenCall`."""
    try:
        return _DECODER.raw_decode(text, at)
    except ValueError as exc:
        raise BrokenCall(f"tool call is not JSON ({getattr(exc, 'msg', exc)})") from None


def json_value(text: str) -> Any:
    """``text`` as one JSON value, whitespace around it allowed. Raises :class:`BrokenCall`."""
    value, end = json_at(text, len(text) - len(text.lstrip()))
    if text[end:].strip():
        raise BrokenCall("tool call is not JSON (text after the value)")
    return value


def arguments_json(arguments: Any) -> str:
    """OpenAI's ``arguments`` string for arguments written as an object, or as a JSON
    string holding one (a model taught by a template that did not decode them)."""
    if isinstance(arguments, str):
        try:
            arguments = json_value(arguments)
        except BrokenCall:
            raise BrokenCall("tool call 'arguments' is not JSON") from None
    if not isinstance(arguments, dict):
        raise BrokenCall("tool call 'arguments' is not an object")
    try:
        return json.dumps(arguments, allow_nan=False)
    except ValueError:  # a float past JSON's range (1e999) or another non-JSON value
        raise BrokenCall("tool call 'arguments' hold a value JSON cannot carry") from None


def call_from_object(call: Any, arguments_keys: tuple[str, ...] = ("arguments",), **extra: Any) -> ToolCall:
    """A call written as ``{"name": …, <arguments key>: {...}}``; the first of
    ``arguments_keys`` present holds the arguments (none: no arguments)."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise BrokenCall("tool call has no 'name'")
    key = next((k for k in arguments_keys if k in call), None)
    return ToolCall(call["name"], arguments_json(call[key] if key else {}), **extra)
