"""The HTTP gateway (aiohttp, on the event loop of its rollout worker): OpenAI chat and
text completions, the OpenAI Responses API and the Anthropic Messages API, each a wire
(``wire.py``) translated into one session's chat form, so one recording serves all three.

``/v1/...`` serves anyone (``asyncrl serve``: nothing recorded, the request's sampling);
``/sessions/<id>/v1/...`` serves one episode's agent and records every call into that
episode's trajectories (``session.py``). aiohttp rather than an ASGI stack: it runs in
the worker's own event loop beside the engine and the agents, with no second thread or
process between an agent and its session — and faster there by measurement
(docs/design.md, "Agents through the gateway").

One request never stalls the others: the loop serves every session, the engine's
replies and ``/health``, so a prompt is judged before it is tokenized (``prompt_size``):
one whose characters or message count certainly cannot fit the context is refused at
once, and a large one that may fit is tokenized on the gateway's two threads rather than
the loop. What stays on the loop is bounded by the body limit — parsing the JSON, which
holds the GIL (what a full body costs: docs/design.md, "Measurements behind choices in
the code") — and by the context: validating and tokenizing a prompt that fits.

Errors never take the server down: each comes back in the dialect's error shape (OpenAI's,
or Anthropic's on ``/v1/messages``) — 404 for an
unknown session or route, 405 for a wrong method, 400 for a body that is not JSON (nested
past the parser included) or not a valid request (``n`` > 1, a tool without a named
function, a JSON ``response_format``, a ``logit_bias``, a ``tool_choice`` that cannot be
honoured included) or a prompt that does not fit the context (both figures named), 401
without the key, 413 for a body over the limit (``access.py``: both decided before a
handler runs), 503 when the engine has stopped; a stream that fails after its first
token ends with an error event in the same shape. A client that hangs up before its
reply is one warning line; its call still ends and is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedTokenizerBase

import asyncrl.rollout.gateway.completions_api as completions_api
import asyncrl.rollout.gateway.messages_api as messages_api
import asyncrl.rollout.gateway.openai_api as api
import asyncrl.rollout.gateway.prompt_size as prompt_size
import asyncrl.rollout.gateway.responses_api as responses_api
import asyncrl.rollout.gateway.streaming as streaming
from asyncrl.rollout.client import LLMClient
from asyncrl.config import GatewayConfig
from asyncrl.engine.protocol import EngineClosedError, PromptTooLongError, RolloutEngine
from asyncrl.rollout.gateway.access import check_exposure, middlewares
from asyncrl.rollout.gateway.session import CallPlan, Session
from asyncrl.rollout.gateway.tool_calls import ToolFormat
from asyncrl.json_api import Refused, error_response, listen, read_json, validate
from asyncrl.rollout.gateway.wire import Event, Wire, sse
from asyncrl.types import AgentDiagnostics, SamplingParams

logger = logging.getLogger(__name__)


class TurnRewardRequest(BaseModel):
    """The body of ``POST /sessions/<id>/v1/turn_reward``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    reward: float = Field(allow_inf_nan=False)  # a JSON number; NaN and ±Infinity refused
    turn: int = -1  # the session's model calls in the order they returned, from 0; negative from the latest

TOKENIZE_THREADS = 2
"""Threads that tokenize large prompts. The gateway's own, not asyncio's default pool,
which a stuck synchronous agent can fill; two, beside the engine's, on a small machine."""


class Gateway:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, parser: ToolFormat, *, model_name: str,
                 engine: RolloutEngine | None = None, sampling: SamplingParams | None = None,
                 settings: GatewayConfig | None = None) -> None:
        """``parser``: the tool format (``tool_calls.get_format``/``resolve_format``). One
        with an opening lets ``tool_choice`` force a call and a stream send content up to
        where a call begins; a user's parser only parses replies (a forced call is refused,
        and a stream read for calls holds its content for the end). ``engine``/``sampling``: what plain ``/v1``
        requests use (``asyncrl serve``); a session uses its own episode's client.
        ``settings``: the reply cap, the body limit and the key (``gateway.*``); its host
        and port are ``start``'s to use."""
        self.tokenizer, self.parser, self.model_name = tokenizer, parser, model_name
        self.engine, self.sampling = engine, sampling
        self.settings = settings or GatewayConfig()
        self.sessions: dict[str, Session] = {}
        self.counts = {"requests": 0, "tool_parse_errors": 0, "sampling_overrides": 0}
        self.base_url = ""
        self._runner: web.AppRunner | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._token_chars: dict[int, tuple[object, int]] = {}  # id(tokenizer) -> (it, its longest token)
        self._plain_responses: dict[str, list[dict[str, Any]]] = {}  # plain /v1/responses: id -> conversation

    # -- lifecycle ------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen (``port`` 0: a free one); returns the base URL. Raises ``ConfigError``
        for a ``host`` beyond loopback with no key (``access.check_exposure``)."""
        check_exposure(host, self.settings)
        app = web.Application(client_max_size=self.settings.max_body_bytes, middlewares=middlewares(self.settings))
        for prefix in ("", "/sessions/{session}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completions)
            app.router.add_post(prefix + "/v1/responses", self._responses)
            app.router.add_post(prefix + "/v1/messages", self._messages)
            app.router.add_post(prefix + "/v1/messages/count_tokens", self._count_tokens)
            app.router.add_get(prefix + "/v1/models", self._models)
        app.router.add_post("/sessions/{session}/v1/turn_reward", self._turn_reward)
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

    async def _turn_reward(self, request: web.Request) -> web.Response:
        """``POST /sessions/<id>/v1/turn_reward`` ``{"reward": r, "turn": k}``: model call k
        of the session's episode (default -1: its latest) gets its own reward r
        (``LLMClient.set_turn_reward``: replaced if set before); answers the call's index
        and the reward. A session's route only: a plain ``/v1`` call belongs to no episode."""
        try:
            session = self._session_of(request)
            assert session is not None  # the route has a session
            body = validate(await read_json(request), TurnRewardRequest)
            try:
                turn = session.client.set_turn_reward(body.reward, body.turn)
            except ValueError as exc:  # the body's types were checked: what is left is the turn's
                raise Refused(400, str(exc), "turn") from None
        except Refused as exc:
            return error_response(exc)
        return web.json_response({"turn": turn, "reward": body.reward})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, completions_api.ChatWire(self.model_name, self.tokenizer))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, completions_api.CompletionWire(self.model_name, self.tokenizer))

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, responses_api.ResponsesWire(self.model_name, self._plain_responses))

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, messages_api.MessagesWire(self.model_name))

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """``/v1/messages/count_tokens``: the prompt a ``/v1/messages`` request would render,
        counted (Claude Code asks before it sends a long conversation)."""
        wire = messages_api.MessagesWire(self.model_name, counting=True)
        try:
            session = self._session_of(request)
            client = session.client if session is not None else self._plain_client()
            if client is None:
                raise Refused(404, "this gateway serves sessions only: use the base URL of your session")
            body = wire.read(await read_json(request), session)
            messages = [m.plain() for m in body.messages]
            self._refuse_unfit({"messages": messages}, wire.param, client, "messages")
            ids = await asyncio.get_running_loop().run_in_executor(
                self._pool, client._render_ids, messages, body.tools or None)
        except (web.HTTPException, ConnectionResetError):
            raise
        except Exception as exc:
            return wire.refusal(_refusal(exc, wire.param, request))
        return web.json_response({"input_tokens": len(ids)})

    async def _serve(self, request: web.Request, wire: Wire) -> web.StreamResponse:
        """Every dialect's call: the body read and sized, translated by ``wire`` into the
        session's request, recorded by the session, and written back by ``wire``."""
        self.counts["requests"] += 1
        try:
            session = self._session_of(request)
            data = await read_json(request)
            client = session.client if session is not None else self._plain_client()
            if client is not None and wire.raw_prompt:  # before validating: pydantic takes a second for 200,000
                self._refuse_unfit(data, wire.param, client)
            body = wire.read(data, session)
            if session is None:  # a plain request: a throwaway client, nothing recorded
                if client is None:
                    raise Refused(404, "this gateway serves sessions only: use the base URL of your session")
                session = Session("", client, self.parser, training=False, tokenize_pool=self._pool)
            if not wire.raw_prompt and isinstance(body, api.ChatRequest):  # sized once in the session's form
                self._refuse_unfit({"messages": [m.plain() for m in body.messages]}, wire.param, client, "messages")
            plan = session.plan(body, self.settings.max_tokens)
            if wire.notes:
                plan = dataclasses.replace(plan, notes=plan.notes + wire.notes)
            if body.stream:
                return await self._stream(request, session, body, plan, wire)
            if isinstance(body, api.ChatRequest):
                result = await session.chat(body, plan)
            else:
                result = await session.complete(body, plan)
        except (web.HTTPException, ConnectionResetError):  # 413 while reading, a client gone: access.py's
            raise
        except Exception as exc:
            return wire.refusal(_refusal(exc, wire.param, request))
        return _json(wire.reply(result, self._fingerprint(session, plan.notes)), plan.notes)

    # -- helpers ----------------------------------------------------------------
    def _plain_client(self) -> LLMClient | None:
        return None if self.engine is None else LLMClient(self.engine, self.tokenizer, self.sampling)

    def _refuse_unfit(self, data: Any, param: str, client: LLMClient, key: str | None = None) -> None:
        """``prompt_size.refuse_unfit`` against the context of ``client``'s engine, where it
        says one; the tokenizer's longest token is looked up once."""
        context = prompt_size.context_of(client.engine)
        if context is None:
            return
        if id(client.tokenizer) not in self._token_chars:
            self._token_chars[id(client.tokenizer)] = (client.tokenizer, prompt_size.longest_token(client.tokenizer))
        prompt_size.refuse_unfit(data, param, context, self._token_chars[id(client.tokenizer)][1], key=key)

    def _session_of(self, request: web.Request) -> Session | None:
        sid = request.match_info.get("session")
        if sid is None:
            return None
        if sid not in self.sessions:
            raise Refused(404, f"no session {sid!r}: it ended with its episode, or never existed", "session")
        return self.sessions[sid]

    @staticmethod
    def _fingerprint(session: Session, notes: list[str]) -> str:
        """The policy version that answered, and what of the request was not honoured."""
        said = "; ".join(notes)
        return f"asyncrl-v{session.client.engine.version}" + (f"; {said}" if said else "")

    async def _stream(self, request: web.Request, session: Session, body: api.ChatRequest | api.CompletionRequest,
                      plan: CallPlan, wire: Wire) -> web.StreamResponse:
        """The reply as server-sent events, its text sent as it is sampled
        (``streaming.py``), in ``wire``'s events. Nothing goes out before the first token,
        so a call refused before sampling gets the same error response unstreamed; one
        that fails after ends its stream with the dialect's error event. The call is the
        unstreamed one with a sink for its tokens: what it records does not depend on the
        stream."""
        chat = isinstance(body, api.ChatRequest)
        tokens: asyncio.Queue[list[int] | None] = asyncio.Queue()
        call = asyncio.ensure_future(session.chat(body, plan, tokens.put_nowait) if isinstance(body, api.ChatRequest)
                                     else session.complete(body, plan, tokens.put_nowait))
        call.add_done_callback(lambda _: tokens.put_nowait(None))
        try:
            ids = await tokens.get()
        except asyncio.CancelledError:
            call.cancel()
            raise
        if ids is None:
            call.result()  # it failed before sampling: raises, for _serve's error response
        if isinstance(body, api.ChatRequest):
            text = streaming.for_chat(plan.choice, plan.thinking, session.parser, body.stops)
        else:
            text = streaming.ReplyStream(stops=tuple(body.stops))
        detokenizer = streaming.Detokenizer(session.client.tokenizer)
        events = wire.stream(plan, self._fingerprint(session, plan.notes))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               **_note_header(plan.notes)})
        await response.prepare(request)
        call.add_done_callback(_retrieved)  # a client gone mid-stream: the call still ends, and is recorded

        async def send(batch: list[Event]) -> None:
            if batch:
                await response.write(b"".join(map(sse, batch)))

        await send(events.opened())
        pending: list[int] | None = ids
        while pending is not None:
            batch, pending = list(pending), []
            while pending is not None and not tokens.empty():  # what came while the last chunk went out
                more = tokens.get_nowait()
                if more is None:
                    pending = None
                else:
                    batch += more
            if delta := text.update(detokenizer.add(batch)):
                await send(events.text(delta))
            if pending is not None:
                pending = await tokens.get()
        try:
            result = call.result()
        except Exception as exc:  # after the stream began: the dialect's error event
            await send(events.failed(_refusal(exc, wire.param, request)))
        else:
            rest = text.finish(result.reasoning, result.parsed.content) if chat else text.finish(None,
                                                                                                  result.response.text)
            await send(events.finished(result, rest))
        await response.write_eof()
        return response


def _refusal(exc: Exception, param: str, request: web.Request) -> Refused:
    """What the agent is told of a call that raised: what it asked for wrong (400), an
    engine that stopped (503), or a bug of ours (500, the traceback in the log)."""
    if isinstance(exc, Refused):
        return exc
    if isinstance(exc, PromptTooLongError):
        return Refused(400, str(exc), param)
    if isinstance(exc, RecursionError):  # nesting the JSON parser let through, met again by the template or json.dumps
        return Refused(400, "the request nests too deeply to render")
    if isinstance(exc, EngineClosedError):
        return Refused(503, f"the engine has stopped: {exc}")
    logger.error("gateway: %s %s failed", request.method, request.path, exc_info=exc)
    return Refused(500, f"{type(exc).__name__}: {exc}")


def _retrieved(call: asyncio.Future[Any]) -> None:
    """Mark an abandoned call's exception as seen (its stream already said it, or nobody listens)."""
    if not call.cancelled():
        call.exception()


def _note_header(notes: list[str]) -> dict[str, str]:
    return {"x-asyncrl-sampling": "; ".join(notes)} if notes else {}


def _json(body: dict[str, Any], notes: list[str]) -> web.Response:
    return web.json_response(body, headers=_note_header(notes))
