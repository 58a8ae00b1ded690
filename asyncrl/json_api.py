"""JSON over HTTP, the one way our aiohttp services (the gateway, the retrieval service)
read a request body into a typed model and refuse what they cannot serve: every refusal
is OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``, naming the
field at fault, and a refusal never takes a server down."""

from __future__ import annotations

import json
import sys
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}


class Refused(Exception):
    """A request the service will not serve: ``status`` and the ``param`` at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _KINDS.get(status, "api_error"), "param": param, "code": status}}


def error_response(refused: Refused) -> web.Response:
    return web.json_response(error_body(refused.status, str(refused), refused.param), status=refused.status)


async def read_body(request: web.Request, model: type[M]) -> M:
    """The body as ``model``, or ``Refused(400)`` saying what is wrong with it."""
    return validate(await read_json(request), model)


async def read_json(request: web.Request) -> Any:
    """The body parsed, not yet validated (the gateway sizes a prompt between the two), or
    ``Refused(400)``. Nesting past the parser's recursion limit and numbers too long to
    convert are the client's fault like any other bad JSON, not a 500."""
    raw = await request.read()
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise Refused(400, f"the body is not JSON: {exc.msg} at column {exc.colno}") from None
    except RecursionError:
        raise Refused(400, f"the body nests too deeply: about {sys.getrecursionlimit()} levels are the most "
                           "this server parses") from None
    except ValueError as exc:  # not UTF-8, an integer over Python's digit limit
        raise Refused(400, f"the body is not JSON: {exc}") from None


def validate(data: Any, model: type[M]) -> M:
    """``data`` as ``model``, or ``Refused(400)`` naming the first field at fault."""
    if not isinstance(data, dict):
        raise Refused(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        raise Refused(400, f"{param}: {message} (got {err.get('input')!r:.80})", param) from None


async def listen(app: web.Application, host: str, port: int, **runner_options: object) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on ``host:port`` (0: a free port the OS picks); returns the runner (for
    ``cleanup()``) and the base URL with the port actually bound. Nothing is left
    listening when binding fails."""
    runner = web.AppRunner(app, access_log=None, **runner_options)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    bound = site._server.sockets[0].getsockname()[1]  # aiohttp exposes the bound port only here
    return runner, f"http://{host}:{bound}"
