"""OpenAI chat completions (``/v1/chat/completions``) and text completions
(``/v1/completions``) as wires (``wire.py``): the session's own form, so a request is
only validated (``openai_api.py``'s models) and a reply written as OpenAI's objects and
stream chunks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web
from transformers import PreTrainedTokenizerBase

from asyncrl.json_api import Refused, error_body, error_response, validate
from asyncrl.rollout.gateway.openai_api import (
    ChatRequest,
    CompletionRequest,
    call_deltas,
    chat_chunk,
    chat_completion,
    chunk_base,
    finish_reason,
    text_chunk,
    text_completion,
    text_finish_reason,
    token_logprobs,
    usage,
)
from asyncrl.rollout.gateway.wire import Event

if TYPE_CHECKING:
    from asyncrl.rollout.gateway.session import CallPlan, CallResult, Session


class ChatWire:
    """``/v1/chat/completions``: the session's own form, sent as it is."""

    param, raw_prompt = "messages", True

    def __init__(self, model: str, tokenizer: PreTrainedTokenizerBase) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.notes: list[str] = []  # nothing of the request is left out: it is the session's form
        self.body: ChatRequest | None = None

    def read(self, data: Any, session: Session | None) -> ChatRequest:
        self.body = validate(data, ChatRequest)
        return self.body

    def reply(self, result: CallResult, fingerprint: str) -> dict[str, Any]:
        r = result.response
        logprobs = None
        if self.body is not None and self.body.logprobs:
            logprobs = token_logprobs([self.tokenizer.decode([t]) for t in r.token_ids], r.logprobs)
        return chat_completion(self.model, fingerprint, result.message, finish_reason(result.parsed, r.finish_reason),
                               usage(r.prompt_tokens, len(r.token_ids)), logprobs)

    def stream(self, plan: CallPlan, fingerprint: str) -> _ChunkStream:
        return _ChunkStream(chunk_base(self.model, fingerprint, chat=True), chat=True)

    def refusal(self, refused: Refused) -> web.Response:
        return error_response(refused)


class CompletionWire(ChatWire):
    """``/v1/completions``: a plain prompt, no template."""

    param = "prompt"
    text_body: CompletionRequest

    def read(self, data: Any, session: Session | None) -> CompletionRequest:  # type: ignore[override]
        self.text_body = body = validate(data, CompletionRequest)
        return body

    def reply(self, result: CallResult, fingerprint: str) -> dict[str, Any]:
        r = result.response
        logprobs = None
        if self.text_body.logprobs is not None:
            tokens = [self.tokenizer.decode([t]) for t in r.token_ids]
            logprobs = {"tokens": tokens, "token_logprobs": list(r.logprobs), "top_logprobs": None}
        return text_completion(self.model, fingerprint, r.text, text_finish_reason(r.finish_reason),
                               usage(r.prompt_tokens, len(r.token_ids)), logprobs)

    def stream(self, plan: CallPlan, fingerprint: str) -> _ChunkStream:
        return _ChunkStream(chunk_base(self.model, fingerprint, chat=False), chat=False)


class _ChunkStream:
    """OpenAI's chunks: a role chunk first (chat), a chunk per delta, the calls whole, a last
    chunk with the finish reason and the usage, then ``[DONE]``; an error event after the
    stream began."""

    def __init__(self, base: dict[str, Any], *, chat: bool) -> None:
        self.base, self.chat = base, chat
        self.chunk = chat_chunk if chat else text_chunk

    def opened(self) -> list[Event]:
        return [(None, chat_chunk(self.base, {"role": "assistant", "content": ""}))] if self.chat else []

    def text(self, delta: dict[str, str]) -> list[Event]:
        return [(None, self.chunk(self.base, delta))]

    def finished(self, result: CallResult, rest: dict[str, str]) -> list[Event]:
        r = result.response
        use = usage(r.prompt_tokens, len(r.token_ids))
        if self.chat:
            deltas, reason = [rest, *call_deltas(result.message)], finish_reason(result.parsed, r.finish_reason)
        else:
            deltas, reason = [rest], text_finish_reason(r.finish_reason)
        events: list[Event] = [(None, self.chunk(self.base, delta)) for delta in deltas if delta]
        return [*events, (None, self.chunk(self.base, {} if self.chat else "", reason, use)), (None, "[DONE]")]

    def failed(self, refused: Refused) -> list[Event]:
        return [(None, error_body(refused.status, str(refused), refused.param)), (None, "[DONE]")]
