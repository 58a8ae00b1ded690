"""A prompt's size, judged before it is tokenized: the gateway shares its event loop with
every session, the engine's replies and ``/health``, so one huge request must neither be
tokenized there nor wait for a tokenizer to be told it cannot fit.

Two bounds need no tokenizer run, and a request past either is refused (400) naming both
figures:

- characters: no token spans more characters than its vocabulary string (true of
  byte-level BPE — GPT-2, Llama 3, Qwen — where a vocabulary character is one byte, and
  of SentencePiece with byte fallback; a tokenizer that fuses unknown characters into one
  token would break it), so messages holding ``chars`` characters of text make at least
  ``chars / longest_token`` tokens;
- messages: a chat template marks each message with at least one token of its own.

Both assume the template renders every message's text; one that drops some (the
reasoning of earlier turns) could see a prompt refused here that it would have shortened
into the context. What passes and is still large is tokenized on the gateway's threads
(``Session``); the small rest costs the loop a few milliseconds, not worth a thread hop.
"""

from __future__ import annotations

import math
from typing import Any

from asyncrl.engine.protocol import RolloutEngine
from asyncrl.json_api import Refused

SMALL_CHARS = 16_384
"""Up to this many characters and ``SMALL_MESSAGES`` messages, a prompt is tokenized on the
loop: a few milliseconds even for the slowest tokenizer, less than a thread hand-off's
worth of latency (the figures: docs/design.md, "Measurements behind choices in the code")."""
SMALL_MESSAGES = 256
"""The chat template's cost grows with the messages: this many keep its render on the loop
within the same few milliseconds."""


def context_of(engine: RolloutEngine) -> int | None:
    """The engine's context in tokens (``RolloutEngine.max_context``), or None where it is not
    a bound: the torch engine reports 2**30 for a model that sets none."""
    context = engine.max_context
    return context if 0 < context < 1 << 30 else None


def longest_token(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` can stand for (its added and special
    tokens included)."""
    return max((len(piece) for piece in tokenizer.get_vocab()), default=1) or 1


def text_chars(messages: Any) -> int:
    """Characters of text in ``messages`` as a client sent them (parsed JSON, not yet
    validated): content strings and text parts, tool calls' names and arguments. What is
    not where text belongs is not counted — validation refuses it later — so the count
    never exceeds what the template renders."""
    if not isinstance(messages, list):
        return 0
    total = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part["text"]) for part in content
                         if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str))
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                total += sum(len(v) for v in (function.get("name"), function.get("arguments")) if isinstance(v, str))
    return total


def is_small(messages: int, chars: int) -> bool:
    return messages <= SMALL_MESSAGES and chars <= SMALL_CHARS


def refuse_unfit(data: Any, param: str, context: int, token_chars: int, *, key: str | None = None) -> None:
    """``Refused(400)`` for a request body (parsed JSON) whose ``param`` (``messages`` or
    ``prompt``) certainly cannot fit a context of ``context`` tokens, given that no token
    spans more than ``token_chars`` characters. The engine refuses a prompt that leaves no
    room for one new token, so "fit" is fewer than ``context`` tokens. ``key``: where the
    prompt is in ``data`` when that is not ``param`` (another dialect's request, in the
    chat form it was translated into: ``param`` is then the field the refusal names)."""
    key = key or param
    value = data.get(key) if isinstance(data, dict) else None
    if key == "messages" and isinstance(value, list) and len(value) >= context:
        raise Refused(400, f"{param}: {len(value)} messages cannot fit the model's context of {context} tokens "
                           "(each takes at least one token)", param)
    chars = len(value) if isinstance(value, str) else text_chars(value)
    if (tokens := math.ceil(chars / token_chars)) >= context:
        raise Refused(400, f"{param}: {chars} characters cannot fit the model's context of {context} tokens: "
                           f"they make at least {tokens} tokens (no token of this tokenizer spans more than "
                           f"{token_chars} characters)", param)
