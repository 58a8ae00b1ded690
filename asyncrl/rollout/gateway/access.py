"""What reaches the gateway's handlers: every request passes two middlewares first.

- ``openai_errors``: what aiohttp raises itself — 404 for an unknown route, 405 for a
  wrong method, 413 for a body read past ``client_max_size`` — comes back in OpenAI's
  error shape like our own refusals (Anthropic's on the ``/v1/messages`` routes), so an
  SDK reports an API error instead of failing to parse plain text. A client that hangs
  up before its reply is one warning line, not aiohttp's traceback: agents time out and
  retry, and a run would log pages of them.
- ``admit``: the key, then the size. A body over ``gateway.max_body_bytes`` is refused
  from its Content-Length before a byte of it is read, so a 10 MB upload costs nothing
  and is never tokenized; a body without one (chunked) is cut off at the same limit by
  aiohttp's ``client_max_size`` while it is read.

``gateway.api_key`` guards every route but ``/health`` and the session routes, sent as
``Authorization: Bearer <key>`` (OpenAI's SDKs) or ``x-api-key: <key>`` (Anthropic's). A
session URL ``/sessions/<id>/v1`` is its own credential: its id is 128 random bits,
handed only to the episode's agent, and dead once the episode ends. That is how a
training run's agents get in with the contract unchanged, ``run(task, base_url)``:
exporting the key as ``OPENAI_API_KEY`` instead would not reach an agent that passes
its own ``api_key`` (the README's passes ``"not-needed"``, and an explicit key wins over
the environment), and would hand the key to every tool the agent runs.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

import asyncrl.rollout.gateway.messages_api as messages_api
from asyncrl.config import ConfigError, GatewayConfig
from asyncrl.json_api import Refused, error_response

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def is_loopback(host: str) -> bool:
    """Only this machine can connect. A name other than ``localhost`` counts as reachable:
    what it resolves to is not ours to decide."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, settings: GatewayConfig) -> None:
    """Raise ``ConfigError`` for a gateway other machines could reach with no key."""
    if is_loopback(host) or settings.api_key is not None or settings.allow_unauthenticated:
        return
    raise ConfigError(f"gateway.host={host!r} is reachable from other machines and gateway.api_key is not set: "
                      "anyone reaching it could sample from the model. Set gateway.api_key (clients then send "
                      "'Authorization: Bearer <key>'), or gateway.allow_unauthenticated=true to serve it open")


def middlewares(settings: GatewayConfig) -> list[Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]]:
    key = None if settings.api_key is None else settings.api_key.encode()

    @web.middleware
    async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except Refused as exc:
            return _error_response(request, exc)
        except web.HTTPException as exc:
            if exc.status < 400:  # a redirect is not an error
                raise
            return _error_response(request, Refused(exc.status, _explain(request, exc, settings)))
        except ConnectionResetError as exc:  # aiohttp would log a traceback per client that hangs up
            logger.warning("gateway: %s %s: the client disconnected before its reply was sent (%s)",
                           request.method, request.path, exc)
            return web.Response(status=499, reason="Client Closed Request")  # nginx's; no one reads it

    @web.middleware
    async def admit(request: web.Request, handler: Handler) -> web.StreamResponse:
        if key is not None and request.path != "/health" and "session" not in request.match_info:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                token = request.headers.get("x-api-key", "")
            if not token.strip():
                return _unauthorized(request, "no API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>' "
                                              "(gateway.api_key)")
            if not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), key):
                return _unauthorized(request, "wrong API key: the key is the gateway's gateway.api_key")
        if (request.content_length or 0) > settings.max_body_bytes:
            raise Refused(413, _over_limit(settings, request.content_length))
        return await handler(request)

    return [openai_errors, admit]


def _error_response(request: web.Request, refused: Refused) -> web.Response:
    """``refused`` in the error shape of the API ``request`` speaks."""
    if "/v1/messages" in request.path:
        return messages_api.error_response(refused)
    return error_response(refused)


def _unauthorized(request: web.Request, message: str) -> web.Response:
    response = _error_response(request, Refused(401, message))
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


def _over_limit(settings: GatewayConfig, size: int | None) -> str:
    of = "" if size is None else f" ({size} bytes)"
    return f"the body{of} is over the gateway's limit of {settings.max_body_bytes} bytes (gateway.max_body_bytes)"


def _explain(request: web.Request, exc: web.HTTPException, settings: GatewayConfig) -> str:
    """aiohttp's own refusals, said as ours are: what was wrong and what would do."""
    if isinstance(exc, web.HTTPNotFound):
        served = sorted({f"{r.method} {r.resource.canonical}" for r in request.app.router.routes()
                         if r.method != "HEAD" and r.resource is not None})
        return f"no route {request.method} {request.path}; served: {', '.join(served)}"
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return f"{request.method} {request.path} is not allowed; use {', '.join(sorted(exc.allowed_methods))}"
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return _over_limit(settings, None)
    return exc.text or exc.reason
