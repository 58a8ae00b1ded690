"""The OpenAI wire format: requests as typed models, responses and errors as plain dicts.

Only what the gateway serves is modelled; fields an SDK sends that we do not use are
accepted and ignored (an SDK adds new ones every month), and the ones that would change
the sampled distribution are reported back (see ``session.py``) or, where going on
without them would hand the agent something other than what it asked for, refused here
(``logit_bias``, a ``response_format`` other than text) with the reason and what to do
instead: the gateway samples the policy's own distribution, so the recorded behaviour
logprobs are the policy's and the learner corrects toward what was really sampled.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncrl.json_api import Refused
from asyncrl.rollout.gateway.tool_calls import ParsedReply


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        """Refused rather than ignored: an agent that biases tokens relies on the bias (a
        banned word, a forced label), and ignoring it would hand back text it did not ask
        for. Honouring it would record logprobs of the biased distribution as the policy's.
        Zeros change nothing and are accepted (some SDKs send an empty map)."""
        if bias and any(value != 0 for value in bias.values()):
            raise Refused(400, "logit_bias is not supported: the gateway samples the policy's own distribution, "
                               "so the behaviour logprobs it records are the policy's (a biased distribution's "
                               "would make the learner correct toward what nobody sampled), and the engine "
                               "applies no bias. Leave logit_bias out; steer the output with the prompt, stop "
                               "strings or the reward instead", "logit_bias")
        return bias

    @field_validator("n")
    @classmethod
    def _one(cls, n: int) -> int:
        if n != 1:
            raise ValueError("n > 1 is not supported: ask n times (each call is one recorded sample)")
        return n

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def token_cap(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning, as vLLM hands it out

    def plain(self) -> dict[str, Any]:
        """The message as the chat template sees it: text content, no empty fields. An
        echoed reply of ours is swapped for the reply as sampled before rendering, so
        ``reasoning_content`` reaches a template (Qwen3's reads it) only on a turn that is
        not one of ours."""
        content = self.content
        if isinstance(content, list):  # content parts: the text ones, joined
            content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        return out


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # what it may be: tool_choice.resolve, which knows the format
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    continue_final_message: bool = False  # vLLM's: the reply continues the last (assistant) message
    add_generation_prompt: bool = True  # vLLM's: false only beside continue_final_message

    @model_validator(mode="after")
    def _prefill(self) -> ChatRequest:
        """vLLM's prefill: ``continue_final_message: true`` with ``add_generation_prompt:
        false`` makes the reply continue the last message, an assistant's text ("Answer:").
        Served, not ignored: an agent that prefills relies on the reply beginning so. The
        prefill is written into the context as environment tokens (never trained: the model
        did not sample it) and the reply is what the model samples after it, as vLLM returns
        it. What vLLM refuses is refused here too, and a generation prompt left out without a
        message to continue (a prompt that ends inside a turn nobody opened)."""
        if not self.continue_final_message:
            if not self.add_generation_prompt:
                raise Refused(400, "add_generation_prompt: false is served only with continue_final_message: true "
                                   "(the reply then continues the last message, an assistant's prefill)",
                              "add_generation_prompt")
            return self
        if self.add_generation_prompt:
            raise Refused(400, "continue_final_message: true needs add_generation_prompt: false, as vLLM's "
                               "(the reply continues the last message rather than opening a new turn)",
                          "add_generation_prompt")
        last = self.messages[-1]
        if last.role != "assistant" or last.tool_calls or not isinstance(last.plain()["content"], str):
            raise Refused(400, "continue_final_message: the last message must be the assistant's text to continue "
                               f"(got a {last.role!r} message{' with tool_calls' if last.tool_calls else ''})",
                          f"messages[{len(self.messages) - 1}]")
        return self

    @property
    def prefill(self) -> str | None:
        """The text the reply continues (``continue_final_message``), else None."""
        return self.messages[-1].plain()["content"] if self.continue_final_message else None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, fmt: dict[str, Any] | None) -> dict[str, Any] | None:
        """``{"type": "text"}`` (the default) is what the gateway does. JSON modes are
        refused, not ignored: an agent that asked for them parses the reply as JSON and
        would fail on free text it was promised would not come. Constrained decoding would
        sample from the distribution left after the grammar's masking, not the policy's,
        so the recorded behaviour logprobs would not be the policy's (the engine has no
        grammar sampling either)."""
        kind = fmt.get("type") if fmt is not None else "text"
        if kind == "text":
            return fmt
        if kind in ("json_object", "json_schema"):
            raise Refused(400, f"response_format {{\"type\": \"{kind}\"}} is not supported: constrained decoding "
                               "samples from the grammar-masked distribution, not the policy's, so the recorded "
                               "behaviour logprobs would not be the policy's (and the engine has no grammar "
                               "sampling). Ask for the JSON in the prompt and parse it in your agent (a reward for "
                               "valid JSON teaches the format), or ask for a tool call: tool_choice naming a "
                               "function returns its arguments as JSON (LangChain: "
                               "with_structured_output(method=\"function_calling\"))", "response_format")
        raise Refused(400, f"response_format.type: expected \"text\" (the only one served), got {kind!r:.80}",
                      "response_format.type")

    @field_validator("tools")
    @classmethod
    def _named_functions(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """Each tool is ``{"type": "function", "function": {"name": …, …}}``: the chat
        template renders the function, so an entry without one would reach the model as
        noise. Raises ``Refused``, which pydantic lets through, rather than ``ValueError``:
        the param is then OpenAI's ``tools[1].function``, which a validation error's
        location (``tools``) cannot name."""
        for i, tool in enumerate(tools or []):
            function = tool.get("function")
            if not isinstance(function, dict):
                raise Refused(400, f"tools[{i}].function: each tool needs a function object, as "
                                   f'{{"type": "function", "function": {{"name": …}}}} (got {function!r:.80})',
                              f"tools[{i}].function")
            if not isinstance(function.get("name"), str) or not function["name"]:
                raise Refused(400, f"tools[{i}].function.name: a function needs a non-empty string name "
                                   f"(got {function.get('name')!r:.80})", f"tools[{i}].function.name")
        return tools


class CompletionRequest(_Request):
    prompt: str
    logprobs: int | None = Field(None, ge=0, le=5)


def finish_reason(parsed: ParsedReply, engine_reason: str) -> str:
    return "tool_calls" if parsed.tool_calls else text_finish_reason(engine_reason)


def assistant_message(parsed: ParsedReply, reasoning: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
    return message


def token_logprobs(tokens: list[str], logprobs: tuple[float, ...]) -> dict[str, Any]:
    """Chat ``logprobs``: the sampled token's own (no alternatives are kept)."""
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, logprobs)]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_completion(model: str, fingerprint: str, message: dict[str, Any], reason: str,
                    use: dict[str, int], logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": fingerprint,
            "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": logprobs}],
            "usage": use}


def chunk_base(model: str, fingerprint: str, *, chat: bool) -> dict[str, Any]:
    """What every chunk of one streamed reply shares."""
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": fingerprint}


def chat_chunk(base: dict[str, Any], delta: dict[str, Any], reason: str | None = None,
               use: dict[str, int] | None = None) -> dict[str, Any]:
    """One chunk of a streamed chat reply; the last one has the finish reason and the usage."""
    chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}
    return chunk if use is None else {**chunk, "usage": use}


def text_chunk(base: dict[str, Any], delta: dict[str, str] | str, reason: str | None = None,
               use: dict[str, int] | None = None) -> dict[str, Any]:
    """One chunk of a streamed text completion (``delta``: its text, or a chat-style delta's content)."""
    text = delta if isinstance(delta, str) else delta.get("content", "")
    chunk = {**base, "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}]}
    return chunk if use is None else {**chunk, "usage": use}


def call_deltas(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A reply's tool calls as stream deltas, each call whole in one."""
    return [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(message.get("tool_calls") or [])]


def text_finish_reason(engine_reason: str) -> str:
    return "length" if engine_reason == "length" else "stop"


def text_completion(model: str, fingerprint: str, text: str, reason: str, use: dict[str, int],
                    logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": fingerprint,
            "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}], "usage": use}

