"""The Anthropic Messages API (``POST /v1/messages``), translated onto the session's chat form.

What Claude Code, the Claude Agent SDK and Anthropic-side harnesses speak
(``ANTHROPIC_BASE_URL`` pointed at the gateway or a session's URL without ``/v1``). A
request's ``system`` (a string or text blocks) becomes a system message; each message's
content blocks become chat messages: an assistant's ``text``, ``thinking`` and
``tool_use`` blocks one assistant message (``tool_calls``, the input as JSON arguments,
``reasoning_content``), a user's ``tool_result`` blocks ``tool`` messages (in their
order, before the user's text); ``tools`` (``name``, ``description``, ``input_schema``)
chat function tools, ``tool_choice`` ``auto``/``any``/``tool``/``none`` the chat form's
``auto``/``required``/named/``none``. Then the session records the call as any chat call
(``wire.py``): our ``tool_use`` blocks sent back mean the same as the reply they came
from, are swapped for the reply as sampled, and the trajectory goes on token-exact
whichever dialect the turn before came in.

The reply: a ``thinking`` block where the model wrote ``<think>…</think>`` (signature
empty: nothing is signed here), a ``text`` block, a ``tool_use`` block per call (its id
the call's id); ``stop_reason`` ``tool_use``, ``max_tokens``, ``stop_sequence`` (with the
one met) or ``end_turn``. ``max_tokens`` is required, as Anthropic's API requires it.

Errors are Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, for the
same refusals as every dialect (``access.py`` writes aiohttp's own so on these routes);
refused here besides: content blocks that are not text (images, documents: the policy
reads text) and tools that are not custom tools (Anthropic's server tools run on its
servers). A request that ends on the assistant's text is a prefill, as in Anthropic's
API: the reply continues it (the chat form's ``continue_final_message``); one that ends
on the assistant's ``tool_use`` is refused (there is nothing to continue).
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from asyncrl.json_api import Refused, validate
from asyncrl.rollout.gateway.openai_api import ChatRequest
from asyncrl.rollout.gateway.wire import Event

if TYPE_CHECKING:
    from asyncrl.rollout.gateway.session import CallPlan, CallResult, Session

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}
_RENAMED = {"stop": "stop_sequences", "response_format": "output_config.format"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_response(refused: Refused) -> web.Response:
    return web.json_response(error_body(refused.status, str(refused)), status=refused.status)


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    output_config: dict[str, Any] | None = None


class CountRequest(MessagesRequest):
    max_tokens: int | None = Field(None, ge=1)  # type: ignore[assignment]  # a count needs no reply budget


def _text_of(block: dict[str, Any], where: str) -> str:
    if block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise Refused(400, f"{where}: only text blocks are served here (got {block.get('type') or block!r:.80}): "
                           "the policy reads text", where)
    return block["text"]


def _blocks(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise Refused(400, f"{where}: expected a string or text blocks (got {content!r:.80})", where)
    return "".join(_text_of(block, f"{where}[{i}]") for i, block in enumerate(content))


def chat_messages(system: str | list[dict[str, Any]] | None, messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """The request's conversation in the chat form (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if system:
        text = system if isinstance(system, str) else "".join(
            _text_of(block, f"system[{i}]") for i, block in enumerate(system))
        out.append({"role": "system", "content": text})
    for m, message in enumerate(messages):
        where = f"messages[{m}].content"
        blocks = _blocks(message.content)
        if message.role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": ""}
            for i, block in enumerate(blocks):
                kind = block.get("type") if isinstance(block, dict) else None
                if kind == "tool_use":
                    turn.setdefault("tool_calls", []).append(
                        {"id": block.get("id"), "type": "function",
                         "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}})
                elif kind == "thinking":
                    turn["reasoning_content"] = turn.get("reasoning_content", "") + str(block.get("thinking") or "")
                elif kind != "redacted_thinking":  # nothing of ours is redacted: another model's, unreadable
                    turn["content"] += _text_of(block, f"{where}[{i}]")
            out.append(turn)
            continue
        texts = []
        for i, block in enumerate(blocks):
            if isinstance(block, dict) and block.get("type") == "tool_result":
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _result_text(block.get("content"), f"{where}[{i}].content")})
            else:
                texts.append(_text_of(block, f"{where}[{i}]"))
        if texts or not any(isinstance(b, dict) and b.get("type") == "tool_result" for b in blocks):
            out.append({"role": "user", "content": "".join(texts)})
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise Refused(400, f"tools[{i}].type {kind!r:.60} is not served: only custom tools (name, description, "
                               "input_schema), which the agent runs and answers with tool_result; server tools run "
                               "on Anthropic's servers", f"tools[{i}].type")
        function = {"name": tool.get("name")}
        if "description" in tool:
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise Refused(400, f'tool_choice.type: expected "auto", "any", "tool" or "none" (got {kind!r:.60})',
                  "tool_choice.type")


class MessagesWire:
    param, raw_prompt = "messages", False

    def __init__(self, model: str, *, counting: bool = False) -> None:
        self.model, self.counting = model, counting
        self.notes: list[str] = []  # what is not honoured is refused or said by the session
        self.id = f"msg_{uuid.uuid4().hex}"
        self.body: MessagesRequest | None = None

    def read(self, data: Any, session: Session | None) -> ChatRequest:
        self.body = body = validate(data, CountRequest if self.counting else MessagesRequest)
        prefill = body.messages[-1].role == "assistant" and not self.counting
        chat = {"messages": chat_messages(body.system, body.messages), "tools": chat_tools(body.tools),
                "tool_choice": chat_tool_choice(body.tool_choice), "stream": body.stream,
                "max_tokens": body.max_tokens, "stop": body.stop_sequences, "temperature": body.temperature,
                "top_p": body.top_p, "top_k": body.top_k, "response_format": (body.output_config or {}).get("format"),
                "continue_final_message": prefill or None, "add_generation_prompt": False if prefill else None}
        try:
            return validate({k: v for k, v in chat.items() if v is not None}, ChatRequest)
        except Refused as exc:
            raise Refused(exc.status, str(exc), _RENAMED.get(exc.param or "", exc.param)) from None

    def stop(self, result: CallResult) -> tuple[str, str | None]:
        """``stop_reason`` and ``stop_sequence``: the stop sequence met is the one the text
        sampled past the reply's visible text begins with."""
        r = result.response
        if result.parsed.tool_calls:
            return "tool_use", None
        if r.finish_reason == "length":
            return "max_tokens", None
        if r.recorded_text is not None and self.body is not None and self.body.stop_sequences:
            after = (r.recorded_text if r.recorded_text.startswith(r.text) else "")[len(r.text):]
            met = next((s for s in self.body.stop_sequences if s and after.startswith(s)), None)
            if met is not None:
                return "stop_sequence", met
        return "end_turn", None

    def content(self, result: CallResult) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = []
        if result.reasoning:
            blocks.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
        if result.parsed.content:
            blocks.append({"type": "text", "text": result.parsed.content})
        blocks += [tool_use(call) for call in result.parsed.tool_calls]
        return blocks

    def message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None], input_tokens: int,
                output_tokens: int) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}

    def reply(self, result: CallResult, fingerprint: str) -> dict[str, Any]:
        r = result.response
        return self.message(self.content(result), self.stop(result), r.prompt_tokens, len(r.token_ids))

    def stream(self, plan: CallPlan, fingerprint: str) -> MessageEvents:
        return MessageEvents(self)

    def refusal(self, refused: Refused) -> web.Response:
        return error_response(refused)


def tool_use(call: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}


class MessageEvents:
    """The Messages stream: ``message_start``; a ``thinking`` block (``thinking_delta``) and
    a ``text`` block (``text_delta``) opened as their text comes, each closed by
    ``content_block_stop``; then each ``tool_use`` block whole (its input as one
    ``input_json_delta``), as the text stream holds calls for the end; ``message_delta``
    with the stop reason and the usage, ``message_stop``. A failure after the first event:
    an ``error`` event, which the SDK raises."""

    def __init__(self, wire: MessagesWire) -> None:
        self.wire = wire
        self.index = 0  # the next block's
        self.open: str | None = None  # "thinking" or "text"

    def opened(self) -> list[Event]:
        return [("message_start", {"type": "message_start", "message": self.wire.message([], (None, None), 0, 0)})]

    def _open(self, kind: str) -> list[Event]:
        events = self._close()
        self.open = kind
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else (
            {"type": "text", "text": ""})
        return [*events, ("content_block_start",
                          {"type": "content_block_start", "index": self.index, "content_block": block})]

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        self.index += 1
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index - 1})]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}

    def text(self, delta: dict[str, str]) -> list[Event]:
        events: list[Event] = []
        for key, kind, field in (("reasoning_content", "thinking", "thinking"), ("content", "text", "text")):
            piece = delta.get(key)
            if piece:
                if self.open != kind:
                    events += self._open(kind)
                events.append(self._delta({"type": f"{field}_delta", field: piece}))
        return events

    def finished(self, result: CallResult, rest: dict[str, str]) -> list[Event]:
        events = [*self.text(rest), *self._close()]
        for call in result.parsed.tool_calls:
            events += [("content_block_start", {"type": "content_block_start", "index": self.index,
                                                "content_block": {**tool_use(call), "input": {}}}),
                       self._delta({"type": "input_json_delta", "partial_json": call.arguments}),
                       ("content_block_stop", {"type": "content_block_stop", "index": self.index})]
            self.index += 1
        r = result.response
        reason, sequence = self.wire.stop(result)
        return [*events, ("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                            "usage": {"input_tokens": r.prompt_tokens,
                                                      "output_tokens": len(r.token_ids)}}),
                ("message_stop", {"type": "message_stop"})]

    def failed(self, refused: Refused) -> list[Event]:
        return [("error", error_body(refused.status, str(refused)))]
