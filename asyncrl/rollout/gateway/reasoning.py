"""A reply's reasoning, ``<think>…</think>``, handed to the agent apart from its answer.

Under a chat template that uses ``<think>`` (Qwen3, QwQ, DeepSeek-R1) a model reasons
inside the tags before it answers. Agent frameworks read the reasoning from
``message.reasoning_content`` (``delta.reasoning_content`` in a stream), as vLLM's
reasoning parsers give it; left in ``content`` it reaches the user, or a JSON parse of the
answer, and a tool call mentioned while thinking would be parsed as one. So the reasoning
is split off first and only the rest is read for tool calls.

Detected from the template's text: a template that says ``<think>`` taught its model the
tags, and no other template gets a split. Two shapes: the reply opens ``<think>`` itself
(Qwen3), or the generation prompt opens it and the reply begins inside (DeepSeek-R1's
newer templates, Qwen3-Thinking-2507); which one is read from the template's generation
prompt.

The split changes only what the agent is handed. The trajectory keeps every sampled
token, the reasoning's included: the model sampled them and the learner trains on them.
An agent sends the reply back without the reasoning or with it in ``reasoning_content``;
either way it means the same reply (``session._canonical`` reads content and calls), is
swapped for the reply as sampled, and the turn continues token-exact where the template
only appends — and from a conversation rendered afresh where the template drops earlier
reasoning (Qwen3), as the client does for every template that rewrites earlier turns.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

THINK, END_THINK = "<think>", "</think>"


@dataclass(frozen=True)
class Thinking:
    """How a template's replies carry reasoning."""

    opened_by_prompt: bool  # the generation prompt ends inside <think>: the reply begins as reasoning


_templates: dict[str, Thinking | None] = {}
_lock = threading.Lock()  # sessions' calls come from the loop, the tokenize threads may render too


def thinking(tokenizer: PreTrainedTokenizerBase) -> Thinking | None:
    """How ``tokenizer``'s chat template carries reasoning; None when it has no ``<think>``
    (or no template). Read once per template text."""
    template = tokenizer.chat_template
    if template is None:
        return None
    key = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    with _lock:
        if key in _templates:
            return _templates[key]
    found = Thinking(_prompt_opens_thinking(tokenizer)) if THINK in key else None
    with _lock:
        _templates[key] = found
    return found


def _prompt_opens_thinking(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the generation prompt leaves a ``<think>`` open, read from the template's
    rendering of one user message with and without it. A template that cannot render
    that is taken as one whose replies open the tags themselves."""
    messages = [{"role": "user", "content": "x"}]
    try:
        bare = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        opened = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template's own refusal (raise_exception) or a Jinja error
        return False
    prompt = opened[len(bare):] if opened.startswith(bare) else opened
    return prompt.rfind(THINK) > prompt.rfind(END_THINK)


def split(text: str, how: Thinking | None) -> tuple[str | None, str]:
    """``(reasoning, the rest)`` of a reply's text; reasoning None when there is none. The
    rest begins after ``</think>`` and its following whitespace; a reply cut off while
    thinking (no ``</think>``) is all reasoning."""
    if how is None:
        return None, text
    if how.opened_by_prompt:
        body = text
    else:
        stripped = text.lstrip()
        if not stripped.startswith(THINK):
            return None, text
        body = stripped[len(THINK):]
    reasoning, closed, rest = body.partition(END_THINK)
    return reasoning, rest.lstrip() if closed else ""
