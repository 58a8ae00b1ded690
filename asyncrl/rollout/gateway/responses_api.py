"""The OpenAI Responses API (``POST /v1/responses``), translated onto the session's chat form.

What the OpenAI Agents SDK speaks by default, and Codex and most new OpenAI-side
harnesses. A request's ``input`` (a string, or items: messages, ``function_call``,
``function_call_output``, ``reasoning``) becomes chat messages — an assistant turn's
reasoning, message and calls one assistant message with ``tool_calls``, each output a
``tool`` message — ``instructions`` a system message first, function ``tools`` chat
tools; then the session records the call as any chat call (``wire.py``). Our earlier
output items sent back mean the same as the reply they came from, so the session swaps
them for the reply as sampled and the trajectory goes on token-exact, whichever dialect
the turn before came in.

``previous_response_id``: each response's conversation (without its ``instructions``,
which the API does not carry over) is kept by id — in the session, for its episode; on
plain ``/v1``, the gateway's most recent ``KEPT_PLAIN`` — and the new ``input`` appended.

The reply: a ``reasoning`` item where the model wrote ``<think>…</think>``
(``reasoning.py``; its text as ``reasoning_text`` content, nothing encrypted), a
``message`` item with the text (also empty, where there are no calls: an agent ends its
run on a message), a ``function_call`` item per call (``call_id`` the call's id).
``status`` ``incomplete`` (``max_output_tokens``) when the reply ran out of tokens.

Function tools are served, also inside a ``namespace`` (Codex groups its sub-agent tools
so); hosted and freeform tools are not offered to the model, and said (``chat_tools``).
Refused (400, OpenAI's error shape, ``param`` naming the field): an input item of a type
not served (``item_reference``, built-in tools' calls), content that is not text (images,
files: the policy reads text), ``text.format`` JSON (as ``response_format``: constrained
decoding), and an unknown ``previous_response_id``.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from asyncrl.json_api import Refused, error_body, error_response, validate
from asyncrl.rollout.gateway.openai_api import ChatRequest
from asyncrl.rollout.gateway.wire import Event

if TYPE_CHECKING:
    from asyncrl.rollout.gateway.session import CallPlan, CallResult, Session

KEPT_PLAIN = 1024
"""Responses kept for ``previous_response_id`` on plain ``/v1`` (a session keeps its own
episode's, all of them)."""

_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")
_RENAMED = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input",
            "stop": "stop"}  # the chat form's fields, as a refusal names them here


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: dict[str, Any] | None = None
    stream: bool = False
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None


def _text(content: Any, where: str) -> str:
    """A message's or output's text: a string, or its text parts joined. Other parts are
    refused: the policy reads text, and dropping an image would answer a question the
    agent did not ask."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise Refused(400, f"{where}: expected a string or a list of content parts (got {content!r:.80})", where)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise Refused(400, f"{where}[{i}]: only text parts are served ({', '.join(_TEXT_PARTS[:3])}); "
                               f"got {kind or part!r:.80}: the policy reads text", f"{where}[{i}]")
        texts.append(part["text"])
    return "".join(texts)


def chat_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages. An assistant turn — reasoning, a message, calls, in the
    order a reply lists them — is one assistant message; any other item ends it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being built

    def assistant() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            messages.append(turn)
        return turn

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise Refused(400, f"{where}: expected an item object (got {item!r:.80})", where)
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") == "assistant":
            if turn is not None and (turn.get("tool_calls") or turn["content"]):  # a new turn
                turn = None
            assistant()["content"] += _text(item.get("content"), f"{where}.content")
        elif kind == "message":
            turn = None
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "reasoning":
            if turn is not None and (turn.get("tool_calls") or turn["content"]):
                turn = None
            thought = _text(item.get("content") or item.get("summary"), f"{where}.content")
            if thought:
                assistant()["reasoning_content"] = thought
        elif kind == "function_call":
            assistant().setdefault("tool_calls", []).append(
                {"id": item.get("call_id"), "type": "function",
                 "function": {"name": item.get("name"), "arguments": item.get("arguments")}})
        elif kind == "function_call_output":
            turn = None
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text(item.get("output"), f"{where}.output")})
        else:
            raise Refused(400, f"{where}.type {kind!r:.60} is not served: send messages, function_call and "
                               "function_call_output items (item_reference: send the item itself, or continue "
                               "with previous_response_id)", f"{where}.type")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]] | None, dict[str, str], list[str]]:
    """Function tools in the chat form, each function of a ``namespace`` among them (its
    calls come back with that ``namespace``); the namespaces by function name; the types
    of the tools left out. ``strict`` is left out: it asks for constrained decoding,
    which the gateway does not do (the policy's own distribution is sampled), and without
    it a conversation's tools are the same whichever dialect sends them.

    Hosted tools (``web_search``, ``file_search``, …) and freeform ``custom`` tools are
    left out, and said: the agent offers them and the model may call them or not; here
    it is not offered them (it could not call them: a hosted tool runs on OpenAI's
    servers, a custom tool's call is free text no tool format reads). Codex offers
    ``web_search`` beside its function tools; refusing would refuse every Codex call."""
    if not tools:
        return None, {}, []
    out: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}
    dropped: list[str] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace" and isinstance(tool.get("tools"), list):
            inner, _, left = chat_tools(tool["tools"])
            out += inner or []
            namespaces.update({t["function"]["name"]: tool.get("name") for t in inner or []})
            dropped += left
        elif kind == "function":
            out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                          if k in tool}})
        elif isinstance(kind, str):
            dropped.append(kind)
        else:
            raise Refused(400, f"tools[{i}]: expected a tool object with a type (got {tool!r:.80})", f"tools[{i}]")
    return out or None, namespaces, dropped


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesWire:
    param, raw_prompt = "input", False

    def __init__(self, model: str, plain_store: dict[str, list[dict[str, Any]]]) -> None:
        self.model, self.plain_store = model, plain_store
        self.id, self.created = _id("resp"), time.time()
        self.ids = {"reasoning": _id("rs"), "message": _id("msg")}
        self.store: dict[str, list[dict[str, Any]]] = {}
        self.conversation: list[dict[str, Any]] = []  # the request's, without instructions
        self.namespaces: dict[str, str] = {}  # a namespaced function's name -> its namespace
        self.notes: list[str] = []
        self.body: ResponsesRequest | None = None

    def read(self, data: Any, session: Session | None) -> ChatRequest:
        self.body = body = validate(data, ResponsesRequest)
        self.store = self.plain_store if session is None else session.responses
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            if body.previous_response_id not in self.store:
                raise Refused(400, f"previous_response_id {body.previous_response_id!r:.80}: no such response here "
                                   "(responses are kept within the session that made them; on plain /v1 the "
                                   f"latest {KEPT_PLAIN}); send the whole conversation as input instead",
                              "previous_response_id")
            history = self.store[body.previous_response_id]
        self.conversation = history + chat_messages(body.input)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        fmt = (body.text or {}).get("format")
        tools, self.namespaces, dropped = chat_tools(body.tools)
        if dropped:
            self.notes.append(f"tools not offered to the model: {', '.join(sorted(set(dropped)))} (served: function)")
        chat = {"messages": system + self.conversation, "tools": tools,
                "tool_choice": chat_tool_choice(body.tool_choice), "stream": body.stream,
                "max_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
                "response_format": fmt}
        try:
            return validate({k: v for k, v in chat.items() if v is not None}, ChatRequest)
        except Refused as exc:  # said with this API's names
            param = exc.param or ""
            head, dot, rest = param.partition(".")
            raise Refused(exc.status, str(exc), _RENAMED.get(head, head) + dot + rest if param else None) from None

    def _remember(self, result: CallResult) -> None:
        self.store[self.id] = [*self.conversation, result.message]
        while self.store is self.plain_store and len(self.store) > KEPT_PLAIN:
            del self.store[next(iter(self.store))]

    def output(self, result: CallResult) -> list[dict[str, Any]]:
        """The reply as output items, in the order the model wrote them."""
        items: list[dict[str, Any]] = []
        if result.reasoning:
            items.append(reasoning_item(self.ids["reasoning"], result.reasoning, "completed"))
        content = result.parsed.content
        if content or not result.parsed.tool_calls:
            items.append(message_item(self.ids["message"], content or "", "completed"))
        items += [call_item(call, "completed", namespace=self.namespaces.get(call.name))
                  for call in result.parsed.tool_calls]
        return items

    def response(self, result: CallResult | None, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        body = self.body
        assert body is not None
        incomplete = status == "incomplete"
        use = None
        if result is not None:
            r = result.response
            use = {"input_tokens": r.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                   "output_tokens": len(r.token_ids), "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": r.prompt_tokens + len(r.token_ids)}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": time.time() if result is not None else None, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "model": self.model, "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": True, "temperature": body.temperature, "text": body.text or {"format": {"type": "text"}},
                "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "top_p": body.top_p,
                "truncation": "disabled", "usage": use, "metadata": body.metadata or {}}

    def reply(self, result: CallResult, fingerprint: str) -> dict[str, Any]:
        self._remember(result)
        return self.response(result, _status(result), self.output(result))

    def stream(self, plan: CallPlan, fingerprint: str) -> ResponseEvents:
        return ResponseEvents(self)

    def refusal(self, refused: Refused) -> web.Response:
        return error_response(refused)


def _status(result: CallResult) -> str:
    return "incomplete" if result.response.finish_reason == "length" else "completed"


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def call_item(call: Any, status: str, arguments: str | None = None, namespace: str | None = None) -> dict[str, Any]:
    item = {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments if arguments is None else arguments, "status": status}
    return item if namespace is None else {**item, "namespace": namespace}


class ResponseEvents:
    """The Responses stream: ``response.created`` and ``.in_progress``; the reasoning item
    (``response.reasoning_text.delta``) and the message item (``response.output_text.delta``)
    opened as their text comes, each with its ``output_item.added``/``content_part.added``
    and closed with their ``.done`` events; then each call whole (``output_item.added``,
    one ``function_call_arguments.delta``, ``.done``, ``output_item.done``), as the text
    stream holds calls for the end; ``response.completed`` (``.incomplete``) with the
    response as unstreamed. A failure after the first event: ``error``, then
    ``response.failed``."""

    def __init__(self, wire: ResponsesWire) -> None:
        self.wire = wire
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # as finished
        self.open: str | None = None  # "reasoning" or "message": the item whose text is streaming
        self.texts = {"reasoning": "", "message": ""}

    def _event(self, kind: str, **fields: Any) -> Event:
        event = (kind, {"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return event

    def _part(self, which: str, text: str) -> dict[str, Any]:
        if which == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def opened(self) -> list[Event]:
        response = self.wire.response(None, "in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def _open(self, which: str) -> list[Event]:
        events = self._close()
        self.open = which
        item_id = self.wire.ids[which]
        item = reasoning_item(item_id, "", "in_progress") if which == "reasoning" else (
            message_item(item_id, None, "in_progress"))
        return [*events, self._event("response.output_item.added", output_index=len(self.items), item=item),
                self._event("response.content_part.added", output_index=len(self.items), item_id=item_id,
                            content_index=0, part=self._part(which, ""))]

    def _close(self, final: str | None = None) -> list[Event]:
        which = self.open
        if which is None:
            return []
        self.open = None
        text = self.texts[which] if final is None else final
        item_id, index = self.wire.ids[which], len(self.items)
        kind = "response.reasoning_text.done" if which == "reasoning" else "response.output_text.done"
        extra = {} if which == "reasoning" else {"logprobs": []}
        item = reasoning_item(item_id, text, "completed") if which == "reasoning" else (
            message_item(item_id, text, "completed"))
        self.items.append(item)
        return [self._event(kind, output_index=index, item_id=item_id, content_index=0, text=text, **extra),
                self._event("response.content_part.done", output_index=index, item_id=item_id, content_index=0,
                            part=self._part(which, text)),
                self._event("response.output_item.done", output_index=index, item=item)]

    def text(self, delta: dict[str, str]) -> list[Event]:
        events: list[Event] = []
        for key, which in (("reasoning_content", "reasoning"), ("content", "message")):
            piece = delta.get(key)
            if not piece:
                continue
            if self.open != which:
                events += self._open(which)
            self.texts[which] += piece
            kind = "response.reasoning_text.delta" if which == "reasoning" else "response.output_text.delta"
            extra = {} if which == "reasoning" else {"logprobs": []}
            events.append(self._event(kind, output_index=len(self.items), item_id=self.wire.ids[which],
                                      content_index=0, delta=piece, **extra))
        return events

    def finished(self, result: CallResult, rest: dict[str, str]) -> list[Event]:
        self.wire._remember(result)
        events = self.text(rest)
        if self.open == "reasoning":
            events += self._close(result.reasoning or "")
        content = result.parsed.content
        if self.open is None and (content or not result.parsed.tool_calls):
            events += self._open("message")
        if self.open == "message":
            events += self._close(content or "")
        for call in result.parsed.tool_calls:
            namespace = self.wire.namespaces.get(call.name)
            index, item = len(self.items), call_item(call, "completed", namespace=namespace)
            events += [self._event("response.output_item.added", output_index=index,
                                   item=call_item(call, "in_progress", "", namespace)),
                       self._event("response.function_call_arguments.delta", output_index=index,
                                   item_id=item["id"], delta=call.arguments),
                       self._event("response.function_call_arguments.done", output_index=index,
                                   item_id=item["id"], name=call.name, arguments=call.arguments),
                       self._event("response.output_item.done", output_index=index, item=item)]
            self.items.append(item)
        status = _status(result)
        return [*events, self._event(f"response.{status}", response=self.wire.response(result, status, self.items))]

    def failed(self, refused: Refused) -> list[Event]:
        error = error_body(refused.status, str(refused), refused.param)["error"]
        response = {**self.wire.response(None, "failed", self.items),
                    "error": {"code": "server_error" if refused.status >= 500 else "invalid_prompt",
                              "message": str(refused)}}
        return [self._event("error", code=error["type"], message=error["message"], param=error["param"]),
                self._event("response.failed", response=response)]
