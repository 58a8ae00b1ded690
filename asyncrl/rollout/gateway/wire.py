"""What a wire format (an API dialect) is to the gateway: how its request becomes the
session's chat form, and how the session's reply goes back in its shape.

The gateway serves three dialects — OpenAI chat completions (and text completions,
``openai_api.py``), the OpenAI Responses API (``responses_api.py``) and the Anthropic
Messages API (``messages_api.py``) — over one :class:`~asyncrl.rollout.gateway.session.Session`:
each dialect translates its request into a ``ChatRequest`` (messages with ``tool_calls``
and ``tool`` results, function tools, ``tool_choice``), the session records the call as it
records every chat call, and the dialect writes the ``CallResult`` back. So a
conversation is one trajectory whatever dialect each turn comes in, the sampled ids are
never re-tokenized, and every refusal is decided once (``openai_api``'s validators,
``tool_choice``, ``prompt_size``, the engine's context) and only *said* in each dialect's
error shape.

A ``Wire`` is made per request (it keeps what the reply needs of the request); a stream
is a ``WireStream`` the server's one stream loop feeds with the text as it may be sent
(``streaming.ReplyStream``) and the result at the end.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from asyncrl.json_api import Refused

if TYPE_CHECKING:
    from asyncrl.rollout.gateway.openai_api import ChatRequest, CompletionRequest
    from asyncrl.rollout.gateway.session import CallPlan, CallResult, Session

Event = tuple[str | None, Any]
"""One server-sent event: its ``event:`` name (None: none) and its data (JSON, or a
literal string such as ``[DONE]``)."""


def sse(event: Event) -> bytes:
    name, data = event
    line = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {name}\n" if name else "").encode() + f"data: {line}\n\n".encode()


class WireStream(Protocol):
    """A reply's server-sent events in one dialect. ``text`` gets each piece of the reply
    as it may be sent (``{"reasoning_content": …, "content": …}``, either present);
    ``finished`` the rest of it (what the parsed reply holds beyond what was sent) and the
    result; ``failed`` a refusal after the stream began."""

    def opened(self) -> list[Event]: ...

    def text(self, delta: dict[str, str]) -> list[Event]: ...

    def finished(self, result: CallResult, rest: dict[str, str]) -> list[Event]: ...

    def failed(self, refused: Refused) -> list[Event]: ...


class Wire(Protocol):
    """One request in one dialect. ``param``: the request field the prompt is in, as a
    refusal names it; ``raw_prompt``: the prompt can be sized from the body as sent,
    before validation (the chat form's own fields) — otherwise it is sized once
    translated; ``notes``: what of the request the translation left out, said with what
    the session did not honour (``system_fingerprint``, ``x-asyncrl-sampling``)."""

    param: str
    raw_prompt: bool
    notes: list[str]

    def read(self, data: Any, session: Session | None) -> ChatRequest | CompletionRequest:
        """The body (parsed JSON) as the session's request, or ``Refused``; ``session`` None
        on plain ``/v1``."""
        ...

    def reply(self, result: CallResult, fingerprint: str) -> dict[str, Any]: ...

    def stream(self, plan: CallPlan, fingerprint: str) -> WireStream: ...

    def refusal(self, refused: Refused) -> web.Response: ...
