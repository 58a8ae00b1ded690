"""The OpenAI-compatible HTTP gateway (aiohttp, on the event loop of its rollout worker).

``/v1/...`` serves anyone (``asyncrl serve``: nothing recorded, the request's sampling);
``/sessions/<id>/v1/...`` serves one episode's agent and records every call into that
episode's trajectories (``session.py``). aiohttp rather than an ASGI stack: it runs in
the worker's own event loop beside the engine and the agents, with no second thread or
process between an agent and its session — and measured: a trivial JSON endpoint served
4,907 req/s on aiohttp against 1,386 on FastAPI + uvicorn in the same event loop as its
client (64 in flight, median of 3 interleaved runs, this 2-core machine).

One request never stalls the others: the loop serves every session, the engine's
replies and ``/health``, so a prompt is judged before it is tokenized (``prompt_size``):
one whose characters or message count certainly cannot fit the context is refused at
once, and a large one that may fit is tokenized on the gateway's two threads rather than
the loop. What stays on the loop is bounded by the body limit — parsing the JSON, which
holds the GIL: 0.09 s for 8 MiB of tiny messages, up to about 1 s for 8 MiB of nothing
but nested empty arrays — and by the context: validating and tokenizing a prompt that
fits.

Errors never take the server down: each comes back in OpenAI's error shape — 404 for an
unknown session or route, 405 for a wrong method, 400 for a body that is not JSON (nested
past the parser included) or not a valid request (``n`` > 1 and a tool without a named
function included) or a prompt that does not fit the context (both figures named), 401
without the key, 413 for a body over the limit (``access.py``: both decided before a
handler runs), 503 when the engine has stopped. A client that hangs up before its reply
is one warning line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web
from transformers import PreTrainedTokenizerBase

import asyncrl.rollout.gateway.openai_api as api
import asyncrl.rollout.gateway.prompt_size as prompt_size
from asyncrl.rollout.client import LLMClient
from asyncrl.config import GatewayConfig
from asyncrl.engine.protocol import EngineClosedError, PromptTooLongError, RolloutEngine
from asyncrl.rollout.gateway.access import check_exposure, middlewares
from asyncrl.rollout.gateway.session import CallResult, Session
from asyncrl.rollout.gateway.tool_calls import ToolParser
from asyncrl.json_api import Refused, error_response, listen, read_json, validate
from asyncrl.types import AgentDiagnostics, SamplingParams

logger = logging.getLogger(__name__)

TOKENIZE_THREADS = 2
"""Threads that tokenize large prompts. The gateway's own, not asyncio's default pool,
which a stuck synchronous agent can fill; two, beside the engine's, on a small machine."""


class Gateway:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, parser: ToolParser, *, model_name: str,
                 engine: RolloutEngine | None = None, sampling: SamplingParams | None = None,
                 settings: GatewayConfig | None = None) -> None:
        """``parser``: the tool format — one with an ``opening`` (``tool_calls.ToolFormat``)
        lets ``tool_choice`` force a call; a plain parser function parses replies and
        refuses a forced call (``tool_choice.py``). ``engine``/``sampling``: what plain
        ``/v1`` requests use (``asyncrl serve``); a session uses its own episode's client. ``settings``: the reply cap, the body limit
        and the key (``gateway.*``); its host and port are ``start``'s to use."""
        self.tokenizer, self.parser, self.model_name = tokenizer, parser, model_name
        self.engine, self.sampling = engine, sampling
        self.settings = settings or GatewayConfig()
        self.sessions: dict[str, Session] = {}
        self.counts = {"requests": 0, "tool_parse_errors": 0, "sampling_overrides": 0}
        self.base_url = ""
        self._runner: web.AppRunner | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._token_chars: dict[int, tuple[object, int]] = {}  # id(tokenizer) -> (it, its longest token)

    # -- lifecycle ------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen (``port`` 0: a free one); returns the base URL. Raises ``ConfigError``
        for a ``host`` beyond loopback with no key (``access.check_exposure``)."""
        check_exposure(host, self.settings)
        app = web.Application(client_max_size=self.settings.max_body_bytes, middlewares=middlewares(self.settings))
        for prefix in ("", "/sessions/{session}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completions)
            app.router.add_get(prefix + "/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner, self.base_url = await listen(app, host, port)
        self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="asyncrl-gateway-tokenize")
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._pool is not None:  # its work is bounded (the context, the body limit): nothing to wait out
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    @contextlib.asynccontextmanager
    async def session(self, client: LLMClient, *, training: bool = True,
                      on_close: Callable[[AgentDiagnostics], None] | None = None) -> AsyncIterator[str]:
        """A session over ``client`` for one episode; yields its OpenAI base URL and is
        closed (404 from then on) when the episode ends, however it ends. ``on_close``
        then gets the episode's diagnostics (``Session.diagnostics``)."""
        session = Session(secrets.token_hex(16), client, self.parser, training=training,  # the URL is the key
                          tokenize_pool=self._pool)
        self.sessions[session.id] = session
        try:
            yield f"{self.base_url}/sessions/{session.id}/v1"
        finally:
            del self.sessions[session.id]
            self.counts["tool_parse_errors"] += session.tool_parse_errors
            self.counts["sampling_overrides"] += session.sampling_overrides
            if on_close is not None:
                on_close(session.diagnostics())

    # -- handlers -------------------------------------------------------------
    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self.sessions)})

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session_of(request)
        except Refused as exc:
            return error_response(exc)
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "asyncrl"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, api.ChatRequest)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, api.CompletionRequest)

    async def _serve(self, request: web.Request, kind: type[api.ChatRequest | api.CompletionRequest]
                     ) -> web.StreamResponse:
        self.counts["requests"] += 1
        try:
            session = self._session_of(request)
            data = await read_json(request)
            client = session.client if session is not None else self._plain_client()
            if client is not None:  # before validating: pydantic takes a second for 200,000 messages
                self._refuse_unfit(data, "messages" if kind is api.ChatRequest else "prompt", client)
            body = validate(data, kind)
            if session is None:  # a plain request: a throwaway client, nothing recorded
                if client is None:
                    raise Refused(404, "this gateway serves sessions only: use the base URL of your session")
                session = Session("", client, self.parser, training=False, tokenize_pool=self._pool)
            if isinstance(body, api.ChatRequest):
                result = await session.chat(body, self.settings.max_tokens)
            else:
                result = await session.complete(body, self.settings.max_tokens)
        except Refused as exc:
            return error_response(exc)
        except PromptTooLongError as exc:
            return error_response(Refused(400, str(exc), "messages" if kind is api.ChatRequest else "prompt"))
        except RecursionError:  # nesting the JSON parser let through, met again by the template or json.dumps
            return error_response(Refused(400, "the request nests too deeply to render"))
        except EngineClosedError as exc:
            return error_response(Refused(503, f"the engine has stopped: {exc}"))
        except (web.HTTPException, ConnectionResetError):  # 413 while reading, a client gone: access.py's
            raise
        except Exception as exc:  # a bug of ours: the agent gets an OpenAI-shaped 500, the log the traceback
            logger.exception("gateway: %s %s failed", request.method, request.path)
            return error_response(Refused(500, f"{type(exc).__name__}: {exc}"))
        fingerprint = self._fingerprint(session, result)
        if isinstance(body, api.CompletionRequest):
            return web.json_response(self._text_reply(body, result, fingerprint))
        return await self._chat_reply(request, body, result, fingerprint)

    # -- helpers ----------------------------------------------------------------
    def _plain_client(self) -> LLMClient | None:
        return None if self.engine is None else LLMClient(self.engine, self.tokenizer, self.sampling)

    def _refuse_unfit(self, data: Any, param: str, client: LLMClient) -> None:
        """``prompt_size.refuse_unfit`` against the context of ``client``'s engine, where it
        says one; the tokenizer's longest token is looked up once."""
        context = prompt_size.context_of(client.engine)
        if context is None:
            return
        key = id(client.tokenizer)
        if key not in self._token_chars:
            self._token_chars[key] = (client.tokenizer, prompt_size.longest_token(client.tokenizer))
        prompt_size.refuse_unfit(data, param, context, self._token_chars[key][1])

    def _session_of(self, request: web.Request) -> Session | None:
        sid = request.match_info.get("session")
        if sid is None:
            return None
        if sid not in self.sessions:
            raise Refused(404, f"no session {sid!r}: it ended with its episode, or never existed", "session")
        return self.sessions[sid]

    @staticmethod
    def _fingerprint(session: Session, result: CallResult) -> str:
        """The policy version that answered, and what of the request was not honoured."""
        notes = "; ".join(result.notes)
        return f"asyncrl-v{session.client.engine.version}" + (f"; {notes}" if notes else "")

    async def _chat_reply(self, request: web.Request, body: api.ChatRequest, result: CallResult,
                          fingerprint: str) -> web.StreamResponse:
        r = result.response
        message = result.message
        reason = api.finish_reason(result.parsed, r.finish_reason)
        use = api.usage(r.prompt_tokens, len(r.token_ids))
        if body.stream:
            return await self._stream(request, api.chat_chunks(self.model_name, fingerprint, message, reason, use),
                                result.notes)
        logprobs = None
        if body.logprobs:
            logprobs = api.token_logprobs([self.tokenizer.decode([t]) for t in r.token_ids], r.logprobs)
        return _json(api.chat_completion(self.model_name, fingerprint, message, reason, use, logprobs), result.notes)

    def _text_reply(self, body: api.CompletionRequest, result: CallResult, fingerprint: str) -> dict[str, Any]:
        r = result.response
        logprobs = None
        if body.logprobs is not None:
            tokens = [self.tokenizer.decode([t]) for t in r.token_ids]
            logprobs = {"tokens": tokens, "token_logprobs": list(r.logprobs), "top_logprobs": None}
        reason = "length" if r.finish_reason == "length" else "stop"
        return api.text_completion(self.model_name, fingerprint, r.text, reason,
                                   api.usage(r.prompt_tokens, len(r.token_ids)), logprobs)

    async def _stream(self, request: web.Request, chunks: list[dict[str, Any]], notes: list[str]
                      ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               **_note_header(notes)})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _note_header(notes: list[str]) -> dict[str, str]:
    return {"x-asyncrl-sampling": "; ".join(notes)} if notes else {}


def _json(body: dict[str, Any], notes: list[str]) -> web.Response:
    return web.json_response(body, headers=_note_header(notes))
